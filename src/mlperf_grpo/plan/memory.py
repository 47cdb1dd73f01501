"""Per-rank memory of a training layout, from a model's ``config.json`` alone (no torch).

:func:`model_tensors` lists a model's parameters (Hugging Face names and shapes) from its
config, analytically: dense Llama / Qwen3 decoders and the hybrid ``qwen3_5_moe`` text
model (tests compare them with ``transformers``' own model built on the meta device).
:func:`plan_memory` turns them into per-rank bytes for world size N and
``inference.tensor_parallel_size`` T, for two layouts:

- ``replica`` (the trainer at ``inference.tensor_parallel_size: 1``): FSDP2 shards the
  fp32 master weights, gradients and AdamW's two moments over N ranks, but every rank
  holds a **full** rollout-dtype engine replica; each rank stages K =
  ``checkpoint.max_in_flight`` x its 1/N share of the rollout-dtype checkpoint in host
  memory (:mod:`~mlperf_grpo.checkpoint.shard_plan`: every rank writes the tensors it
  owns); the evaluator reads 2 whole checkpoints into host buffers.
- ``sharded`` (issue 28): the engine is tensor-parallel over T ranks (each holds 1/T of
  every sharded tensor plus the replicated small ones: norms, router, gates; KV
  projections are split over ``min(T, kv_heads)``, replicated beyond, as vLLM does; the
  ``hf`` engine's T divides them), each rank stages K x its 1/N share, each evaluation
  rank reads 2 x its 1/T. The ``hf`` engine's split is built
  (:mod:`mlperf_grpo.inference.tensor_parallel`); the per-rank staging and reads are
  the checkpoint writer's and the evaluator's.

Not counted: activations, the KV cache, communication buffers, the CUDA context and the
allocator's slack, so a planned figure is a lower bound of the measured peak.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from mlperf_grpo.errors import ConfigError

FP32_BYTES = 4
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
"""Bytes per parameter of the rollout dtype (``model.dtype``)."""

EVAL_READ_BUFFERS = 2
"""Checkpoint buffer sets the evaluator's prefetcher keeps (evaluate/prefetch.py)."""

QWEN3_5_397B_A17B = {
    "model_type": "qwen3_5_moe_text", "hidden_size": 4096, "num_hidden_layers": 60, "full_attention_interval": 4,
    "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
    "linear_num_value_heads": 64, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 1024,
    "shared_expert_intermediate_size": 1024, "vocab_size": 248320, "tie_word_embeddings": False,
    "max_position_embeddings": 262144,
}
"""Text config of Qwen3.5-397B-A17B (the benchmark's model), as recalled and partly checked
against public model cards (hidden 4096, 32 / 2 heads of 256, 512 experts; a native context
of 262,144 tokens, recalled, of which the benchmark uses 65,536); the vision tower and the
multi-token-prediction layer are not counted."""

MODEL_SHAPES = {"qwen3.5-397b-a17b": QWEN3_5_397B_A17B}
"""Named shapes for ``plan --memory --model-shape NAME``."""

DENSE_TYPES = ("llama", "qwen3")
MOE_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")

SPLIT, REPLICATED, KV = "split", "replicated", "kv"
"""How the sharded engine holds a tensor: split over T ranks, whole on each, or split over
``min(T, kv_heads)`` ranks (KV heads are replicated once T exceeds them)."""


class MemoryPlanError(ConfigError):
    """A model config the planner cannot read, or a layout that does not divide (exit 2)."""


@dataclass(frozen=True)
class Tensor:
    """One parameter: its Hugging Face name, shape and how the sharded engine holds it."""

    name: str
    shape: tuple[int, ...]
    tp: str = SPLIT

    @property
    def numel(self) -> int:
        """Elements (parameters) in the tensor."""
        return math.prod(self.shape)


def _get(config: dict, key: str, default=None):
    value = config.get(key, default)
    if value is None:
        raise MemoryPlanError(f"the model config has no {key!r}; give the model's full config.json")
    return value


def counts(config: dict) -> bool:
    """True when :func:`model_tensors` knows the config's ``model_type``."""
    return config.get("model_type") in DENSE_TYPES + MOE_TYPES


