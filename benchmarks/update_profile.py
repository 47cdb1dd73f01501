"""Profile of one GRPO update (``optimize_step``) for ``benchmarks/grpo_step.py --profile-update``:
the kernel launches and host syncs of each micro-batch, the gradient clip and the
optimizer step, and the device's kernel time (``torch.profiler``)."""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict

import torch

from mlperf_grpo.train import trainer as trainer_module


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def update_profiler(device: str, step: int | None, out: dict):
    """With ``step``, the ``step``-th call of the loop's ``optimize_step`` (1-based) runs
    under ``torch.profiler``; ``out`` gets :func:`profile_summary`'s figures of it."""
    if step is None:
        yield
        return
    from mlperf_grpo.train import optimize

    calls = [0]
    inner, micro_batch, clip = trainer_module.optimize_step, optimize._micro_batch, torch.nn.utils.clip_grad_norm_

    def labelled(name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)
        return wrapper

    @functools.wraps(inner)
    def profiled(*args, **kwargs):
        calls[0] += 1
        if calls[0] != step:
            return inner(*args, **kwargs)
        activities = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
        optimize._micro_batch = labelled("micro_batch", micro_batch)
        torch.nn.utils.clip_grad_norm_ = labelled("clip_grad_norm", clip)
        try:
            _synchronize(device)
            with torch.profiler.profile(activities=activities) as prof:
                with torch.profiler.record_function("optimize_step"):
                    result = inner(*args, **kwargs)
                _synchronize(device)
        finally:
            optimize._micro_batch, torch.nn.utils.clip_grad_norm_ = micro_batch, clip
        out.update(profile_summary(prof))
        return result

    trainer_module.optimize_step = profiled
    try:
        yield
    finally:
        trainer_module.optimize_step = inner


LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch",
            "cudaMemcpyAsync", "cudaMemsetAsync")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def profile_summary(prof) -> dict:
    """Of one profiled ``optimize_step``: its wall ms; per labelled region
    (``micro_batch``, ``clip_grad_norm``, the optimizer's step) the count, wall ms and
    the kernel launches and host syncs inside; the device's kernel ms; the 8 kernels
    of most device time."""
    events = prof.events()
    regions: dict[str, list] = defaultdict(list)
    cpu, device = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    for ev in events:
        if _label(ev.name) and ev.device_type == cpu:  # a label's device-side twin is left out
            regions["optimizer_step" if ev.name.startswith("Optimizer.step#") else ev.name].append(ev.time_range)
    calls = [ev for ev in events if ev.name in LAUNCHES + SYNCS]
    summary: dict = {}
    for name, ranges in regions.items():
        inside = [ev for ev in calls if any(r.start <= ev.time_range.start <= r.end for r in ranges)]
        summary[name] = {"count": len(ranges), "wall_ms": round(sum(r.elapsed_us() for r in ranges) / 1e3, 2),
                         "launches": sum(ev.name in LAUNCHES for ev in inside),
                         "syncs": sum(ev.name in SYNCS for ev in inside)}
    kernels = defaultdict(float)
    for ev in events:
        if ev.device_type == device and not _label(ev.name):
            kernels[ev.name] += ev.time_range.elapsed_us()
    summary["device_kernel_ms"] = round(sum(kernels.values()) / 1e3, 2)
    summary["top_kernels_ms"] = {name[:80]: round(us / 1e3, 2)
                                 for name, us in sorted(kernels.items(), key=lambda kv: -kv[1])[:8]}
    return summary


def _label(name: str) -> bool:
    """Whether ``name`` is one of the regions labelled here or the optimizer's own."""
    return name in ("optimize_step", "micro_batch", "clip_grad_norm") or name.startswith("Optimizer.step#")
