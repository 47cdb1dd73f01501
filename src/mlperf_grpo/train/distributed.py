"""Data-parallel training under ``torchrun``: the one place that decides who does what.

Launched by ``torchrun`` (``torch.distributed.is_torchelastic_launched()``), every rank
runs the same trainer; without it the process is rank 0 of a world of 1 and nothing here
communicates (every helper is then the identity), so single-process runs behave as
before. "Distributed" is decided from torchrun's environment (:func:`in_process_group`),
never from ``torch.distributed.is_initialized()`` alone: the vLLM engine initialises a
process group of its own inside a single process. The decisions, in one place:

- **process group**: :func:`process_group` (gloo for CPU tensors, NCCL for CUDA tensors
  when CUDA is present; each rank on the CUDA device ``LOCAL_RANK``).
- **prompts**: :func:`prompt_share`; rank ``r`` of ``N`` generates prompts
  ``[r P/N, (r+1) P/N)`` of the step, with the per-completion seeds of their global
  index, so a completion does not depend on ``N``; a prompt group never spans ranks. At
  T > 1 the group's T ranks generate the group's prompts together and each trains on
  its 1/T of them.
- **policy**: :func:`load_sharded_policy` builds it sharded from the start: the
  architecture on the meta device, :func:`shard_policy` (FSDP2 ``fully_shard`` on each
  decoder layer and the root: fp32 master weights, optional bf16 compute, fp32 gradient
  reduction, gradients summed, not averaged, because the loss is already normalized by
  the global token count: :func:`all_reduce_sum`), storage for this rank's shards only on
  its device, then each rank reads its own rows of each tensor from the safetensors
  files. No rank ever holds the whole fp32 model, on the host or on a device.
- **engine**: :func:`engine_from_policy` gives each rank a full rollout-dtype copy on
  its device, or at ``inference.tensor_parallel_size`` T > 1 its slices of the model
  split over its group of T ranks (:mod:`~mlperf_grpo.inference.tensor_parallel`),
  filled by a refit from the sharded policy (the files are read once).
- **refit**: :func:`policy_weights` hands the policy to the engine's one refit entry
  (``engine.load_weights``) one parameter at a time (``DTensor.full_tensor()``), never
  the whole model gathered; the same call refits from an unsharded policy.
- **who writes**: rank 0 alone writes the run directory, the MLPerf log and the deferred
  checkpoints (from its engine, which holds the full rollout-dtype weights after the
  refit); :func:`is_writer`.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from mlperf_grpo.config import ConfigError, RunConfig
from mlperf_grpo.inference.hf import HFEngine
from mlperf_grpo.model import (
    ModelLoadError,
    check_model_path,
    check_weights,
    compile_decoder_layers,
    decoder_layers,
    materialize,
    model_skeleton,
    tied_groups,
)
from mlperf_grpo.weight_names import ExpertParts, UnsupportedConversionError, saved_sources


class LayoutError(ConfigError):
    """The config does not divide over the launched ranks (exit 2)."""


@dataclass(frozen=True)
class Layout:
    """Where this process sits: ``rank`` of ``world_size`` data-parallel ranks."""

    rank: int = 0
    world_size: int = 1

    @property
    def distributed(self) -> bool:
        """True under ``torchrun`` (even with one rank): the policy is FSDP-sharded."""
        return in_process_group()


def launched() -> bool:
    """True when this process was started by ``torchrun`` (its environment is set)."""
    return dist.is_available() and dist.is_torchelastic_launched()


def in_process_group() -> bool:
    """True when this process is a torchrun rank that has joined its process group
    (:func:`process_group`): the one test of "distributed" every helper here uses. A
    group that something else initialised in a process torchrun did not start (vLLM's,
    of world size 1) does not count."""
    return launched() and dist.is_initialized()


def layout() -> Layout:
    """This process's :class:`Layout` (rank 0 of 1 outside a torchrun process group)."""
    if in_process_group():
        return Layout(dist.get_rank(), dist.get_world_size())
    return Layout()


def is_writer() -> bool:
    """True on the one rank that writes the run directory, the log and checkpoints."""
    return layout().rank == 0


