"""Tensor parallelism for the ``hf`` engine: transformers' own DTensor implementation.

The model is split over the T ranks of one tensor-parallel group by the plan its
transformers class declares (``config.base_model_tp_plan`` and the class's ``_tp_plan``:
``colwise`` / ``rowwise`` linear layers, the vocabulary-split ``embedding_rowwise``
embeddings, a ``colwise_gather_output`` lm_head), applied by
``transformers.distributed.tensor_parallel.apply_tensor_parallelism``: each parameter
becomes a ``torch.distributed.tensor.DTensor`` (``Shard(0)`` for a column split,
``Shard(-1)`` for a row split, whole elsewhere) holding only this rank's slice, and each
split module's forward all-reduces (row split) or all-gathers (the lm_head) what the
next one needs. Attention keeps ``num_attention_heads / T`` query heads and
``num_key_value_heads / T`` KV heads on each rank (its KV cache too). The logits that
leave the lm_head are the gathered full-vocabulary ones, the same on every rank of the
group, so the per-row sampler draws the same tokens on all of them: every rank of a group
holds the same completions.

Layout: world = data-parallel replicas x T; group ``g`` is ranks ``g T .. g T + T - 1``
(:func:`tensor_parallel_mesh`). Nothing here communicates at T = 1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from mlperf_grpo.errors import ModelLoadError
from mlperf_grpo.model.skeleton import materialize, model_skeleton


def tensor_parallel_mesh(tensor_parallel_size: int, device: str):
    """The 1-D ``DeviceMesh`` of this process's tensor-parallel group: ranks
    ``g T .. g T + T - 1`` for ``g = rank // T``. Every rank of the world must call this
    (it creates the groups: ``init_device_mesh`` over ``(world / T, T)``, dims
    ``("dp", "tp")``).

    Args:
        tensor_parallel_size: T >= 1.
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL): the mesh's device type.
    Raises:
        ValueError: no process group is initialised, or T does not divide its world size.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise ValueError(f"a tensor-parallel engine of {tensor_parallel_size} ranks needs a process group (torchrun)")
    world = dist.get_world_size()
    if world % tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} does not divide the world size {world}")
    mesh = init_device_mesh(device, (world // tensor_parallel_size, tensor_parallel_size), mesh_dim_names=("dp", "tp"))
    return mesh["tp"]


def parallelize(model: PreTrainedModel, mesh) -> PreTrainedModel:
    """Split ``model`` (on the meta device: nothing is copied) over ``mesh`` by its
    transformers tensor-parallel plan, in place; tied parameters (input and output
    embedding, both vocabulary-split ``Shard(0)``) stay one tensor.

    Returns:
        ``model``, its split parameters now ``DTensor`` s on ``mesh``.
    Raises:
        ModelLoadError: the model's class declares no tensor-parallel plan, or T does not
            divide its attention heads, KV heads or vocabulary (the plan splits them
            evenly and replicates nothing: ``memory_plan.check_tensor_parallel`` refuses
            such a config first, naming the fix).
    """
    from transformers.distributed import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    t, text = mesh.size(), model.config.get_text_config()
    for key in ("num_attention_heads", "num_key_value_heads", "vocab_size"):
        count = getattr(text, key, None)
        if count and count % t:
            raise ModelLoadError(f"inference.tensor_parallel_size {t} does not divide the model's {key} {count}: "
                                 f"set it to a divisor of {count}")
    try:
        plan = model._resolve_parallel_plans(DistributedConfig(tp_size=t))[0]  # the expanded per-name plan
    except ValueError as err:  # no plan for this class
        raise ModelLoadError(f"{type(model).__name__} cannot be split over {t} ranks: {str(err).splitlines()[0]} "
                             "(set inference.tensor_parallel_size: 1)") from None
    # a tied parameter is listed under its first name only (lm_head.weight is the embeddings')
    names = set(dict(model.named_parameters())) | set(dict(model.named_modules()))
    apply_tensor_parallelism(model, mesh, {name: style for name, style in plan.items() if name in names})
    model.tie_weights()
    return model


def build_tensor_parallel_model(path: str, dtype: str, device: str, mesh) -> PreTrainedModel:
    """The causal LM at ``path`` split over ``mesh`` (:func:`parallelize`), storage for
    this rank's slices only on ``device`` in ``dtype``, weights unset (a refit fills
    them: :func:`~mlperf_grpo.model.skeleton.materialize`), in eval mode.

    Raises:
        ModelLoadError: no model directory, a config that does not build, or a model
            :func:`parallelize` cannot split.
    """
    model = parallelize(model_skeleton(path, dtype), mesh)
    materialize(model, device)
    return model.eval()


def mesh_of(model: torch.nn.Module):
    """The ``DeviceMesh`` of the model's first ``DTensor`` parameter, or None (not split)."""
    from torch.distributed.tensor import DTensor

    return next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), None)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (a ``DTensor``'s local slice, no copy); a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of ``tensor``: a split ``DTensor`` all-gathered over its mesh (a
    collective: every rank of the mesh calls it), a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local_slices(tensor: torch.Tensor) -> tuple[slice, ...] | None:
    """The index into the full tensor of what this rank holds of ``tensor``: one slice
    per dim (whole for a plain tensor or a replicated dim), so that
    ``full[local_slices(t)]`` equals :func:`local_tensor` ``(t)``. None for a packed
    parameter (a fused gate/up projection, ``packed_colwise``: its ``_StridedShard``
    holds a slice of each half, which no single index gives): give it in full."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(tensor, DTensor):
        return tuple(slice(0, n) for n in tensor.shape)
    if any(isinstance(p, _StridedShard) for p in tensor.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def local_part(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """This rank's part of the full tensor ``full`` as ``target`` (a ``DTensor``, or a
    plain tensor: ``full`` itself) holds it, cut on this rank without communication
    (``distribute_tensor(..., src_data_rank=None)``: each rank takes its own share, packed
    parameters included)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(target, DTensor):
        return full
    return distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()


def rank_share(rows: int, tp_rank: int, tp_size: int) -> slice:
    """This tensor-parallel rank's part of its group's ``rows`` (the group generates
    them all, each rank trains on ``rows / T`` of them): ``[k rows/T, (k+1) rows/T)``.

    Raises:
        ValueError: ``rows`` is not a multiple of ``tp_size``.
    """
    if rows % tp_size:
        raise ValueError(f"{rows} rows do not divide over the {tp_size} ranks of a tensor-parallel group")
    per_rank = rows // tp_size
    return slice(tp_rank * per_rank, (tp_rank + 1) * per_rank)
