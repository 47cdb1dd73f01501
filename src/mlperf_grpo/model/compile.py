"""``torch.compile`` of the training policy's decoder layers (regional compilation),
and when ``model.compile: auto`` leaves a model eager."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx.experimental._config as shape_config

from mlperf_grpo.model.files import check_model_path, hf_config, linear_attention_layers


def _layers_and_parent(model: torch.nn.Module) -> tuple[torch.nn.ModuleList, torch.nn.Module]:
    """The one ``ModuleList`` of decoder layers and the module holding it: a child of the
    base model (Llama's and Qwen's ``model.layers``, GPT-2's ``transformer.h``), else of
    its one child that holds lists (OPT's ``model.decoder.layers``).

    Raises:
        ValueError: no such list, or several.
    """
    base = getattr(model, "base_model", None)
    parents = [base] if isinstance(base, torch.nn.Module) else []
    lists = [(m, p) for p in parents for m in p.children() if isinstance(m, torch.nn.ModuleList)]
    if not lists and parents:
        lists = [(m, p) for p in base.children() if not isinstance(p, torch.nn.ModuleList)
                 for m in p.children() if isinstance(m, torch.nn.ModuleList)]
    if len(lists) != 1:
        raise ValueError(f"{type(model).__name__}: {len(lists)} lists of decoder layers in its base model, not one; "
                         "FSDP sharding needs one")
    return lists[0]


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """A Hugging Face causal LM's decoder layers (:func:`_layers_and_parent`).

    Raises:
        ValueError: the base model has no such list, or several.
    """
    return _layers_and_parent(model)[0]


def no_duck_sizing() -> None:
    """Turn off Dynamo's duck sizing in this process (``use_duck_shape``): with it, sizes
    equal at a function's first compile share one symbol, so a first pass of 64 rows 64
    columns wide compiles for square passes only and the next pass of other rows recompiles
    every decoder layer, the loss and the rotary embedding (``TORCH_LOGS=recompiles`` of
    ``benchmarks/grpo_step.py --model-shape qwen3-tiny --compile on`` on the CPU: 6
    recompiles and 46 s with it, 3 and 27 s without)."""
    shape_config.use_duck_shape = False


def trace_checkpointed_layers_whole() -> None:
    """Let Dynamo compile an activation-checkpointed decoder layer as one graph in this
    process (``skip_fwd_side_effects_in_bwd_under_checkpoint``, as torchtitan sets when it
    compiles). ``transformers`` >= 5 requires the ``kernels`` package, whose
    ``use_kernelized_func`` wraps the attention's ``forward`` (Llama, Qwen2, Qwen3, ...): it
    sets a module-level context variable (``_ACTIVE_KERNEL_FUNCS``) and resets it before
    returning. Dynamo traces ``torch.utils.checkpoint`` as a higher-order op and refuses a
    mutation of an object from outside it, which eager checkpointing would replay in the
    recomputation: the graph broke there and the checkpointed layers ran eager, without the
    linear fusion (a 2-layer tiny Qwen3's pass: 59 GEMMs, 33 with this). With it the
    mutation happens once, in the forward, and is not replayed; a set and its reset replay
    to nothing. A torch without the flag (not checked which of >= 2.6 lack it) keeps the
    break, as before."""
    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def compile_dynamic(fn: Callable) -> Callable:
    """``torch.compile(fn, dynamic=True)`` without duck sizing (:func:`no_duck_sizing`)."""
    no_duck_sizing()
    return torch.compile(fn, dynamic=True)


def compile_decoder_layers(model: torch.nn.Module) -> None:
    """``torch.compile`` each decoder layer in place (``nn.Module.compile``: parameter
    names and ``state_dict`` keys are unchanged), with dynamic shapes (micro-batches differ
    in rows and width) and no duck sizing (:func:`no_duck_sizing`). The layers share one
    code object, so one compilation serves them all; it happens at the first forward and
    backward pass. Regional compilation as torchtitan's ``apply_compile`` (before any
    ``fully_shard``). In each layer's graph the linears of one input are one GEMM
    (:mod:`~mlperf_grpo.model.linear_fusion`, an inductor pre-grad pass: q/k/v and gate/up).
    The layers' sibling modules but embeddings and dropouts are compiled too (the final
    norm, the rotary embedding: some 35 kernels a pass eager, a few compiled). A layer
    checkpointed before (``trainer.checkpoint_layers``, FSDP's ``checkpoint_wrapper``) is
    compiled with its recomputation, in one graph (:func:`trace_checkpointed_layers_whole`).

    Raises:
        ValueError: the model has no list of decoder layers (:func:`decoder_layers`).
    """
    from mlperf_grpo.model.linear_fusion import FUSE_LINEARS  # imports torch._inductor (about 1 s)

    layers, parent = _layers_and_parent(model)
    no_duck_sizing()
    trace_checkpointed_layers_whole()
    for layer in layers:
        layer.compile(dynamic=True, options={"pre_grad_custom_pass": FUSE_LINEARS})
    for child in parent.children():
        if child is not layers and not isinstance(child, (torch.nn.Embedding, torch.nn.Dropout)):
            child.compile(dynamic=True)


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
    config = hf_config(check_model_path(path)).get_text_config()
    kinds = []
    if getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None):
        kinds.append("mixture-of-experts")
    if linear_attention_layers(path):
        kinds.append("linear-attention")
    return f"{' and '.join(kinds)} layers break the compiled graph" if kinds else None


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
