"""Gradients summed over micro-batches with one ``_foreach_add_`` a pass, not one ``add_`` a parameter.

``loss.backward()`` into parameters whose ``.grad`` is set adds each new gradient in
place, one kernel per parameter (``AccumulateGrad``): 11 a Qwen3 decoder layer, 308 a
pass at 28 layers. Into a ``.grad`` of None autograd stores the new gradient itself (no
kernel). :class:`GradSum` keeps every pass's ``.grad`` at None: after each backward it
takes the gradients out and adds them to the running sums in one ``torch._foreach_add_``
(a handful of kernels); :meth:`GradSum.restore` puts the sums back as ``.grad``. The
additions are those ``AccumulateGrad`` makes (float32 ``sum += new``, pass after pass):
the same bits.

Not for sharded (DTensor) parameters: FSDP2 reduces and accumulates their gradients in
its own hooks (:func:`usable`).
"""

from __future__ import annotations

import torch


def usable(params: list[torch.nn.Parameter]) -> bool:
    """Whether :class:`GradSum` may hold these parameters' gradients: plain tensors only
    (an FSDP2-sharded parameter is a DTensor, accumulated by FSDP2 itself)."""
    return all(type(p) is torch.nn.Parameter and type(p.data) is torch.Tensor for p in params)


class GradSum:
    """The running sums of ``params``' gradients over a step's backward passes.

    Call :meth:`take` after each backward (with every ``.grad`` None before the first)
    and :meth:`restore` after the last: the ``.grad`` are then what the backward passes
    would have accumulated into them.
    """

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.sums: list[torch.Tensor | None] = [None] * len(params)

    def take(self) -> None:
        """Move the last backward's gradients into the sums (``.grad`` back to None)."""
        into, new = [], []
        for i, p in enumerate(self.params):
            g = p.grad
            if g is None:
                continue
            p.grad = None
            if self.sums[i] is None:
                self.sums[i] = g  # the first gradient of this parameter: kept as autograd stored it
            else:
                into.append(self.sums[i])
                new.append(g)
        if into:
            torch._foreach_add_(into, new)

    def restore(self) -> None:
        """Set each parameter's ``.grad`` to its sum (None where no pass reached it)."""
        for p, s in zip(self.params, self.sums):
            p.grad = s
