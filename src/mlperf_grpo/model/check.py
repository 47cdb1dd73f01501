"""A model directory checked fully but cheaply, before a run directory is made: its
weight files against ``config.json`` and its tokenizer against the embedding."""

from __future__ import annotations

import json

from mlperf_grpo.errors import ModelLoadError
from mlperf_grpo.model.files import check_model_path
from mlperf_grpo.model.load import load_tokenizer
from mlperf_grpo.model.skeleton import check_weights

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
"""A Hugging Face tokenizer needs one of these (``tokenizer_config.json`` alone is not one)."""


def check_model(path: str, sample_text: str) -> None:
    """Check a model directory fully but cheaply, before a run directory is made.

    Reads only ``config.json``, the safetensors headers and the tokenizer files:
    every parameter the architecture needs is in the weight files with its shape (a
    tied name may stand for its group); the tokenizer loads, encodes ``sample_text`` to
    at least one token, has an end-of-sequence token and a padding token, and every id
    it can produce (vocabulary, ``eos``, ``pad``) is below the embedding's row count.

    Raises:
        ModelLoadError: one line naming the file or value that is wrong and what to do.
    """
    directory = check_model_path(path)
    _, _, embedding_name, rows = check_weights(directory)
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(
            f"model directory {directory} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}); "
            "copy the model's tokenizer there"
        )
    tokenizer = load_tokenizer(path)
    if not tokenizer(sample_text)["input_ids"]:
        raise ModelLoadError(f"tokenizer of {directory} encodes {sample_text!r} to no tokens; are its files (tokenizer.json) missing?")
    if tokenizer.eos_token_id is None:
        raise ModelLoadError(f"tokenizer of {directory} has no eos_token; set it in tokenizer_config.json")
    ids = {"the largest vocabulary id": max(tokenizer.get_vocab().values(), default=-1),
           "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    for what, token_id in ids.items():
        if token_id >= rows:  # name the token and the class transformers loaded (it may add tokens: Qwen2Tokenizer)
            token = tokenizer.convert_ids_to_tokens(token_id)
            loaded, named = type(tokenizer).__name__, _named_tokenizer_class(directory)
            why = (f"tokenizer_config.json names {named}, but transformers loaded {loaded} for this model type and "
                   f"it adds tokens: use this model type's own tokenizer, or an embedding of at least {token_id + 1} rows"
                   if named is not None and named != loaded else "the tokenizer does not belong to these weights")
            raise ModelLoadError(
                f"tokenizer of {directory}: {what} is {token_id} ({token!r}, tokenizer loaded as "
                f"{loaded}) but the embedding {embedding_name!r} has {rows} rows; {why}"
            )


def _named_tokenizer_class(directory) -> str | None:
    """``tokenizer_class`` of the directory's ``tokenizer_config.json``, or None."""
    try:
        named = json.loads((directory / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    return named if isinstance(named, str) else None
