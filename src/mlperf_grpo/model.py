"""Loading the policy model and tokenizer from a local Hugging Face directory."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
)
from huggingface_hub.errors import StrictDataclassError
from transformers.utils import logging as hf_logging

from mlperf_grpo.config import BUILTIN_MODEL
from mlperf_grpo.errors import ModelLoadError
from mlperf_grpo.weight_names import loaded_shapes

ASSETS = Path(__file__).parent / "assets"
BUILTIN_MODEL_DIR = ASSETS / "arithmetic-tiny"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


HF_LOAD_ERRORS = (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError, StrictDataclassError)
"""What ``transformers``/``safetensors`` raise for a model directory they cannot load (a
config value of the wrong type: ``StrictDataclassError``; weights that do not fit the
config: ``RuntimeError``; a weight file that is not safetensors: ``SafetensorError``)."""


def _reason(err: BaseException) -> str:
    """The first line of an error's message (with the next one where it ends in ':')."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
    return " ".join(lines[:2]) if lines[0].endswith(":") and len(lines) > 1 else lines[0]


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


SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
"""A Hugging Face tokenizer needs one of these (``tokenizer_config.json`` alone is not one)."""


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
                f"cannot read the safetensors header of {path}: {_reason(err)}; the file is truncated or not "
                "safetensors: copy the model's weight files there again"
            ) from None
    return tensors


def _skeleton(directory: Path, dtype: torch.dtype) -> PreTrainedModel:
    """The architecture of ``directory/config.json`` in ``dtype`` on the meta device.

    Raises:
        ModelLoadError: ``config.json`` does not load, names an unknown architecture, or
            a family ``AutoModelForCausalLM`` has no class for (T5, ViT: not a causal LM).
    """
    config = _config(directory)
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ModelLoadError(_not_causal(directory, config, ", ".join(getattr(config, "architectures", None) or [config.model_type]),
                                         "transformers has no causal-LM class for it"))
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except HF_LOAD_ERRORS as err:
        raise ModelLoadError(
            f"cannot build the model of {directory / 'config.json'}: {_reason(err)}; copy the model's config.json there again"
        ) from None
    check_causal(directory, config, model)
    return model


def check_causal(directory: Path, config, model: torch.nn.Module) -> None:
    """Refuse a model that is not a causal LM although ``AutoModelForCausalLM`` builds it.

    ``transformers`` maps encoder families (BERT, RoBERTa, ...) to a causal head too
    (``BertLMHeadModel``), which attends to the whole sequence unless ``is_decoder`` is
    set: such a directory would be trained as if it predicted the next token. Refused
    when ``config.json``'s ``architectures`` are all masked-LM heads
    (``MODEL_FOR_MASKED_LM_MAPPING_NAMES``, none a causal one), or when the built model's
    attention modules (those with an ``is_causal`` flag) are all bidirectional. A model
    without such flags (no attention, as Mamba) is accepted.

    Raises:
        ModelLoadError: one line naming the architecture, why, and what is accepted.
    """
    causal_names = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    masked_names = set(MODEL_FOR_MASKED_LM_MAPPING_NAMES.values()) - causal_names
    listed = list(getattr(config, "architectures", None) or [])
    flags = [m.is_causal for m in model.modules() if isinstance(getattr(m, "is_causal", None), bool)]
    if listed and all(name in masked_names for name in listed):
        why = "a masked LM (it predicts hidden tokens from both sides)"
    elif flags and not any(flags):
        why = "its attention sees the whole sequence" + (" (is_decoder is false)" if hasattr(config, "is_decoder") else "")
    else:
        return
    raise ModelLoadError(_not_causal(directory, config, ", ".join(listed) or type(model).__name__, why))


def _not_causal(directory: Path, config, named: str, why: str) -> str:
    """The one line refusing ``directory`` as not a causal LM: what it is, why, what is accepted."""
    return (
        f"model {directory}: config.json describes {named} (model_type {config.model_type}), {why}: not a causal LM; "
        "give a causal LM directory (architectures ...ForCausalLM or ...LMHeadModel; an encoder family such as BERT "
        "only with is_decoder: true)"
    )


def _config(directory: Path):
    """``directory/config.json`` as a ``transformers`` config. Raises ModelLoadError."""
    try:
        return AutoConfig.from_pretrained(directory, local_files_only=True)
    except HF_LOAD_ERRORS as err:
        raise ModelLoadError(
            f"cannot build the model of {directory / 'config.json'}: {_reason(err)}; copy the model's config.json there again"
        ) from None


