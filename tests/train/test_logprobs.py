"""Chunked log-probs and entropy (train/logprobs.py) equal the full-vocabulary computation.

Tolerances, derived from float32 arithmetic (u = 2^-24, gamma_K = K u / (1 - K u)):
the chunked and the full path compute every value with the same formula, but the order
of each summation may differ (a GEMM over a block of rows may block its H-long dot
products differently; the weight gradient sums N positions chunk by chunk instead of
at once). Two orders of a K-term float32 sum differ by at most 2 gamma_K sum|terms|
(Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., eq. 4.4). The
longest chain of summations feeding a value here runs over the hidden size H (the
logits), the vocabulary V (the normaliser, the entropy) and the N positions (the weight
gradient), so K = N + H + V bounds each, and sum|terms| is computed in float64 from the
absolute values: |h| |W|^T for a logit, sum_v |G_v| |W_v| for a hidden-state gradient,
|G|^T |h| for a weight gradient, with G = dL/dz bounded by (onehot + p) / T x |upstream|.
A log-prob moves at most 2 max|dz| / T when its logits move by dz (its gradient in z is
(onehot - p) / T, of l1 norm <= 2 / T); an entropy at most 2 H max|dz| / T (its
gradient is -p_v (log p_v + H) / T).
"""

import shutil

import pytest
import torch

from mlperf_grpo.model.load import load_model
from mlperf_grpo.train.grpo import token_logprobs
from mlperf_grpo.train.logprobs import chunk_tokens_for, chunked_token_stats, policy_token_logprobs

U = 2.0**-24


def _gamma(k: int) -> float:
    return k * U / (1 - k * U)


