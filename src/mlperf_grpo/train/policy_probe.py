"""Whether the loss pass's shortcuts hold for a policy, checked on a few tokens before
training: training mode, the log-prob head (``train/logprobs.py``) and packing (``train/packing.py``).

The loss passes run in training mode (activation checkpointing needs it), the engine
samples in eval mode; with dropout off (``trainer.disable_dropout``) the two forwards
are the same computation for most models. :func:`training_mode_problem` checks it on one
short row; a model whose training mode adds noise or randomness (Mixtral's and PhiMoE's
``router_jitter_noise``: hidden states jittered, experts sampled) is refused (exit 2).

The log-prob head stands in for ``lm_head`` and returns log-probs, so a model that
transforms its logits after ``lm_head`` (Gemma2/3's ``final_logit_softcapping``, a
``logit_scale``) would transform log-probs instead: :func:`logprob_head_problem`
checks that the model's logits are its ``lm_head``'s output, and the trainer refuses
such a model (exit 2, one line).

Packing: a packed pass (``train/packing.py``: rows
end to end, ``position_ids`` restarting, no ``attention_mask``) relies on the model to
keep attention within each row. Most Hugging Face decoders do (``masking_utils`` reads
the packed rows from ``position_ids``); some do not, and then score a row with its
neighbours' tokens in its context, silently: Qwen3.5's gated delta-net carries its
recurrent state from one row into the next (its torch path ignores sequence
boundaries), OPT numbers positions from the attention mask, Bloom's ALiBi and Gemma2's
eager attention do not read ``position_ids`` for their masks.

:func:`packing_problem` runs two short rows packed, twice (the first row's tokens
redrawn the second time), and the second row alone, before training: where the second
row's log-probs depend on the first row's tokens, or differ from its own beyond a few
roundings of the compute dtype, the trainer trains with padded passes instead
(``OptimizeSettings.packing: never``) and says so in one line.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from mlperf_grpo.errors import ModelLoadError
from mlperf_grpo.model.attention import planless_attention
from mlperf_grpo.train import collectives
from mlperf_grpo.train.logprobs import policy_token_logprobs
from mlperf_grpo.train.optimize import OptimizeSettings, compute_autocast
from mlperf_grpo.train.packing import packed_inputs

FIRST, SECOND = 6, 4
"""Tokens of the probe's two rows."""
TOLERANCE = {torch.float32: 1e-3, torch.float16: 3e-2, torch.bfloat16: 6e-2}
"""Largest difference of the second row's packed log-probs from its own (a few roundings
of the compute dtype, as ``inference.slot_probe.PROBE_TOLERANCE``)."""
ISOLATION_TOLERANCE = 1e-4
"""Largest change of the second row's packed log-probs when only the first row's tokens
change: none where attention is kept within each row (the same kernels on the same
shapes; a masked key adds an exact 0)."""


@torch.no_grad()
def packing_problem(policy: torch.nn.Module, compute_dtype: torch.dtype, width_multiple: int = 1) -> str | None:
    """None when packing two rows gives the second row the log-probs it has alone (and
    none of the first row's tokens reach it); else one line saying what differs (or the
    error the packed forward raised). Every rank runs it alike (FSDP2's forward is
    collective). ``compute_dtype``: the loss passes' (their autocast);
    ``width_multiple``: the compiled policy's width multiple (the packed width)."""
    vocab = policy.lm_head.out_features
    device = next(policy.parameters()).device
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, vocab, (3, FIRST), generator=gen)
    ids = torch.zeros(2, FIRST, dtype=torch.long)
    ids[0], ids[1, :SECOND] = rows[0], rows[2, :SECOND]
    lengths = torch.tensor([FIRST, SECOND])
    score = torch.arange(FIRST - 1).unsqueeze(0) < (lengths - 1).unsqueeze(1)  # every next token of each row
    second, training = [], policy.training
    policy.eval()  # no dropout: the two packed runs differ only by the first row's tokens
    try:
        for first in (rows[0], rows[1]):
            ids[0] = first
            packed = packed_inputs(ids, lengths, score, width_multiple).to(device)
            with compute_autocast(device, compute_dtype):
                flat, _ = policy_token_logprobs(policy, packed.targets, 1.0, FIRST + SECOND, input_ids=packed.input_ids,
                                                position_ids=packed.position_ids, logits_to_keep=packed.select,
                                                use_cache=False)
            second.append(flat[0, FIRST - 1:].float().cpu())  # the second row's SECOND - 1 log-probs
        alone_ids = ids[1:, :SECOND].to(device)
        with compute_autocast(device, compute_dtype):
            alone, _ = policy_token_logprobs(policy, torch.nn.functional.pad(alone_ids[:, 1:], (0, 1)), 1.0, SECOND,
                                             input_ids=alone_ids, use_cache=False)
    except Exception as err:  # noqa: BLE001 - any failure of the packed path means: do not pack
        return f"a packed forward failed ({type(err).__name__}: {str(err).splitlines()[0][:160]})"
    finally:
        policy.train(training)
    alone = alone[0, :-1].float().cpu()
    leak = float((second[0] - second[1]).abs().max())
    if leak > ISOLATION_TOLERANCE:
        return f"a packed row's log-probs change by {leak:.2g} with the tokens of the row before it"
    off = float((second[0] - alone).abs().max()) / max(1.0, float(alone.abs().max()))
    if off > TOLERANCE.get(compute_dtype, TOLERANCE[torch.bfloat16]):
        return f"a packed row's log-probs differ from its own by {off:.2g} (relative)"
    return None


