"""The policy FSDP2-sharded over the ranks: built sharded from the files, gradients
summed, and its weights handed out one parameter at a time for a refit.

:func:`load_sharded_policy` builds it sharded from the start: the architecture on the
meta device, :func:`shard_policy` (FSDP2 ``fully_shard`` on each decoder layer and the
root: fp32 master weights, optional bf16 compute, fp32 gradient reduction, gradients
summed, not averaged, because the loss is already normalized by the global token count:
:func:`~mlperf_grpo.train.collectives.all_reduce_sum`), storage for this rank's shards
only on its device, then each rank reads its own rows of each tensor from the safetensors
files. No rank ever holds the whole fp32 model, on the host or on a device.
:func:`policy_weights` hands the policy to the engine's one refit entry
(``engine.load_weights``) one parameter at a time (``DTensor.full_tensor()``), never the
whole model gathered; the same call refits from an unsharded policy.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from mlperf_grpo.errors import ModelLoadError
from mlperf_grpo.model.compile import compile_decoder_layers, decoder_layers
from mlperf_grpo.model.files import check_model_path
from mlperf_grpo.model.skeleton import check_weights, materialize, model_skeleton, tied_groups
from mlperf_grpo.model.weight_names import ExpertParts, UnsupportedConversionError, saved_sources


def shard_policy(policy: torch.nn.Module, compute_dtype: torch.dtype | None, activation_checkpointing: bool,
                 compile_layers: bool = False, reshard_every_micro_batch: bool = True) -> torch.nn.Module:
    """Wrap a Hugging Face causal LM with FSDP2, as torchtitan's ``parallelize`` does:
    ``fully_shard`` on each decoder layer (:func:`~mlperf_grpo.model.compile.decoder_layers`), then on the root.

    Parameters stay fp32 (the optimizer's master weights, sharded over the ranks along
    dim 0); ``compute_dtype`` (e.g. ``torch.bfloat16``) is what they are all-gathered to
    for the forward and backward passes (``None``: fp32). Gradients are reduce-scattered
    in fp32 and **summed** (divide factor 1): the loss each rank backpropagates is its
    tokens' sum over the global token count, so the sum over ranks is the global mean's
    gradient. ``activation_checkpointing`` recomputes each decoder layer's activations in
    the backward pass (``torch.utils.checkpoint``, non-reentrant, wrapped inside each
    layer's FSDP unit as torchtitan does). ``compile_layers``: each layer is compiled
    (:func:`~mlperf_grpo.model.compile.compile_decoder_layers`) after the wrapping and before
    ``fully_shard``, torchtitan's order. ``reshard_every_micro_batch=False``: the
    weights are not freed after a forward (``reshard_after_forward=False``) and the
    training loop calls :func:`sync_after_micro_batch` before each micro-batch (see
    ``distributed.reshard_every_micro_batch``). The policy's ``config.use_cache`` is set
    False.

    Returns:
        The same module, now an ``FSDPModule`` whose parameters are ``DTensor`` shards.
    Raises:
        ValueError: the model has no one list of decoder layers.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    layers = decoder_layers(policy)
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    # the policy only trains (the engine generates): no KV cache, which a recomputed
    # layer would otherwise extend a second time
    policy.config.use_cache = False
    for i, layer in enumerate(layers):
        if activation_checkpointing:
            layer = checkpoint_wrapper(layer, preserve_rng_state=False)
            layers[i] = layer
    if compile_layers:
        compile_decoder_layers(policy)
    for layer in layers:
        fully_shard(layer, mp_policy=mp, reshard_after_forward=reshard_every_micro_batch)
    fully_shard(policy, mp_policy=mp, reshard_after_forward=reshard_every_micro_batch)
    # the root's output in the loss pass is the log-prob head's [..., 1] view (train/logprobs.py:
    # no copy kernel), read out of place only: FSDP2's warning that an in-place op on a view
    # would skip its pre-backward hook does not apply
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    for module in policy.modules():  # each fully_shard group reduces its own gradients
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
    return policy


def sync_after_micro_batch(policy: torch.nn.Module, last: bool) -> None:
    """Before a micro-batch of an FSDP2 policy sharded with
    ``reshard_every_micro_batch=False``: reduce-scatter the gradients and free the
    gathered weights after this micro-batch's backward only if it is the step's ``last``
    (before, gradients accumulate unsharded in the reduce dtype, fp32, and the weights
    stay gathered for the next micro-batch). A no-op for a policy that is not sharded.
    """
    from torch.distributed.fsdp import FSDPModule

    if isinstance(policy, FSDPModule):
        policy.set_requires_gradient_sync(last)
        policy.set_reshard_after_backward(last)


def load_sharded_policy(
    path: str, device: str, compute_dtype: torch.dtype | None, activation_checkpointing: bool,
    compile_layers: bool = False, reshard_every_micro_batch: bool = True,
) -> torch.nn.Module:
    """The policy at ``path``, fp32, FSDP2-sharded over the process group's ranks as it is
    built: every rank must call this.

    1. the architecture on the meta device (:func:`~mlperf_grpo.model.skeleton.model_skeleton`);
    2. :func:`shard_policy` (``fully_shard`` per decoder layer and at the root; each layer
       compiled first with ``compile_layers``; ``reshard_every_micro_batch`` as there);
    3. storage for this rank's shards only, on ``device``; RoPE's ``inv_freq`` and other
       non-persistent buffers recomputed from the config
       (:func:`~mlperf_grpo.model.skeleton.materialize`);
    4. ``torch.distributed.checkpoint.load`` with ``HuggingFaceStorageReader``: each rank
       reads only its rows of each tensor (safetensors slices, memory-mapped) and casts
       them into its fp32 shard. A name tied to a loaded one (``lm_head.weight`` to the
       embeddings, which ``save_pretrained`` writes once) follows it. Tensors saved under
       other names are read as ``from_pretrained`` reads them
       (:mod:`~mlperf_grpo.model.weight_names`): a renamed one into its parameter, MoE experts
       saved one tensor each (Qwen3-MoE, Qwen3.5-MoE) straight into this rank's experts
       of the merged parameter.

    Peak memory per rank: its shards (``4 P / N`` bytes for ``P`` parameters) plus one
    tensor's slice on the host; nothing of the size of the whole model anywhere.
    The parameters equal ``load_model(path, "float32")``'s exactly
    (``tests/e2e/test_distributed.py``).

    Raises:
        ModelLoadError: the directory, its config or its weight files are unusable (a
            file truncated or not safetensors, a tensor missing or of another shape), the
            files need a merge other than of experts, or a rank fails to read them (every
            rank raises it).
        ValueError: the model has no one list of decoder layers to shard.
    """
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.api import CheckpointException

    directory = check_model_path(path)
    have = check_weights(directory)[0]  # every parameter there, with its shape (headers only)
    skeleton = model_skeleton(path, "float32")
    try:
        sources = saved_sources(skeleton, have)
    except UnsupportedConversionError as err:
        raise ModelLoadError(f"model {directory}: {err}; train it in one process (without torchrun), or save its "
                             "weights under the model's parameter names") from None
    policy = shard_policy(skeleton, compute_dtype, activation_checkpointing, compile_layers, reshard_every_micro_batch)
    materialize(policy, device)
    followers = {_plain_name(n) for group in tied_groups(policy) for n in group}  # may follow a loaded name
    state: dict[str, torch.Tensor] = {}
    for name, tensor in policy.state_dict().items():
        name = _plain_name(name)
        source = sources.get(name)
        if isinstance(source, ExpertParts):
            state.update(_expert_views(directory, name, tensor, source, have))
        elif source is not None:
            state[source] = tensor
        elif name not in followers:  # check_weights passed: only a merge can lack a part
            raise ModelLoadError(f"model {directory}: the weight files have no tensor for {name!r}")
    try:
        dcp_load(state, storage_reader=HuggingFaceStorageReader(str(directory)))
    except CheckpointException as err:  # a BaseException: it would pass every `except Exception`
        reason = next((str(exc).splitlines()[0] for exc, _ in err.failures.values() if str(exc)), "unreadable")
        raise ModelLoadError(f"cannot load the weight files of {directory}: {reason}; copy the model's weight "
                             "files there again") from None
    return policy


def _expert_views(directory: Path, name: str, tensor: torch.Tensor, parts: ExpertParts,
                  have: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The experts of ``tensor`` (``[E, parts * R, ...]``, sharded on dim 0 or whole) that
    this rank holds, as views keyed by the file tensor each one is (:class:`ExpertParts`),
    so that ``torch.distributed.checkpoint.load`` reads each saved expert tensor straight
    into its rows of this rank's shard.

    Raises:
        ModelLoadError: an expert's part is missing from the files or has another shape.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    experts, rows = tensor.shape[0], tensor.shape[1] // parts.parts
    missing = [(e, p) for e in range(experts) for p in range(parts.parts) if (e, p) not in parts.keys]
    if missing:
        raise ModelLoadError(f"model {directory}: the weight files have no part {missing[0][1]} of expert "
                             f"{missing[0][0]} of {name!r}; copy the model's weight files there again")
    local, first = tensor, 0
    if isinstance(tensor, DTensor):
        local = tensor.to_local()
        first = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)[1][0]
    views = {}
    for e in range(first, first + local.shape[0]):
        for p in range(parts.parts):
            key = parts.keys[(e, p)]
            view = local[e - first].narrow(0, p * rows, rows)
            if tuple(view.shape) != have[key]:
                raise ModelLoadError(f"model {directory}: tensor {key!r} has shape {list(have[key])} in the weight files "
                                     f"but is {list(view.shape)} of {name!r} by config.json; the weights and config.json "
                                     "do not match")
            views[key] = view
    return views


def _plain_name(name: str) -> str:
    """A parameter's name without activation checkpointing's wrapper (its name in the files)."""
    return name.replace("._checkpoint_wrapped_module", "")


def policy_weights(policy: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights for a refit (``engine.load_weights``), one ``(name, tensor)``
    at a time, under the names of the saved model (activation checkpointing's wrapper
    removed). A sharded parameter is all-gathered only when its turn comes
    (``full_tensor()``: every rank must consume this, in the same order), so at most
    one full parameter exists besides the engine's copy; an unsharded policy's tensors
    are given as they are. Detached (a refit copies values only).
    """
    from torch.distributed.tensor import DTensor

    for name, tensor in policy.state_dict().items():
        tensor = tensor.detach()
        yield _plain_name(name), tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
