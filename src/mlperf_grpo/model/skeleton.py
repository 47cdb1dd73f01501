"""The architecture of a model directory's ``config.json`` on the meta device (no
memory): refused unless it is a causal LM, the weight files' shapes checked against it
(headers only), and its storage materialized on a device once it is sharded."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
)

from mlperf_grpo.errors import ModelLoadError
from mlperf_grpo.model.files import (
    DTYPES,
    HF_LOAD_ERRORS,
    check_model_path,
    error_reason,
    hf_config,
    saved_generation_config,
    weight_shapes,
)
from mlperf_grpo.model.weight_names import loaded_shapes


def _skeleton(directory: Path, dtype: torch.dtype) -> PreTrainedModel:
    """The architecture of ``directory/config.json`` in ``dtype`` on the meta device.

    Raises:
        ModelLoadError: ``config.json`` does not load, names an unknown architecture, or
            a family ``AutoModelForCausalLM`` has no class for (T5, ViT: not a causal LM).
    """
    config = hf_config(directory)
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ModelLoadError(_not_causal(directory, config, ", ".join(getattr(config, "architectures", None) or [config.model_type]),
                                         "transformers has no causal-LM class for it"))
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except HF_LOAD_ERRORS as err:
        raise ModelLoadError(
            f"cannot build the model of {directory / 'config.json'}: {error_reason(err)}; copy the model's config.json there again"
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


def _expected_shapes(model: PreTrainedModel) -> tuple[dict[str, tuple[int, ...]], list[set[str]], str, int]:
    """What the config's architecture needs, from its skeleton (:func:`_skeleton`, no memory).

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
    parameter ``from_pretrained`` loads it into (:func:`~mlperf_grpo.model.weight_names.loaded_shapes`).

    Returns:
        ``(shapes_in_files, tied_groups, embedding_name, embedding_rows)``: tensor name ->
        shape in the weight files; then as :func:`_expected_shapes`.
    Raises:
        ModelLoadError: one line naming the file or tensor that is wrong and what to do.
    """
    return check_weight_shapes(directory, weight_shapes(directory))


def check_weight_shapes(directory: Path, have: dict[str, tuple[int, ...]]) -> tuple[dict[str, tuple[int, ...]], list[set[str]], str, int]:
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


def model_skeleton(path: str, dtype: str) -> PreTrainedModel:
    """The model at ``path`` as an architecture without weights: its parameters and
    buffers on the meta device (no memory) in ``dtype``, its generation config read from
    the directory as ``from_pretrained`` reads it. Shard it, then :func:`materialize` it.

    Raises:
        ModelLoadError: not a local model directory, or ``config.json`` does not build.
    """
    directory = check_model_path(path)
    model = _skeleton(directory, DTYPES[dtype])
    generation_config = saved_generation_config(directory)
    if model.can_generate() and generation_config is not None:  # as adjust_generation_fn does in from_pretrained
        model.generation_config = generation_config
    return model


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
