"""One pass's loss and figures (train/pass_loss.py): the grpo functions' values, eager and compiled.

Tolerance of the compiled function against the eager one, float32 (u = 2^-24): both
evaluate the same formula; inductor fuses the elementwise chain (a handful of roundings,
each operation within a few ulp: 32 u relative per value is generous) and may sum in
another order (two orders of an n-term sum differ by at most 2 gamma_n sum|terms|, Higham
eq. 4.4). So each per-token value and gradient within 32 u of its magnitude, each sum
within (32 u + 2 gamma_n) sum|terms|.
"""

import shutil

import pytest
import torch

from mlperf_grpo import rules
from mlperf_grpo.train.grpo import PGLossOptions, clipped_pg_loss_sum, seq_logprob_error_keep
from mlperf_grpo.train.pass_loss import STATS, PassLossSettings, loss_function, pass_loss

U = 2.0**-24
REFERENCE = PassLossSettings(PGLossOptions(**{k: rules.REFERENCE_ALGORITHM[k] for k in PGLossOptions.__dataclass_fields__}),
                             rules.REFERENCE_ALGORITHM["seq_logprob_error_threshold"], True)


def _inputs(seed=0, rows=6, width=9):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(rows, width, generator=g) > 0.3).float()
    mask[0] = 0  # a row without tokens
    generation = -torch.rand(rows, width, generator=g) * 3
    curr = (generation + torch.randn(rows, width, generator=g) * 1e-3).requires_grad_()  # near the rollout's
    curr_wide = torch.nn.functional.pad(curr, (0, 1))  # the pass's extra last column, left out
    entropy = torch.rand(rows, width + 1, generator=g) * 2
    generation[1] -= 5 * mask[1]  # its log-prob error is e^5 > 2: the filter drops it
    return curr, curr_wide, entropy, generation, mask, torch.ones(rows), torch.randn(rows, generator=g)


def test_pass_loss_is_the_grpo_functions_composed():
    curr, wide, entropy, generation, mask, kept, adv = _inputs()
    loss, stats = pass_loss(wide, entropy, generation, mask, kept, adv, torch.tensor(7.0), REFERENCE)
    prev = curr.detach()
    keep, _ = seq_logprob_error_keep(prev, generation, mask, 2.0)
    kept_mask = mask * keep.unsqueeze(1)
    part = clipped_pg_loss_sum(curr, prev, generation, adv, kept_mask, REFERENCE.options)
    assert torch.equal(loss, part.loss / 7.0)
    values = dict(zip(STATS, stats.tolist()))
    assert values["masked_by_error"] == 1 and keep[1] == 0
    assert values["tokens"] == kept_mask.sum().item() and values["sequences"] == 5
    assert values["importance_weight_sum"] == part.importance_weight_sum.item()
    assert values["entropy_sum"] == (entropy[:, :-1] * kept_mask).sum().item()
    assert values["loss"] == loss.item()


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="torch.compile on the CPU needs a C compiler")
def test_the_compiled_pass_loss_gives_the_eager_values_and_gradient():
    results = []
    for compiled in (False, True):
        curr, wide, entropy, generation, mask, kept, adv = _inputs(seed=1)
        loss, stats = loss_function(compiled)(wide, entropy, generation, mask, kept, adv, torch.tensor(5.0), REFERENCE)
        loss.backward()
        results.append((loss.detach(), stats, curr.grad))
    (loss_e, stats_e, grad_e), (loss_c, stats_c, grad_c) = results
    n = mask.numel()
    gamma = 2 * n * U / (1 - n * U)
    # sum|terms| of the loss: |A| * ratio * weight per token (ratio and weights near 1 here: bounded by 2)
    terms = (2 * adv.abs().unsqueeze(1) * mask).sum().item() / 5.0
    assert abs(loss_c.item() - loss_e.item()) <= (32 * U + gamma) * terms
    assert ((grad_c - grad_e).abs() <= 32 * U * grad_e.abs() + 1e-30).all()
    scale = torch.tensor([terms, 2 * n, 0, 0, 0, 0, (entropy.abs() * 1).sum().item()], dtype=torch.float64)
    assert ((stats_c - stats_e).abs() <= (32 * U + gamma) * scale).all()
    assert stats_c[2:6].tolist() == stats_e[2:6].tolist()  # the counts are exact


def _uneven_batch(g, prompts, generations, longest):
    """Rows of random tokens, prompts of 2..11 and completions of 1..longest-1 tokens."""
    from mlperf_grpo.inference.base import Completion
    from mlperf_grpo.train.grpo import group_advantages
    from mlperf_grpo.train.rollout import build_batch

    comps = [[Completion(torch.randint(3, 15, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist(),
                         torch.randint(3, 15, (n,), generator=g).tolist(), [-1.0] * n, "")
              for n in torch.randint(1, longest, (generations,), generator=g).tolist()] for _ in range(prompts)]
    rewards = torch.rand(prompts, generations, generator=g)
    return build_batch(comps, rewards, group_advantages(rewards), 0, [2])


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="torch.compile on the CPU needs a C compiler")
def test_the_compiled_loss_is_not_recompiled_for_each_pass_shape():
    # each pass's inputs were views of the step's tensors (other rows, widths, offsets): Dynamo
    # guarded their strides and storage offsets and recompiled the loss on most new pass
    # shapes (5 compilations in these 6 steps, 8 in 6 more), then ran it eager with a warning (recompile_limit)
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from mlperf_grpo.model.load import load_model
    from mlperf_grpo.train.optimize import OptimizeSettings, optimize_step

    torch._dynamo.reset()
    policy = load_model("builtin:arithmetic-tiny", "float32")
    settings = OptimizeSettings(None, 1.0, PGLossOptions(), 1e9, width_multiple=8, compile_loss=True,
                                micro_batch_tokens=41)  # packed, padded and one-row passes
    g = torch.Generator().manual_seed(1)
    for shape in ((2, 3, 40), (1, 2, 5), (3, 2, 60), (1, 2, 2), (2, 4, 30), (1, 3, 90)):
        optimize_step(policy, torch.optim.SGD(policy.parameters(), lr=0.0), _uneven_batch(g, *shape), settings)
    assert len(_debug_get_cache_entry_list(pass_loss.__code__)) <= 2  # a pass of one row, and of several