TRAINING_MODE_TOLERANCE = {**TOLERANCE, torch.float32: 1e-5}
"""Largest difference of a row's training-mode logits from its eval-mode ones, relative to
the largest logit (at least 1): 0 where both modes run the same kernels (the usual case);
in float32 about 80 roundings (2^-23 each) of a model whose modes sum in another order,
in the half types :data:`TOLERANCE`'s few roundings."""


@torch.no_grad()
def training_mode_problem(policy: torch.nn.Module, compute_dtype: torch.dtype = torch.float32) -> str | None:
    """None when the policy's training-mode forward gives one row of :data:`FIRST` tokens
    the logits its eval-mode forward gives (within :data:`TRAINING_MODE_TOLERANCE`); else one
    line naming the difference (the largest over ranks, so that every rank decides alike).
    ``compute_dtype``: the loss passes' (their autocast). Every rank runs it (FSDP2's
    forward is collective)."""
    device = next(policy.parameters()).device
    ids = torch.randint(0, policy.lm_head.out_features, (1, FIRST), generator=torch.Generator().manual_seed(2))
    ids = ids.to(device)
    training, logits = policy.training, []
    try:
        for mode in (False, True):
            with compute_autocast(device, compute_dtype):
                logits.append(policy.train(mode)(input_ids=ids, use_cache=False).logits.float())
    finally:
        policy.train(training)
    off = float((logits[1] - logits[0]).abs().max()) / max(1.0, float(logits[0].abs().max()))
    off = float(collectives.all_gather_rows(torch.tensor([[off]])).max())  # noise differs by rank: all ranks agree
    if off > TRAINING_MODE_TOLERANCE.get(compute_dtype, TOLERANCE[torch.bfloat16]):
        return (f"its training-mode forward scores a row differently from its eval-mode one (by {off:.2g}, relative: "
                "noise or sampling only training mode applies, e.g. router_jitter_noise), so the loss passes "
                "(training mode) would not score the tokens as the engine (eval mode) sampled them")
    return None


@torch.no_grad()
def logprob_head_problem(policy: torch.nn.Module) -> str | None:
    """None when the policy's logits are its ``lm_head``'s output (up to a cast to
    float32), which the log-prob head computes; else one line naming the largest
    difference. A forward hook reads ``lm_head``'s output inside the model's own forward
    (also under FSDP2, whose root owns it); every rank runs it alike."""
    device = next(policy.parameters()).device
    ids = torch.randint(0, policy.lm_head.out_features, (1, FIRST), generator=torch.Generator().manual_seed(1))
    seen = []
    hook = policy.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.detach()))
    training = policy.training
    policy.eval()
    try:
        logits = policy(input_ids=ids.to(device), use_cache=False).logits
    finally:
        hook.remove()
        policy.train(training)
    off = float((logits.float() - seen[-1].float()).abs().max())
    if off > 0:
        return (f"its logits are not its lm_head's output (they differ by up to {off:.3g}: the model transforms them "
                "after lm_head, e.g. final_logit_softcapping or a logit scale), which the chunked log-probs "
                "(train/logprobs.py) do not apply")
    return None


def checked_settings(policy: torch.nn.Module, settings: OptimizeSettings,
                     model: str) -> tuple[OptimizeSettings, str | None]:
    """``settings`` for ``policy`` (``model``: its path, for the message), and a note line
    where packing is turned off (:func:`packing_problem`: passes right-padded instead).
    The probes run eager (``torch.compiler.set_stance("force_eager")``): compiled, their
    eval-mode, no-grad and one-row calls took 6 of Dynamo's 8 entries of the checkpointed
    layer's frame before training, and a checkpointed 256 x 1,024 run on one H100 failed
    its first backward (``CheckpointError``: 52 tensors saved, 46 recomputed); eager, it
    trained.

    Raises:
        ModelLoadError: :func:`training_mode_problem` or :func:`logprob_head_problem` (the
            loss would score other log-probs than the engine samples from).
    """
    with torch.compiler.set_stance("force_eager"), planless_attention():  # the passes' attention kernels
        return _checked_settings(policy, settings, model)


def _checked_settings(policy: torch.nn.Module, settings: OptimizeSettings,
                      model: str) -> tuple[OptimizeSettings, str | None]:
    problem = training_mode_problem(policy, settings.compute_dtype)
    if problem is not None:
        raise ModelLoadError(f"model {model}: {problem}; set that noise to 0 in its config.json, or use another model")
    problem = logprob_head_problem(policy)
    if problem is not None:
        raise ModelLoadError(f"model {model}: {problem}; use a model whose logits are its lm_head's output")
    if settings.micro_batch_tokens is None or settings.packing == "never":
        return settings, None
    problem = packing_problem(policy, settings.compute_dtype, settings.width_multiple)
    if problem is None:
        return settings, None
    return replace(settings, packing="never"), (f"rows not packed for this model ({problem}): each pass "
                                                "right-pads its rows instead, grpo.micro_batch_tokens padding included")
