"""The slot decoder (inference/decode.py): a per-slot KV cache with refilled slots.
On CPU it runs without CUDA graphs; the bookkeeping (refill, compaction, key-length
buckets) is the same code the graphs capture."""

import heapq
import math
import random

import pytest
import torch
from test_generation import EOS, reference_sample, tiny_qwen3
from transformers import DynamicCache, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
from transformers.generation.logits_process import TopPLogitsWarper

from mlperf_grpo.inference.base import SamplingParams
from mlperf_grpo.inference.decode import DecodeOptions, SlotDecoder
from mlperf_grpo.inference.hf import HFEngine
from mlperf_grpo.inference.sampling import (
    block_masses,
    sample_tokens,
    sample_tokens_by_blocks,
    sample_tokens_from_candidates,
)
from mlperf_grpo.inference.slot_attention import supports_slot_decoding
from mlperf_grpo.inference.slot_state import DecodeCall, cache_bytes

PARAMS = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=12)


def _prompts(n: int, seed: int) -> tuple[list[list[int]], list[int]]:
    gen = random.Random(seed)
    prompts = [[gen.randrange(3, 24) for _ in range(gen.randint(1, 9))] for _ in range(n)]
    return prompts, [gen.getrandbits(63) for _ in prompts]


def _makespan(lengths: list[int], slots: int) -> int:
    """Decode steps of list scheduling: each prompt, in order, goes to the slot free
    first; a completion of L tokens holds its slot for L - 1 decode steps (its first
    token comes from the prefill)."""
    free_at = [0] * slots
    for length in lengths:
        heapq.heappush(free_at, heapq.heappop(free_at) + length - 1)
    return max(free_at)


def test_completions_do_not_depend_on_slot_count_order_or_neighbours():
    model = tiny_qwen3(vocab_size=24, eos_token_id=EOS)
    prompts, seeds = _prompts(14, seed=3)
    expected = [reference_sample(model, p, s, PARAMS) for p, s in zip(prompts, seeds)]
    lengths = [len(tokens) for tokens, _ in expected]
    assert min(lengths) < PARAMS.max_new_tokens == max(lengths), "rows must end at EOS and at the limit"
    order = list(range(len(prompts)))
    random.Random(5).shuffle(order)
    for slots in (1, 3, 8):
        for perm in (list(range(len(prompts))), order):
            decoder = SlotDecoder(model, slots, 0, DecodeOptions(cuda_graphs=False, key_block=4))
            out = decoder.generate([prompts[i] for i in perm], [seeds[i] for i in perm], PARAMS.temperature,
                                   PARAMS.top_p, PARAMS.max_new_tokens, [EOS])
            for i, (tokens, logprobs) in zip(perm, out):
                assert tokens == expected[i][0]
                # float32 sums over a few layers in another order: about 1e-6 apart
                torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected[i][1]), rtol=1e-5, atol=1e-5)
            # refilled slots: the loop runs as long as list scheduling says, not to each batch's longest row
            assert decoder.decode_steps == _makespan([lengths[i] for i in perm], slots)


def test_steps_between_looks_keep_each_completion():
    """With check_every > 1 rows end between two host looks: an ended row keeps its
    count and writes past its tokens (at its limit into a spare column), so every
    completion still equals the reference, and a freed slot waits at most
    check_every - 1 steps (the loop runs at most that much longer per admission)."""
    model = tiny_qwen3(vocab_size=24, eos_token_id=EOS)
    prompts, seeds = _prompts(14, seed=3)
    expected = [reference_sample(model, p, s, PARAMS) for p, s in zip(prompts, seeds)]
    lengths = [len(tokens) for tokens, _ in expected]
    for every in (3, 8):
        decoder = SlotDecoder(model, 3, 0, DecodeOptions(cuda_graphs=False, key_block=4, check_every=every))
        out = decoder.generate(prompts, seeds, PARAMS.temperature, PARAMS.top_p, PARAMS.max_new_tokens, [EOS])
        for (tokens, logprobs), (want_tokens, want_logprobs) in zip(out, expected):
            assert tokens == want_tokens
            torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), rtol=1e-5, atol=1e-5)
        assert _makespan(lengths, 3) <= decoder.decode_steps <= _makespan(lengths, 3) + (every - 1) * len(prompts)


