"""A fresh prompt longer than ``prefill_chunk`` (inference/decode.py ``_admit``) is
prefilled alone in chunks, through the path a preempted row resumes by
(slot_prefill.py ``_chunked_ops``): the same tokens as one prefill of every prompt, and
an attention mask of the chunk's rows, not the long prompt's ``[W, W]``."""

import random

import pytest
import torch
from test_generation import EOS, reference_sample, tiny_qwen3

from mlperf_grpo.inference.base import SamplingParams
from mlperf_grpo.inference.decode import DecodeOptions, SlotDecoder

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
