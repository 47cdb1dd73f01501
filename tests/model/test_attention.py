"""planless_attention: cuDNN's SDPA kernel off while any thread is inside, restored after the last."""

import threading

import pytest
import torch

from mlperf_grpo.model.attention import planless_attention


@pytest.mark.parametrize("first_out", ["generation", "training"])
def test_overlapping_passes_of_two_threads_keep_cudnn_out_and_restore_it_after_both(first_out):
    # the one-step-async rollout thread generates while the trainer's passes run: with
    # sdpa_kernel in each, the first to leave turned cuDNN back on inside the other, and
    # the last one out left it off for the rest of the process
    inside, leave, left, seen = threading.Event(), threading.Event(), threading.Event(), []

    def first():  # enters first, leaves first when first_out is "generation"
        with planless_attention():
            inside.set()
            leave.wait(10)
            if first_out == "training":
                left.wait(10)
            seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        if first_out == "generation":
            left.set()

    assert torch.backends.cuda.cudnn_sdp_enabled()
    thread = threading.Thread(target=first)
    thread.start()
    inside.wait(10)
    with planless_attention():
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        leave.set()
        if first_out == "generation":
            left.wait(10)
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
    if first_out == "training":
        left.set()
    thread.join(10)
    assert seen == [False, False]  # each pass ran without cuDNN to its end
    assert torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()


def test_the_flag_is_restored_after_an_error_and_a_process_setting_is_kept():
    try:
        with planless_attention():
            raise RuntimeError("a pass failed")
    except RuntimeError:
        pass
    assert torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)  # the user's own choice survives
    try:
        with planless_attention():
            pass
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