def test_bucketed_prefills_keep_each_completion():
    """prefill_graphs (run eagerly on the CPU): each admission padded to a power of two
    of rows (the padding rows written to the cache's spare row) and a multiple of 16
    columns gives the reference's completions; the rows' keys start at their pads."""
    model = tiny_qwen3(vocab_size=24, eos_token_id=EOS)
    prompts, seeds = _prompts(14, seed=3)
    expected = [reference_sample(model, p, s, PARAMS) for p, s in zip(prompts, seeds)]
    for slots in (3, 8):
        decoder = SlotDecoder(model, slots, 0, DecodeOptions(cuda_graphs=False, key_block=4, prefill_graphs=True))
        out = decoder.generate(prompts, seeds, PARAMS.temperature, PARAMS.top_p, PARAMS.max_new_tokens, [EOS])
        for (tokens, logprobs), (want_tokens, want_logprobs) in zip(out, expected):
            assert tokens == want_tokens
            torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), rtol=1e-5, atol=1e-5)
        # prompts of at most 9 tokens: one width of 16 columns; 16 + 12 tokens, in blocks of 4
        assert decoder.cache.length == 28 and decoder.cache.keys[0].shape[0] == slots + 1
    assert decoder.graph_captures == 0  # no CUDA graphs on the CPU


