"""The slot decoder's growing KV cache (inference/decode.py, slot_state.SlotCache.grow):
the same completions as a cache allocated at full length, and a peak that follows the
live rows' lengths, not slots x the longest possible row."""

import random

import pytest
import torch
from test_generation import EOS, tiny_qwen3

from mlperf_grpo.inference.decode import DecodeOptions, SlotDecoder
from mlperf_grpo.inference.slot_state import cache_bytes

GROW = 1
"""A budget (``kv_cache_bytes``) no full-length cache fits: the cache always grows."""


def _long_tail(n: int = 48) -> tuple[list[list[int]], list[int]]:
    """Prompts of 1 to 9 tokens whose completions (temperature 1, EOS 2 of 24 ids: about
    1 in 24 stops a row) are mostly short, one runs past 100 tokens (checked by the tests)."""
    gen = random.Random(2)
    prompts = [[gen.randrange(3, 24) for _ in range(gen.randint(1, 9))] for _ in range(n)]
    return prompts, [gen.getrandbits(63) for _ in prompts]


def _decoder(model, slots: int, budget: int | None, **options) -> SlotDecoder:
    return SlotDecoder(model, slots, 0, DecodeOptions(cuda_graphs=False, key_block=4, kv_cache_bytes=budget, **options))


@pytest.mark.parametrize("slots, options, top_p, length, grows", [
    # all admitted at once: compaction, then growth over the live rows only (16, 32, 64, 112 columns)
    (48, {"check_every": 4}, 1.0, 112, 3),
    # refilled slots: growth while prompts wait; prefills 16 columns wide (32, 64, 116)
    (12, {"check_every": 1, "prefill_graphs": True}, 1.0, 116, 2),
    # blocks run again (3 candidates) around growths
    (16, {"check_every": 3, "top_p_candidates": 3}, 0.9, 112, 3),
])
def test_a_growing_cache_gives_the_full_length_caches_completions(slots, options, top_p, length, grows):
    """Rows ending at EOS early, one at the limit (100 tokens): a cache that starts at the
    first block's columns and doubles up to the call's (9-token prompts + 100, in blocks
    of 4) gives the tokens and log-probabilities of one allocated at full length at once,
    bit for bit (the same columns, read by the same kernels), twice in a row (the second
    call starts from the first one's cache, or again where that holds fewer rows)."""
    model = tiny_qwen3(vocab_size=24, eos_token_id=EOS)
    prompts, seeds = _long_tail()
    static = _decoder(model, slots, None, **options)
    want = static.generate(prompts, seeds, 1.0, top_p, 100, [EOS])
    lengths = sorted(len(tokens) for tokens, _ in want)
    assert lengths[len(lengths) // 2] < 25 and lengths[-1] == 100 and lengths[-2] < 100, lengths
    assert static.cache_grows == 0 and static.cache.length == length
    grown = _decoder(model, slots, GROW, **options)
    for call in range(2):
        got = grown.generate(prompts, seeds, 1.0, top_p, 100, [EOS])
        assert got == want
        # the second call reuses the first one's cache where it holds the slots (refilled: all 12)
        assert grown.cache_grows == (grows if call == 0 or slots == 48 else 0) and grown.cache.length == length
    if options.get("top_p_candidates"):
        assert static.rerun_steps > 0 and grown.rerun_steps == static.rerun_steps


def test_the_grown_cache_holds_the_live_rows_not_every_slot():
    """48 rows, a few of which run long (up to 400 new tokens; the longest stops at EOS
    after about 110): the cache's tensors at their largest (counted at every block of
    steps, and inside each growth with the one old tensor not yet freed) stay a small
    part of 48 rows at full length, and once the cache is at its widest it holds the
    few live rows (a bucket of at most 4 and the spare row), not 48."""
    model = tiny_qwen3(vocab_size=24, eos_token_id=EOS)
    prompts, seeds = _long_tail()
    decoder = _decoder(model, 48, GROW, check_every=4)
    seen = []  # per block: (rows the step runs, live rows, cache rows, cache columns, cache tensors' bytes)
    run_block = decoder._run_block

    def counted(call, rows, key_length, steps, exact):
        cache = decoder.cache
        live = int((~decoder.state.done[:rows]).sum())
        seen.append((rows, live, cache.slots, cache.length, sum(t.nbytes for t in (*cache.keys, *cache.values))))
        return run_block(call, rows, key_length, steps, exact)

    decoder._run_block = counted
    out = decoder.generate(prompts, seeds, 1.0, 1.0, 400, [EOS])
    assert max(len(t) for t, _ in out) < 400  # every row stopped at EOS
    shapes, dtype = decoder._layout()
    full = cache_bytes(shapes, 48, decoder.state.length, dtype)  # 49 rows x 413 columns
    assert decoder.state.length == 412
    widest = max(length for *_, length, _ in seen)
    assert widest == 128 and decoder.cache_grows == 3  # 16, 32, 64, 128: the longest row's columns
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
    prompts, seeds = _long_tail(16)
    decoder = _decoder(model, 16, None, check_every=4)
    decoder.generate(prompts, seeds, 1.0, 1.0, 100, [EOS])
    shapes, dtype = decoder._layout()
    full = cache_bytes(shapes, 16, decoder.cache.length, dtype)
    budgeted = _decoder(model, 16, full, check_every=4)
    first = budgeted.generate(prompts, seeds, 1.0, 1.0, 100, [EOS])
    cache = budgeted.cache
    assert budgeted.generate(prompts, seeds, 1.0, 1.0, 100, [EOS]) == first
    assert budgeted.cache is cache and budgeted.cache_grows == 0 and budgeted.kv_cache_peak_bytes == full
    smaller = _decoder(model, 16, full - 1, check_every=4)
    assert smaller.generate(prompts, seeds, 1.0, 1.0, 100, [EOS]) == first and smaller.cache_grows > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and memory statistics need a CUDA device")
def test_growth_on_cuda_drops_the_graphs_and_lowers_the_peak():
    """On CUDA with graphs: the growing cache's completions equal the eager full-length
    cache's (graphs captured on freed tensors are dropped and captured again), and the
    device's peak allocated memory of the call is below the full-length cache's bytes."""
    model = tiny_qwen3(vocab_size=24, eos_token_id=EOS).cuda()
    prompts, seeds = _long_tail()
    options = DecodeOptions(cuda_graphs=False, key_block=8, check_every=4, fused_kernels=False)
    want = SlotDecoder(model, 48, 0, options).generate(prompts, seeds, 1.0, 1.0, 400, [EOS])
    decoder = SlotDecoder(model, 48, 0, DecodeOptions(cuda_graphs=True, key_block=8, check_every=4,
                                                      fused_kernels=False, kv_cache_bytes=GROW))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    got = decoder.generate(prompts, seeds, 1.0, 1.0, 400, [EOS])
    peak = torch.cuda.max_memory_allocated() - start
    assert [t for t, _ in got] == [t for t, _ in want] and decoder.cache_grows >= 3 and decoder.graph_captures > 0
    shapes, dtype = decoder._layout()
    assert peak < cache_bytes(shapes, 48, decoder.state.length, dtype) / 2
