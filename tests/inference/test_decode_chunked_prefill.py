"""A fresh prompt longer than ``prefill_chunk`` (inference/decode.py ``_admit``) is
prefilled alone in chunks, through the path a preempted row resumes by
(slot_prefill.py ``_chunked_ops``): the same tokens as one prefill of every prompt, and
an attention mask of the chunk's rows, not the long prompt's ``[W, W]``; the planner's
prefill bytes (plan/sequences.py ``prefill_bytes``) hold what a prefill allocates."""

import random

import pytest
import torch
from test_generation import EOS, reference_sample, tiny_qwen3
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import Qwen3Config, Qwen3ForCausalLM

from mlperf_grpo.inference.base import SamplingParams
from mlperf_grpo.inference.decode import DecodeOptions, SlotDecoder
from mlperf_grpo.plan import sequences

LONG = 300
"""Tokens of the long prompt (the short ones have 1 to 9)."""


def _prompts() -> tuple[list[list[int]], list[int]]:
    """Seven short prompts and one of :data:`LONG` tokens, third in line (admitted with
    short ones in the first prefill, 4 slots)."""
    gen = random.Random(5)
    prompts = [[gen.randrange(3, 24) for _ in range(gen.randint(1, 9))] for _ in range(8)]
    prompts[2] = [gen.randrange(3, 24) for _ in range(LONG)]
    return prompts, [gen.getrandbits(63) for _ in prompts]


def _generate(model, chunk: int, masks: list, **options) -> list[tuple[list[int], list[float]]]:
    """The completions of 4 slots with ``prefill_chunk`` ``chunk``; every prefill's
    attention mask shape appended to ``masks`` (a forward with more than one position)."""
    def seen(module, args, kwargs):
        if kwargs["input_ids"].shape[1] > 1:
            masks.append(tuple(kwargs["attention_mask"].shape))

    hook = model.register_forward_pre_hook(seen, with_kwargs=True)
    try:
        decoder = SlotDecoder(model, 4, 0, DecodeOptions(key_block=4, prefill_chunk=chunk, **options))
        prompts, seeds = _prompts()
        return decoder.generate(prompts, seeds, 1.0, 1.0, 12, [EOS])
    finally:
        hook.remove()


@pytest.mark.parametrize("options", [{}, {"prefill_graphs": True}])
def test_a_long_prompt_prefilled_in_chunks_gives_one_prefills_tokens(options):
    """Chunks of 16 columns (the long prompt alone in 19 chunks, the short ones batched
    as before; bucketed with ``prefill_graphs``) against a chunk larger than every prompt
    (the first 4 prompts in one ``[4, 1, 300, 300]`` mask): the same tokens, equal to a
    one-row full-forward reference's for the long prompt, and log-probabilities within
    1e-5 (float32 sums over at most 312 columns in another order, a few ulps through 2
    layers). Every mask of the chunked run has at most 16 query rows: none is the long
    prompt's ``[300, 300]``."""
    model = tiny_qwen3(vocab_size=24, eos_token_id=EOS)
    whole, chunked = [], []
    want = _generate(model, 4096, whole, **options)
    got = _generate(model, 16, chunked, **options)
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, logprobs), (_, expected) in zip(got, want):
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected), rtol=1e-5, atol=1e-5)
    prompts, seeds = _prompts()
    assert got[2][0] == reference_sample(model, prompts[2], seeds[2], SamplingParams(1.0, 1.0, 12))[0]
    assert any(shape[-2] == shape[-1] >= LONG for shape in whole)  # the one prefill: the long prompt's width
    assert all(shape[-2] <= 16 and shape[-1] <= LONG + 12 for shape in chunked), chunked
    assert {(1, 1, 16, 16), (1, 1, 16, 288), (1, 1, LONG - 288, LONG)} <= set(chunked)


def test_a_prefill_chunk_below_one_is_refused():
    with pytest.raises(ValueError, match="prefill_chunk 0"):
        SlotDecoder(tiny_qwen3(vocab_size=24, eos_token_id=EOS), 4, 0, DecodeOptions(prefill_chunk=0))


