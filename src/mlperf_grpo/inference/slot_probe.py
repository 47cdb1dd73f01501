"""Whether the slot decoder can drive a model: one prefill and one decode step through
its caches, checked against the model's own forward.

:func:`~mlperf_grpo.inference.slot_attention.supports_slot_decoding` reads the config (full
attention only, no recurrent state, no sliding window); a family can pass it and still
not run through the slot decoder's caches (OPT and Falcon call ``get_seq_length`` on the
cache a prefill hands them; a family may number positions from its attention mask rather
than ``position_ids``). :func:`slot_decoding_problem` runs the real path on a few tokens
so that such a model is routed to ``generate`` instead of failing inside a rollout.
"""

from __future__ import annotations

import warnings

import torch
from transformers import PreTrainedModel

from mlperf_grpo.inference.decode import DecodeOptions, SlotDecoder
from mlperf_grpo.inference.slot_attention import SLOT_ATTENTION, attention_implementation
from mlperf_grpo.inference.slot_state import DecodeCall

PROBE_PROMPT = (1, 2, 3, 4)
"""Token ids of the probe's prompt (taken modulo the vocabulary size)."""

PROBE_TOLERANCE = {torch.float32: 1e-3, torch.float16: 3e-2, torch.bfloat16: 6e-2}
"""Largest difference of the probe's logits from the model's own, relative to
``max(1, max |logit|)``: a few roundings of the dtype (other dtypes: the bfloat16 one). A
cache the model does not use as the decoder does (wrong columns, positions or rows) is off
by the logits' own scale."""


@torch.no_grad()
def slot_decoding_problem(model: PreTrainedModel, pad_token_id: int) -> str | None:
    """None when the slot decoder computes ``model``'s next-token logits: a prefill of
    :data:`PROBE_PROMPT` into one slot, then one decode step of the token it sampled,
    against the model's forward over the 5 tokens with no cache. Else one line saying
    what went wrong (the error the path raised, or how far the logits are). Logits that
    are not finite (an engine built empty for a refit, its weights not loaded yet) are not
    compared: the path ran. Eager (no CUDA graphs, no fused kernels); a few forward
    passes of 5 tokens, and a one-slot cache of 8 columns."""
    vocab = model.get_input_embeddings().weight.shape[0]
    prompt = [t % vocab for t in PROBE_PROMPT]
    decoder = SlotDecoder(model, 1, pad_token_id, DecodeOptions(cuda_graphs=False, key_block=8, fused_kernels=False))
    call = DecodeCall(1.0, 1.0, 2, (-1,))
    try:
        decoder._ensure(1, 8, 8, call.max_new_tokens)  # one slot, 8 columns
        decoder._prefill([0], [prompt], [0], call, 1)
        with attention_implementation(model, SLOT_ATTENTION):
            got = decoder._decode_logits(1, 8)[0].float()  # [V]
        token = int(decoder.state.tokens[0, 0])
    except Exception as error:  # noqa: BLE001 - any failure of the path routes the model to generate
        return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:160]}"
    ids = torch.tensor([prompt + [token]], device=model.device)
    want = model(input_ids=ids).logits[0, -1].float()  # [V]
    if not bool(torch.isfinite(want).all()):  # weights not loaded yet (an engine built for a refit): the path ran
        return None
    error = float((got - want).abs().max())
    scale = max(1.0, float(want.abs().max()))
    tolerance = PROBE_TOLERANCE.get(next(model.parameters()).dtype, PROBE_TOLERANCE[torch.bfloat16])
    if not error <= tolerance * scale:  # NaN fails too
        return f"its decode step's logits differ from the model's by {error:.3g} (scale {scale:.3g})"
    return None


def slot_decoder_drives(model: PreTrainedModel, pad_token_id: int, decode: str) -> bool:
    """Whether the slot decoder drives ``model``'s cache (:func:`slot_decoding_problem`);
    if not, one warning line (an engine's ``decode`` ``"auto"``: ``generate`` then runs).

    Raises:
        ValueError: it does not, and ``decode`` is ``"slots"``.
    """
    problem = slot_decoding_problem(model, pad_token_id)
    if problem is None:
        return True
    if decode == "slots":
        raise ValueError(f"{type(model).__name__} does not run through the slot decoder ({problem}): "
                         "use decode='generate'")
    warnings.warn(f"{type(model).__name__} decodes through generate: the slot decoder cannot drive it ({problem})",
                  RuntimeWarning, stacklevel=3)
    return False