def _expected_shapes(model: PreTrainedModel) -> tuple[dict[str, tuple[int, ...]], list[set[str]], str, int]:
    """What the config's architecture needs, from its :func:`_skeleton` (no memory).

    Returns:
        ``(shapes, tied_groups, embedding_name, embedding_rows)``: parameter name ->
        shape; sets of names that share one tensor (tied embeddings); the input
        embedding's parameter name and its number of rows (token ids must be below it).
    """
    embedding_module = model.get_input_embeddings()
    embedding = embedding_module.weight
    embedding_name = next(n for n, m in model.named_modules() if m is embedding_module) + ".weight"
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    return shapes, tied_groups(model), embedding_name, int(embedding.shape[0])


def tied_groups(model: torch.nn.Module) -> list[set[str]]:
    """The parameter names of ``model``, grouped by the tensor they name (a tied input
    and output embedding is one group of two names)."""
    groups: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), set()).add(name)
    return list(groups.values())


def check_weights(directory: Path) -> tuple[dict[str, tuple[int, ...]], list[set[str]], str, int]:
    """Check that the weight files of a model directory hold every parameter its
    ``config.json`` needs, each with its shape (a tied name may stand for its group),
    reading only ``config.json`` and the safetensors headers. A saved name counts as the
    parameter ``from_pretrained`` loads it into (:func:`~mlperf_grpo.weight_names.loaded_shapes`).

    Returns:
        ``(shapes_in_files, tied_groups, embedding_name, embedding_rows)``: tensor name ->
        shape in the weight files; then as :func:`_expected_shapes`.
    Raises:
        ModelLoadError: one line naming the file or tensor that is wrong and what to do.
    """
    return _check_shapes(directory, weight_shapes(directory))


def _check_shapes(directory: Path, have: dict[str, tuple[int, ...]]) -> tuple[dict[str, tuple[int, ...]], list[set[str]], str, int]:
    """:func:`check_weights` on the tensor shapes ``have`` of the weight files."""
    skeleton = _skeleton(directory, torch.float32)
    want, groups, embedding_name, rows = _expected_shapes(skeleton)
    loaded = loaded_shapes(skeleton, have)
    for group in groups:
        present = sorted(n for n in group if n in loaded)
        if not present:
            raise ModelLoadError(
                f"model {directory}: the weight files have no tensor {sorted(group)[0]!r} that "
                f"{directory / 'config.json'} needs; the weights and config.json are of different models"
            )
        for name in present:
            if loaded[name] is not None and loaded[name] != want[name]:
                raise ModelLoadError(
                    f"model {directory}: tensor {name!r} has shape {list(loaded[name])} in the weight files but "
                    f"config.json needs {list(want[name])}; the weights and config.json (vocab_size, sizes) do not match"
                )
    return have, groups, embedding_name, rows


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
            raise ModelLoadError(
                f"tokenizer of {directory}: {what} is {token_id} ({token!r}, tokenizer loaded as "
                f"{type(tokenizer).__name__}) but the embedding {embedding_name!r} has {rows} rows; the tokenizer "
                "does not belong to these weights"
            )


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


def encode_prompts(tokenizer: PreTrainedTokenizerBase, prompts: list[str]) -> list[list[int]]:
    """The token ids (unpadded, one list per prompt) every engine feeds the model for
    these prompt texts, and what :func:`mlperf_grpo.tasks.lengths.check_prompt_lengths`
    measures: each text tokenized with the tokenizer's special tokens (BOS) added, unless
    the text already begins with them, as a prompt rendered by a chat template that writes
    ``{{ bos_token }}`` does (a ``messages`` task's prompt); then without, so it starts
    with one BOS, not two (the fix TRL and vLLM's chat path apply: the rendered template is
    tokenized with ``add_special_tokens=False``).
    """
    with_special = tokenizer(prompts)["input_ids"]
    plain = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    out = []
    for ids, text_ids in zip(with_special, plain):
        # where the text's own ids sit among the added special tokens: after the prefix
        at = next((k for k in range(len(ids) - len(text_ids) + 1) if ids[k:k + len(text_ids)] == text_ids), 0)
        prefix = ids[:at]
        out.append(text_ids if prefix and text_ids[:len(prefix)] == prefix else ids)
    return out


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
    values = _config(check_model_path(path)).get_text_config().to_dict()  # the keys as config.json spells them
    for key in CONTEXT_KEYS:
        value = values.get(key)
        if isinstance(value, int) and value > 0:
            return value, key
    return None, ""


