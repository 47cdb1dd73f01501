"""The decoder layers' linear weights as compute-dtype copies over a step's passes, their
gradients summed in float32.

Under ``torch.autocast`` every pass casts each float32 weight a linear layer multiplies to
the compute dtype (one kernel a weight) and casts its gradient back to float32 (one more):
14 of the some 60 kernels a Qwen3 decoder layer launches a pass, where a 64-row pass of the
1.4B model is bound by the host's launches (``benchmarks/grpo_step.py`` on one H100).
:class:`ComputeWeights` puts compute-dtype copies of those weights in the modules once a
step (one ``_foreach_copy_``) and adds the copies' gradients to float32 sums after each
pass (a few foreach operations), as Megatron's bfloat16 parameters with float32 main
parameters and main gradients do. The forward reads the values autocast would have made
(both round to nearest even), and each sum is the float32 additions of the same
compute-dtype gradients that ``AccumulateGrad`` or
:class:`~mlperf_grpo.train.grad_accumulation.GradSum` would make: the same bits.

A copy's gradient is summed in the compute dtype where a pass uses the linear more than
once (autograd adds the uses before the sum): HF decoder layers call each linear once, and
``lm_head`` (read by every logits chunk, tied to the embedding in some models) is left to
autocast. Not for sharded (DTensor) parameters: FSDP2's ``MixedPrecisionPolicy`` casts
those (:func:`~mlperf_grpo.train.grad_accumulation.usable`).
"""

from __future__ import annotations

import functools

import torch

from mlperf_grpo.model.compile import decoder_layers
from mlperf_grpo.train.grad_accumulation import FLUSH_BYTES, usable


def linear_slots(policy: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """``(module, name)`` of each float32 weight and bias of the ``nn.Linear`` modules in
    ``policy``'s decoder layers that trains and belongs to that module alone; ``[]`` for a
    model without one list of decoder layers (:func:`~mlperf_grpo.model.compile.decoder_layers`)."""
    try:
        layers = decoder_layers(policy)
    except ValueError:
        return []
    uses: dict[int, int] = {}
    for _, p in policy.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    return [(m, name) for m in layers.modules() if isinstance(m, torch.nn.Linear)
            for name, p in m.named_parameters(recurse=False)
            if p.requires_grad and p.dtype == torch.float32 and uses[id(p)] == 1]


def compute_weights(policy: torch.nn.Module, dtype: torch.dtype) -> ComputeWeights | None:
    """A :class:`ComputeWeights` of ``policy``'s decoder linears in ``dtype``; None in
    float32, for sharded parameters, or where there is no such linear."""
    if dtype == torch.float32 or not usable(list(policy.parameters())):
        return None
    slots = linear_slots(policy)
    return ComputeWeights(slots, dtype) if slots else None


class ComputeWeights:
    """A context over a step's passes: inside, each slot's parameter is a ``dtype`` copy of
    its float32 parameter (the master); call :meth:`take` after each backward. On exit (an
    error too, or a signal's exception raised during the exit) the masters are back in their
    modules, each with the float32 sum of its copy's gradients as ``.grad`` (None where no
    pass reached it). Enter with every master's ``.grad`` None.

    Args:
        slots: ``(module, name)`` of float32 parameters (:func:`linear_slots`).
        dtype: the compute dtype of the copies.
        flush_bytes: queued gradients are added to the sums once their float32 sizes
            reach this many bytes (and after each backward): beyond the sums, a pass holds
            at most that much float32 staging and half as much queued.
    """

    def __init__(self, slots: list[tuple[torch.nn.Module, str]], dtype: torch.dtype,
                 flush_bytes: int = FLUSH_BYTES // 2) -> None:
        self.slots, self.dtype, self.flush_bytes = slots, dtype, flush_bytes
        self.masters = [m._parameters[name] for m, name in slots]
        self.copies: list[torch.nn.Parameter] = []
        self.sums: list[torch.Tensor] = []
        self.reached = [False] * len(slots)
        self.queue: list[tuple[int, torch.Tensor]] = []
        self.queued_bytes = 0
        self.handles: list = []

    def __enter__(self) -> ComputeWeights:
        sizes = [p.numel() for p in self.masters]
        device = self.masters[0].device
        flat = torch.empty(sum(sizes), dtype=self.dtype, device=device)  # [P] the copies
        views = [v.view(p.shape) for v, p in zip(flat.split(sizes), self.masters)]
        with torch.no_grad():
            torch._foreach_copy_(views, [p.detach() for p in self.masters])
        self.copies = [torch.nn.Parameter(v) for v in views]
        sums = torch.empty(sum(sizes), dtype=torch.float32, device=device)  # [P] the float32 gradient sums
        self.sums = [v.view(p.shape) for v, p in zip(sums.split(sizes), self.masters)]
        try:
            for (module, name), copy in zip(self.slots, self.copies):
                module._parameters[name] = copy
            self.handles = [c.register_post_accumulate_grad_hook(functools.partial(self._arrived, i))
                            for i, c in enumerate(self.copies)]
        except BaseException:
            self._restore()
            raise
        return self

    def _arrived(self, index: int, copy: torch.nn.Parameter) -> None:
        self.queue.append((index, copy.grad))
        copy.grad = None
        self.queued_bytes += copy.numel() * 4
        if self.queued_bytes >= self.flush_bytes:
            self.take()

    def take(self) -> None:
        """Add the queued gradients to their float32 sums: a first gradient copied in, a
        later one cast to float32 in a staging buffer and added (one foreach operation each)."""
        first = [(i, g) for i, g in self.queue if not self.reached[i]]
        later = [(i, g) for i, g in self.queue if self.reached[i]]
        self.queue, self.queued_bytes = [], 0
        if first:
            torch._foreach_copy_([self.sums[i] for i, _ in first], [g for _, g in first])
            for i, _ in first:
                self.reached[i] = True
        if later:
            sizes = [g.numel() for _, g in later]
            staging = torch.empty(sum(sizes), dtype=torch.float32, device=later[0][1].device)
            parts = [v.view(g.shape) for v, (_, g) in zip(staging.split(sizes), later)]
            torch._foreach_copy_(parts, [g for _, g in later])
            torch._foreach_add_([self.sums[i] for i, _ in later], parts)

    def _restore(self) -> None:
        """Every master back in its module, even where an exception a signal raises (SIGTERM's
        ``Terminated``, Ctrl-C) cuts the loop short: the rest are put back before it propagates."""
        done = False
        try:
            for (module, name), master in zip(self.slots, self.masters):
                module._parameters[name] = master
            done = True
        finally:
            if not done:
                for (module, name), master in zip(self.slots, self.masters):
                    module._parameters[name] = master

    def __exit__(self, *exc: object) -> None:
        self._restore()  # first: a signal's exception in what follows leaves no copy in a module
        for handle in self.handles:
            handle.remove()
        self.take()
        for master, total, reached in zip(self.masters, self.sums, self.reached):
            master.grad = total if reached else None
        self.copies, self.sums = [], []