@contextlib.contextmanager
def process_group() -> Iterator[Layout]:
    """Under ``torchrun``: join the process group for the duration (rank ``RANK`` of
    ``WORLD_SIZE``, rendezvous from torchrun's environment), pin this rank to CUDA device
    ``LOCAL_RANK`` when CUDA is present, and send the stdout of ranks other than 0 to
    ``/dev/null`` (rank 0 prints the run's outcome). Without torchrun: nothing.

    Yields:
        The :class:`Layout`.
    """
    if not launched() or dist.is_initialized():
        yield layout()
        return
    if torch.cuda.is_available():
        device_id = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device_id)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device_id)  # the small CPU stats go through gloo
    else:
        dist.init_process_group("gloo")
    try:
        with rank_zero_stdout():
            yield layout()
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def rank_zero_stdout() -> Iterator[None]:
    """Under ``torchrun``, send the stdout of ranks other than 0 to ``/dev/null`` for the
    duration (rank 0 prints the outcome; errors still reach stderr). Without: nothing."""
    saved_stdout = sys.stdout
    if launched() and int(os.environ.get("RANK", "0")) != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (closed below)
    try:
        yield
    finally:
        if sys.stdout is not saved_stdout:
            sys.stdout.close()
            sys.stdout = saved_stdout


def check_layout(config: RunConfig, world_size: int | None = None, deferred: bool = True) -> None:
    """Refuse a config that does not divide over ``world_size`` ranks (default: this
    process's world).

    Raises:
        LayoutError: ``num_prompts_per_step`` is not a multiple of the world size, the
            per-rank rows ``GBS / N`` are not a multiple of ``micro_batch_size``, or a
            feature that runs in one process only (the vLLM engine, inline evaluation)
            was asked for under torchrun or with more than one rank.
    """
    n = layout().world_size if world_size is None else world_size
    if n > 1 or launched():  # the policy is FSDP-sharded: these read it as one module
        if config.inference.engine != "hf":
            raise LayoutError(f"inference.engine {config.inference.engine} runs in one process, not under torchrun: use engine hf")
        if not deferred:
            raise LayoutError("DEFERRED_OFFLINE_EVAL=0 (inline evaluation) runs in one process, not under torchrun: unset it")
    if n == 1:
        return
    g = config.grpo
    if g.num_prompts_per_step % n:
        raise LayoutError(
            f"grpo.num_prompts_per_step {g.num_prompts_per_step} (GBS {config.global_batch_size}) does not divide over "
            f"{n} ranks: each rank generates whole prompt groups; use a multiple of {n} or another --nproc-per-node"
        )
    rows = config.global_batch_size // n
    if rows % g.micro_batch_size:
        raise LayoutError(
            f"grpo.micro_batch_size {g.micro_batch_size} does not divide the {rows} rows each of {n} ranks trains on "
            f"(GBS {config.global_batch_size} / {n}); set it to a divisor of {rows}"
        )


def prompt_share(num_prompts: int, here: Layout | None = None, tensor_parallel_size: int = 1) -> slice:
    """The prompts of a step this rank generates: its tensor-parallel group's,
    ``[g P/G, (g+1) P/G)`` for group ``g = r // T`` of ``G = N / T`` (at T = 1, the
    rank's own ``[r P/N, (r+1) P/N)``, which it also trains on; at T > 1 each rank of the
    group trains on its 1/T of them:
    :func:`~mlperf_grpo.inference.tensor_parallel.rank_share`).

    Raises:
        LayoutError: ``num_prompts`` is not a multiple of the world size.
    """
    here = layout() if here is None else here
    if num_prompts % here.world_size:
        raise LayoutError(f"{num_prompts} prompts do not divide over {here.world_size} ranks")
    per_group = num_prompts * tensor_parallel_size // here.world_size
    group = here.rank // tensor_parallel_size
    return slice(group * per_group, (group + 1) * per_group)