def test_a_prefill_writes_the_prompts_keys_into_their_slots():
    """The cache rows a prefill fills hold the keys and values a DynamicCache prefill of
    the same prompt (alone, unpadded) gives, at columns [pad, width); other rows keep
    theirs (zeros)."""
    model = tiny_qwen3(vocab_size=24, eos_token_id=EOS)
    prompts, seeds = [[5, 6, 7], [9, 3, 4, 11, 12]], [1, 2]
    for bucketed in (False, True):
        decoder = SlotDecoder(model, 4, 0, DecodeOptions(cuda_graphs=False, key_block=4, prefill_graphs=bucketed))
        call = DecodeCall(PARAMS.temperature, PARAMS.top_p, PARAMS.max_new_tokens, (EOS,))
        decoder._ensure(4, 32, 32, PARAMS.max_new_tokens)
        decoder._prefill([2, 0], prompts, seeds, call, 4)
        width = 16 if bucketed else 5
        for slot, prompt in zip([2, 0], prompts):
            alone = DynamicCache(config=model.config)
            with torch.no_grad():
                model(input_ids=torch.tensor([prompt]), use_cache=True, **{decoder._cache_arg: alone})
            for layer, (keys, values) in enumerate((lay.keys, lay.values) for lay in alone.layers):
                own = decoder.cache.keys[layer][slot, :, width - len(prompt):width], \
                      decoder.cache.values[layer][slot, :, width - len(prompt):width]
                # float32 attention over the same columns, other kernels' order: about 1e-6 apart
                torch.testing.assert_close(own[0], keys[0], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(own[1], values[0], rtol=1e-5, atol=1e-5)
        assert not decoder.cache.keys[0][[1, 3]].any()
        assert decoder.state.column_cpu[:4] == [width, 0, width, 0] and decoder.state.count_cpu[:4] == [1, 0, 1, 0]


def _nucleus_sizes(scores: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """``[B]`` tokens the definition keeps (``TopPLogitsWarper``)."""
    kept = TopPLogitsWarper(top_p)(None, scores.float() / temperature)
    return (kept > -torch.inf).sum(-1)


def _stable_definition(scores: torch.Tensor, uniforms: torch.Tensor, temperature: float, top_p: float,
                       higher_first: bool = False) -> torch.Tensor:
    """sample_tokens with the warper's sort made stable (among equal logits the lower id is
    removed first, as CUDA's radix sort orders them; ``higher_first``: the higher id):
    ``[B]`` ids."""
    x = scores.float() / temperature
    ascending, ids = torch.sort(x.flip(-1) if higher_first else x, dim=-1, stable=True)
    ids = x.shape[-1] - 1 - ids if higher_first else ids
    remove = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
    remove[:, -1] = False
    x = x.masked_fill(remove.scatter(1, ids, remove), -torch.inf)
    cdf = x.softmax(-1).cumsum(-1)
    return torch.searchsorted(cdf, uniforms * cdf[:, -1:]).clamp(max=x.shape[-1] - 1)[:, 0]


@pytest.mark.parametrize("seed", [0, 1, -7, 2**32, 2**40 + 5, 12345678901234567890, 2**64 + 1, 3**200, -(2**100)])
def test_row_uniforms_are_each_seeds_python_random_stream(seed):
    from mlperf_grpo.inference.sampling import PYTHON_DRAWS_MAX, draw_uniforms, row_streams

    python = random.Random(seed)
    want = torch.tensor([[python.random() for _ in range(300)]], dtype=torch.float32)
    for draws in (300, PYTHON_DRAWS_MAX + 1):  # Python's generator itself; NumPy's set to its state
        streams = row_streams([seed], draws)
        got = torch.cat([draw_uniforms(streams, 1), draw_uniforms(streams, 299)], dim=1)  # the stream goes on
        assert draw_uniforms(streams[:0], 3).shape == (0, 3)
        assert torch.equal(got, want), draws  # the same bits: (a * 2**26 + b) / 2**53 of two MT19937 words


def test_candidate_sampling_gives_the_definitions_token_or_says_it_cannot():
    """Where sample_tokens_from_candidates calls a row exact, its token is sample_tokens'
    (float32 normal logits: no ties) and its log-probability log_softmax's; a row whose
    nucleus is wider than the candidates is flagged, never sampled wrong silently."""
    gen = torch.Generator().manual_seed(0)
    exact_rows = flagged_rows = 0
    for std, temperature, top_p, k in [(1.0, 0.1, 0.95, 16), (3.0, 0.7, 0.9, 64), (0.3, 1.0, 0.5, 256),
                                       (1.0, 1.0, 0.3, 16), (1.0, 0.1, 0.95, 4)]:
        scores = torch.randn(64, 4096, generator=gen) * std
        u = torch.rand(64, 1, generator=gen)
        want, want_logprob = sample_tokens(scores, u, temperature, top_p)
        got, logprob, exact = sample_tokens_from_candidates(scores, u, temperature, top_p, k)
        sizes = _nucleus_sizes(scores, temperature, top_p)
        # no ties: exact iff a removed token is among the k - 1 largest (the k-th might equal
        # one outside, so it proves nothing)
        assert torch.equal(exact, sizes < k - 1)
        assert torch.equal(got[exact], want[exact])
        # float32 x - logsumexp(x) against log_softmax at |x| <= 50: a few ulps of 50 (6e-6)
        torch.testing.assert_close(logprob[exact], want_logprob[exact], rtol=0, atol=2e-5)
        exact_rows, flagged_rows = exact_rows + int(exact.sum()), flagged_rows + int((~exact).sum())
    assert exact_rows > 100 and flagged_rows > 10


def test_candidates_that_are_the_whole_vocabulary_are_always_exact():
    """k >= V: every row is exact, also where the nucleus is the whole vocabulary (equal
    logits) or the removed tokens tie at the smallest value (which proves nothing when
    k < V); the tokens are sample_tokens'. Equal logits give probabilities 1 / V, so the
    token is floor(u x V) away from the rounding boundaries u x V near an integer."""
    vocab = 8
    flat = torch.zeros(4, vocab)
    peaked = torch.zeros(4, vocab)
    peaked[:, 3] = 5.0  # p(3) = e^5 / (e^5 + 7), about 0.95: the nucleus at top-p 0.5 is {3}
    u = torch.tensor([[0.05], [0.3], [0.61], [0.93]])
    for scores, top_p in ((flat, 0.999), (peaked, 0.5)):
        want, want_logprob = sample_tokens(scores, u, 1.0, top_p)
        for k in (vocab, 2 * vocab):
            got, logprob, exact = sample_tokens_from_candidates(scores, u, 1.0, top_p, k)
            assert bool(exact.all()) and torch.equal(got, want)
            torch.testing.assert_close(logprob, want_logprob, rtol=0, atol=1e-6)  # |log p| <= log 8: a few ulps
    assert sample_tokens(flat, u, 1.0, 0.999)[0].flatten().tolist() == [int(x * vocab) for x in u.flatten().tolist()]
    assert not bool(sample_tokens_from_candidates(peaked, u, 1.0, 0.5, vocab - 1)[2].any())  # ties at the k-th value


def test_a_uniform_rounded_to_one_takes_the_last_id_of_positive_probability():
    """float32(random()) is 1.0 for draws above 1 - 2**-25: each sampler then takes the
    last id that can be sampled (here 5, after it only ids of zero probability), never
    one past it. At top-p 0.5 the nucleus is {1, 5} (p about 0.49 each): 5 again."""
    scores = torch.full((1, 300), -torch.inf)
    scores[0, 1], scores[0, 5], scores[0, 2] = 2.0, 2.0, -2.0
    one = torch.ones(1, 1)
    assert int(sample_tokens(scores, one, 1.0, 1.0)[0]) == 5
    assert int(sample_tokens_by_blocks(scores, one, 1.0, block=128)[0]) == 5
    assert int(sample_tokens(scores, one, 1.0, 0.5)[0]) == 5
    chosen, _, exact = sample_tokens_from_candidates(scores, one, 1.0, 0.5, 8)
    assert bool(exact.all()) and int(chosen) == 5


@pytest.mark.parametrize("vocab, block", [(4096, 128), (1000, 128), (300, 512)])
def test_sampling_by_blocks_is_the_inverse_cdf(vocab, block):
    """sample_tokens_by_blocks' token is the inverse CDF of softmax(scores / T) in id
    order at u, computed here in float64 (the first id whose cumulative probability
    reaches u): exactly, except where u lies within 1e-5 of a boundary (float32 sums
    in another order); its log-probability is log_softmax's; u = 0 gives id 0, as the
    definition; and a vocabulary with ids of zero probability never yields one."""
    gen = torch.Generator().manual_seed(vocab)
    rows = 512
    for std, temperature in [(1.0, 1.0), (3.0, 0.7), (0.3, 1.3)]:
        scores = torch.randn(rows, vocab, generator=gen) * std
        u = torch.rand(rows, 1, generator=gen)
        u[0], u[1] = 0.0, 1 - 2**-24
        got, logprob = sample_tokens_by_blocks(scores, u, temperature, block=block)
        cdf = torch.softmax(scores.double() / temperature, dim=-1).cumsum(-1)
        want = torch.searchsorted(cdf, u.double() * cdf[:, -1:]).clamp(max=vocab - 1)
        near = ((cdf - u.double() * cdf[:, -1:]).abs() < 1e-5).any(-1, keepdim=True)
        assert int(near.sum()) < rows // 4  # boundaries about 1 / vocab apart: at most 2e-5 x 4096 = 8% of the rows
        assert torch.equal(got[~near], want[~near])
        assert got[0, 0] == 0
        # float32 x - top - log(sum) against float64 log_softmax at |x| <= 20 / 0.7: a few ulps (1e-5)
        log_softmax = torch.log_softmax(scores.double() / temperature, -1).gather(1, got)
        torch.testing.assert_close(logprob.double(), log_softmax, rtol=0, atol=1e-5)
        # the same token as the definition's float32 arithmetic away from the boundaries
        definition, _ = sample_tokens(scores, u, temperature, 1.0)
        assert torch.equal(got[~near], definition[~near])
    masked = torch.randn(rows, vocab, generator=gen).masked_fill_(torch.rand(rows, vocab, generator=gen) < 0.9,
                                                                  -torch.inf)
    masked[:, 0] = 0.0  # every row has a token to take
    got, logprob = sample_tokens_by_blocks(masked, torch.rand(rows, 1, generator=gen), 1.0, block=block)
    assert bool(torch.isfinite(masked.gather(1, got)).all()) and bool(torch.isfinite(logprob).all())


def test_sampling_by_blocks_survives_rows_of_nan_and_infinite_logits():
    """A row of NaN, +inf or all -inf logits gets some id in range and a NaN
    log-probability (as sample_tokens gives them), and the batch's finite rows are
    sampled as alone: one bad row does not fail the step."""
    gen = torch.Generator().manual_seed(4)
    scores = torch.randn(5, 1000, generator=gen)
    scores[0, 10] = torch.nan
    scores[1, 20] = torch.inf
    scores[2] = -torch.inf
    u = torch.rand(5, 1, generator=gen)
    got, logprob = sample_tokens_by_blocks(scores, u, 1.0)
    assert bool(((got >= 0) & (got < 1000)).all())
    assert bool(torch.isnan(logprob[:3]).all())
    alone, alone_logprob = sample_tokens_by_blocks(scores[3:], u[3:], 1.0)
    assert torch.equal(got[3:], alone) and torch.equal(logprob[3:], alone_logprob)


def test_candidate_sampling_keeps_its_precision_at_a_small_temperature():
    """T = 1e-3 puts the tempered logits near 2.4e4: the token's mass is exp(x - top -
    log(total)) with the two kept apart (one normaliser top + log(total) would round at
    2.4e4's ulp, 2e-3, and move this row's nucleus boundary, 4e-4 from top_p)."""
    scores = torch.linspace(-100.0, -90.0, 256)[None, :].clone()  # distinct: the 64th is below the removed
    scores[0, 0], scores[0, 1] = 24.20554542541504, 24.20261001586914
    u = torch.tensor([[0.99]])
    want, want_logprob = sample_tokens(scores, u, 1e-3, 0.95)
    got, logprob, exact = sample_tokens_from_candidates(scores, u, 1e-3, 0.95, 64)
    assert bool(exact.all()) and torch.equal(got, want) and int(got) == 1
    # float64 from the float32 tempered logits (as the definition tempers them):
    # log p(1) = -d - log(1 + exp(-d)), d = x0 / T - x1 / T, about -2.99
    tempered = (scores[0, :2] / 1e-3).double()
    d = float(tempered[0] - tempered[1])
    torch.testing.assert_close(logprob.double(), torch.tensor([[-d - math.log1p(math.exp(-d))]], dtype=torch.float64),
                               rtol=0, atol=1e-5)
    torch.testing.assert_close(logprob, want_logprob, rtol=0, atol=1e-5)


def test_block_masses_sum_each_blocks_probability_mass():
    """block_masses: the row's largest tempered logit and, per block of ids (the last
    one short), the sum of exp(x - top), here against a float64 loop over the blocks."""
    scores = torch.randn(8, 1000, generator=torch.Generator().manual_seed(2)) * 2
    top, sums = block_masses(scores, 0.5, 128)
    x = scores.double() / 0.5
    assert torch.equal(top, (scores / 0.5).amax(-1, keepdim=True))
    want = torch.stack([torch.exp(x[:, i:i + 128] - x.amax(-1, keepdim=True)).sum(-1) for i in range(0, 1000, 128)], -1)
    assert sums.shape == (8, 8)
    torch.testing.assert_close(sums.double(), want, rtol=1e-6, atol=0)  # 128 float32 terms in (0, 1]


def test_candidate_sampling_orders_equal_logits_as_a_stable_sort():
    """Logits on a coarse grid (many equal values at the nucleus boundary, as bfloat16
    gives): the kept tokens among equals are the higher ids, as the warper's stable
    ascending sort removes the lower ones first."""
    gen = torch.Generator().manual_seed(1)
    scores = (torch.randn(256, 2048, generator=gen) * 4).round() / 4  # std 1 on a grid of 0.25
    u = torch.rand(256, 1, generator=gen)
    got, _, exact = sample_tokens_from_candidates(scores, u, 0.3, 0.9, 128)  # nuclei of about 66 tokens
    assert int(exact.sum()) > 200
    assert torch.equal(got[exact, 0], _stable_definition(scores, u, 0.3, 0.9)[exact])
    # the other order among equals gives other tokens: the ties matter here
    assert not torch.equal(got[exact, 0], _stable_definition(scores, u, 0.3, 0.9, higher_first=True)[exact])


def test_blocks_with_a_nucleus_beyond_the_candidates_run_again_exactly():
    """top_p_candidates of 3 (of a vocabulary of 24): the first block has a row whose
    nucleus is wider, it runs again with sample_tokens, the call's later blocks take
    twice as many candidates (3, 6, 12, 24: at most three blocks of 3 steps run again),
    and every completion is the reference's; 24 candidates (the vocabulary) hold the
    nuclei of this model, so no block runs again."""
    model = tiny_qwen3(vocab_size=24, eos_token_id=EOS)
    prompts, seeds = _prompts(14, seed=3)
    expected = [reference_sample(model, p, s, PARAMS) for p, s in zip(prompts, seeds)]
    reruns = {}
    for k in (3, 24):
        decoder = SlotDecoder(model, 3, 0, DecodeOptions(cuda_graphs=False, key_block=4, check_every=3,
                              top_p_candidates=k))
        out = decoder.generate(prompts, seeds, PARAMS.temperature, PARAMS.top_p, PARAMS.max_new_tokens, [EOS])
        for (tokens, logprobs), (want_tokens, want_logprobs) in zip(out, expected):
            assert tokens == want_tokens
            torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), rtol=1e-5, atol=1e-5)
        reruns[k] = (decoder.rerun_steps, decoder._candidates)
    assert 0 < reruns[3][0] <= 9 and reruns[3][1] == 3 * 2 ** (reruns[3][0] // 3)
    assert reruns[24] == (0, 24)


def test_slot_decoding_equals_generate_on_the_builtin_model():
    generate = HFEngine("builtin:arithmetic-tiny", "float32", batch_size=16, decode="generate")
    slots = HFEngine.from_model(generate.model, generate.tokenizer, batch_size=16, decode="slots")
    prompts = [f"{a}+{b}=" for a in range(10, 99, 17) for b in range(15, 99, 19)]
    seeds = list(range(100, 100 + len(prompts)))
    for params in (SamplingParams(1.0, 1.0, 8), SamplingParams(0.1, 0.95, 8)):
        old = generate.generate(prompts, params, seeds)
        new = slots.generate(prompts, params, seeds)
        assert [c.token_ids for c in new] == [c.token_ids for c in old]
        assert [c.text for c in new] == [c.text for c in old]
        for a, b in zip(new, old):  # float32, 2 layers: the kernels' summation order only
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-5, atol=1e-5)
        # the counts of the call: 25 prompts through 16 refilled slots, the steps of list
        # scheduling (no graphs on the CPU, no candidates)
        steps = _makespan([len(c.token_ids) for c in new], 16)
        stats = slots.generation_stats()
        assert stats.pop("prefill_ms") > 0
        # the first 16 admitted together, then the other 9 in at least one admission, at most one each
        assert 2 <= stats.pop("prefills") <= 1 + 9
        # the CPU: no budget, the cache allocated at full length once (16 slots, prompts + 8 in 64 columns)
        shapes, dtype = slots._decoder._layout()
        assert slots._decoder.cache.length == 64
        assert stats == {"decode_steps": steps, "rerun_steps": 0, "graph_captures": 0, "cache_grows": 0,
                         "preempted": 0, "kv_cache_peak_bytes": cache_bytes(shapes, 16, 64, dtype)}
        assert generate.generation_stats() == {}


