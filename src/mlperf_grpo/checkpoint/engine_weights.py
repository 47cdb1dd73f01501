"""What a rank stages for a checkpoint from its rollout engine (the engine interface of
``inference/base.py``: ``weights()``, ``tp_size``, ``full_weights()``)."""

from __future__ import annotations

from mlperf_grpo.checkpoint.staging import Weights, unique_tensors


def engine_checkpoint_weights(engine) -> Weights | None:
    """The rollout-dtype weights a checkpoint stores, as the engine holds them.

    ``tp_size == 1`` (a replica on every rank): the engine's own ``weights()`` dict, no
    communication (each rank stages the tensors it owns from it). ``tp_size > 1``: every
    full tensor, one at a time, from ``full_weights()`` (a collective over the engine's
    tensor-parallel group: every rank must consume the result to the end, and does, in
    :meth:`~mlperf_grpo.checkpoint.writer.AsyncCheckpointer.save`), without the names
    tied to an earlier one in the engine's local tensors (stored once, as one rank does).
    ``None``: the engine hands out no tensors (the caller casts the policy's).
    """
    held = engine.weights()
    if held is None or getattr(engine, "tp_size", 1) == 1:
        return held
    tied = held.keys() - unique_tensors(held).keys()
    return ((name, t) for name, t in engine.full_weights() if name not in tied)
