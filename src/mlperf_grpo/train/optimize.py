"""One optimizer step of GRPO on a global batch: the batch, its settings, the step.

:func:`training_batch` turns a step's scored rollouts into the batch,
:class:`OptimizeSettings` holds what the config decides about the step, and
:func:`optimize_step` accumulates the loss's gradient over micro-batches and steps the
optimizer. Under torchrun each rank calls it on its share of the batch; the counts it
returns are the global batch's (:mod:`~mlperf_grpo.train.collectives`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from mlperf_grpo.agent.trajectory import Trajectory
from mlperf_grpo.config.run import RunConfig
from mlperf_grpo.config.sections import GRPOConfig
from mlperf_grpo.inference.base import Completion
from mlperf_grpo.model.attention import planless_attention
from mlperf_grpo.model.files import DTYPES
from mlperf_grpo.train import collectives
from mlperf_grpo.train.compute_weights import compute_weights
from mlperf_grpo.train.fsdp import sync_after_micro_batch
from mlperf_grpo.train.grad_accumulation import GradSum, usable
from mlperf_grpo.train.grpo import PGLossOptions
from mlperf_grpo.train.logprobs import LOGITS_CHUNK_BYTES, chunk_tokens_for, policy_token_logprobs
from mlperf_grpo.train.packing import (PackedInputs, packed_inputs, padded_width, split_padded, split_to_count,
                                       token_budget_micro_batches)
from mlperf_grpo.train.pass_loss import STATS, PassLossSettings, loss_function
from mlperf_grpo.train.rollout import RolloutBatch, build_batch, truncated_completions
from mlperf_grpo.train.trajectories import overlong_trajectories, valid_group_advantages, valid_samples

PACK_PADDING_RATIO = 2.0
"""``packing: auto`` packs a pass when padding its rows would more than double its tokens..."""

PACK_MIN_PADDING = 0.5
"""... and add more than this fraction of ``micro_batch_tokens`` of padding: below it a
padded pass is the faster (on one H100, 64-token completions of GBS 256 in 64-row passes
took 1.40x the step of right-padded passes when the passes that more than doubled were
packed: a packed pass's block-diagonal mask and its host read cost more than the padding)."""

COMPILED_WIDTH_MULTIPLE = 8
"""Micro-batch widths of a compiled policy are multiples of this (see :class:`OptimizeSettings`)."""


@dataclass
class OptimizeResult:
    """What one optimizer step measured (see :func:`optimize_step`)."""

    loss: float
    """Global-batch token-level mean loss."""
    grad_norm: float
    """Pre-clip gradient norm."""
    num_valid_tokens: int
    """Completion tokens of the sequences kept by the batch's ``sample_mask`` (overlong
    filter) and the log-prob error filter (the normalizer)."""
    num_valid_sequences: int
    """Sequences kept by both (NeMo-RL's ``global_valid_seqs``: the sum of its final ``sample_mask``)."""
    num_sequences_masked_by_is: int
    num_sequences_masked_by_logprob_error: int
    importance_weight_mean: float
    """Mean IS weight over valid tokens (1 without the correction)."""
    entropy_mean: float = 0.0
    """Token-mean entropy (nats) of the policy's distributions at the rollout temperature
    over the valid tokens, from the loss pass (before the update; no gradient)."""


@dataclass(frozen=True)
class OptimizeSettings:
    """What the config decides about :func:`optimize_step`.

    Raises:
        ValueError: ``seq_logprob_error_threshold`` without ``needs_prev_logprobs``.
    """

    micro_batch_size: int | None
    """Rows per forward/backward pass (gradients accumulate over them); with
    ``micro_batch_tokens`` a cap on them (None: none)."""
    temperature: float
    """The rollouts' sampling temperature: the log-probs are of ``logits / temperature``."""
    options: PGLossOptions
    grad_clip_norm: float
    """Clip of the global gradient norm (``clip_grad_norm_``)."""
    seq_logprob_error_threshold: float | None = None
    """Drop sequences whose prev/generation log-prob error exceeds it (``None``: no filter)."""
    needs_prev_logprobs: bool = False
    """Take ``prev`` from the loss pass (``GRPOConfig.needs_prev_logprobs``)."""
    compute_dtype: torch.dtype = torch.float32
    """The forward passes' autocast dtype (:func:`compute_autocast`); weights stay float32."""
    width_multiple: int = 1
    """Each micro-batch's width is rounded up to a multiple of it (the batch right-padded
    with masked columns): a compiled policy then never sees a sequence length of another
    alignment, which would recompile each decoder layer (inductor guards on
    ``length % 8``). The masked columns change no value in exact arithmetic."""
    reshard_every_micro_batch: bool = True
    """False (an FSDP2 policy sharded with it, ``distributed.reshard_every_micro_batch``):
    gradients are reduced once, after the last micro-batch
    (:func:`~mlperf_grpo.train.fsdp.sync_after_micro_batch`)."""
    micro_batch_tokens: int | None = None
    """Token budget of a micro-batch (``grpo.micro_batch_tokens``): rows up to it a pass,
    packed end to end where padding them would waste more than it saves
    (:attr:`packing`, :mod:`~mlperf_grpo.train.packing`); None: ``micro_batch_size``
    right-padded rows."""
    packing: str = "auto"
    """With ``micro_batch_tokens``: ``auto`` packs a pass's rows only when right-padding
    them to the longest would take more than :data:`PACK_PADDING_RATIO` times their
    tokens and add more than :data:`PACK_MIN_PADDING` of the budget in padding (rows of
    very different lengths: multi-turn trajectories); ``always``; ``never``
    (passes of at most the budget's tokens padding included, for a model packing does not
    suit: ``train/policy_probe.py``).
    A packed pass pays attention over all its tokens at once: SDPA with the block-diagonal
    mask computes every block, so ``k`` packed rows of length ``L`` cost ``k`` times the
    attention of ``k`` padded ones (measured: ``benchmarks/grpo_step.py`` at 64 tokens,
    GBS 256, took 1.9x the step when every pass was packed)."""
    logits_chunk_bytes: int = LOGITS_CHUNK_BYTES
    """The loss pass's log-probs are computed this many bytes of float32 logits at a time
    (:func:`~mlperf_grpo.train.logprobs.chunk_tokens_for`), never the micro-batch's whole."""
    compile_loss: bool = False
    """The head's log-softmax and the loss of each pass run under ``torch.compile``
    (:mod:`~mlperf_grpo.train.pass_loss`): a compiled policy's passes then launch a few
    fused kernels for them instead of some 150 (the same math, other kernels)."""

    def __post_init__(self) -> None:
        if self.seq_logprob_error_threshold is not None and not self.needs_prev_logprobs:
            raise ValueError("seq_logprob_error_threshold needs the prev log-probs (needs_prev_logprobs=True)")
        if self.micro_batch_size is None and self.micro_batch_tokens is None:
            raise ValueError("a micro-batch needs micro_batch_size or micro_batch_tokens")

    @classmethod
    def of(cls, config: RunConfig, compiled: bool = False) -> OptimizeSettings:
        """The settings of ``config``'s training step; ``compiled``: the policy's decoder
        layers are compiled (widths a multiple of :data:`COMPILED_WIDTH_MULTIPLE`)."""
        g = config.grpo
        return cls(
            g.micro_batch_size, g.rollout_temperature, PGLossOptions.of(g), config.gradient_clip_norm,
            g.seq_logprob_error_threshold, g.needs_prev_logprobs, DTYPES[config.model.train_compute_dtype],
            width_multiple=COMPILED_WIDTH_MULTIPLE if compiled else 1,
            reshard_every_micro_batch=config.distributed.reshard_every_micro_batch,
            micro_batch_tokens=g.micro_batch_tokens, compile_loss=compiled,
        )

    @property
    def pass_loss(self) -> PassLossSettings:
        """What :func:`~mlperf_grpo.train.pass_loss.pass_loss` needs of these settings."""
        return PassLossSettings(self.options, self.seq_logprob_error_threshold, self.needs_prev_logprobs)


def training_batch(
    completions: list[list[Completion]], rewards: torch.Tensor, grpo: GRPOConfig, pad_token_id: int,
    eos_token_ids: list[int],
) -> RolloutBatch:
    """The step's batch: ``[P][G]`` completions, their ``[P, G]`` rewards, the advantages
    the config's baseline gives (:func:`~mlperf_grpo.train.grpo.group_advantages`) and,
    with ``overlong_filtering``, sample mask 0 for the truncated completions
    (:func:`~mlperf_grpo.train.rollout.truncated_completions`).

    Agent trajectories (``task.name: swe``): an invalid sample is out of the baseline and
    the loss, an overlong one (ended at the context limit) out of the loss only
    (``train/trajectories.py``, which states the rules and their sources).

    As NeMo-RL's ``async_grpo_train``: the baseline takes every sample as valid (its
    ``GRPOAdvantageEstimator`` passes ``valid_mask = ones``), so a truncated completion
    still counts in its group's baseline and std; the filter only takes it out of the loss
    and the valid-token and valid-sequence counts.
    """
    valid = valid_samples(completions)  # [P, G]; an agent's invalid samples leave the baseline too
    advantages = valid_group_advantages(rewards, valid, leave_one_out_baseline=grpo.use_leave_one_out_baseline,
                                        normalize_rewards=grpo.normalize_rewards)  # [P, G]
    agentic = bool(completions) and isinstance(completions[0][0], Trajectory)
    keep = valid
    if grpo.overlong_filtering:
        overlong = overlong_trajectories(completions) if agentic else truncated_completions(completions, eos_token_ids)
        keep = valid & ~overlong
    return build_batch(completions, rewards, advantages, pad_token_id, eos_token_ids, keep.float())


def compute_autocast(device: torch.device, compute_dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to ``compute_dtype`` for the policy's forward (and so backward)
    passes; a no-op for float32. The weights, their gradients and the optimizer stay float32
    (master weights); log-probabilities are taken in float32 (:mod:`~mlperf_grpo.train.logprobs`)."""
    if compute_dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=compute_dtype)


class _Sums:
    """The step's running sums, float64 on the device: :data:`~mlperf_grpo.train.pass_loss.STATS`
    of each pass added (the same sums as Python floats of each pass's values; read back
    once, after the optimizer step)."""

    def __init__(self, device: torch.device) -> None:
        self.values = torch.zeros(len(STATS), dtype=torch.float64, device=device)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.values[STATS.index(name)]


def optimize_step(
    policy: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: RolloutBatch, settings: OptimizeSettings,
) -> OptimizeResult:
    """One optimizer step on a global batch, accumulating gradients over micro-batches.

    ``prev`` (the training policy's log-probs before the update) is needed with
    ``settings.needs_prev_logprobs``. One optimizer step follows each rollout batch, so the
    policy before the update is the policy of this step's loss pass: ``prev = sg(curr)``,
    taken from each micro-batch's own forward, not from a second no-grad pass over the
    batch (NeMo-RL runs one; the values are equal up to kernel numerics).
    ``seq_logprob_error_threshold`` then drops sequences from the mask
    (:func:`~mlperf_grpo.train.grpo.seq_logprob_error_keep`, per row, so per micro-batch).
    Without ``needs_prev_logprobs``, ``prev`` is ``sg(curr)`` under
    ``force_on_policy_ratio`` and else the rollout's generation log-probs. The batch's
    ``sample_mask`` (the overlong filter) multiplies the completion mask first
    (``RolloutBatch.loss_mask``): a row it leaves out adds nothing to the loss, the token
    count or ``num_valid_sequences`` (with ``micro_batch_tokens`` it is not run at all).
    Micro-batches: ``micro_batch_tokens`` packs rows up to that many tokens into one
    sequence, scoring only the positions the loss reads (:mod:`~mlperf_grpo.train.packing`;
    a model with linear-attention layers gets the same rows right-padded instead, whose
    recurrent state would cross packed rows); without it, ``micro_batch_size`` rows
    right-padded to their longest.

    The gradient is that of the token-level mean over the whole batch: without the filter
    each micro-batch's loss sum is divided by the global valid-token count before its
    backward; with the filter that count is known only after the last micro-batch, so the
    summed gradient is divided by it then (equal in exact arithmetic). The forward passes
    run under :func:`compute_autocast` of ``compute_dtype``; below float32 they compute
    logits only from each micro-batch's first completion column on (HF ``logits_to_keep``;
    the same log-probs, a smaller ``[mb, T, V]`` at a real vocabulary). The micro-batch loop
    reads nothing back from the device. Under torchrun the batch is this rank's share and
    the count is the global batch's (summed over ranks), as are the returned loss, counts
    and IS weight mean; the gradient norm is over all shards.
    """
    filtered = settings.seq_logprob_error_threshold is not None
    policy.train()
    optimizer.zero_grad(set_to_none=True)
    device = next(policy.parameters()).device  # the batch is built on the CPU
    batch = batch.padded_to_multiple(settings.width_multiple)
    mask = batch.loss_mask  # [B, L-1]: completion tokens of the rows sample_mask keeps (overlong filter)
    # the global batch's valid tokens (summed over ranks); with the filter known only after the loop
    num_valid_tokens = 0 if filtered else int(collectives.all_reduce_sum([mask.sum().item()])[0])
    loss_divisor = max(num_valid_tokens, 1)
    divisor = torch.tensor(float(loss_divisor), device=device)  # a tensor: a compiled loss sees no new constant
    sums = _Sums(device)
    # to the device once a step (a copy from pageable host memory waits for the device)
    on_device = tuple(t.to(device) for t in (
        batch.input_ids, batch.attention_mask, mask, batch.rollout_logprobs, batch.advantages, batch.sample_mask))
    _run_passes(policy, batch, on_device, _passes(batch, settings, packable(policy), device), settings, divisor, sums)
    if filtered:
        num_valid_tokens = int(collectives.all_reduce_sum([sums["tokens"].item()])[0])  # the global batch's
        loss_divisor = max(num_valid_tokens, 1)
        grads = [p.grad for p in policy.parameters() if p.grad is not None]
        if grads:  # none when no row was run (every one left out by sample_mask)
            torch._foreach_div_(grads, float(loss_divisor))
        sums["loss"].div_(loss_divisor)
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), settings.grad_clip_norm)
    optimizer.step()
    policy.eval()
    grad_norm = collectives.full_value(grad_norm)  # over all shards
    local = sums.values[[STATS.index(k) for k in ("loss", "importance_weight_sum", "masked_by_is", "masked_by_error",
                                                   "sequences", "entropy_sum")]].tolist()
    loss_total, weight_sum, masked_by_is, masked_by_error, kept_sequences, entropy_sum = (
        collectives.all_reduce_sum(local))
    return OptimizeResult(
        loss=loss_total,
        grad_norm=grad_norm,
        num_valid_tokens=num_valid_tokens,
        num_valid_sequences=int(kept_sequences),
        num_sequences_masked_by_is=int(masked_by_is),
        num_sequences_masked_by_logprob_error=int(masked_by_error),
        importance_weight_mean=weight_sum / loss_divisor,
        entropy_mean=entropy_sum / loss_divisor,
    )


def _run_passes(policy: torch.nn.Module, batch: RolloutBatch, on_device: tuple[torch.Tensor, ...],
                passes: list[_Pass], settings: OptimizeSettings, divisor: torch.Tensor, sums: _Sums) -> None:
    """Forward and backward of every pass, gradients summed into the parameters' ``.grad``:
    the decoder linears' through compute-dtype copies made once a step
    (:class:`~mlperf_grpo.train.compute_weights.ComputeWeights`, below float32), the others'
    by :class:`~mlperf_grpo.train.grad_accumulation.GradSum` where it may (a few foreach adds a pass)."""
    copies = compute_weights(policy, settings.compute_dtype)
    copied = {id(p) for p in copies.masters} if copies is not None else set()
    params = [p for p in policy.parameters() if id(p) not in copied]
    summed = usable(params) and len(passes) > 1
    with copies or contextlib.nullcontext(), GradSum(params) if summed else contextlib.nullcontext() as grad_sum:
        for index, one in enumerate(passes):
            if not settings.reshard_every_micro_batch and index in (0, len(passes) - 1):  # the flags persist
                sync_after_micro_batch(policy, last=index == len(passes) - 1)
            _micro_batch(policy, batch, on_device, one, settings, divisor, sums)
            if grad_sum is not None:
                grad_sum.take()
            if copies is not None:
                copies.take()


@dataclass(frozen=True)
class _Pass:
    """One forward/backward pass: ``rows`` of the batch (a slice, or a ``[mb]`` index
    tensor on the device) cut to their first ``width`` columns; ``packed``: their packed
    inputs on the device (:func:`~mlperf_grpo.train.packing.packed_inputs`), None for
    right-padded rows; ``empty``: scores nothing (see
    :class:`~mlperf_grpo.train.packing.MicroBatch`)."""

    rows: slice | torch.Tensor
    width: int
    packed: PackedInputs | None = None
    empty: bool = False
    host_rows: slice | list[int] | None = None
    """``rows`` as the CPU batch indexes them (None: ``rows``)."""


def packable(policy: torch.nn.Module) -> bool:
    """Whether rows may be packed into one sequence: no linear-attention layer (whose
    recurrent state would run from one packed row into the next)."""
    config = policy.config.get_text_config() if hasattr(policy.config, "get_text_config") else policy.config
    return "linear_attention" not in (getattr(config, "layer_types", None) or [])


def causal_mask_argument(policy: torch.nn.Module) -> dict | None:
    """The ``attention_mask`` a right-padded pass gives the policy below float32: none,
    which causal attention needs none of for the real positions (see :func:`_curr_logprobs`).
    For a model whose layers are all ``full_attention`` (``config.layer_types``), as the
    mask mapping ``transformers`` would build itself (``{"full_attention": None}``): it
    then skips building it, whose packed-sequence check of the position ids reads the
    device once a pass."""
    config = policy.config.get_text_config() if hasattr(policy.config, "get_text_config") else policy.config
    layer_types = getattr(config, "layer_types", None)
    return {"full_attention": None} if layer_types and set(layer_types) == {"full_attention"} else None


def _passes(batch: RolloutBatch, settings: OptimizeSettings, pack: bool, device: torch.device) -> list[_Pass]:
    """The step's micro-batches: ``micro_batch_size`` rows each without a token budget,
    else :func:`~mlperf_grpo.train.packing.token_budget_micro_batches`, as many on every
    rank (:func:`~mlperf_grpo.train.packing.split_to_count`). Packed inputs are built on
    the CPU and copied to the device here, before the first pass (a copy from pageable
    memory waits for the device)."""
    if settings.micro_batch_tokens is None:
        return [_Pass(rows, width) for rows, width in batch.micro_batch_spans(settings.micro_batch_size,
                                                                              settings.width_multiple)]
    lengths = batch.attention_mask.sum(dim=1)  # [B]
    kept = (batch.sample_mask > 0).tolist()
    padded_only = not pack or settings.packing == "never"
    micro = token_budget_micro_batches(lengths.tolist(), kept, settings.micro_batch_tokens, settings.micro_batch_size,
                                       padded=padded_only, multiple=settings.width_multiple)
    if settings.packing == "auto" and not padded_only:
        micro = split_padded(micro, lengths.tolist(), settings.micro_batch_tokens, PACK_PADDING_RATIO,
                             settings.width_multiple)
    micro = split_to_count(micro, lengths.tolist(), collectives.all_reduce_max(len(micro)))
    out = []
    for m in micro:
        index = list(m.rows)
        width = int(lengths[index].max())
        consecutive = index == list(range(index[0], index[-1] + 1))
        rows = slice(index[0], index[-1] + 1) if consecutive else torch.tensor(index).to(device)
        tokens, padded = int(lengths[index].sum()), len(index) * padded_width(width, settings.width_multiple)
        wasteful = (padded > PACK_PADDING_RATIO * tokens
                    and padded - tokens > PACK_MIN_PADDING * settings.micro_batch_tokens)
        # a part split_to_count cut from a packed micro-batch, padded past the budget: packed, so
        # that a pass holds at most the budget's tokens, as the planner counts (plan/sequences.py)
        over = len(index) > 1 and padded > settings.micro_batch_tokens
        if padded_only or (settings.packing == "auto" and not wasteful and not over):
            width = min(padded_width(width, settings.width_multiple), batch.input_ids.shape[1])
            out.append(_Pass(rows, width, None, m.empty, index))
            continue
        score = batch.loss_mask[index, :width - 1] > 0
        packed = packed_inputs(batch.input_ids[index, :width], lengths[index], score & (not m.empty),
                               settings.width_multiple)
        out.append(_Pass(rows, width, packed.to(device), m.empty, index))
    return out


def _curr_logprobs(policy: torch.nn.Module, batch: RolloutBatch, on_device: tuple[torch.Tensor, ...], one: _Pass,
                   settings: OptimizeSettings) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(curr, entropy, start)``: the policy's float32 log-probs of each row's next tokens
    from column ``start`` on, with gradient, and the entropy of each position's
    distribution, without (0 where a packed pass scores nothing); ``[mb, width-1-start]``,
    right-padded rows one column more (the last row position's, which predicts nothing)."""
    input_ids, attention_mask = on_device[0], on_device[1]
    chunk = chunk_tokens_for(policy.lm_head.out_features, settings.logits_chunk_bytes)
    packed = one.packed
    if packed is not None:
        with compute_autocast(input_ids.device, settings.compute_dtype):
            flat, entropy = policy_token_logprobs(policy, packed.targets, settings.temperature, chunk, "detached",
                                                  settings.compile_loss, input_ids=packed.input_ids,
                                                  position_ids=packed.position_ids, logits_to_keep=packed.select,
                                                  use_cache=False)  # [1, n]
        curr = torch.zeros(packed.padded_select.shape, dtype=flat.dtype, device=flat.device)
        return (curr.masked_scatter(packed.padded_select, flat[0]),
                torch.zeros_like(curr).masked_scatter(packed.padded_select, entropy[0]), 0)
    ids = input_ids[one.rows, :one.width]
    # Logits from the first completion column on (earlier ones would only score prompt
    # tokens); float32 keeps every position's, the bits the built-in calibration was made with.
    start = 0 if settings.compute_dtype == torch.float32 else batch.first_completion_column(
        one.rows if one.host_rows is None else one.host_rows)
    targets = torch.nn.functional.pad(ids[:, start + 1:], (0, 1))  # [mb, width-start]: the last predicts nothing
    # Right-padded rows need no attention mask below float32: causal attention keeps every real
    # position off the padding after it, and without a mask transformers builds none (its
    # check of the mask reads the device twice a pass) and SDPA may take its causal flash kernel.
    rows_mask = attention_mask[one.rows, :one.width] if settings.compute_dtype == torch.float32 else (
        causal_mask_argument(policy))
    with compute_autocast(input_ids.device, settings.compute_dtype):
        curr, entropy = policy_token_logprobs(policy, targets, settings.temperature, chunk, "detached",
                                              settings.compile_loss, input_ids=ids, attention_mask=rows_mask,
                                              logits_to_keep=one.width - start)
    return curr, entropy, start  # [mb, width-start]


def _micro_batch(
    policy: torch.nn.Module, batch: RolloutBatch, on_device: tuple[torch.Tensor, ...], one: _Pass,
    settings: OptimizeSettings, divisor: torch.Tensor, sums: _Sums,
) -> None:
    """Forward and backward of one micro-batch, its sums added to ``sums``; see
    :func:`optimize_step` and :func:`~mlperf_grpo.train.pass_loss.pass_loss`."""
    _, _, token_mask, rollout_logprobs, advantages, sample_mask = on_device
    rows, width = one.rows, one.width
    curr, entropy, start = _curr_logprobs(policy, batch, on_device, one, settings)
    cols = slice(start, width - 1)
    rows_mask = token_mask[rows, cols]
    rows_kept = sample_mask[rows]  # [mb]
    if one.empty:
        rows_mask, rows_kept = rows_mask * 0, rows_kept * 0
    inputs = (curr, entropy, rollout_logprobs[rows, cols], rows_mask, rows_kept, advantages[rows])
    if settings.compile_loss:
        inputs = owned(inputs)
    loss, stats = loss_function(settings.compile_loss)(*inputs, divisor, settings.pass_loss)
    with planless_attention():  # a checkpointed layer's recomputation picks its kernel again
        loss.backward()
    sums.values += stats


def owned(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """``tensors`` each in its own contiguous storage (a copy of a view; ``clone``, so the
    gradient flows): the compiled loss then sees no view of the step's tensors, whose
    strides and storage offsets Dynamo guards (offsets and widths that happen to be equal
    in one pass are specialized), which recompiled it on most new pass shapes until
    ``recompile_limit`` (8) left it eager for the rest of the run, with a warning."""
    return tuple(t if t._base is None and t.is_contiguous() and t.storage_offset() == 0
                 else t.clone(memory_format=torch.contiguous_format)
                 for t in tensors)
