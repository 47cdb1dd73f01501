"""The slot decoder's growing KV cache (inference/decode.py, slot_state.SlotCache.grow):
the same completions as a cache allocated at full length, and a peak that follows the
live rows' lengths, not slots x the longest possible row."""

import random

import pytest
import torch
from test_generation import EOS, tiny_qwen3

from mlperf_grpo.inference.decode import DecodeOptions, SlotDecoder
from mlperf_grpo.inference.slot_schedule import KVCacheBudgetError
from mlperf_grpo.inference.slot_state import SlotCache, cache_bytes

def _long_tail(n: int = 48) -> tuple[list[list[int]], list[int]]:
    """Prompts of 1 to 9 tokens whose completions (temperature 1, EOS 2 of 24 ids: about
    1 in 24 stops a row) are mostly short, one runs past 100 tokens (checked by the tests)."""
    gen = random.Random(2)
    prompts = [[gen.randrange(3, 24) for _ in range(gen.randint(1, 9))] for _ in range(n)]
    return prompts, [gen.getrandbits(63) for _ in prompts]


def _decoder(model, slots: int, budget: int | None, **options) -> SlotDecoder:
    return SlotDecoder(model, slots, 0, DecodeOptions(cuda_graphs=False, key_block=4, kv_cache_bytes=budget, **options))


def _full_length(model, slots: int, max_new_tokens: int, top_p: float, **options):
    """The completions of a cache allocated at full length (no budget), and its bytes."""
    prompts, seeds = _long_tail()
    static = _decoder(model, slots, None, **options)
    out = static.generate(prompts, seeds, 1.0, top_p, max_new_tokens, [EOS])
    assert static.cache_grows == 0 and static.kv_cache_peak_bytes == static.cache.nbytes
    return out, static.cache.nbytes


@pytest.mark.parametrize("slots, options, top_p, max_new_tokens, grows", [
    # all admitted at once: compaction, then growth over the live rows only (16, 32, 64, 112
    # columns); rows ending at EOS early, one at the limit
    (48, {"check_every": 4}, 1.0, 100, 3),
    # refilled slots: growth while prompts wait; prefills 16 columns wide (32, 64, 128)
    (12, {"check_every": 1, "prefill_graphs": True}, 1.0, 400, 2),
    # blocks run again (3 candidates) around growths (16, 32, 64, 128)
    (16, {"check_every": 3, "top_p_candidates": 3}, 0.9, 400, 3),
])
def test_a_growing_cache_gives_the_full_length_caches_completions(slots, options, top_p, max_new_tokens, grows):
    """A budget 1 byte short of the full-length cache: the cache starts at the first
    block's columns and doubles (9-token prompts, columns in blocks of 4), and gives the
    tokens and log-probabilities of one allocated at full length at once, bit for bit
    (the same columns, read by the same kernels), twice in a row (the second call starts
    from the first one's cache, or again where that holds fewer rows); no row is
    preempted (the budget holds every growth)."""
    model = tiny_qwen3(vocab_size=24, eos_token_id=EOS)
    want, full = _full_length(model, slots, max_new_tokens, top_p, **options)
    lengths = sorted(len(tokens) for tokens, _ in want)
    assert lengths[len(lengths) // 2] < 25 and lengths[-1] > 4 * lengths[len(lengths) // 2], lengths
    assert (lengths[-1] == max_new_tokens) is (max_new_tokens == 100), lengths
    grown = _decoder(model, slots, full - 1, **options)
    prompts, seeds = _long_tail()
    for call in range(2):
        got = grown.generate(prompts, seeds, 1.0, top_p, max_new_tokens, [EOS])
        assert got == want and grown.preempted == 0
        assert grown.cache_grows == (grows if call == 0 or slots == 48 else 0)
    if options.get("top_p_candidates"):
        assert grown.rerun_steps > 0


@pytest.mark.parametrize("slots, options, top_p, fraction, chunk", [
    (48, {"check_every": 4}, 1.0, 0.25, 1024),
    (12, {"check_every": 1, "prefill_graphs": True}, 1.0, 0.5, 16),  # resumed prefills of several chunks
    (16, {"check_every": 3, "top_p_candidates": 3}, 0.9, 0.5, 7),
])
def test_a_budget_too_small_for_the_live_rows_preempts_and_resumes_them(slots, options, top_p, fraction, chunk,
                                                                        monkeypatch):
    """A budget of a fraction of the full-length cache: growths preempt the live rows of
    fewest columns (their prompt and tokens prefilled again when a slot frees, sampling
    on at their next uniform) and copy the kept rows through host memory where the new
    tensors beside the old would not fit; the cache never holds more than the budget
    (with what a growth holds at once), and every completion is the full-length cache's:
    the same tokens, the log-probabilities within 1e-5 (keys and values recomputed by a
    prefill: float32 sums over at most 112 columns in another order, a few ulps through
    2 layers), also where a resumed row's prefill runs in chunks of ``chunk`` columns
    (7: the fresh 8- and 9-token prompts too)."""
    model = tiny_qwen3(vocab_size=24, eos_token_id=EOS)
    want, full = _full_length(model, slots, 100, top_p, **options)
    budget = int(full * fraction)
    decoder = _decoder(model, slots, budget, prefill_chunk=chunk, **options)
    prompts, seeds = _long_tail()
    staged, grow = [], SlotCache.grow
    monkeypatch.setattr(SlotCache, "grow", lambda cache, rows, length, stage=False: staged.append(stage) or
                        grow(cache, rows, length, stage))
    got = decoder.generate(prompts, seeds, 1.0, top_p, 100, [EOS])
    assert decoder.preempted > 0 and decoder.kv_cache_peak_bytes <= budget and any(staged)
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, logprobs), (_, expected) in zip(got, want):
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected), rtol=1e-5, atol=1e-5)