def test_one_token_completions_take_no_decode_step():
    """max_new_tokens 1: every token comes from a prefill (8 prompts through 4 slots, two
    admissions), no forward pass after them; an empty call then resets the counts."""
    model = tiny_qwen3(vocab_size=24, eos_token_id=EOS)
    prompts, seeds = _prompts(8, seed=6)
    decoder = SlotDecoder(model, 4, 0, DecodeOptions(cuda_graphs=False, key_block=4))
    out = decoder.generate(prompts, seeds, 1.0, 1.0, 1, [EOS])
    assert [len(tokens) for tokens, _ in out] == [1] * 8
    assert [t for t, _ in out] == [reference_sample(model, p, s, SamplingParams(1.0, 1.0, 1))[0]
                                   for p, s in zip(prompts, seeds)]
    assert (decoder.decode_steps, decoder.prefills) == (0, 2)
    assert decoder.generate([], [], 1.0, 1.0, 4, [EOS]) == []
    assert (decoder.decode_steps, decoder.prefills, decoder.prefill_ms) == (0, 0, 0.0)


def test_cpu_keeps_generate_by_default():
    """The CPU calibration's completions come from generate, as before."""
    engine = HFEngine("builtin:arithmetic-tiny", "float32", batch_size=4)
    assert engine.describe()["engine"] == "transformers.generate"
    assert engine.describe()["cuda_graphs"] is False


