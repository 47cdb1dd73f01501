"""The transformers engine at real vocabulary sizes and lengths: per-row seeded sampling,
log-probabilities taken at the sampling step, memory that grows with tokens only."""

import random
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.generation.logits_process import TopPLogitsWarper

from mlperf_grpo.inference.base import SamplingParams
from mlperf_grpo.inference.hf import HFEngine

EOS = 2


def tiny_qwen3(vocab_size: int, eos_token_id: int | None, seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=4096, tie_word_embeddings=True,
        eos_token_id=eos_token_id, pad_token_id=0, bos_token_id=None,
    )
    model = Qwen3ForCausalLM(config).float().eval()
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = 0
    return model


def reference_sample(model, prompt: list[int], seed: int, params: SamplingParams) -> tuple[list[int], list[float]]:
    """One row alone, no KV cache, no padding: at each step a full forward pass, the
    inverse CDF of softmax(top_p(logits / T)) at the row's next ``random.Random(seed)``
    draw; then the log-probabilities from one full forward pass over prompt + completion,
    ``log_softmax(logits / T)`` gathered at the sampled tokens (the previous engine's
    definition)."""
    rng = random.Random(seed)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(params.max_new_tokens):
            scores = model(torch.tensor([ids])).logits[:, -1].float() / params.temperature  # [1, V]
            if params.top_p < 1.0:
                scores = TopPLogitsWarper(params.top_p)(None, scores)
            cdf = torch.softmax(scores, dim=-1).cumsum(dim=-1)[0]
            u = torch.tensor(rng.random(), dtype=torch.float32) * cdf[-1]
            token = min(int(torch.searchsorted(cdf, u)), cdf.shape[0] - 1)
            ids.append(token)
            if token == EOS:
                break
        completion = ids[len(prompt):]
        logits = model(torch.tensor([ids])).logits[0, len(prompt) - 1 : -1].float()  # [T, V]
        logprobs = torch.log_softmax(logits / params.temperature, dim=-1)
        logprobs = logprobs.gather(1, torch.tensor(completion)[:, None])[:, 0]
    return completion, logprobs.tolist()


def test_completions_and_logprobs_equal_a_one_row_full_forward_reference():
    model = tiny_qwen3(vocab_size=24, eos_token_id=EOS)
    gen = random.Random(7)
    prompts = [[gen.randrange(3, 24) for _ in range(gen.randint(1, 9))] for _ in range(12)]
    seeds = [gen.getrandbits(63) for _ in prompts]
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=10)
    for batch_size in (12, 5):  # left padding and batch composition must not matter
        engine = HFEngine.from_model(model, batch_size=batch_size)
        completions = engine.generate_ids(prompts, params, seeds)
        for prompt, seed, c in zip(prompts, seeds, completions):
            tokens, logprobs = reference_sample(model, prompt, seed, params)
            assert c.prompt_token_ids == prompt
            assert c.token_ids == tokens
            torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(logprobs), rtol=1e-5, atol=1e-5)
    assert any(c.token_ids[-1] == EOS for c in completions), "some rows must stop at EOS"
    assert any(len(c.token_ids) == params.max_new_tokens for c in completions), "some rows must run to the limit"


def test_long_generation_stops_once_every_row_has_produced_eos():
    engine = HFEngine("builtin:arithmetic-tiny", "float32", batch_size=64)
    prompts = [f"{a}+{b}=" for a in range(10, 99, 11) for b in range(15, 99, 13)]
    seeds = list(range(len(prompts)))
    forward_calls = []
    hook = engine.model.register_forward_hook(lambda *_: forward_calls.append(1))
    try:
        long = engine.generate(prompts, SamplingParams(1.0, 1.0, 4096), seeds)
    finally:
        hook.remove()
    short = engine.generate(prompts, SamplingParams(1.0, 1.0, 6), seeds)
    assert all(c.token_ids[-1] == engine.eos_token_ids[0] for c in long)
    assert long == short  # the same rows; the larger limit only lets them run
    # One forward pass per generated position, per batch of 64: no step past the last EOS.
    batches = [long[i : i + 64] for i in range(0, len(long), 64)]
    assert len(forward_calls) == sum(max(len(c.token_ids) for c in b) for b in batches)


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _can_reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _can_reset_peak_rss(), reason="needs Linux /proc/self/clear_refs to reset the peak RSS")
def test_generate_peak_memory_stays_below_the_full_vocabulary_logits_tensor():
    vocab, new_tokens, rows = 50_000, 64, 32
    logits_bytes = rows * new_tokens * vocab * 4  # the [B, T, V] float32 tensor: 410 MB
    engine = HFEngine.from_model(tiny_qwen3(vocab_size=vocab, eos_token_id=None), batch_size=rows)
    prompts = [[5 + i, 6, 7] for i in range(rows)]
    params = SamplingParams(1.0, 1.0, new_tokens)
    engine.generate_ids(prompts[:2], SamplingParams(1.0, 1.0, 2), [0, 1])  # warm up lazy initialisation
    Path("/proc/self/clear_refs").write_text("5")
    before_kib = _rss_kib("VmRSS")
    completions = engine.generate_ids(prompts, params, list(range(rows)))
    peak_delta_bytes = (_rss_kib("VmHWM") - before_kib) * 1024
    assert all(len(c.token_ids) == new_tokens for c in completions)
    assert peak_delta_bytes < logits_bytes / 4, f"peak RSS grew by {peak_delta_bytes / 1e6:.0f} MB"


