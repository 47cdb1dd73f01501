"""The tensor-parallel ``hf`` engine (CPU, gloo): the same completions at T = 1 and 2,
this rank's slices only, the interface other modules read and refit through."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

from mlperf_grpo.inference.base import SamplingParams
from mlperf_grpo.inference.hf import HFEngine
from mlperf_grpo.model import resolve_model_path

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=6)
PROMPTS = [[1, 5, 7, 3], [1, 9, 4], [1, 2, 3, 4, 5], [1, 11]]
SEEDS = [11, 12, 13, 14]
LOGPROB_TOLERANCE = 1e-4
"""float32 (unit roundoff u = 2**-24 = 6e-8). T = 2 changes only the order of the sums
inside the row-split matmuls (o_proj, down_proj: two partial sums of length <= 64, then
their all-reduce; the vocabulary-split embedding adds exact zeros). A reordered sum of
length K differs by at most K u times the sum of its terms' magnitudes (Higham, Accuracy
and Stability of Numerical Algorithms, 3.1): <= 128 u = 7.6e-6 relative for K <= 128,
on activations of order 1 here (init std 0.02, RMS-normed inputs). Two such reductions
per layer over 2 layers: <= 4 x 7.6e-6 = 3.1e-5 on the logits, and a log-softmax at
temperature 1 at most doubles a max-norm error: 6.1e-5 < 1e-4."""


def _model_dir(tmp_path: Path) -> Path:
    """A 2-layer Llama (4 heads, 2 KV heads, vocab 32, tied embeddings) with the built-in
    model's tokenizer, saved as a Hugging Face directory."""
    directory = tmp_path / "model"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(directory)
    builtin = resolve_model_path("builtin:arithmetic-tiny")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(builtin / name, directory / name)
    return directory


def _tp_rank(rank: int, world: int, init_file: str, model_dir: str, out: str) -> None:
    os.environ.update(OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        engine = HFEngine(model_dir, "float32", tensor_parallel_size=2)  # each rank reads its slices
        completions = engine.generate_ids(PROMPTS, PARAMS, SEEDS)
        local = engine.weights()
        slices = engine.weight_slices()
        full = {n: t.clone() for n, t in engine.full_weights()}  # collective: both ranks iterate it; unsplit ones are the engine's own
        report = {
            "tp": [engine.tp_size, engine.tp_rank, dist.get_world_size(engine.tp_group)],
            "decoder": engine.describe()["engine"],
            "tokens": [c.token_ids for c in completions],
            "logprobs": [c.logprobs for c in completions],
            "engine_bytes": sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in local.values()}.values()),
            "slices_match": all(torch.equal(full[n][slices[n]], local[n]) for n in local),
            "order": list(dict(engine.full_weights()).keys()),
        }
        # refit with this rank's slices (what a sharded reader gives), then with full tensors
        engine.load_weights({n: torch.zeros_like(t) for n, t in local.items()})
        report["zeroed"] = all(float(t.abs().sum()) == 0 for t in engine.weights().values())
        engine.load_weights({n: full[n][slices[n]].clone() for n in local})
        report["slices_refit"] = engine.generate_ids(PROMPTS, PARAMS, SEEDS)[0].token_ids
        try:
            engine.load_weights({n: t[..., :1] if t.dim() > 1 else t[:1] for n, t in full.items()})
            report["wrong_shape"] = "accepted"
        except ValueError as err:
            report["wrong_shape"] = str(err)
        torch.save({n: t for n, t in full.items()}, Path(out) / f"full{rank}.pt")
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(report))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_ranks_at_t2_generate_what_one_rank_at_t1_generates(tmp_path):
    model_dir = _model_dir(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(_tp_rank, args=(2, str(tmp_path / "pg"), str(model_dir), str(out)), nprocs=2, join=True)
    one = HFEngine(str(model_dir), "float32")
    expected = one.generate_ids(PROMPTS, PARAMS, SEEDS)
    whole = one.weights()
    total = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in whole.values()}.values())
    largest = max(t.numel() * t.element_size() for t in whole.values())
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, report in enumerate(reports):
        assert report["tp"] == [2, rank, 2] and report["decoder"] == "transformers.generate"
        assert report["tokens"] == [c.token_ids for c in expected]  # the same completions on both ranks
        for got, want in zip(report["logprobs"], expected):
            assert max(abs(a - b) for a, b in zip(got, want.logprobs)) <= LOGPROB_TOLERANCE
        assert report["engine_bytes"] <= total / 2 + largest  # this rank's slices, from its own tensors
        assert report["engine_bytes"] < total  # split, not a replica
        assert report["slices_match"] and report["order"] == sorted(whole)
        assert report["zeroed"] and report["slices_refit"] == expected[0].token_ids
        assert "other shape" in report["wrong_shape"]
        full = torch.load(out / f"full{rank}.pt")
        assert all(torch.equal(full[n], whole[n]) for n in whole)  # full_weights gathers the file's tensors