class LiveBytes(TorchDispatchMode):
    """The most bytes of tensor storages made inside at once (each op's new outputs,
    counted until freed: ``StorageWeakRef``), after each op."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live = {ptr: v for ptr, v in self.live.items() if not v[0].expired()}
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            storage = t.untyped_storage() if isinstance(t, torch.Tensor) else None
            if storage is not None and storage.data_ptr() not in given | self.live.keys():
                self.live[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def _prefill_peak(model, rows: int, prompt: int, chunk: int) -> int:
    """The most bytes a prefill of ``rows`` prompts of ``prompt`` tokens allocates at once
    (its cache written in place, not counted)."""
    gen = random.Random(1)
    prompts = [[gen.randrange(3, model.config.vocab_size) for _ in range(prompt)] for _ in range(rows)]
    decoder = SlotDecoder(model, rows, 0, DecodeOptions(key_block=4, prefill_chunk=chunk))
    peaks = []
    for name in ("_prefill_ops", "_chunked_ops"):
        def counted(*args, ops=getattr(decoder, name)):
            with LiveBytes() as live:
                ops(*args)
            peaks.append(live.peak)
        setattr(decoder, name, counted)
    decoder.generate(prompts, list(range(rows)), 1.0, 1.0, 1, [])
    return max(peaks)


def test_the_planned_prefill_bytes_hold_what_a_prefill_allocates():
    """``plan.sequences.prefill_bytes`` against the live bytes counted in the prefill of a
    2-layer float32 Qwen3 (H 128, I 384, 4 heads of 32, 2 KV heads): rows together, a
    long prompt alone in chunks, and one prefill of it: the plan is an upper bound
    (it sums a layer's tensors that are not all alive at once) within 40%. Chunks of 64
    columns allocate under a quarter of one 600-column prefill (its [600, 600] mask)."""
    dims = dict(vocab_size=512, hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, num_hidden_layers=2)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(max_position_embeddings=1024, pad_token_id=0, **dims)).float().eval()
    peaks = {}
    for rows, prompt, chunk in ((4, 64, 1024), (1, 600, 64), (1, 600, 1024)):
        peaks[chunk, prompt] = got = _prefill_peak(model, rows, prompt, chunk)
        planned = sequences.prefill_bytes({"model_type": "qwen3", **dims}, rows, prompt, 4, chunk=chunk)
        assert got <= planned <= 1.4 * got, (rows, prompt, chunk)
    assert peaks[64, 600] < peaks[1024, 600] / 4


@pytest.mark.parametrize("chunk, max_new_tokens", [(8, 6), (8, 1), (1, 6)])
def test_prompts_at_the_chunk_take_the_batched_prefill_and_longer_ones_the_chunked(chunk, max_new_tokens):
    """Prompts of ``chunk`` - 1, ``chunk`` and ``chunk`` + 1 tokens (and 3 ``chunk``, and 1)
    through 2 slots, so rows wait and a long prompt is admitted alone when a slot frees:
    exactly those over ``chunk`` are prefilled in chunks (a chunk of 1: every prompt of
    more than one token), and every completion is a one-row full-forward reference's
    (float32: the same tokens; log-probabilities within 1e-5, as above), at one new token
    too (the chunked path's first token ends the row)."""
    model = tiny_qwen3(vocab_size=24, eos_token_id=EOS)
    gen = random.Random(3)
    prompts = [[gen.randrange(3, 24) for _ in range(n)] for n in (3 * chunk, chunk - 1 or 2, chunk, chunk + 1, 1)]
    seeds = [gen.getrandbits(63) for _ in prompts]
    decoder = SlotDecoder(model, 2, 0, DecodeOptions(key_block=4, prefill_chunk=chunk, check_every=2))
    alone, chunked_ops = [], decoder._chunked_ops
    decoder._chunked_ops = lambda slot, prompt, row, *args: (alone.append(len(prompt)),
                                                             chunked_ops(slot, prompt, row, *args))
    got = decoder.generate(prompts, seeds, 1.0, 1.0, max_new_tokens, [EOS])
    assert sorted(alone) == sorted(len(p) for p in prompts if len(p) > chunk)
    for prompt, seed, (tokens, logprobs) in zip(prompts, seeds, got):
        want, expected = reference_sample(model, prompt, seed, SamplingParams(1.0, 1.0, max_new_tokens))
        assert tokens == want
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected), rtol=1e-5, atol=1e-5)
