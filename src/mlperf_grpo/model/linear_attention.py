"""The optional gated delta-net kernels (``fla-core``, the ``fla`` extra) that
``transformers`` uses for linear-attention layers (Qwen3.5's), and the one case where
they must not train: Triton >= 3.4.0 and < 3.7.1 on a Hopper GPU gives wrong gradients
in their gated ``chunk_bwd_dqkwg`` kernel (flash-linear-attention issue #640; fla-core
0.6.0 raises mid-run, older releases compute wrong gradients silently)."""

from __future__ import annotations

import importlib.metadata

from packaging.version import Version

from mlperf_grpo.errors import ModelLoadError
from mlperf_grpo.model.files import linear_attention_layers

BAD_TRITON = (Version("3.4.0"), Version("3.7.1"))
"""Triton releases ``[low, high)`` whose gated delta-net backward is wrong on Hopper."""
HOPPER = (9, 0)


class KernelRefusalError(ModelLoadError):
    """The installed linear-attention kernels would refuse, or be wrong, in this run."""


def fla_refusal(capability: tuple[int, int] | None, triton_version: str | None, fla_version: str | None) -> str | None:
    """Why fla-core must not run a training backward here, or None.

    Args:
        capability: the CUDA device's compute capability (None: not training on CUDA).
        triton_version, fla_version: installed versions, or None when not installed.
    """
    if capability != HOPPER or triton_version is None or fla_version is None:
        return None
    if not BAD_TRITON[0] <= Version(triton_version) < BAD_TRITON[1]:
        return None
    return (f"fla-core {fla_version} (flash-linear-attention) with Triton {triton_version} on a Hopper GPU gives wrong "
            f"gradients in its gated delta-net backward (flash-linear-attention #640): install Triton >= "
            f"{BAD_TRITON[1]}, or uninstall fla-core (transformers then runs its PyTorch fallback)")


def check_linear_attention_kernels(path: str, device: str) -> None:
    """Refuse a training run whose linear-attention layers would run fla-core's
    backward where it is wrong (:func:`fla_refusal`), before anything is written.
    Reads ``config.json`` and the installed packages' metadata only.

    Raises:
        KernelRefusalError: one line naming the versions and the remedy.
        ModelLoadError: ``config.json`` does not load.
    """
    if device != "cuda" or not linear_attention_layers(path):
        return
    reason = fla_refusal(_cuda_capability(), _version("triton"), _version("fla-core"))
    if reason is not None:
        raise KernelRefusalError(f"model.path {path!r} has linear-attention layers, but {reason}")


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cuda_capability() -> tuple[int, int]:
    import torch

    return torch.cuda.get_device_capability()
