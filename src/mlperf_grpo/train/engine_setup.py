"""Each rank's rollout engine under ``torchrun``, built from the sharded policy."""

from __future__ import annotations

import torch

from mlperf_grpo.config.run import RunConfig
from mlperf_grpo.inference.decode import DecodeOptions
from mlperf_grpo.inference.hf import HFEngine
from mlperf_grpo.train.fsdp import policy_weights


def engine_from_policy(config: RunConfig, policy: torch.nn.Module, batch_size: int = 256,
                       kv_cache_bytes: int | None = None) -> HFEngine:
    """This rank's rollout engine (``inference.engine: hf``) in ``model.dtype`` on
    ``model.device``: a full copy of the model at ``inference.tensor_parallel_size`` 1, else
    this rank's slices of the model split over its tensor-parallel group of T ranks
    (:mod:`~mlperf_grpo.inference.tensor_parallel`). Built empty there
    (:meth:`~mlperf_grpo.inference.hf.HFEngine.for_refit`) and filled by a refit
    (:func:`policy_weights`) from the sharded policy (every rank must call this): one
    gathered parameter at a time, of which each rank keeps its slice, so the weight files
    are not read again, no host copy is made and no rank holds the whole model at T > 1.
    The weights equal ``load_model(path, model.dtype)``'s: a cast of the same values to
    the same dtype. ``batch_size``: the most rows it decodes at once; ``kv_cache_bytes``:
    the most bytes its KV cache takes (``DecodeOptions.kv_cache_bytes``; None: its default).

    Returns:
        An :class:`~mlperf_grpo.inference.hf.HFEngine` with the model's tokenizer.
    Raises:
        ModelLoadError: the model or its tokenizer does not load.
    """
    engine = HFEngine.for_refit(config.model.path, config.model.dtype, batch_size=batch_size, device=config.model.device,
                                tensor_parallel_size=config.inference.tensor_parallel_size,
                                decoder=DecodeOptions(top_p_candidates=config.inference.top_p_candidates,
                                                      prefill_graphs=config.inference.prefill_graphs,
                                                      kv_cache_bytes=kv_cache_bytes))
    engine.load_weights(policy_weights(policy))
    return engine