def test_a_budget_that_holds_no_row_is_one_line():
    model = tiny_qwen3(vocab_size=24, eos_token_id=EOS)
    prompts, seeds = _long_tail()
    with pytest.raises(KVCacheBudgetError) as err:
        _decoder(model, 48, 1000).generate(prompts, seeds, 1.0, 1.0, 100, [EOS])
    assert "holds no row of 16 columns" in str(err.value) and "\n" not in str(err.value)


def test_the_grown_cache_holds_the_live_rows_not_every_slot():
    """48 rows, a few of which run long (up to 400 new tokens; the longest stops at EOS
    after about 110): the cache's tensors at their largest (counted at every block of
    steps, and inside each growth with the one old tensor not yet freed) stay a small
    part of 48 rows at full length, and once the cache is at its widest it holds the
    few live rows (a bucket of at most 4 and the spare row), not 48."""
    model = tiny_qwen3(vocab_size=24, eos_token_id=EOS)
    prompts, seeds = _long_tail()
    shapes, dtype = _decoder(model, 1, None)._layout()
    full = cache_bytes(shapes, 48, 412, dtype)  # 49 rows x 413 columns: 9-token prompts + 400
    decoder = _decoder(model, 48, full - 1, check_every=4)
    seen = []  # per block: (rows the step runs, live rows, cache rows, cache columns, cache tensors' bytes)
    run_block = decoder._run_block

    def counted(call, rows, key_length, steps, exact):
        cache = decoder.cache
        live = int((~decoder.state.done[:rows]).sum())
        seen.append((rows, live, cache.slots, cache.length, sum(t.nbytes for t in (*cache.keys, *cache.values))))
        return run_block(call, rows, key_length, steps, exact)

    decoder._run_block = counted
    out = decoder.generate(prompts, seeds, 1.0, 1.0, 400, [EOS])
    assert max(len(t) for t, _ in out) < 400 and decoder.state.length == 412  # every row stopped at EOS
    widest = max(length for *_, length, _ in seen)
    assert widest == 128 and decoder.cache_grows == 3 and decoder.preempted == 0  # 16, 32, 64, 128 columns
    assert all(rows <= 4 and live <= 4 for _, live, rows, length, _ in seen if length == widest)
    observed = max(nbytes for *_, nbytes in seen)
    # the largest moment: the growth to 64 columns (19 rows live, compacted into a bucket of
    # 32) while one of the 2 layers x keys/values old tensors (48 rows x 32 columns) is copied
    peak = cache_bytes(shapes, 32, 64, dtype) + cache_bytes(shapes, 48, 32, dtype) // 4
    assert observed <= decoder.kv_cache_peak_bytes == peak < full / 7
    for rows, live, cache_rows, length, nbytes in seen:  # the step's rows in the cache, counted as cache_bytes
        assert live <= rows <= cache_rows and nbytes == cache_bytes(shapes, cache_rows, length, dtype)


def test_a_cache_that_fits_the_budget_is_allocated_at_full_length_once():
    """A budget that holds every slot at full length: one allocation, no growth, and the
    second call reuses the cache (nothing allocated or captured again)."""
    model = tiny_qwen3(vocab_size=24, eos_token_id=EOS)
    want, full = _full_length(model, 48, 100, 1.0, check_every=4)
    budgeted = _decoder(model, 48, full, check_every=4)
    prompts, seeds = _long_tail()
    assert budgeted.generate(prompts, seeds, 1.0, 1.0, 100, [EOS]) == want
    cache = budgeted.cache
    assert budgeted.generate(prompts, seeds, 1.0, 1.0, 100, [EOS]) == want
    assert budgeted.cache is cache and budgeted.cache_grows == 0 and budgeted.kv_cache_peak_bytes == full


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and memory statistics need a CUDA device")
@pytest.mark.parametrize("max_new_tokens, fraction", [(400, 1.0), (100, 0.25)])
def test_growth_on_cuda_drops_the_graphs_and_lowers_the_peak(max_new_tokens, fraction):
    """On CUDA with graphs: the growing cache's tokens (growth alone; growth and
    preemption) equal the eager full-length cache's (graphs captured on freed tensors are
    dropped and captured again); the decoder's count of its cache at its largest stays
    below half the full-length cache (and within the budget), and the device's peak
    allocated memory during the call is that count but for at most 1 MiB (the slots'
    state, the steps' activations, the graphs' pool of this 2-layer model)."""
    model = tiny_qwen3(vocab_size=24, eos_token_id=EOS).cuda()
    prompts, seeds = _long_tail()
    eager = SlotDecoder(model, 48, 0, DecodeOptions(cuda_graphs=False, key_block=8, check_every=4,
                                                    fused_kernels=False, kv_cache_bytes=1 << 40))
    want = eager.generate(prompts, seeds, 1.0, 1.0, max_new_tokens, [EOS])
    full = eager.cache.nbytes
    decoder = SlotDecoder(model, 48, 0, DecodeOptions(cuda_graphs=True, key_block=8, check_every=4,
                                                      fused_kernels=False, kv_cache_bytes=int(full * fraction) - 1))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    got = decoder.generate(prompts, seeds, 1.0, 1.0, max_new_tokens, [EOS])
    peak = torch.cuda.max_memory_allocated() - start
    assert [t for t, _ in got] == [t for t, _ in want] and decoder.cache_grows >= 2 and decoder.graph_captures > 0
    assert (decoder.preempted > 0) is (fraction < 1) and decoder.kv_cache_peak_bytes < full * min(fraction, 0.5)
    assert decoder.kv_cache_peak_bytes <= peak < decoder.kv_cache_peak_bytes + (1 << 20), (peak, full)
