"""Megatron-core tensor names -> Hugging Face names and shapes, per architecture.

The reference's policy checkpoints (Megatron-core ``torch_dist``, ``megatron_layout.py``)
hold Megatron-named *global* tensors: each tensor-parallel rank's shard is placed by its
offsets, so the files do not depend on the writing ranks' layout (``linear_fc1``'s gate
and up halves are stored as ``[gate; up]`` whatever the tensor-parallel size:
``transformer/mlp.py::apply_swiglu_sharded_factory``; the gated delta-net's fused
``in_proj`` and ``conv1d`` are stored split into their parts:
``ssm/gated_delta_net.py::GatedDeltaNet.sharded_state_dict``). Each Hugging Face tensor is
a concatenation, along dim 0, of row ranges of Megatron tensors (a :class:`Recipe`),
plus 1 for a zero-centred gamma.

Layers: ``decoder.layers.N.<suffix>`` (global N, when the layers differ: a hybrid
model, ``TransformerBlock.sharded_state_dict`` ``non_homogeneous_layers``) or
``decoder.layers.<suffix>`` with a leading layer axis (homogeneous models). Experts:
``mlp.experts.experts.linear_fc{1,2}.weight`` with a leading expert axis
(``SequentialMLP``/``TEGroupedMLP.sharded_state_dict``), or one tensor per expert
``mlp.experts.experts.E.linear_fc{1,2}.weight`` (``singleton_local_shards``, whose
``linear_fc1`` may be ``weight_w``/``weight_v``: gate/up).

The table (Megatron suffix -> Hugging Face name under ``model.layers.N.``; Megatron-Bridge
at 067f987, ``models/qwen/qwen35_bridge.py::Qwen35MoEBridge._get_moe_lm_mappings``,
``qwen3_bridge.py``, ``qwen3_moe_bridge.py``, ``models/llama/llama_bridge.py`` (Qwen3's
without q/k norms); transforms from
``models/conversion/param_mapping.py``):

==============================================  =========================================  ==========================
Megatron                                        Hugging Face                               how (Bridge function)
==============================================  =========================================  ==========================
embedding.word_embeddings.weight                model.embed_tokens.weight                  rows < vocab_size (padded)
output_layer.weight (absent when tied)          lm_head.weight                             rows < vocab_size
decoder.final_layernorm.weight                  model.norm.weight                          as is
self_attention.linear_qkv.weight                self_attn.q_proj / k_proj / v_proj         split_qkv_weights
self_attention.linear_qkv.layer_norm_weight     input_layernorm.weight                     as is (also input_layernorm.weight)
self_attention.q_layernorm / k_layernorm        self_attn.q_norm / k_norm                  as is
self_attention.linear_proj.weight               self_attn.o_proj.weight                    as is
self_attention.in_proj.weight.query|key|value   linear_attn.in_proj_qkv.weight             GDNLinearMappingSeparate
self_attention.in_proj.weight.z|beta|alpha      linear_attn.in_proj_z / _b / _a            GDNLinearMappingSeparate
self_attention.in_proj.layer_norm_weight        input_layernorm.weight                     as is
self_attention.conv1d.weight.query|key|value    linear_attn.conv1d.weight                  GDNConv1dMapping
self_attention.A_log / dt_bias / out_proj       linear_attn.A_log / dt_bias / out_proj     as is
self_attention.out_norm.weight                  linear_attn.norm.weight                    + 1 (RMSNorm2ZeroCenteredRMSNormMapping)
mlp.linear_fc1.weight (or weight_w, weight_v)   mlp.gate_proj / up_proj                    GatedMLPMapping
mlp.linear_fc1.layer_norm_weight                post_attention_layernorm.weight            as is (also pre_mlp_layernorm.weight)
mlp.linear_fc2.weight                           mlp.down_proj.weight                       as is
mlp.router.weight                               mlp.gate.weight                            as is
mlp.experts.experts.linear_fc1.weight [E,..]    mlp.experts.E.gate_proj / up_proj          GatedMLPMapping per expert
mlp.experts.experts.linear_fc2.weight [E,..]    mlp.experts.E.down_proj.weight             as is per expert
mlp.shared_experts.linear_fc1 / linear_fc2      mlp.shared_expert.gate_proj, up_proj / down_proj   GatedMLPMapping
mlp.shared_experts.gate_weight                  mlp.shared_expert_gate.weight              ReplicatedMapping
==============================================  =========================================  ==========================

Hugging Face names are the *saved* form (per-expert tensors), as ``save_pretrained``
writes them (``weight_names.py``). ``qwen3_5*``: the attention's query rows carry the
output gate (``attention_output_gate``: per query group ``[q, gate, k, v]``) and only the
delta-net's ``out_norm`` is zero-centred against Hugging Face (its other norms are
``1 + w`` on both sides). ``mtp.*`` (multi-token prediction) has no Hugging Face
causal-LM tensor and is left out; ``optimizer.*`` and non-tensor entries are not model
weights. Any other tensor is an error naming it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mlperf_grpo.checkpoint.format import CheckpointError

ARCHITECTURES = ("llama", "qwen3", "qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_text")
_LAYER = re.compile(r"^decoder\.layers\.(?:(\d+)\.)?(.+)\Z")
_EXPERT = re.compile(r"^mlp\.experts\.experts\.(?:(\d+)\.)?linear_fc([12])\.weight(_w|_v)?\Z")
IGNORED_PREFIXES = ("optimizer.", "mtp.")


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` of Megatron tensor ``key`` after indexing its leading
    axes with ``index`` (layer and/or expert)."""

    key: str
    index: tuple[int, ...]
    start: int
    stop: int


