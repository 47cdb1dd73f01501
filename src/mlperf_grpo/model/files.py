"""A local Hugging Face model directory's files, read without loading any weight:
``builtin:`` names resolved to the shipped directories, ``config.json`` and
``generation_config.json`` as ``transformers`` builds them, the safetensors headers."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, GenerationConfig

from mlperf_grpo.config.sections import BUILTIN_MODEL, BUILTIN_PREFIX
from mlperf_grpo.errors import ModelLoadError
from mlperf_grpo.model import random_init

ASSETS = Path(__file__).parents[1] / "assets"
"""The shipped model directories (``builtin:NAME``)."""
BUILTIN_MODEL_DIR = ASSETS / "arithmetic-tiny"
"""The built-in default model (:data:`mlperf_grpo.config.sections.BUILTIN_MODEL`)."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""``model.dtype`` names -> torch dtypes."""


HF_LOAD_ERRORS = (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError, StrictDataclassError)
"""What ``transformers``/``safetensors`` raise for a model directory they cannot load (a
config value of the wrong type: ``StrictDataclassError``; weights that do not fit the
config: ``RuntimeError``; a weight file that is not safetensors: ``SafetensorError``)."""


def error_reason(err: BaseException) -> str:
    """The first line of an error's message (with the next one where it ends in ':')."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
    return " ".join(lines[:2]) if lines[0].endswith(":") and len(lines) > 1 else lines[0]


def resolve_model_path(path: str) -> Path:
    """``builtin:NAME`` -> the shipped ``assets/NAME`` directory; anything else is a local path.

    Shipped: ``arithmetic-tiny`` (the default), ``arithmetic-tiny-closed`` (its
    starting weights for closed-division runs, docs/closed-division.md "Closed division and plan") and
    ``swe-tiny`` (the agentic suite's byte-level model, random init). A directory with
    ``random_init.json`` and no weights resolves to its cached random-init copy
    (:mod:`mlperf_grpo.model.random_init`).
    """
    if path == BUILTIN_MODEL:
        return BUILTIN_MODEL_DIR
    directory = ASSETS / path.removeprefix(BUILTIN_PREFIX) if path.startswith(BUILTIN_PREFIX) else Path(path)
    return random_init.materialized(directory) if random_init.needs_random_init(directory) else directory


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


SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def weight_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, read from the safetensors headers only (no weights loaded).

    Raises:
        ModelLoadError: no ``model.safetensors`` (or sharded index), a shard missing, or a
            header that does not parse.
    """
    with contextlib.ExitStack() as files:
        return {name: tuple(t.get_shape()) for name, t in open_weights(directory, files).items()}


def open_weights(directory: Path, files: contextlib.ExitStack) -> dict:
    """Tensor name -> a lazy safetensors slice (``get_shape()``; ``[...]`` reads it) of
    every tensor of the weight files, each file opened once (its header read once) and
    kept open until ``files`` closes.

    Raises:
        ModelLoadError: as :func:`weight_shapes`.
    """
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise ModelLoadError(f"{index} is not a readable safetensors index (no weight_map)") from None
    elif (directory / SAFETENSORS_FILE).is_file():
        names = [SAFETENSORS_FILE]
    else:
        raise ModelLoadError(
            f"model directory {directory} has no weights ({SAFETENSORS_FILE} or {SAFETENSORS_INDEX}); "
            "copy the model's safetensors files there"
        )
    tensors = {}
    for name in names:
        path = directory / name
        try:
            f = files.enter_context(safe_open(str(path), framework="pt"))
            for key in f.keys():
                tensors[key] = f.get_slice(key)
        except (OSError, SafetensorError, ValueError) as err:
            raise ModelLoadError(
                f"cannot read the safetensors header of {path}: {error_reason(err)}; the file is truncated or not "
                "safetensors: copy the model's weight files there again"
            ) from None
    return tensors


def hf_config(directory: Path):
    """``directory/config.json`` as a ``transformers`` config. Raises ModelLoadError."""
    try:
        return AutoConfig.from_pretrained(directory, local_files_only=True)
    except HF_LOAD_ERRORS as err:
        raise ModelLoadError(
            f"cannot build the model of {directory / 'config.json'}: {error_reason(err)}; copy the model's config.json there again"
        ) from None


def saved_generation_config(directory: Path) -> GenerationConfig | None:
    """``directory/generation_config.json``, or ``None`` without one (the model keeps the
    generation config built from ``config.json``)."""
    try:
        return GenerationConfig.from_pretrained(directory, local_files_only=True)
    except OSError:
        return None


def load_generation_config(path: str) -> GenerationConfig:
    """The generation config the model at ``path`` generates with, as ``from_pretrained``
    gives it: ``generation_config.json``, else one built from ``config.json`` (for
    engines that do not load the model through ``transformers``: vLLM).

    Raises:
        ModelLoadError: not a local model directory, or ``config.json`` does not build.
    """
    directory = check_model_path(path)
    return saved_generation_config(directory) or GenerationConfig.from_model_config(hf_config(directory))

CONTEXT_KEYS = ("max_position_embeddings", "n_positions")
"""``config.json`` keys that give a model's context in tokens (Llama, Qwen: the first; GPT-2: the second)."""


def context_length(path: str) -> tuple[int | None, str]:
    """The model's context: the most tokens (prompt + completion) one sequence may hold.

    Returns:
        ``(tokens, key)``: the first of :data:`CONTEXT_KEYS` that the text config of
        ``config.json`` has (``get_text_config()``: a multimodal config's language model),
        and its name; ``(None, "")`` when it has none (no limit known).
    Raises:
        ModelLoadError: no model directory, or ``config.json`` does not load.
    """
    values = hf_config(check_model_path(path)).get_text_config().to_dict()  # the keys as config.json spells them
    return _context_of(values)


def _context_of(values: dict) -> tuple[int | None, str]:
    for key in CONTEXT_KEYS:
        value = values.get(key)
        if isinstance(value, int) and value > 0:
            return value, key
    return None, ""


def config_context_length(values: dict) -> tuple[int | None, str]:
    """:func:`context_length` of a ``config.json``'s text config given as a dict, as
    ``transformers`` fills it in for the training: a context key the dict leaves out is
    the model type's default (Qwen3: 32,768; Llama: 2,048). ``(None, "")`` where neither
    the dict nor its model type (unknown to ``transformers``) gives one."""
    found = _context_of(values)
    if found[0] is not None:
        return found
    try:
        config = AutoConfig.for_model(**values)
    except (ValueError, TypeError, KeyError, StrictDataclassError):
        return None, ""
    return _context_of(config.get_text_config().to_dict())


def linear_attention_layers(path: str) -> bool:
    """Whether the model at ``path`` has linear-attention layers (``config.layer_types``
    naming ``linear_attention``: Qwen3.5's gated delta-net). Raises ModelLoadError."""
    config = hf_config(check_model_path(path)).get_text_config()
    return "linear_attention" in (getattr(config, "layer_types", None) or [])
