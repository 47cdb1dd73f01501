"""SDPA without cuDNN's attention kernel, for every pass of ours: :func:`planless_attention`."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_LOCK = threading.Lock()
_HOLDERS = 0
_SAVED = True


@contextlib.contextmanager
def planless_attention() -> Iterator[None]:
    """SDPA may pick any kernel but cuDNN's while some thread is inside.

    cuDNN's attention builds an execution plan for every new shape (torch 2.11), and our
    passes keep meeting new ones: a KV-cached generation step has a new key length, a
    prefill or a right-padded training pass is as wide as its longest row. On one H100, a
    1.4B Qwen3 training pass of a width not seen before spent 73 ms of host time in cuDNN's
    forward and 46 ms in its backward (``benchmarks/grpo_step.py --profile-update``); on
    one H200, 64-token generations at new key lengths took 9.83 s, 3.09 s once seen, and
    2.68 s without cuDNN (``benchmarks/attention_backends.py``).

    The flag is the process's: the first thread to enter turns it off, the last to leave
    restores it. ``torch.nn.attention.sdpa_kernel`` restores it at every exit, so a rollout
    thread leaving generation (``max_trajectory_age_steps: 1``) would turn cuDNN on again
    inside a training pass, whose checkpointed layers could then recompute with another
    kernel than their forward's.
    """
    global _HOLDERS, _SAVED
    with _LOCK:
        if _HOLDERS == 0:
            _SAVED = torch.backends.cuda.cudnn_sdp_enabled()
            torch.backends.cuda.enable_cudnn_sdp(False)
        _HOLDERS += 1
    try:
        yield
    finally:
        with _LOCK:
            _HOLDERS -= 1
            if _HOLDERS == 0:
                torch.backends.cuda.enable_cudnn_sdp(_SAVED)
