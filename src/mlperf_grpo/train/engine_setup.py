"""Each rank's rollout engine under ``torchrun``, built from the sharded policy."""

from __future__ import annotations

import torch

from mlperf_grpo.config import RunConfig
from mlperf_grpo.inference.hf import HFEngine
from mlperf_grpo.model import load_tokenizer, materialize, model_skeleton
from mlperf_grpo.train.fsdp import policy_weights


def engine_from_policy(config: RunConfig, policy: torch.nn.Module) -> HFEngine:
    """This rank's rollout engine (``inference.engine: hf``): a full copy of the model in
    ``model.dtype`` on ``model.device``, built empty there
    (:func:`~mlperf_grpo.model.materialize`) and filled by a refit (:func:`policy_weights`) from the
    sharded policy (every rank must call this), so the weight files are not read again
    and no host copy is made. The weights equal ``load_model(path, model.dtype)``'s:
    a cast of the same values to the same dtype.

    Returns:
        An :class:`~mlperf_grpo.inference.hf.HFEngine` with the model's tokenizer.
    Raises:
        ModelLoadError: the model or its tokenizer does not load.
    """
    model = model_skeleton(config.model.path, config.model.dtype)
    materialize(model, config.model.device)
    engine = HFEngine.from_model(model, load_tokenizer(config.model.path), model_path=config.model.path)
    engine.load_weights(policy_weights(policy))
    return engine