@dataclass(frozen=True)
class Recipe:
    """Hugging Face tensor ``name`` of ``shape``: its pieces concatenated on dim 0,
    plus 1 when ``add_one``."""

    name: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    add_one: bool = False


@dataclass(frozen=True)
class Dims:
    """The Hugging Face config's numbers the table needs (``config.json``)."""

    model_type: str
    vocab_size: int
    tied: bool
    heads: int
    groups: int
    head_dim: int

    @property
    def gated_attention(self) -> bool:
        return self.model_type.startswith("qwen3_5")


def dims_from_config(config: dict, where: str) -> Dims:
    """:class:`Dims` of a ``config.json`` (a multimodal one's ``text_config``).

    Raises:
        CheckpointError: not an architecture with a table, or a needed key missing.
    """
    text = config.get("text_config") or config
    model_type = text.get("model_type") or config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise CheckpointError(f"{where}: no Megatron name table for model_type {model_type!r} "
                              f"(tables: {', '.join(ARCHITECTURES)})")
    try:
        heads = int(text["num_attention_heads"])
        return Dims(model_type, int(text["vocab_size"]), bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
                    heads, int(text.get("num_key_value_heads") or heads),
                    int(text.get("head_dim") or int(text["hidden_size"]) // heads))
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{where}: config key {err} missing or not a number; the Megatron name table needs it") from None


def _whole(name: str, key: str, shape: tuple[int, ...], index: tuple[int, ...] = (), add_one: bool = False) -> Recipe:
    return Recipe(name, shape, (Piece(key, index, 0, shape[0]),), add_one)


def _rows(name: str, parts: list[tuple[str, tuple[int, ...], int, int]], rest: tuple[int, ...]) -> Recipe:
    pieces = tuple(Piece(k, i, a, b) for k, i, a, b in parts)
    return Recipe(name, (sum(p.stop - p.start for p in pieces), *rest), pieces)


class _Planner:
    """Collects the recipes of one checkpoint; ``specs``: Megatron key -> shape."""

    def __init__(self, specs: dict[str, tuple[int, ...]], dims: Dims) -> None:
        self.specs, self.d = specs, dims
        self.recipes: dict[str, Recipe] = {}
        self.used: set[str] = set()

    def add(self, recipe: Recipe) -> None:
        if recipe.name in self.recipes:
            raise CheckpointError(f"two Megatron tensors give {recipe.name} (the second from {recipe.pieces[0].key!r})")
        self.recipes[recipe.name] = recipe
        self.used.update(p.key for p in recipe.pieces)

    def shape(self, key: str, index: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(self.specs[key][len(index):])

    def qkv(self, hf: str, key: str, index: tuple[int, ...]) -> None:
        """``split_qkv_weights``: per query group ``[q heads (gate rows after them when
        gated), k, v]``, ``head_dim`` rows each; Hugging Face ``q_proj`` holds per head
        ``[q, gate]`` when gated."""
        d, shape = self.d, self.shape(key, index)
        per, gate = d.heads // d.groups, 2 if d.gated_attention else 1
        block = (gate * per + 2) * d.head_dim
        if d.heads % d.groups or shape[0] != d.groups * block:
            raise CheckpointError(f"Megatron tensor {key!r} has {shape[0]} rows; {d.heads} heads in {d.groups} query groups of "
                                  f"{d.head_dim} (config.json) make {d.groups * block}: the model differs")
        hd, rest = d.head_dim, shape[1:]
        q = []
        for h in range(d.heads):
            at = (h // per) * block + (h % per) * hd
            q.append((key, index, at, at + hd))
            if gate == 2:
                q.append((key, index, at + per * hd, at + per * hd + hd))
        self.add(_rows(f"{hf}self_attn.q_proj.weight", q, rest))
        for n, name in ((gate * per, "k_proj"), (gate * per + 1, "v_proj")):
            self.add(_rows(f"{hf}self_attn.{name}.weight", [(key, index, g * block + n * hd, g * block + (n + 1) * hd)
                                                             for g in range(d.groups)], rest))

    def concat(self, name: str, keys: list[str], index: tuple[int, ...]) -> None:
        missing = [k for k in keys if k not in self.specs]
        if missing:
            raise CheckpointError(f"Megatron tensor {missing[0]!r} is missing (needed with {keys[0]!r} for {name})")
        rest = {self.shape(k, index)[1:] for k in keys}
        if len(rest) != 1:
            raise CheckpointError(f"Megatron tensors {keys} do not stack into {name}: shapes differ")
        self.add(_rows(name, [(k, index, 0, self.shape(k, index)[0]) for k in keys], rest.pop()))

    def gate_up(self, hf: str, key: str, index: tuple[int, ...]) -> None:
        """``GatedMLPMapping``: ``linear_fc1`` is ``[gate; up]`` (or ``weight_w``/``weight_v``)."""
        if key.endswith("_w") or key.endswith("_v"):
            if key.endswith("_v"):
                return  # placed with its _w
            base = key[:-2]
            self.concat(f"{hf}gate_proj.weight", [key], index)
            self.concat(f"{hf}up_proj.weight", [base + "_v"], index)
            return
        shape = self.shape(key, index)
        if shape[0] % 2:
            raise CheckpointError(f"Megatron tensor {key!r} has an odd row count {shape[0]}; linear_fc1 is [gate; up]")
        half = shape[0] // 2
        self.add(_rows(f"{hf}gate_proj.weight", [(key, index, 0, half)], shape[1:]))
        self.add(_rows(f"{hf}up_proj.weight", [(key, index, half, shape[0])], shape[1:]))


_SAME = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.in_proj.layer_norm_weight": "input_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.in_proj.weight.z": "linear_attn.in_proj_z.weight",
    "self_attention.in_proj.weight.beta": "linear_attn.in_proj_b.weight",
    "self_attention.in_proj.weight.alpha": "linear_attn.in_proj_a.weight",
    "self_attention.A_log": "linear_attn.A_log",
    "self_attention.dt_bias": "linear_attn.dt_bias",
    "self_attention.out_proj.weight": "linear_attn.out_proj.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_expert.down_proj.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
}
"""Megatron layer suffix -> Hugging Face layer suffix, tensor as is (see the table)."""
_PARTS = {"self_attention.in_proj.weight.query": ("linear_attn.in_proj_qkv.weight", ("query", "key", "value")),
          "self_attention.conv1d.weight.query": ("linear_attn.conv1d.weight", ("query", "key", "value"))}
_PART_OF = {k.rsplit(".", 1)[0] + "." + p for k, (_, parts) in _PARTS.items() for p in parts[1:]}


def _layer_tensor(pl: _Planner, key: str, suffix: str, index: tuple[int, ...], layer: int) -> bool:
    """Places one layer's tensor; False when the suffix is not in the table."""
    hf = f"model.layers.{layer}."
    if suffix in _SAME:
        pl.add(_whole(hf + _SAME[suffix], key, pl.shape(key, index), index))
    elif suffix == "self_attention.out_norm.weight" and pl.d.gated_attention:
        pl.add(_whole(hf + "linear_attn.norm.weight", key, pl.shape(key, index), index, add_one=True))
    elif suffix == "self_attention.linear_qkv.weight":
        pl.qkv(hf, key, index)
    elif suffix in _PARTS:
        name, parts = _PARTS[suffix]
        base = key.rsplit(".", 1)[0]
        pl.concat(hf + name, [f"{base}.{p}" for p in parts], index)
    elif suffix in _PART_OF:
        return True  # placed with its .query
    elif re.fullmatch(r"mlp\.linear_fc1\.weight(_w|_v)?", suffix):
        pl.gate_up(hf + "mlp.", key, index)
    elif re.fullmatch(r"mlp\.shared_experts\.linear_fc1\.weight(_w|_v)?", suffix):
        pl.gate_up(hf + "mlp.shared_expert.", key, index)
    elif (m := _EXPERT.match(suffix)):
        experts = [int(m.group(1))] if m.group(1) else range(pl.specs[key][len(index)])
        for e in experts:
            at = index if m.group(1) else (*index, e)
            if m.group(2) == "2":
                pl.add(_whole(f"{hf}mlp.experts.{e}.down_proj.weight", key, pl.shape(key, at), at))
            else:
                pl.gate_up(f"{hf}mlp.experts.{e}.", key, at)
    else:
        return False
    return True


def plan(specs: dict[str, tuple[int, ...]], dims: Dims, where: str) -> dict[str, Recipe]:
    """Hugging Face name -> :class:`Recipe` for the Megatron model tensors ``specs``
    (key -> global shape; ``optimizer.*``, ``mtp.*`` left out by the caller's
    :func:`is_model_key`).

    Raises:
        CheckpointError: a tensor the table cannot place, a part missing, a shape that
            does not fit ``dims``; names the tensor and ``where``.
    """
    pl = _Planner(specs, dims)
    for key in sorted(specs):
        shape = specs[key]
        if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            if shape[0] < dims.vocab_size:
                raise CheckpointError(f"{where}: Megatron tensor {key!r} has {shape[0]} rows, fewer than the vocabulary "
                                      f"({dims.vocab_size}, config.json): another model")
            name = "model.embed_tokens.weight" if key.startswith("embedding") else "lm_head.weight"
            if name == "lm_head.weight" and dims.tied:
                raise CheckpointError(f"{where}: holds an output layer {key!r}, but config.json ties the embeddings")
            pl.add(Recipe(name, (dims.vocab_size, *shape[1:]), (Piece(key, (), 0, dims.vocab_size),)))
        elif key == "decoder.final_layernorm.weight":
            pl.add(_whole("model.norm.weight", key, shape))
        elif (m := _LAYER.match(key)):
            layers = [int(m.group(1))] if m.group(1) else range(shape[0])
            for layer in layers:
                if not _layer_tensor(pl, key, m.group(2), () if m.group(1) else (layer,), layer):
                    raise CheckpointError(f"{where}: Megatron tensor {key!r} is not in the {dims.model_type} name table "
                                          "(checkpoint/megatron_names.py); it cannot be placed in the Hugging Face model")
        else:
            raise CheckpointError(f"{where}: Megatron tensor {key!r} is not in the {dims.model_type} name table "
                                  "(checkpoint/megatron_names.py); it cannot be placed in the Hugging Face model")
    unused = sorted(set(specs) - pl.used)
    if unused:
        raise CheckpointError(f"{where}: Megatron tensor {unused[0]!r} was not placed (a part without its group?)")
    if not dims.tied and "lm_head.weight" not in pl.recipes:
        raise CheckpointError(f"{where}: no output_layer.weight, but config.json does not tie the embeddings")
    return pl.recipes


def is_model_key(key: str) -> bool:
    """A model weight of the checkpoint (not optimizer state, not the multi-token
    prediction head, not ``_extra_state``)."""
    return not key.startswith(IGNORED_PREFIXES) and "._extra_state" not in key