def _full(hidden, linear, targets, temperature):
    logp_all = torch.log_softmax(linear(hidden).float() / temperature, dim=-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy


@pytest.mark.parametrize("chunk", [1, 8, 37, 100])
def test_chunked_logprobs_entropy_and_gradients_equal_the_full_computation(chunk):
    torch.manual_seed(0)
    n, h, v, temperature = 37, 16, 50, 0.7
    linear = torch.nn.Linear(h, v, bias=True)
    hidden = torch.randn(n, h, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    a, b = torch.randn(n), torch.randn(n)  # the upstream gradients of log-probs and entropies
    results = []
    for run in ("full", "chunked"):
        linear.zero_grad()
        hidden.grad = None
        if run == "full":
            logp, entropy = _full(hidden, linear, targets, temperature)
        else:
            logp, entropy = chunked_token_stats(hidden, linear, targets, temperature, chunk, with_entropy=True)
        ((a * logp).sum() + (b * entropy).sum()).backward()
        results.append([logp.detach(), entropy.detach(), hidden.grad.clone(), linear.weight.grad.clone(),
                        linear.bias.grad.clone()])
    k = n + h + v
    w64, h64 = linear.weight.detach().double(), hidden.detach().double()
    dz = 2 * _gamma(k) * (h64.abs() @ w64.abs().T + linear.bias.detach().double().abs())  # [n, v] logit bound
    max_dz = dz.amax(dim=1) / temperature  # [n]
    entropy = results[0][1].double()
    bounds = [2 * max_dz, 2 * entropy * max_dz + 2 * _gamma(k) * entropy]
    probs = torch.softmax((h64 @ w64.T) / temperature, dim=-1)
    g = (torch.nn.functional.one_hot(targets, v) + probs) / temperature * (a.abs() + b.abs() * (1 + entropy.float()
                                                                                                 ).double()).unsqueeze(1)
    g = g * (1 + 4 * _gamma(k))  # G itself carries the logits' error (first order)
    bounds += [2 * _gamma(k) * (g @ w64.abs()), 2 * _gamma(k) * (g.T @ h64.abs()), 2 * _gamma(k) * g.sum(0)]
    for name, full, chunked, bound in zip(("logp", "entropy", "d hidden", "d weight", "d bias"), *results, bounds):
        assert ((full.double() - chunked.double()).abs() <= bound + 1e-30).all(), name


def test_one_chunk_is_the_full_computation_bit_for_bit():
    # at most chunk_tokens positions: no checkpoint, the same operations as before
    torch.manual_seed(1)
    linear = torch.nn.Linear(8, 20, bias=False)
    hidden, targets = torch.randn(3, 5, 8), torch.randint(0, 20, (3, 5))
    logp, entropy = chunked_token_stats(hidden, linear, targets, 1.3, chunk_tokens=15)
    assert entropy is None
    assert torch.equal(logp, token_logprobs(linear(hidden), targets, 1.3))


def test_chunk_tokens_bound_the_float32_logits_bytes():
    assert chunk_tokens_for(151_936) == (1 << 30) // (4 * 151_936) == 1766
    assert chunk_tokens_for(10**12) == 1


def test_policy_head_swap_gives_the_policys_logprobs_and_gradients():
    # the built-in model's log-probs through the swapped head, chunked by 4 positions,
    # equal token_logprobs of its full logits, as do the parameters' gradients
    torch.manual_seed(2)
    policy = load_model("builtin:arithmetic-tiny", "float32")
    ids = torch.randint(0, policy.config.vocab_size, (3, 9))
    targets = ids[:, 1:]
    logits = policy(input_ids=ids).logits[:, :-1]
    full = token_logprobs(logits, targets, 0.9)
    full.sum().backward()
    expected = {n: p.grad.clone() for n, p in policy.named_parameters()}
    policy.zero_grad()
    padded = torch.nn.functional.pad(targets, (0, 1))
    chunked, entropy = policy_token_logprobs(policy, padded, 0.9, 4, with_entropy=True, input_ids=ids)
    chunked[:, :-1].sum().backward()
    assert isinstance(policy.lm_head, torch.nn.Linear)  # put back
    torch.testing.assert_close(chunked[:, :-1], full, rtol=1e-5, atol=1e-6)
    probs = torch.softmax(logits.float() / 0.9, dim=-1)
    torch.testing.assert_close(entropy[:, :-1], -(probs * probs.log()).sum(-1), rtol=1e-5, atol=1e-6)
    for name, p in policy.named_parameters():  # a handful of positions: float32 rounding of sums of ~30 terms
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-4, atol=1e-6)


def test_head_refuses_misshaped_targets():
    policy = load_model("builtin:arithmetic-tiny", "float32")
    with pytest.raises(ValueError, match="targets"):
        policy_token_logprobs(policy, torch.zeros(2, 3, dtype=torch.long), 1.0, 8, input_ids=torch.zeros(2, 4, dtype=torch.long))
    assert isinstance(policy.lm_head, torch.nn.Linear)


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="torch.compile on the CPU needs a C compiler")
@pytest.mark.parametrize("chunk", [8, 100])
def test_compiled_chunks_give_the_eager_logprobs_entropy_and_gradients(chunk):
    # compiled=True (a compiled policy's loss pass): the same formula through inductor, inside
    # the checkpointed chunks too. Each value passes a handful of float32 roundings (shift,
    # exp, sum, log, product), each within a few ulp in either: 64 u of its scale, the
    # scale of a log-prob |logp| + ln V, of an entropy H + ln V; the gradient of the logits,
    # G = (onehot - p) / T, within 64 u of (onehot + p) / T each, reaches the hidden states
    # and the weight through the same GEMMs: 64 u (onehot + p) / T |W| and its transpose |h|
    torch.manual_seed(4)
    n, h, v, temperature = 37, 16, 50, 0.7
    linear = torch.nn.Linear(h, v, bias=False)
    hidden = torch.randn(n, h, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    results = []
    for compiled in (False, True):
        linear.zero_grad()
        hidden.grad = None
        logp, entropy = chunked_token_stats(hidden, linear, targets, temperature, chunk, "detached", compiled)
        logp.sum().backward()
        assert not entropy.requires_grad
        results.append((logp.detach(), entropy, hidden.grad.clone(), linear.weight.grad.clone()))
    (lp_e, h_e, dh_e, dw_e), (lp_c, h_c, dh_c, dw_c) = results
    log_v = torch.log(torch.tensor(float(v)))
    assert ((lp_c - lp_e).abs() <= 64 * U * (lp_e.abs() + log_v)).all()
    assert ((h_c - h_e).abs() <= 64 * U * (h_e + log_v)).all()
    with torch.no_grad():
        g = (torch.nn.functional.one_hot(targets, v) + torch.softmax(linear(hidden) / temperature, -1)) / temperature
        bound_dh, bound_dw = 64 * U * g @ linear.weight.abs(), 64 * U * g.T @ hidden.abs()
    assert ((dh_c - dh_e).abs() <= bound_dh).all() and ((dw_c - dw_e).abs() <= bound_dw).all()


@pytest.mark.parametrize("with_entropy", [False, True])
def test_fsdp2_policy_scores_without_the_view_output_warning(tmp_path, with_entropy):
    # FSDP2 warns where its root returns a view (an in-place op on it would skip the
    # pre-backward all-gather): the head's [..., 1] output is one (no kernel), read out of
    # place only, so shard_policy silences that warning. One gloo rank: the same logprobs
    # as the unwrapped policy (the same float32 ops).
    import warnings

    import torch.distributed as dist

    from mlperf_grpo.train.fsdp import shard_policy

    torch.manual_seed(3)
    ids = torch.randint(0, 15, (2, 7))
    want, _ = policy_token_logprobs(load_model("builtin:arithmetic-tiny", "float32"), ids, 1.0, 4, input_ids=ids)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # shard_policy's filter goes in front of it
            policy = shard_policy(load_model("builtin:arithmetic-tiny", "float32"), None, False)
            logp, _ = policy_token_logprobs(policy, ids, 1.0, 4, with_entropy=with_entropy, input_ids=ids)
            logp.sum().backward()
    finally:
        dist.destroy_process_group()
    assert not [w for w in caught if "view" in str(w.message)], [str(w.message) for w in caught]
    torch.testing.assert_close(logp.detach(), want.detach(), rtol=1e-6, atol=1e-6)
