"""The policy model and its tokenizer, loaded from a local Hugging Face directory (or
built for an engine whose first use is a refit), and the prompts' token ids."""

from __future__ import annotations

import contextlib

from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
from transformers.utils import logging as hf_logging

from mlperf_grpo.errors import ModelLoadError
from mlperf_grpo.model.files import (
    DTYPES,
    HF_LOAD_ERRORS,
    check_device,
    check_model_path,
    error_reason,
    hf_config,
    open_weights,
    saved_generation_config,
)
from mlperf_grpo.model.skeleton import check_weight_shapes, materialize, model_skeleton


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


def load_model(path: str, dtype: str, device: str = "cpu") -> PreTrainedModel:
    """The causal LM at ``path`` in ``dtype`` ("float32" or "bfloat16") on ``device``
    ("cpu" or "cuda"), in eval mode, as ``AutoModelForCausalLM.from_pretrained`` loads
    it. Each weight file is opened once (:func:`~mlperf_grpo.model.files.open_weights`): its header is checked
    against ``config.json`` (as :func:`~mlperf_grpo.model.skeleton.check_weights`), then ``from_pretrained`` reads
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
        check_weight_shapes(directory, {name: tuple(t.get_shape()) for name, t in tensors.items()})
        try:
            config = hf_config(directory)
            model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # as AutoModelForCausalLM picks it
            model = model_class.from_pretrained(None, config=config, state_dict=tensors,
                                                generation_config=saved_generation_config(directory), dtype=DTYPES[dtype])
        except HF_LOAD_ERRORS as err:
            raise ModelLoadError(f"cannot load model from {directory}: {error_reason(err)}") from None
    model.name_or_path = model.config.name_or_path = str(directory)  # as from_pretrained(directory) records it
    return model.to(device).eval()


def build_model_for_refit(path: str, dtype: str, device: str = "cpu") -> PreTrainedModel:
    """The causal LM at ``path`` built on ``device`` in ``dtype`` ("float32" or
    "bfloat16") with its weights neither read from the weight files nor initialised
    (:func:`~mlperf_grpo.model.skeleton.model_skeleton`, then
    :func:`~mlperf_grpo.model.skeleton.materialize`: non-persistent buffers such as
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
