"""Fused elementwise kernels for the slot decoder's decode step.

In eager mode a decoder layer of a Llama-family model (Llama, Qwen2, Qwen3, Mistral)
runs about 60 kernels per decode step, most of them small elementwise ones: RMSNorm is
seven (float cast, square, mean, add, rsqrt, two products), the rotary embedding about
ten, SiLU-times-up three, the attention's scale, mask, softmax and cast four. A captured
CUDA graph removes their launch cost but not their run time: at 256 rows each reads and
writes a few hundred kilobytes and costs a few microseconds, so a 16-layer model
spends more time in them than in its matrix products. :func:`fuse` gives the decode
step ``torch.compile``'d twins of those functions (each one Triton kernel; matrix
products stay cuBLAS's), the same arithmetic in float32 rounded once at the end where
eager rounds after each operation.

The twins run only inside :func:`fused` on the thread that entered it (the slot
decoder's step, warmed up and captured there); anywhere else (prefill, the trainer's
forward and backward on another thread, ``generate``) the model runs its own code.
Each twin checks itself once, on its first call inside :func:`fused`, against the
model's own function on the same inputs, and is dropped for good (a one-line warning)
if it does not agree within a few bfloat16 roundings or does not compile; so a model
whose norm or MLP differs from the Llama form (Gemma's ``1 + weight``, another
activation) keeps its own code. Fused: modules whose class name ends in ``RMSNorm``
and that have ``weight`` and ``variance_epsilon``; MLPs with ``gate_proj``,
``up_proj``, ``down_proj`` and a SiLU ``act_fn``; the ``apply_rotary_pos_emb`` of each
attention module's modeling module; :func:`masked_softmax` of the slot attention; and
the sampler's vocabulary-wide pass at top-p 1 (:func:`~mlperf_grpo.inference.sampling.block_masses`,
one reduction; the rest of :func:`~mlperf_grpo.inference.sampling.sample_tokens_by_blocks`
works on ``[B, 128]`` and ``[B, V / 128]`` tensors). Top-p < 1 keeps its sort (inductor's
scan of a vocabulary-wide cumulative sum failed to compile with dynamic shapes on one
H200, torch 2.11).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from collections.abc import Callable, Iterator

import torch

from mlperf_grpo.inference.sampling import block_masses

_thread = threading.local()
_compiled: dict[str, Callable] = {}
_twins: dict[str, "_Twin"] = {}  # the shared twins: "masked_softmax", "block_masses", "rotary:<modeling module>"


def active() -> bool:
    """Whether this thread is inside :func:`fused`."""
    return getattr(_thread, "active", False)


@contextlib.contextmanager
def fused() -> Iterator[None]:
    """Inside, on this thread, the fused twins installed by :func:`fuse` run."""
    before = active()
    _thread.active = True
    try:
        yield
    finally:
        _thread.active = before


def _compile(name: str, fn: Callable) -> Callable:
    """``torch.compile(fn, dynamic=True)``, one per name (shared by all modules: their
    weights are arguments, so one graph serves every layer and row bucket)."""
    if name not in _compiled:
        _compiled[name] = torch.compile(fn, dynamic=True)
    return _compiled[name]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm (Zhang and Sennrich 2019, as ``transformers``' ``LlamaRMSNorm``):
    ``weight * (x / sqrt(mean(x^2) + eps))``, the normalisation in float32, the product
    in ``x``'s dtype. ``x``: ``[..., H]``; ``weight``: ``[H]``; returns ``[..., H]``."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def silu_times(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, the SwiGLU MLP's activation (Shazeer 2020, as ``LlamaMLP``):
    ``gate`` and ``up`` ``[..., I]`` of one dtype; returns ``[..., I]``."""
    return torch.nn.functional.silu(gate) * up