def test_generation_runs_without_cudnn_attention_and_restores_the_setting():
    """cuDNN attention plans every new key length (benchmarks/attention_backends.py):
    generation leaves it out, every other attention kernel stays allowed, and the
    process's setting (the training's forward passes) is as before afterwards."""
    model = tiny_qwen3(vocab_size=24, eos_token_id=None)
    seen = []
    model.register_forward_hook(lambda *_: seen.append((torch.backends.cuda.cudnn_sdp_enabled(),
                                                        torch.backends.cuda.mem_efficient_sdp_enabled(),
                                                        torch.backends.cuda.flash_sdp_enabled(),
                                                        torch.backends.cuda.math_sdp_enabled())))
    before = torch.backends.cuda.cudnn_sdp_enabled()
    assert before  # torch's default
    HFEngine.from_model(model, batch_size=4).generate_ids([[3, 4], [5]], SamplingParams(1.0, 1.0, 3), [1, 2])
    assert seen and set(seen) == {(False, True, True, True)}
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


def test_the_models_generation_config_processors_are_ignored_with_one_note(capsys):
    """Issue 44: ``generate`` filled its unset settings from ``model.generation_config``, so
    ``repetition_penalty`` & co. changed the distribution the rollouts were drawn from. Now
    the completions and log-probs are the raw-logits reference's, the model's config is
    left as it was, and one note names what was ignored."""
    model = tiny_qwen3(vocab_size=24, eos_token_id=EOS)
    processors = {"repetition_penalty": 1.3, "no_repeat_ngram_size": 2, "min_new_tokens": 5, "suppress_tokens": [5, 6]}
    for key, value in processors.items():
        setattr(model.generation_config, key, value)
    gen = random.Random(11)
    prompts = [[gen.randrange(3, 24) for _ in range(gen.randint(1, 9))] for _ in range(8)]
    seeds = [gen.getrandbits(63) for _ in prompts]
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=10)
    engine = HFEngine.from_model(model, batch_size=8, model_path="tiny-with-processors")
    assert engine._decoder is None  # the generate path (a CPU device)
    completions = engine.generate_ids(prompts, params, seeds)
    for prompt, seed, c in zip(prompts, seeds, completions):
        tokens, logprobs = reference_sample(model, prompt, seed, params)
        assert c.token_ids == tokens
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(logprobs), rtol=1e-5, atol=1e-5)
    assert all(getattr(model.generation_config, k) == v for k, v in processors.items())  # restored
    HFEngine.from_model(model, model_path="tiny-with-processors")  # a second engine: no second note
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert notes == ["note: tiny-with-processors: generation_config.json sets min_new_tokens=5, no_repeat_ngram_size=2, "
                     "repetition_penalty=1.3, suppress_tokens=[5, 6]; ignored: every engine samples from the run's "
                     "temperature and top-p of the raw logits, the distribution the trainer scores"]


def test_odd_seeds_sample_each_seeds_python_stream_on_both_paths():
    """Seeds below 0 (``random.Random`` takes their absolute value), 0, past 2**64 (seeded
    from more than two 32-bit words) and one given twice: ``generate`` (the CPU's
    ``auto``) and the slot decoder give every row the one-row reference's completion at
    its own ``random.Random(seed)`` stream, the repeated seed twice the same (and -5 as 5)."""
    model = tiny_qwen3(vocab_size=24, eos_token_id=EOS)
    seeds = [-5, 0, 2**64 + 1, -(2**100), 7, 7, 5]
    gen = random.Random(13)
    prompts = [[gen.randrange(3, 24) for _ in range(4)] for _ in seeds]
    prompts[5], prompts[6] = prompts[4], prompts[0]
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=8)
    want = [reference_sample(model, prompt, seed, params) for prompt, seed in zip(prompts, seeds)]
    for decode in ("auto", "slots"):
        engine = HFEngine.from_model(model, batch_size=4, decode=decode)
        assert (engine._decoder is None) is (decode == "auto")
        completions = engine.generate_ids(prompts, params, seeds)
        for c, (tokens, logprobs) in zip(completions, want):
            assert c.token_ids == tokens
            torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(logprobs), rtol=1e-5, atol=1e-5)
    assert want[4] == want[5] and want[0] == want[6]  # random.Random(-5) is random.Random(5)
