"""Gradients summed over micro-batches with a few ``_foreach_add_`` a pass, not one ``add_`` a parameter.

``loss.backward()`` into parameters whose ``.grad`` is set adds each new gradient in
place, one kernel per parameter (``AccumulateGrad``): 11 a Qwen3 decoder layer, 308 a
pass at 28 layers. Into a ``.grad`` of None autograd stores the new gradient itself (no
kernel). :class:`GradSum` keeps every ``.grad`` at None during the step's passes: as each
parameter's gradient arrives (``register_post_accumulate_grad_hook``) it is taken out,
kept as the parameter's sum on its first pass and queued after that; the queue is added
to the sums by one ``torch._foreach_add_`` whenever it holds :data:`FLUSH_BYTES` and at
the end of each backward. On exit the sums are the ``.grad`` again. The additions are
those ``AccumulateGrad`` makes (float32 ``sum += new``, pass after pass): the same bits;
the queue bounds what is held beside the sums.

Not for sharded (DTensor) parameters: FSDP2 reduces and accumulates their gradients in
its own hooks (:func:`usable`).
"""

from __future__ import annotations

import functools

import torch

FLUSH_BYTES = 1 << 30
"""Queued gradients are added to the sums once they hold this many bytes (1 GiB: the most
memory a pass holds beyond the one set of gradients ``AccumulateGrad`` would)."""


def usable(params: list[torch.nn.Parameter]) -> bool:
    """Whether :class:`GradSum` may hold these parameters' gradients: plain tensors only
    (an FSDP2-sharded parameter is a DTensor, accumulated by FSDP2 itself)."""
    return all(type(p) is torch.nn.Parameter and type(p.data) is torch.Tensor for p in params)


class GradSum:
    """The running sums of ``params``' gradients over a step's backward passes, as a
    context: enter with every ``.grad`` None, call :meth:`take` after each backward; on
    exit (an error too) each ``.grad`` is what the passes would have accumulated into it
    (None where no pass reached it) and the hooks are gone."""

    def __init__(self, params: list[torch.nn.Parameter], flush_bytes: int = FLUSH_BYTES) -> None:
        self.params, self.flush_bytes = params, flush_bytes
        self.sums: list[torch.Tensor | None] = [None] * len(params)
        self.into: list[torch.Tensor] = []
        self.new: list[torch.Tensor] = []
        self.queued_bytes = 0
        self.handles: list = []

    def __enter__(self) -> GradSum:
        self.handles = [p.register_post_accumulate_grad_hook(functools.partial(self._arrived, i))
                        for i, p in enumerate(self.params) if p.requires_grad]
        return self

    def _arrived(self, index: int, param: torch.nn.Parameter) -> None:
        g = param.grad
        param.grad = None
        if self.sums[index] is None:
            self.sums[index] = g  # the first gradient of this parameter: kept as autograd stored it
            return
        self.into.append(self.sums[index])
        self.new.append(g)
        self.queued_bytes += g.numel() * g.element_size()
        if self.queued_bytes >= self.flush_bytes:
            self.take()

    def take(self) -> None:
        """Add the queued gradients to their sums (one foreach add)."""
        if self.into:
            torch._foreach_add_(self.into, self.new)
        self.into, self.new, self.queued_bytes = [], [], 0

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        self.take()
        for p, s in zip(self.params, self.sums):
            p.grad = s
