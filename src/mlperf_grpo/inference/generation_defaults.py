"""Every engine samples from exactly temperature + top-p of the raw logits, as the trainer
scores them: the model folder's ``generation_config.json`` sampling settings are ignored.

A model's ``generation_config.json`` may carry logits processors (``repetition_penalty``,
``no_repeat_ngram_size``, ``min_new_tokens``, ``suppress_tokens``, ...; instruct models
ship ``repetition_penalty: 1.05``) and sampling defaults (``temperature``, ``top_k``,
``top_p``). ``transformers``' ``generate`` fills every setting a call leaves unset from
``model.generation_config`` (``GenerationMixin._prepare_generation_config``) and applies
the processors before a custom one, so the rollouts were drawn from another distribution
than the one whose log-probabilities the trainer computes (the importance weights and the
loss assume ``softmax(logits / temperature)``, cut by top-p). vLLM's ``LLM`` likewise
loads the folder's config as default sampling parameters (``generation_config="auto"``).

So: :func:`neutral_generation_config` keeps only the token ids (the EOS list still ends
completions), ``HFEngine`` generates with it, vLLM is built with
``generation_config="vllm"`` (its own defaults, no file), and one note line names what was
ignored (:func:`ignored_note`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch.distributed as dist
from transformers import GenerationConfig

TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
"""What a neutral config keeps: token ids, which say when a completion ends, not how a
token is drawn."""
DISTRIBUTION_KEYS = {
    "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0, "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0, "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None, "min_length": 0, "min_new_tokens": 0,
    "suppress_tokens": None, "begin_suppress_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None, "sequence_bias": None, "renormalize_logits": False,
    "remove_invalid_values": False, "guidance_scale": 1.0, "num_beams": 1, "diversity_penalty": 0.0,
    "penalty_alpha": None, "watermarking_config": None, "top_h": None,
}
"""The generation-config settings that change which token is drawn (``transformers``'
logits processors and warpers, beam and contrastive search), each with its neutral value;
None, an empty list or mapping and False are neutral too."""


def ignored_settings(generation_config: GenerationConfig | None) -> dict[str, object]:
    """The settings of ``generation_config`` in :data:`DISTRIBUTION_KEYS` set to other
    than their neutral value (sorted by name): what the engines ignore."""
    if generation_config is None:
        return {}
    found = {}
    for key, neutral in sorted(DISTRIBUTION_KEYS.items()):
        value = getattr(generation_config, key, None)
        if value is None or value is False or value == [] or value == {} or value == neutral:
            continue
        found[key] = value
    return found


def neutral_generation_config(generation_config: GenerationConfig | None) -> GenerationConfig:
    """A ``GenerationConfig`` holding only ``generation_config``'s token ids."""
    kept = {key: getattr(generation_config, key, None) for key in TOKEN_ID_KEYS} if generation_config else {}
    return GenerationConfig(**{k: v for k, v in kept.items() if v is not None})


def ignored_note(model_path: str, generation_config: GenerationConfig | None) -> str | None:
    """One line naming the ignored settings of ``model_path``'s generation config, or None."""
    ignored = ignored_settings(generation_config)
    if not ignored:
        return None
    shown = ", ".join(f"{key}={value!r}" for key, value in ignored.items())
    return (f"note: {model_path}: generation_config.json sets {shown}; ignored: every engine samples from the "
            "run's temperature and top-p of the raw logits, the distribution the trainer scores")


_NOTED: set[str] = set()


def print_ignored_note(model_path: str, generation_config: GenerationConfig | None) -> None:
    """:func:`ignored_note` on stderr, once per model path and process, on rank 0 only."""
    note = ignored_note(model_path, generation_config)
    if note is None or model_path in _NOTED or (dist.is_available() and dist.is_initialized() and dist.get_rank() > 0):
        return
    _NOTED.add(model_path)
    print(note, file=sys.stderr)


@contextlib.contextmanager
def generating_with(model, config: GenerationConfig) -> Iterator[None]:
    """``model.generation_config`` is ``config`` inside (restored after): ``generate``
    fills every setting a call leaves unset from it, logits processors included."""
    saved = model.generation_config
    model.generation_config = config
    try:
        yield
    finally:
        model.generation_config = saved