def load_model(path: str, dtype: str, device: str = "cpu") -> PreTrainedModel:
    """The causal LM at ``path`` in ``dtype`` ("float32" or "bfloat16") on ``device``
    ("cpu" or "cuda"), in eval mode, as ``AutoModelForCausalLM.from_pretrained`` loads
    it. Each weight file is opened once (:func:`open_weights`): its header is checked
    against ``config.json`` (as :func:`check_weights`), then ``from_pretrained`` reads
    the tensors through the same open files (``state_dict=``), so no header is read twice.

    Raises:
        ModelLoadError: not found or not loadable (nothing is downloaded): a weight file
            truncated or not safetensors, a tensor missing or of another shape, a
            ``config.json`` that does not build; or ``cuda`` asked for where no CUDA
            device is available.
    """
    check_device(device)
    directory = check_model_path(path)
    hf_logging.disable_progress_bar()  # our own bars show progress; keep stderr readable
    with contextlib.ExitStack() as files:
        tensors = open_weights(directory, files)
        # names the file or tensor that is wrong; from_pretrained would not
        _check_shapes(directory, {name: tuple(t.get_shape()) for name, t in tensors.items()})
        try:
            config = _config(directory)
            model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # as AutoModelForCausalLM picks it
            model = model_class.from_pretrained(None, config=config, state_dict=tensors,
                                                generation_config=_generation_config(directory), dtype=DTYPES[dtype])
        except HF_LOAD_ERRORS as err:
            raise ModelLoadError(f"cannot load model from {directory}: {_reason(err)}") from None
    model.name_or_path = model.config.name_or_path = str(directory)  # as from_pretrained(directory) records it
    return model.to(device).eval()


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """A Hugging Face causal LM's decoder layers: the one ``ModuleList`` of its base model
    (``model.layers`` for Llama and Qwen, ``gpt_neox.layers``, GPT-2's ``transformer.h``).

    Raises:
        ValueError: the base model has no such list, or several.
    """
    base = getattr(model, "base_model", None)
    lists = [m for m in base.children() if isinstance(m, torch.nn.ModuleList)] if isinstance(base, torch.nn.Module) else []
    if len(lists) != 1:
        raise ValueError(f"{type(model).__name__}: {len(lists)} lists of decoder layers in its base model, not one; "
                         "FSDP sharding needs one")
    return lists[0]


def compile_decoder_layers(model: torch.nn.Module) -> None:
    """``torch.compile`` each decoder layer in place (``nn.Module.compile``: parameter
    names and ``state_dict`` keys are unchanged), with dynamic shapes (micro-batches differ
    in rows and width). The layers share one code object, so one compilation serves them
    all; it happens at the first forward and backward pass. Regional compilation as
    torchtitan's ``apply_compile`` (before any ``fully_shard``).

    Raises:
        ValueError: the model has no ``model.layers`` list.
    """
    for layer in decoder_layers(model):
        layer.compile(dynamic=True)


def graph_breaking_layers(path: str) -> str | None:
    """Why ``model.compile: auto`` leaves the model at ``path`` eager, or None: its
    decoder layers hold mixture-of-experts routing or linear attention, whose
    data-dependent control flow breaks the compiled graph (on one H200, a
    ``qwen3_5_moe`` model's first compiled step had not ended after 216 s: inductor
    graph breaks at the experts' grouped matmul, ``aten._local_scalar_dense``, issue 29).
    Reads ``config.json`` only.

    Raises:
        ModelLoadError: no model directory, or a ``config.json`` that does not load.
    """
    config = _config(check_model_path(path)).get_text_config()
    kinds = []
    if getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None):
        kinds.append("mixture-of-experts")
    if linear_attention_layers(path):
        kinds.append("linear-attention")
    return f"{' and '.join(kinds)} layers break the compiled graph" if kinds else None


def linear_attention_layers(path: str) -> bool:
    """Whether the model at ``path`` has linear-attention layers (``config.layer_types``
    naming ``linear_attention``: Qwen3.5's gated delta-net). Raises ModelLoadError."""
    config = _config(check_model_path(path)).get_text_config()
    return "linear_attention" in (getattr(config, "layer_types", None) or [])


