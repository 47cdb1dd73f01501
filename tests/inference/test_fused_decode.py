"""The slot decoder's fused kernels (inference/fused_decode.py): on CPU through
inductor's C++ backend, the same code path the CUDA graphs capture on a GPU."""

import shutil
import threading
import warnings

import pytest
import torch
from test_decode import PARAMS, _prompts
from test_generation import EOS, tiny_qwen3

from mlperf_grpo.inference import fused_decode
from mlperf_grpo.inference.decode import DecodeOptions, SlotDecoder


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                    reason="inductor's CPU backend needs a C++ compiler")
@pytest.mark.parametrize("top_p", [PARAMS.top_p, 1.0])
def test_fused_decoding_gives_the_models_own_completions(top_p):
    """float32: the fused twins round once where eager rounds after each operation
    (float32 ulps, far below the 1e-5 the log-probabilities are compared at), so every
    token is the unfused decoder's; at top-p 1 the sampler's block masses run fused too."""
    model = tiny_qwen3(vocab_size=24, eos_token_id=EOS)
    prompts, seeds = _prompts(10, seed=5)
    runs = {}
    for fused in (False, True):
        decoder = SlotDecoder(model, 4, 0, DecodeOptions(cuda_graphs=False, key_block=4, fused_kernels=fused))
        runs[fused] = decoder.generate(prompts, seeds, PARAMS.temperature, top_p, PARAMS.max_new_tokens, [EOS])
        assert decoder.fused_kernels == (["rms_norm", "rotary", "silu_times"] if fused else [])
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(runs[True], runs[False]):
        assert tokens == want_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), rtol=1e-5, atol=1e-5)
    norm, mlp = model.model.layers[0].input_layernorm.forward, model.model.layers[0].mlp.forward
    assert norm.ok is True and mlp.ok is True and fused_decode._twins["masked_softmax"].ok is True
    if top_p == 1.0:
        assert fused_decode._twins["block_masses"].ok is True
    # outside the decode step the model runs its own code: a forward equals a fresh model's
    fresh = tiny_qwen3(vocab_size=24, eos_token_id=EOS)
    ids = torch.tensor([prompts[0]])
    assert torch.equal(model(ids).logits, fresh(ids).logits)


def _spy_twin(result):
    calls = []

    def twin(x):
        calls.append(x)
        if isinstance(result, Exception):
            raise result
        return result(x)

    return fused_decode._Twin("test", lambda x: x + 1, twin), calls


def test_a_twin_runs_only_inside_fused_on_the_thread_that_entered_it():
    twin, calls = _spy_twin(lambda x: x + 1)
    x = torch.ones(3)
    assert torch.equal(twin(x), x + 1) and not calls  # outside: the original
    seen = []
    with fused_decode.fused():
        other = threading.Thread(target=lambda: seen.append((fused_decode.active(), twin(x))))
        other.start()
        other.join()
        assert not calls and seen[0][0] is False  # another thread (the trainer's) keeps the original
        assert torch.equal(twin(x), x + 1) and len(calls) == 1 and twin.ok is True
    assert fused_decode.active() is False


@pytest.mark.parametrize("result", [lambda x: x + 1.1, RuntimeError("inductor failed\nsecond line")],
                         ids=["disagrees", "fails"])
def test_a_twin_that_disagrees_or_fails_is_dropped_with_one_warning(result):
    twin, calls = _spy_twin(result)
    x = torch.ones(3)
    with fused_decode.fused(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(twin(x), x + 1)  # the original's result
        assert torch.equal(twin(x), x + 1)
    assert twin.ok is False and len(calls) == 1  # tried once, then never again
    assert len(caught) == 1 and "fused decode kernel test not used" in str(caught[0].message)
    assert "\n" not in str(caught[0].message)


def test_agreement_is_within_a_few_bfloat16_roundings():
    """8 x 2^-8 of the largest magnitude: one bfloat16 rounding is 2^-8 relative."""
    want = torch.tensor([1.0, -2.0, 4.0])
    assert fused_decode._agree(want + 4 * 2**-8 * 4, want)
    assert not fused_decode._agree(want + 9 * 2**-8 * 4, want)
    assert not fused_decode._agree(want.to(torch.bfloat16), want)  # another dtype
    assert not fused_decode._agree((want, want), want)