def masked_softmax(scores: torch.Tensor, scale: float, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``softmax(scores * scale + mask)`` over the last dimension, cast to ``dtype``.

    Args:
        scores: float32 ``[b, Hkv, group, K]``; mask: float32 broadcastable to it (0 or -inf).
        scale: the attention's scaling, usually ``head_dim ** -0.5``.
    Returns:
        ``[b, Hkv, group, K]`` in ``dtype``.
    """
    return torch.softmax(scores * scale + mask, dim=-1).to(dtype)


def masked_softmax_fn() -> Callable:
    """:func:`masked_softmax`; inside :func:`fused`, its fused twin (checked as the others)."""
    if not active():
        return masked_softmax  # no compile wrapper outside the fused step (the CPU's eager decoder)
    if "masked_softmax" not in _twins:
        _twins["masked_softmax"] = _Twin("masked_softmax", masked_softmax, _compile("masked_softmax", masked_softmax))
    return _twins["masked_softmax"]


def block_masses_fn() -> Callable:
    """:func:`~mlperf_grpo.inference.sampling.block_masses`; inside :func:`fused`, its
    fused twin (checked as the others)."""
    if not active():
        return block_masses
    if "block_masses" not in _twins:
        _twins["block_masses"] = _Twin("block_masses", block_masses, _compile("block_masses", block_masses))
    return _twins["block_masses"]


class _Twin:
    """A fused function standing in for ``original`` inside :func:`fused`; on its first
    call there it is compared with ``original`` on the same inputs and kept only if
    every output agrees within ``8 x 2^-8`` relative (a few bfloat16 roundings; the
    twin rounds once where eager rounds after each operation)."""

    def __init__(self, name: str, original: Callable, twin: Callable) -> None:
        self.name, self.original, self.twin = name, original, twin
        self.ok: bool | None = None  # None: not checked yet

    def __call__(self, *args, **kwargs):
        if not active() or self.ok is False:
            return self.original(*args, **kwargs)
        want = None if self.ok else self.original(*args, **kwargs)
        try:
            got = self.twin(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - a twin that does not compile is dropped, not fatal
            return self._drop(f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}", args, kwargs,
                              want)
        if self.ok is None:
            self.ok = _agree(got, want)
            if not self.ok:
                return self._drop("its outputs differ from the model's own", args, kwargs, want)
        return got

    def _drop(self, reason: str, args: tuple, kwargs: dict, want=None):
        """Use the original from now on (one warning); the original's result."""
        self.ok = False
        warnings.warn(f"fused decode kernel {self.name} not used ({reason}); the model's own code runs",
                      RuntimeWarning, stacklevel=3)
        return self.original(*args, **kwargs) if want is None else want


def _agree(got, want) -> bool:
    """Every tensor of ``got`` within ``8 x 2^-8`` of ``want`` relative to ``want``'s largest magnitude."""
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    if len(got) != len(want):
        return False
    for g, w in zip(got, want):
        if g.shape != w.shape or g.dtype != w.dtype:
            return False
        scale = w.float().abs().max().clamp(min=1e-30)
        if not bool(((g.float() - w.float()).abs() <= 8 * 2**-8 * scale).all()):
            return False
    return True


def fuse(model: torch.nn.Module) -> list[str]:
    """Install the fused twins on ``model``'s RMSNorm and MLP modules (as instance
    ``forward``s, so other models of the same class are untouched) and on the rotary
    function of its attention modules' modeling module (a dispatcher that runs the
    twin only inside :func:`fused`). Idempotent.

    Returns:
        The kinds installed, e.g. ``["rms_norm", "silu_times", "rotary"]`` (empty for a
        model with none of them, or with tensor-parallel (``DTensor``) parameters,
        which are left as they are).
    """
    if any(type(p) is not torch.nn.Parameter and type(p) is not torch.Tensor for p in model.parameters()):
        return []
    kinds: set[str] = set()
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon") \
                and isinstance(getattr(module, "weight", None), torch.Tensor):
            if not isinstance(module.__dict__.get("forward"), _Twin):
                module.forward = _Twin(f"rms_norm ({type(module).__name__})", module.forward,
                                       _norm_twin(module))
            kinds.add("rms_norm")
        elif all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")) \
                and isinstance(module.act_fn, _silu_classes()):
            if not isinstance(module.__dict__.get("forward"), _Twin):
                module.forward = _Twin(f"silu_times ({type(module).__name__})", module.forward, _mlp_twin(module))
            kinds.add("silu_times")
        elif hasattr(module, "q_proj") and _install_rotary(type(module).__module__):
            kinds.add("rotary")
    return sorted(kinds, key=["rms_norm", "rotary", "silu_times"].index)


def _norm_twin(module: torch.nn.Module) -> Callable:
    norm = _compile("rms_norm", rms_norm)
    return lambda x: norm(x, module.weight, module.variance_epsilon)


def _mlp_twin(module: torch.nn.Module) -> Callable:
    times = _compile("silu_times", silu_times)
    return lambda x: module.down_proj(times(module.gate_proj(x), module.up_proj(x)))


def _silu_classes() -> tuple[type, ...]:
    from transformers.activations import SiLUActivation

    return (torch.nn.SiLU, SiLUActivation)


def _install_rotary(module_name: str) -> bool:
    """The rotary dispatcher in modeling module ``module_name`` (once); whether it has one."""
    name = f"rotary:{module_name}"
    if name in _twins:
        return True
    modeling = sys.modules.get(module_name)
    original = getattr(modeling, "apply_rotary_pos_emb", None)
    if original is None:
        return False
    _twins[name] = modeling.apply_rotary_pos_emb = _Twin(f"rotary ({module_name.rsplit('.', 1)[-1]})", original,
                                                         _compile(name, original))
    return True
