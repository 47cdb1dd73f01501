"""Loading the policy model and tokenizer from a local Hugging Face directory."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from mlperf_grpo.config import BUILTIN_MODEL

ASSETS = Path(__file__).parent / "assets"
BUILTIN_MODEL_DIR = ASSETS / "arithmetic-tiny"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class ModelLoadError(ValueError):
    """The model directory is missing or is not a loadable Hugging Face causal LM."""


BUILTIN_PREFIX = "builtin:"


def resolve_model_path(path: str) -> Path:
    """``builtin:NAME`` -> the shipped ``assets/NAME`` directory; anything else is a local path.

    Shipped: ``arithmetic-tiny`` (the default) and ``arithmetic-tiny-closed`` (its
    starting weights for closed-division runs, README "Closed division and plan").
    """
    if path == BUILTIN_MODEL:
        return BUILTIN_MODEL_DIR
    if path.startswith(BUILTIN_PREFIX):
        return ASSETS / path.removeprefix(BUILTIN_PREFIX)
    return Path(path)


def check_model_path(path: str) -> Path:
    """The model's local directory.

    Raises:
        ModelLoadError: it does not exist or has no ``config.json`` (nothing is downloaded).
    """
    directory = resolve_model_path(path)
    if not (directory / "config.json").is_file():
        raise ModelLoadError(
            f"model.path {path!r}: {directory} is not a local Hugging Face model directory (no config.json); "
            "models are never downloaded"
        )
    return directory


def check_device(device: str) -> None:
    """Raises ModelLoadError when ``device`` is ``cuda`` and no CUDA device is available."""
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("model.device is cuda but no CUDA device is available; set model.device: cpu")


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """Tokenizer of the model at ``path``, padding on the left (for batched generation).

    Raises:
        ModelLoadError: not found or not loadable (nothing is downloaded).
    """
    directory = check_model_path(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot load tokenizer from {directory}: {str(err).splitlines()[0]}") from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(path: str, dtype: str, device: str = "cpu") -> PreTrainedModel:
    """The causal LM at ``path`` in ``dtype`` ("float32" or "bfloat16") on ``device``
    ("cpu" or "cuda"), in eval mode.

    Raises:
        ModelLoadError: not found or not loadable (nothing is downloaded), or ``cuda``
            asked for where no CUDA device is available.
    """
    check_device(device)
    directory = check_model_path(path)
    hf_logging.disable_progress_bar()  # our own bars show progress; keep stderr readable
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=DTYPES[dtype], local_files_only=True)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot load model from {directory}: {str(err).splitlines()[0]}") from None
    return model.to(device).eval()
