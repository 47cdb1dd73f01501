"""The fused attention kernels our passes let SDPA choose."""

from __future__ import annotations

from torch.nn.attention import SDPBackend

PLANLESS_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""All of SDPA's kernels but cuDNN's, which builds an execution plan for every new shape
(torch 2.11). Generation, prefills and training passes all meet new widths: a KV-cached
step has a new key length, a right-padded training pass is as wide as its longest row.
On one H100, a 1.4B Qwen3 training pass of a width not seen before spent 73 ms of host
time in cuDNN's forward and 46 ms in its backward (``benchmarks/grpo_step.py
--profile-update``); see ``inference/hf.GENERATION_SDPA_BACKENDS`` for generation."""