def test_hybrid_linear_attention_models_keep_generate():
    config = Qwen3_5MoeTextConfig(
        vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"],
    )
    with torch.device("meta"):
        model = Qwen3_5MoeForCausalLM(config)
    assert not supports_slot_decoding(model)
    assert supports_slot_decoding(tiny_qwen3(vocab_size=24, eos_token_id=EOS))
    with pytest.raises(ValueError, match="decode='generate'"):
        HFEngine.from_model(model, batch_size=2, decode="slots")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graph_replays_give_the_eager_steps():
    model = tiny_qwen3(vocab_size=24, eos_token_id=EOS).cuda()
    prompts, seeds = _prompts(40, seed=11)
    runs = {}
    for graphs in (False, True):
        # the same schedule (looks every 4 steps): buckets and compaction as in the graphs
        decoder = SlotDecoder(model, 16, 0, DecodeOptions(cuda_graphs=graphs, key_block=8, check_every=4,
                              fused_kernels=False))
        for _ in range(2):  # the second call replays the graphs the first captured
            runs[graphs] = decoder.generate(prompts, seeds, PARAMS.temperature, PARAMS.top_p,
                                            PARAMS.max_new_tokens, [EOS])
    assert runs[True] == runs[False]  # the same kernels, replayed: bit for bit
    cpu_model = tiny_qwen3(vocab_size=24, eos_token_id=EOS)  # the same weights (seed 0), on the CPU
    for (tokens, _), prompt, seed in zip(runs[True], prompts, seeds):
        assert tokens == reference_sample(cpu_model, prompt, seed, PARAMS)[0]
    assert HFEngine.from_model(model, batch_size=8).describe()["cuda_graphs"] is True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graph_replays_run_a_block_again_as_the_eager_steps():
    """With 3 candidates of 24 a block runs again: graphs (keyed by how they sample) give
    the eager steps' completions."""
    model = tiny_qwen3(vocab_size=24, eos_token_id=EOS).cuda()
    prompts, seeds = _prompts(40, seed=11)
    runs = {}
    for graphs in (False, True):
        decoder = SlotDecoder(model, 16, 0, DecodeOptions(cuda_graphs=graphs, key_block=8, check_every=4,
                              top_p_candidates=3, fused_kernels=False))
        for _ in range(2):  # the second call replays the graphs the first captured
            runs[graphs] = decoder.generate(prompts, seeds, PARAMS.temperature, PARAMS.top_p,
                                            PARAMS.max_new_tokens, [EOS])
            assert decoder.rerun_steps > 0
    assert runs[True] == runs[False]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_captured_prefills_give_the_eager_bucketed_prefills():
    """prefill_graphs with CUDA graphs: each bucket's prefill is captured once (the first
    call) and replayed (the second captures nothing), bit for bit the eager bucketed
    prefill's completions, and the reference's tokens."""
    model = tiny_qwen3(vocab_size=24, eos_token_id=EOS).cuda()
    prompts, seeds = _prompts(40, seed=11)
    runs, captures = {}, {}
    for graphs in (False, True):
        decoder = SlotDecoder(model, 16, 0, DecodeOptions(cuda_graphs=True, key_block=8, check_every=4,
                              fused_kernels=False, prefill_graphs=True))
        if not graphs:  # the same buckets, prefills run eagerly
            decoder._capture_prefill = lambda call, inputs: decoder._prefill_body(call, inputs)
        for call in range(2):
            runs[graphs] = decoder.generate(prompts, seeds, PARAMS.temperature, PARAMS.top_p,
                                            PARAMS.max_new_tokens, [EOS])
            captures[graphs, call] = len(decoder._prefill_graphs)
        assert decoder.prefill_graphs  # not turned off
    assert runs[True] == runs[False]
    assert captures[True, 0] > 0 and captures[True, 1] == captures[True, 0] and captures[False, 1] == 0
    cpu_model = tiny_qwen3(vocab_size=24, eos_token_id=EOS)
    for (tokens, _), prompt, seed in zip(runs[True], prompts, seeds):
        assert tokens == reference_sample(cpu_model, prompt, seed, PARAMS)[0]