def compile_policy_layers(setting: str, wanted: bool, path: str) -> tuple[bool, str | None]:
    """``model.compile`` resolved for the model at ``path``: ``(compile, note)``.

    ``wanted`` is ``ModelConfig.compile_policy`` (``auto`` resolved by device and
    dtype). Under ``auto`` a model whose layers break the graph
    (:func:`graph_breaking_layers`) stays eager, and ``note`` says so in one line;
    ``on`` compiles it anyway.

    Raises:
        ModelLoadError: as :func:`graph_breaking_layers`.
    """
    if not wanted or setting != "auto":
        return wanted, None
    reason = graph_breaking_layers(path)
    if reason is None:
        return True, None
    return False, f"model.compile auto: off for this model ({reason}); model.compile: on compiles it anyway"


def model_skeleton(path: str, dtype: str) -> PreTrainedModel:
    """The model at ``path`` as an architecture without weights: its parameters and
    buffers on the meta device (no memory) in ``dtype``, its generation config read from
    the directory as ``from_pretrained`` reads it. Shard it, then :func:`materialize` it.

    Raises:
        ModelLoadError: not a local model directory, or ``config.json`` does not build.
    """
    directory = check_model_path(path)
    model = _skeleton(directory, DTYPES[dtype])
    generation_config = _generation_config(directory)
    if model.can_generate() and generation_config is not None:  # as adjust_generation_fn does in from_pretrained
        model.generation_config = generation_config
    return model


def _generation_config(directory: Path) -> GenerationConfig | None:
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
    return _generation_config(directory) or GenerationConfig.from_model_config(_config(directory))


def materialize(model: torch.nn.Module, device: str | torch.device) -> None:
    """Give a :func:`model_skeleton` (sharded or not) storage on ``device``, in place.

    Parameters and persistent buffers are left **uninitialised** (``to_empty``): the caller
    loads them. Tied parameters (input and output embedding) stay one tensor.
    Non-persistent buffers, which no weight file holds (RoPE's ``inv_freq``), are
    recomputed from the config by the model's own initializer (Hugging Face
    ``_init_weights`` of each module that owns one), as ``from_pretrained`` computes them.

    Raises:
        ModelLoadError: the model's initializer left a non-persistent floating-point
            buffer unset (it is filled with NaN first, so this is detected), or its ties
            could not be restored.
    """
    ties = _tie_pattern(model)
    model.to_empty(device=device)  # new tensors per module: a tie between two modules breaks
    if _tie_pattern(model) != ties:
        model.tie_weights()
        if _tie_pattern(model) != ties:
            raise ModelLoadError(f"{type(model).__name__}: tie_weights() did not restore its tied weights {ties}")
    owners = [(name, m) for name, m in model.named_modules() if m._non_persistent_buffers_set]
    with torch.no_grad():
        for _, module in owners:
            for _, buffer in _float_buffers(module):
                buffer.fill_(float("nan"))
            model._init_weights(module)
    for owner, module in owners:
        for buffer_name, buffer in _float_buffers(module):
            if bool(buffer.isnan().any()):
                raise ModelLoadError(
                    f"{type(model).__name__}: its initializer does not recompute the buffer {owner}.{buffer_name}; "
                    "this model cannot be built sharded: train it in one process (without torchrun)"
                )


def _tie_pattern(model: torch.nn.Module) -> list[list[str]]:
    """The groups of parameter names that share a tensor, in a comparable form."""
    return sorted(sorted(group) for group in tied_groups(model) if len(group) > 1)


def _float_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, buffer)`` of the floating-point non-persistent buffers ``module`` itself owns."""
    found = ((name, getattr(module, name)) for name in sorted(module._non_persistent_buffers_set))
    return [(name, b) for name, b in found if b is not None and b.is_floating_point()]


def build_model_for_refit(path: str, dtype: str, device: str = "cpu") -> PreTrainedModel:
    """The causal LM at ``path`` built on ``device`` in ``dtype`` ("float32" or
    "bfloat16") with its weights neither read from the weight files nor initialised
    (:func:`model_skeleton`, then :func:`materialize`: non-persistent buffers such as
    RoPE's ``inv_freq``, tied weights and ``generation_config.json`` as
    ``from_pretrained`` gives them), in eval mode. For an engine whose first use is a
    refit that overwrites every parameter (the evaluators': ``HFEngine.load_weights``
    refuses a refit that leaves one out, and each refit is verified by the weights'
    fingerprint and the canary logits).

    Raises:
        ModelLoadError: no model directory, a config that does not build, or ``cuda``
            asked for where no CUDA device is available.
    """
    check_device(device)
    model = model_skeleton(path, dtype)
    materialize(model, device)
    return model.eval()
