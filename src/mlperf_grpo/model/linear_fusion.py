"""One GEMM for the linears of a compiled graph that read the same input: an inductor
pre-grad pass (``torch._inductor.config.pre_grad_custom_pass``: each Dynamo graph before
AOTAutograd) that ``model/compile.py`` gives the decoder layers.

``F.linear(x, w1), F.linear(x, w2), ...`` become ``F.linear(x, cat([w1, w2, ...]))`` and a
split of its last dim: a Qwen3 or Llama layer's q/k/v and gate/up projections, 7 GEMMs a
forward and 14 a backward down to 4 and 8 (the weights' gradients are slices of the fused
one's, the input's gradient is one GEMM, not one a linear and their sum). The concatenated
weight is recomputed for the backward, not saved (``CheckpointPolicy.MUST_RECOMPUTE``): no
more memory than the linears held, one more copy kernel. Inductor's own
``BatchLinearLHSFusion`` fuses 2-D inputs only (ours are ``[batch, seq, hidden]``). Each
input gradient is one sum over the group's output features: in float32 it differs from the
linears' added gradients by the order of the additions. ``TORCHINDUCTOR_DISABLED_PASSES=
PRE_GRAD_CUSTOM_PASS`` turns the pass off.

Fused: linears (``torch._C._nn.linear``) of one input node whose weights are 2-D with
static sizes, of one dtype, device and in-features, all without bias or all with a 1-D bias
of the weights' dtype, their operands defined before the group's first linear. Not fused: a
linear whose output is a graph output or is ``view``-ed other than along its last dim (a
split's slices are not contiguous), and no linear of a graph with an in-place operation or
a grad-mode or autocast switch (a group might read a mutated input or straddle a region).
"""

from __future__ import annotations

import operator
from collections import defaultdict

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils.checkpoint import CheckpointPolicy

_IN_PLACE_OPERATORS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                       operator.ifloordiv, operator.imod, operator.ipow, operator.imatmul, operator.iand,
                       operator.ior, operator.ixor, operator.ilshift, operator.irshift}
_STATE_SWITCHES = {torch._C._set_grad_enabled, torch.amp.autocast_mode._enter_autocast,
                   torch.amp.autocast_mode._exit_autocast}


class FuseLinears(CustomGraphPass):
    """The pass (:func:`fuse_linears`) as inductor's config takes it: its ``uuid`` (this
    file's hash) keys inductor's caches."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        fuse_linears(graph)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))


FUSE_LINEARS = FuseLinears()


def _unusual(node: torch.fx.Node) -> bool:
    """Whether ``node`` mutates a tensor or switches grad mode or autocast."""
    if node.op not in ("call_function", "call_method"):
        return False
    target = node.target
    if target in _IN_PLACE_OPERATORS or target in _STATE_SWITCHES:
        return True
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.is_mutable
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or "out" in node.kwargs or node.kwargs.get("inplace") is True


def _operands(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node | None] | None:
    """``(input, weight, bias)`` of a linear node; None for any other node."""
    if node.op != "call_function" or node.target is not torch._C._nn.linear:
        return None
    names = ("input", "weight", "bias")
    if set(node.kwargs) - set(names[len(node.args):]):
        return None
    x, w, b = (*node.args, *(node.kwargs.get(n) for n in names[len(node.args):]))
    if not isinstance(x, torch.fx.Node) or not isinstance(w, torch.fx.Node) or not isinstance(b, (torch.fx.Node, type(None))):
        return None
    return x, w, b


def _value(node: torch.fx.Node | None) -> torch.Tensor | None:
    return None if node is None else node.meta.get("example_value")


def _group_key(node: torch.fx.Node) -> tuple | None:
    """What the linears of one group share, or None where ``node`` is no linear to fuse."""
    operands = _operands(node)
    if operands is None:
        return None
    x, w, b = operands
    weight, bias = _value(w), _value(b)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not all(isinstance(s, int) for s in weight.shape):
        return None
    if b is not None and (not isinstance(bias, torch.Tensor) or bias.dim() != 1 or bias.dtype != weight.dtype):
        return None
    for user in node.users:
        if user.op == "output" or (user.op == "call_method" and user.target == "view" and not _keeps_leading_dims(node, user)):
            return None
    return x, weight.dtype, weight.device, weight.shape[1], b is not None


def _keeps_leading_dims(node: torch.fx.Node, view: torch.fx.Node) -> bool:
    """Whether ``view`` of ``node``'s output splits its last dim only (a view a slice of the
    last dim allows), as far as the traced shapes tell without a guard."""
    src, out = _value(node), _value(view)
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor) or out.dim() < src.dim():
        return False
    return all(statically_known_true(a == b) for a, b in zip(src.shape[:-1], out.shape[:src.dim() - 1]))


def fuse_linears(graph: torch.fx.Graph) -> int:
    """Fuse each group of two or more linears in ``graph`` (the module docstring says
    which); the number of linears fused."""
    nodes = list(graph.nodes)
    if any(_unusual(n) for n in nodes):
        return 0
    order = {n: i for i, n in enumerate(nodes)}
    groups: dict[tuple, list[torch.fx.Node]] = defaultdict(list)
    for node in nodes:
        key = _group_key(node)
        if key is not None:
            groups[key].append(node)
    fused = 0
    for group in groups.values():
        operands = [_operands(n) for n in group]
        if len(group) > 1 and all(order[a] < order[group[0]] for ops in operands for a in ops if a is not None):
            _fuse(graph, group, operands)
            fused += len(group)
    return fused


def _fuse(graph: torch.fx.Graph, group: list[torch.fx.Node], operands: list[tuple]) -> None:
    """One linear before ``group[0]`` in place of ``group``, its output split by the weights' out-features."""
    x = operands[0][0]
    sizes = [_value(w).shape[0] for _, w, _ in operands]
    with graph.inserting_before(group[0]):
        weight = graph.call_function(torch.cat, ([w for _, w, _ in operands],), {"dim": 0})
        bias = None if operands[0][2] is None else graph.call_function(torch.cat, ([b for _, _, b in operands],), {"dim": 0})
        weight.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE  # not saved for the backward: a copy of weights
        parts = graph.call_function(torch.split, (graph.call_function(torch._C._nn.linear, (x, weight, bias)), sizes),
                                    {"dim": -1})
        outputs = [graph.call_function(operator.getitem, (parts, i)) for i in range(len(group))]
    for node, output in zip(group, outputs):  # erased after the inserts before group[0]
        node.replace_all_uses_with(output)
        graph.erase_node(node)