def shard_policy(policy: torch.nn.Module, compute_dtype: torch.dtype | None, activation_checkpointing: bool,
                 compile_layers: bool = False, reshard_every_micro_batch: bool = True) -> torch.nn.Module:
    """Wrap a Hugging Face causal LM with FSDP2, as torchtitan's ``parallelize`` does:
    ``fully_shard`` on each decoder layer (``policy.model.layers``), then on the root.

    Parameters stay fp32 (the optimizer's master weights, sharded over the ranks along
    dim 0); ``compute_dtype`` (e.g. ``torch.bfloat16``) is what they are all-gathered to
    for the forward and backward passes (``None``: fp32). Gradients are reduce-scattered
    in fp32 and **summed** (divide factor 1): the loss each rank backpropagates is its
    tokens' sum over the global token count, so the sum over ranks is the global mean's
    gradient. ``activation_checkpointing`` recomputes each decoder layer's activations in
    the backward pass (``torch.utils.checkpoint``, non-reentrant, wrapped inside each
    layer's FSDP unit as torchtitan does). ``compile_layers``: each layer is compiled
    (:func:`~mlperf_grpo.model.compile_decoder_layers`) after the wrapping and before
    ``fully_shard``, torchtitan's order. ``reshard_every_micro_batch=False``: the
    weights are not freed after a forward (``reshard_after_forward=False``) and the
    training loop calls :func:`sync_after_micro_batch` before each micro-batch (see
    ``distributed.reshard_every_micro_batch``). The policy's ``config.use_cache`` is set
    False.

    Returns:
        The same module, now an ``FSDPModule`` whose parameters are ``DTensor`` shards.
    Raises:
        ValueError: the model has no ``model.layers`` list of decoder layers.
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

    1. the architecture on the meta device (:func:`~mlperf_grpo.model.model_skeleton`);
    2. :func:`shard_policy` (``fully_shard`` per decoder layer and at the root; each layer
       compiled first with ``compile_layers``; ``reshard_every_micro_batch`` as there);
    3. storage for this rank's shards only, on ``device``; RoPE's ``inv_freq`` and other
       non-persistent buffers recomputed from the config
       (:func:`~mlperf_grpo.model.materialize`);
    4. ``torch.distributed.checkpoint.load`` with ``HuggingFaceStorageReader``: each rank
       reads only its rows of each tensor (safetensors slices, memory-mapped) and casts
       them into its fp32 shard. A name tied to a loaded one (``lm_head.weight`` to the
       embeddings, which ``save_pretrained`` writes once) follows it. Tensors saved under
       other names are read as ``from_pretrained`` reads them
       (:mod:`~mlperf_grpo.weight_names`): a renamed one into its parameter, MoE experts
       saved one tensor each (Qwen3-MoE, Qwen3.5-MoE) straight into this rank's experts
       of the merged parameter.

    Peak memory per rank: its shards (``4 P / N`` bytes for ``P`` parameters) plus one
    tensor's slice on the host; nothing of the size of the whole model anywhere.
    The parameters equal ``load_model(path, "float32")``'s exactly
    (``tests/test_distributed.py``).

    Raises:
        ModelLoadError: the directory, its config or its weight files are unusable (a
            file truncated or not safetensors, a tensor missing or of another shape), the
            files need a merge other than of experts, or a rank fails to read them (every
            rank raises it).
        ValueError: the model has no ``model.layers`` to shard.
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


def engine_from_policy(config: RunConfig, policy: torch.nn.Module) -> HFEngine:
    """This rank's rollout engine (``inference.engine: hf``) in ``model.dtype`` on
    ``model.device``: a full copy of the model at ``inference.tensor_parallel_size`` 1, else
    this rank's slices of the model split over its tensor-parallel group of T ranks
    (:mod:`~mlperf_grpo.inference.tensor_parallel`). Built empty there
    (:meth:`~mlperf_grpo.inference.hf.HFEngine.for_refit`) and filled by a refit
    (:func:`policy_weights`) from the sharded policy (every rank must call this): one
    gathered parameter at a time, of which each rank keeps its slice, so the weight files
    are not read again, no host copy is made and no rank holds the whole model at T > 1.
    The weights equal ``load_model(path, model.dtype)``'s: a cast of the same values to
    the same dtype.

    Returns:
        An :class:`~mlperf_grpo.inference.hf.HFEngine` with the model's tokenizer.
    Raises:
        ModelLoadError: the model or its tokenizer does not load.
    """
    engine = HFEngine.for_refit(config.model.path, config.model.dtype, device=config.model.device,
                                tensor_parallel_size=config.inference.tensor_parallel_size)
    engine.load_weights(policy_weights(policy))
    return engine


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


def all_reduce_sum(values: list[float]) -> list[float]:
    """The sum over ranks of each value (float64 on the CPU, gloo); the values
    themselves outside a torchrun process group."""
    if not in_process_group():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def all_gather_rows(t: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``[n, ...]`` CPU tensor along dim 0, in rank order
    (``[N n, ...]``); ``t`` itself outside a torchrun process group."""
    if not in_process_group():
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def barrier() -> None:
    """Wait for every rank (e.g. after the optimizer step, so the weight-update time is
    when all ranks' updates returned); nothing without a process group.

    Training also ends with one, after its last collective, for a reason of gloo's: its
    worker threads drop their reference to a finished collective's tensors after the
    caller has moved on, and that takes the GIL. A worker still waiting for it when the
    interpreter finalizes is ended by CPython inside C++, and the process aborts after a
    run that succeeded ("terminate called without an active exception", SIGABRT;
    pytorch/pytorch#190489, open). The barrier's wait releases the GIL to them.
    """
    if in_process_group():
        dist.barrier()


def broadcast_object(obj: object) -> object:
    """Rank 0's ``obj`` on every rank; ``obj`` outside a torchrun process group."""
    if not in_process_group():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def full_value(t: torch.Tensor) -> float:
    """A scalar as a Python float; a ``DTensor`` (e.g. the gradient norm that
    ``clip_grad_norm_`` computes over sharded gradients) is reduced over its ranks first."""
    from torch.distributed.tensor import DTensor

    return float(t.full_tensor() if isinstance(t, DTensor) else t)