def _fail_when_captured(body):
    """``body`` that, inside a CUDA graph capture only, then copies from pageable host
    memory (which a capture refuses): a capture that fails as a real one can, after
    capturing some work."""
    def failing(*args):
        out = body(*args)
        if torch.cuda.is_current_stream_capturing():
            torch.ones(1).to("cuda")
        return out
    return failing


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("failing", ["prefill", "step"])
def test_a_failed_capture_falls_back_in_one_warning(failing):
    """A prefill or decode-step capture that fails turns its graphs off with one warning
    and the calls (this one and the next) give the completions of the decoder without
    them; later captures take a new memory pool (a capture into the pool of a dropped
    graph fails the caching allocator's assertion)."""
    model = tiny_qwen3(vocab_size=24, eos_token_id=EOS).cuda()
    prompts, seeds = _prompts(40, seed=13)
    eager = SlotDecoder(model, 16, 0, DecodeOptions(cuda_graphs=False, key_block=8, check_every=4,
                                                   fused_kernels=False, prefill_graphs=True))
    want = eager.generate(prompts, seeds, PARAMS.temperature, PARAMS.top_p, PARAMS.max_new_tokens, [EOS])
    decoder = SlotDecoder(model, 16, 0, DecodeOptions(cuda_graphs=True, key_block=8, check_every=4,
                                                     fused_kernels=False, prefill_graphs=True))
    name = "_prefill_body" if failing == "prefill" else "_step_body"
    setattr(decoder, name, _fail_when_captured(getattr(decoder, name)))
    with pytest.warns(RuntimeWarning) as caught:
        for _ in range(2):
            got = decoder.generate(prompts, seeds, PARAMS.temperature, PARAMS.top_p, PARAMS.max_new_tokens, [EOS])
            assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
            # after the fallback, prefills are padded to their longest, not to a bucket: float32
            # sums over other shapes, about 1e-6 apart
            for (_, logprobs), (_, expected) in zip(got, want):
                torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected), rtol=1e-5, atol=1e-5)
    ours = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(ours) == 1 and "turned off" in ours[0] and "\n" not in ours[0], ours
    assert not decoder.prefill_graphs
    assert decoder.cuda_graphs == (failing == "prefill")
    if failing == "prefill":
        assert decoder._graphs  # the decode steps captured after it, into a new pool
