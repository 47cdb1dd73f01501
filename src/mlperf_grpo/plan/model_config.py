"""A model's ``config.json`` read for the planner: at most :data:`MAX_CONFIG_BYTES`, a
multimodal config's text model, and every count the planner's arithmetic reads checked
(one :class:`~mlperf_grpo.plan.memory.MemoryPlanError` line, never a traceback)."""

from __future__ import annotations

import json
from pathlib import Path

from mlperf_grpo.plan.memory import MemoryPlanError, counts

DIVISOR_KEYS = ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim", "full_attention_interval",
                "linear_num_key_heads", "linear_num_value_heads", "num_experts", "max_position_embeddings",
                "linear_conv_kernel_dim", "intermediate_size", "linear_key_head_dim", "linear_value_head_dim",
                "moe_intermediate_size", "shared_expert_intermediate_size")
"""Keys of a model config the planner divides by, or that are a weight's dimension (a
weight of 0 rows is no model's, and FSDP's shard arithmetic divides by its rows): where
present (not null), whole numbers >= 1."""
SIZE_KEYS = ("num_hidden_layers",)
"""Keys of a model config the planner multiplies by: where present (not null), whole numbers >= 0."""


FLAG_KEYS = ("tie_word_embeddings", "attention_bias", "mlp_bias")
"""Keys of a model config the planner reads as switches: where present (not null), true or false."""
LAYER_TYPES = {"llama": {"full_attention"}, "qwen3": {"full_attention", "sliding_attention"},
               "qwen3_5_moe": {"full_attention", "linear_attention"}, "qwen3_5_moe_text": {"full_attention", "linear_attention"}}
"""The ``layer_types`` entries of each model type the planner counts (transformers' config classes)."""


TYPE_DEFAULTS = {"qwen3": {"head_dim": 128}, "qwen3_5_moe": {"head_dim": 256, "num_key_value_heads": 2},
                 "qwen3_5_moe_text": {"head_dim": 256, "num_key_value_heads": 2}}
"""What transformers' config class of the type fills in for these keys where ``config.json``
leaves them out (``Qwen3Config``, ``Qwen3_5MoeTextConfig``); the planner's own fallback
(``hidden_size / num_attention_heads``, KV heads = heads) is Llama's rule."""


MAX_COUNT = 2**32
"""The largest count of a model config the planner takes (a width, a vocabulary, a context)."""
MAX_LAYERS = 100_000
"""The most layers it takes (it lists every layer's tensors)."""


def _check_dimensions(config: dict, file: Path) -> None:
    """Refuse a count the planner's arithmetic cannot take (a string, a fraction, a
    negative, a 0 it divides by): one line, not a ZeroDivisionError or TypeError."""
    for keys, least in ((DIVISOR_KEYS, 1), (SIZE_KEYS, 0)):
        for key in keys:
            value = config.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                raise MemoryPlanError(f"{file}: {key} is {value!r}, not a whole number >= {least}; "
                                      "give the model's real config.json")
            most = MAX_LAYERS if key == "num_hidden_layers" else MAX_COUNT
            if value is not None and value > most:
                raise MemoryPlanError(f"{file}: {key} is over {most:,}; give the model's real config.json")
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if config.get("head_dim") is None and hidden and heads and hidden % heads:
        raise MemoryPlanError(f"{file}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} and no "
                              "head_dim is given; give the model's real config.json")
    for many, few in (("num_attention_heads", "num_key_value_heads"), ("linear_num_value_heads", "linear_num_key_heads")):
        if config.get(many) and config.get(few) and config[many] % config[few]:
            raise MemoryPlanError(f"{file}: {few} {config[few]} does not divide {many} {config[many]} (each "
                                  "key head serves a whole group); give the model's real config.json")
    for key in FLAG_KEYS:
        if config.get(key) is not None and not isinstance(config[key], bool):
            raise MemoryPlanError(f"{file}: {key} is {config[key]!r}, not true or false; give the model's real config.json")
    layer_types, layers = config.get("layer_types"), config.get("num_hidden_layers")
    known = LAYER_TYPES[config["model_type"]]
    if layer_types is not None and layers is None:  # not "a list of 0": the count is what is missing
        raise MemoryPlanError(f"{file}: layer_types is given but num_hidden_layers is not; give the model's full config.json")
    if layer_types is not None and (not isinstance(layer_types, list) or len(layer_types) != layers
                                    or not all(isinstance(t, str) and t in known for t in layer_types)):
        raise MemoryPlanError(f"{file}: layer_types is not a list of {layers} of {', '.join(sorted(known))}; "
                              "give the model's real config.json")


MAX_CONFIG_BYTES = 16 * 2**20
"""The most a model config may take (a config.json is a few KiB; a weights file or a device given by mistake is refused)."""


def load_model_config(path: Path) -> dict:
    """A model's ``config.json`` (``path`` is the file or its directory) as a dict; a
    multimodal config's ``text_config`` is what is planned (the text model).

    Raises:
        MemoryPlanError: the file is missing or not JSON, or (for a model type the planner
            counts) a count is not a whole number (:func:`_check_dimensions`).
    """
    file = path / "config.json" if path.is_dir() else path
    try:
        if file.exists() and not file.is_file():  # a FIFO would block the read; a device never ends
            raise ValueError("not a regular file")
        with open(file, "rb") as handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise ValueError(f"over {MAX_CONFIG_BYTES // 2**20} MiB, not a model config")
        data = json.loads(raw)
    except (OSError, ValueError, RecursionError) as err:
        why = "nested too deeply" if isinstance(err, RecursionError) else err
        raise MemoryPlanError(f"cannot read the model config {file}: {why}; give a config.json") from None
    if not isinstance(data, dict):
        raise MemoryPlanError(f"{file} is not a JSON object; give a model's config.json")
    text = data.get("text_config")
    config = {"model_type": data.get("model_type"), **text} if isinstance(text, dict) else data
    defaults = TYPE_DEFAULTS.get(config.get("model_type"), {})
    config = {**config, **{key: value for key, value in defaults.items() if config.get(key) is None}}
    if counts(config):  # other model types are not planned
        _check_dimensions(config, file)
    return config
