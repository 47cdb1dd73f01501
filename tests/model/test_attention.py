"""planless_attention: cuDNN's SDPA kernel off while any thread is inside, restored after the last."""

import threading

import torch

from mlperf_grpo.model.attention import planless_attention


def test_cudnn_attention_stays_off_until_the_last_thread_leaves():
    # a rollout thread (max_trajectory_age_steps 1) leaving generation inside a training pass:
    # torch's sdpa_kernel would restore the flag it saw on entry (on) at its exit
    entered, leave = threading.Event(), threading.Event()

    def rollout():
        with planless_attention():
            entered.set()
            leave.wait(10)

    assert torch.backends.cuda.cudnn_sdp_enabled()
    thread = threading.Thread(target=rollout)
    thread.start()
    assert entered.wait(10)
    with planless_attention():
        leave.set()
        thread.join(10)
        assert not thread.is_alive() and not torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()


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