def model_tensors(config: dict) -> list[Tensor]:
    """The parameters of the causal LM the config describes, in Hugging Face names.

    ``llama`` / ``qwen3``: embeddings, per layer q/k/v/o (``num_attention_heads`` x
    ``head_dim``, KV heads), Qwen3's q/k norms, the SwiGLU MLP, norms, lm_head unless
    ``tie_word_embeddings``. ``qwen3_5_moe``: layer ``i`` is full attention when
    ``(i + 1) % full_attention_interval == 0`` (gated: q_proj is twice as wide), else a
    gated delta-net; every layer has the router (``num_experts`` x hidden), the routed
    experts (``num_experts`` x 3 x hidden x ``moe_intermediate_size``), a shared expert and
    its gate. Source: ``transformers/models/{llama,qwen3,qwen3_5_moe}/modeling_*.py``.

    Raises:
        MemoryPlanError: another ``model_type``, or a needed key is missing.
    """
    kind = config.get("model_type")
    if not counts(config):
        raise MemoryPlanError(f"model_type {kind!r} is not one the memory planner counts; "
                              f"it counts {', '.join(DENSE_TYPES + MOE_TYPES)}")
    hidden, vocab = _get(config, "hidden_size"), _get(config, "vocab_size")
    tensors = [Tensor("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(_get(config, "num_hidden_layers")):
        tensors += _layer(config, f"model.layers.{i}.", i, kind in MOE_TYPES)
    tensors.append(Tensor("model.norm.weight", (hidden,), REPLICATED))
    if not config.get("tie_word_embeddings", False):  # transformers' default for these types
        tensors.append(Tensor("lm_head.weight", (vocab, hidden)))
    return tensors


def _attention(config: dict, prefix: str, gated: bool, qk_norm: bool) -> list[Tensor]:
    hidden, heads = _get(config, "hidden_size"), _get(config, "num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    bias = bool(config.get("attention_bias", False))
    q = heads * head_dim * (2 if gated else 1)
    out = [Tensor(prefix + "q_proj.weight", (q, hidden)), Tensor(prefix + "k_proj.weight", (kv_heads * head_dim, hidden), KV),
           Tensor(prefix + "v_proj.weight", (kv_heads * head_dim, hidden), KV),
           Tensor(prefix + "o_proj.weight", (hidden, heads * head_dim))]
    if bias:
        out += [Tensor(prefix + "q_proj.bias", (q,)), Tensor(prefix + "k_proj.bias", (kv_heads * head_dim,), KV),
                Tensor(prefix + "v_proj.bias", (kv_heads * head_dim,), KV), Tensor(prefix + "o_proj.bias", (hidden,), REPLICATED)]
    if qk_norm:
        out += [Tensor(prefix + "q_norm.weight", (head_dim,), REPLICATED), Tensor(prefix + "k_norm.weight", (head_dim,), REPLICATED)]
    return out


def _mlp(prefix: str, hidden: int, intermediate: int, bias: bool = False) -> list[Tensor]:
    out = [Tensor(prefix + "gate_proj.weight", (intermediate, hidden)), Tensor(prefix + "up_proj.weight", (intermediate, hidden)),
           Tensor(prefix + "down_proj.weight", (hidden, intermediate))]
    if bias:
        out += [Tensor(prefix + "gate_proj.bias", (intermediate,)), Tensor(prefix + "up_proj.bias", (intermediate,)),
                Tensor(prefix + "down_proj.bias", (hidden,), REPLICATED)]
    return out


def _delta_net(config: dict, prefix: str) -> list[Tensor]:
    hidden = _get(config, "hidden_size")
    v_heads = _get(config, "linear_num_value_heads")
    key_dim = _get(config, "linear_num_key_heads") * _get(config, "linear_key_head_dim")
    value_dim = v_heads * _get(config, "linear_value_head_dim")
    conv_dim = 2 * key_dim + value_dim
    return [Tensor(prefix + "conv1d.weight", (conv_dim, 1, _get(config, "linear_conv_kernel_dim"))),
            Tensor(prefix + "dt_bias", (v_heads,)), Tensor(prefix + "A_log", (v_heads,)),
            Tensor(prefix + "norm.weight", (_get(config, "linear_value_head_dim"),), REPLICATED),
            Tensor(prefix + "out_proj.weight", (hidden, value_dim)), Tensor(prefix + "in_proj_qkv.weight", (conv_dim, hidden)),
            Tensor(prefix + "in_proj_z.weight", (value_dim, hidden)), Tensor(prefix + "in_proj_b.weight", (v_heads, hidden)),
            Tensor(prefix + "in_proj_a.weight", (v_heads, hidden))]


def is_full_attention(config: dict, index: int) -> bool:
    """Whether layer ``index`` of a ``qwen3_5_moe`` config is full attention (else linear):
    its ``layer_types`` entry, else every ``full_attention_interval``-th layer (4), as
    transformers derives them."""
    if config.get("layer_types") is not None:
        return config["layer_types"][index] == "full_attention"
    return (index + 1) % _get(config, "full_attention_interval", 4) == 0


def _layer(config: dict, prefix: str, index: int, moe: bool) -> list[Tensor]:
    hidden = _get(config, "hidden_size")
    out = [Tensor(prefix + "input_layernorm.weight", (hidden,), REPLICATED),
           Tensor(prefix + "post_attention_layernorm.weight", (hidden,), REPLICATED)]
    if not moe:
        out += _attention(config, prefix + "self_attn.", gated=False, qk_norm=config["model_type"] == "qwen3")
        return out + _mlp(prefix + "mlp.", hidden, _get(config, "intermediate_size"), bool(config.get("mlp_bias", False)))
    full = is_full_attention(config, index)
    out += _attention(config, prefix + "self_attn.", gated=True, qk_norm=True) if full else _delta_net(config, prefix + "linear_attn.")
    experts, moe_size = _get(config, "num_experts"), _get(config, "moe_intermediate_size")
    return out + [
        Tensor(prefix + "mlp.gate.weight", (experts, hidden), REPLICATED),
        Tensor(prefix + "mlp.experts.gate_up_proj", (experts, 2 * moe_size, hidden)),
        Tensor(prefix + "mlp.experts.down_proj", (experts, hidden, moe_size)),
        *_mlp(prefix + "mlp.shared_expert.", hidden, _get(config, "shared_expert_intermediate_size")),
        Tensor(prefix + "mlp.shared_expert_gate.weight", (1, hidden), REPLICATED),
    ]


def check_tensor_parallel(config: dict, world_size: int, tensor_parallel_size: int, engine: str = "vllm",
                          name: str = "inference.tensor_parallel_size") -> None:
    """Refuse a T that does not divide the world size, the attention heads, the
    linear-attention heads, the MoE experts or the KV heads; with ``engine="vllm"`` a T
    above the KV heads may instead be a multiple of them (each KV head is then replicated
    on T / kv_heads ranks, vLLM's rule); with ``engine="hf"`` (transformers' tensor
    parallelism, which splits ``k_proj`` / ``v_proj`` by T and replicates nothing) T must
    divide the KV heads and the vocabulary (the embeddings and lm_head are split by rows;
    vLLM pads it). ``name``: how the messages call T (the config key, or ``plan``'s flag).

    Raises:
        MemoryPlanError: naming both numbers and the fix.
    """
    t = tensor_parallel_size
    if t == 1:
        return
    fix = f"set {name} to a common divisor"
    if world_size % t:
        raise MemoryPlanError(f"{name} {t} does not divide the world size {world_size}: "
                              f"{fix} of the world size and the heads, or launch a multiple of {t} ranks")
    heads = _get(config, "num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    counts = [("attention heads (num_attention_heads)", heads),
              ("linear-attention key heads (linear_num_key_heads)", config.get("linear_num_key_heads")),
              ("linear-attention value heads (linear_num_value_heads)", config.get("linear_num_value_heads")),
              ("MoE experts (num_experts)", config.get("num_experts"))]
    for what, count in counts:
        if count is not None and count % t:
            raise MemoryPlanError(f"{name} {t} does not divide the {count} {what}: {fix} of {count}")
    if engine == "hf" and kv_heads % t:
        raise MemoryPlanError(f"{name} {t} does not divide the {kv_heads} KV heads "
                              f"(num_key_value_heads) of the hf engine, which does not replicate them: {fix} of "
                              f"{kv_heads}, or engine vllm (it replicates KV heads)")
    if (kv_heads % t if t <= kv_heads else t % kv_heads):
        raise MemoryPlanError(f"{name} {t} and the {kv_heads} KV heads (num_key_value_heads) "
                              f"do not divide one another: {fix} or a multiple of {kv_heads}")
    vocab = config.get("vocab_size")
    if engine == "hf" and vocab is not None and vocab % t:
        raise MemoryPlanError(f"{name} {t} does not divide the {vocab} vocabulary entries "
                              f"(vocab_size): {fix} of {vocab}")


@dataclass(frozen=True)
class RankMemory:
    """Planned bytes on one rank of one layout. Device: ``master_weights_bytes`` (fp32,
    FSDP2 shard), ``gradient_bytes`` (fp32 shard), ``adam_bytes`` (two fp32 moments),
    ``engine_bytes`` (rollout dtype); host: ``staging_bytes`` (checkpoint staging, this
    rank's share), ``eval_read_bytes`` (evaluator read buffers)."""

    layout: str
    master_weights_bytes: int
    gradient_bytes: int
    adam_bytes: int
    engine_bytes: int
    staging_bytes: int
    eval_read_bytes: int

    @property
    def device_bytes(self) -> int:
        """What the rank's accelerator holds: weights, gradients, AdamW moments, engine."""
        return self.master_weights_bytes + self.gradient_bytes + self.adam_bytes + self.engine_bytes


@dataclass(frozen=True)
class MemoryPlan:
    """Both layouts of one model at world size N and T, with the model's totals."""

    parameters: int
    weight_bytes: int
    world_size: int
    tensor_parallel_size: int
    replica: RankMemory
    sharded: RankMemory

    def to_json(self) -> dict:
        """Plain values, each layout with its ``device_bytes``."""
        out = asdict(self)
        for name in ("replica", "sharded"):
            out[name]["device_bytes"] = getattr(self, name).device_bytes
        return out


def fsdp_shard_numel(tensors: list[Tensor], world_size: int) -> int:
    """Elements of rank 0's FSDP2 shard: each tensor split along dim 0 into
    ``ceil(dim0 / N)`` rows (torch's ``fully_shard`` chunking: rank 0 holds the most)."""
    return sum(-(-t.shape[0] // world_size) * (t.numel // t.shape[0]) for t in tensors)


def _sharded_engine_numel(tensors: list[Tensor], t: int, kv_heads: int) -> int:
    shares = {SPLIT: t, REPLICATED: 1, KV: min(t, kv_heads)}
    return sum(-(-x.numel // shares[x.tp]) for x in tensors)


def plan_memory(config: dict, world_size: int, tensor_parallel_size: int = 1, dtype: str = "bfloat16",
                max_in_flight: int = 2, engine: str = "vllm",
                tensor_parallel_name: str = "inference.tensor_parallel_size") -> MemoryPlan:
    """Per-rank bytes of the ``replica`` and ``sharded`` layouts for the model ``config``
    on ``world_size`` ranks (see the module docstring).

    Args:
        config: a model ``config.json`` as a dict (:func:`~mlperf_grpo.plan.model_config.load_model_config`).
        world_size: N ranks (>= 1), each one accelerator.
        tensor_parallel_size: T, the sharded engine's group size (``sharded`` layout only).
        dtype: the rollout dtype (``model.dtype``): ``bfloat16`` or ``float32``.
        max_in_flight: K, ``checkpoint.max_in_flight``.
        engine: whose rules split the engine, ``"vllm"`` (KV heads replicated past T)
            or ``"hf"`` (T divides the KV heads and the vocabulary):
            :func:`check_tensor_parallel`.
        tensor_parallel_name: how refusals call T (``plan --memory``: its flag).
    Raises:
        MemoryPlanError: the config is not one :func:`model_tensors` counts, or T does
            not divide (:func:`check_tensor_parallel`).
    """
    if world_size < 1 or tensor_parallel_size < 1:
        raise MemoryPlanError(f"world size {world_size} and tensor parallel size {tensor_parallel_size} must be >= 1")
    tensors = model_tensors(config)
    check_tensor_parallel(config, world_size, tensor_parallel_size, engine, tensor_parallel_name)
    total = sum(t.numel for t in tensors)
    shard = fsdp_shard_numel(tensors, world_size)
    rollout = DTYPE_BYTES[dtype]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    engine = _sharded_engine_numel(tensors, tensor_parallel_size, kv_heads)
    fp32 = dict(master_weights_bytes=shard * FP32_BYTES, gradient_bytes=shard * FP32_BYTES, adam_bytes=2 * shard * FP32_BYTES)
    replica = RankMemory("replica", **fp32, engine_bytes=total * rollout, staging_bytes=max_in_flight * shard * rollout,
                         eval_read_bytes=EVAL_READ_BUFFERS * total * rollout)
    sharded = RankMemory("sharded", **fp32, engine_bytes=engine * rollout, staging_bytes=max_in_flight * shard * rollout,
                         eval_read_bytes=EVAL_READ_BUFFERS * engine * rollout)
    return MemoryPlan(total, total * rollout, world_size, tensor_parallel_size, replica, sharded)


def static_device_bytes(plan: MemoryPlan, engine_shards: int = 1) -> int:
    """A rank's planned device bytes before any sequence: the FSDP2 shards (fp32 weights,
    gradients, AdamW moments) plus the engine's weights (its ``sharded`` share at T > 1,
    else the whole engine over ``engine_shards``: :func:`check_fits`)."""
    r = plan.replica
    engine = plan.sharded.engine_bytes if plan.tensor_parallel_size > 1 else -(-r.engine_bytes // engine_shards)
    return r.device_bytes - r.engine_bytes + engine


def check_fits(plan: MemoryPlan, device_memory_bytes: int, engine_shards: int = 1) -> None:
    """Refuse a layout when a rank's planned device bytes exceed its accelerator's memory:
    the FSDP2 shards plus, at ``plan.tensor_parallel_size`` T > 1 (the tensor-parallel
    ``hf`` engine), the ``sharded`` layout's engine share, else the whole engine divided
    by ``engine_shards`` (GPUs the engine itself spreads over: vLLM's T in one process).

    Raises:
        MemoryPlanError: naming the planned bytes, the device's bytes and the remedies.
    """
    planned = static_device_bytes(plan, engine_shards)
    r = plan.replica
    engine = planned - (r.device_bytes - r.engine_bytes)
    if planned > device_memory_bytes:
        raise MemoryPlanError(
            f"the planned {planned:,} bytes per rank ({size_text(planned)}: fp32 weights, gradients and AdamW moments "
            f"sharded over {plan.world_size} rank(s), plus a {size_text(engine)} rollout engine share) exceed the "
            f"device's {device_memory_bytes:,} bytes ({size_text(device_memory_bytes)}), before activations: launch more "
            f"ranks (torchrun --nproc-per-node / --nnodes: they shard the fp32 state), a larger "
            f"inference.tensor_parallel_size (it splits the engine), "
            f"or a smaller model; 'mlperf-grpo plan --memory' gives the figures")


def gib(n: int) -> str:
    """``n`` bytes in GiB, one decimal (a table's column of GiB)."""
    return f"{n / 2**30:,.1f}"


def gib_cell(n: int) -> str:
    """A GiB table's cell: :func:`gib`, or :func:`size_text` with its unit for a nonzero
    size under 0.05 GiB (no nonzero cell reads 0.0)."""
    return gib(n) if n == 0 or n >= 2**30 / 20 else size_text(n)


def size_text(n: int) -> str:
    """``n`` bytes with their unit, for a line of text: GiB with one decimal, MiB below
    0.05 GiB, bytes below 0.05 MiB (so no nonzero size reads 0.0)."""
    if n >= 2**30 / 20:
        return f"{gib(n)} GiB"
    if n >= 2**20 / 20:
        return f"{n / 2**20:.1f} MiB"
    return f"{n:,} bytes"


def format_memory_plan(plan: MemoryPlan) -> str:
    """The plan as a table in GiB (what ``mlperf-grpo plan --memory`` prints)."""
    r, s = plan.replica, plan.sharded
    rows = [("fp32 master weights (FSDP2 shard)", r.master_weights_bytes, s.master_weights_bytes),
            ("fp32 gradients (shard)", r.gradient_bytes, s.gradient_bytes),
            ("AdamW moments (2 x fp32 shard)", r.adam_bytes, s.adam_bytes),
            ("rollout engine", r.engine_bytes, s.engine_bytes),
            ("= device total", r.device_bytes, s.device_bytes),
            ("host: checkpoint staging (K)", r.staging_bytes, s.staging_bytes),
            ("host: evaluator read buffers (2)", r.eval_read_bytes, s.eval_read_bytes)]
    billions = f" ({plan.parameters / 1e9:.3g}e9)" if plan.parameters >= 1e7 else ""  # not "(6.58e-05e9)"
    head = (f"{plan.parameters:,} parameters{billions}, {size_text(plan.weight_bytes)} of rollout-dtype "
            f"weights; N = {plan.world_size} ranks, T = {plan.tensor_parallel_size}; GiB per rank")
    lines = [head, f"  {'':36} {'replica (T = 1)':>16} {'sharded':>20}"]
    lines += [f"  {name:36} {gib_cell(a):>16} {gib_cell(b):>20}" for name, a, b in rows]
    lines.append("  evaluator buffers per evaluate worker (of T ranks); "
                 "not counted: activations, KV cache, CUDA context")
    return "\n".join(lines)
