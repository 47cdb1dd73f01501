"""The tensor-parallel ``hf`` engine (CPU, gloo): the same completions at T = 1 and 2,
this rank's slices only, the interface other modules read and refit through."""

import fnmatch
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

from mlperf_grpo.errors import ModelLoadError
from mlperf_grpo.inference.base import SamplingParams
from mlperf_grpo.inference.hf import HFEngine
from mlperf_grpo.inference.tensor_parallel import mesh_of, parallelize
from mlperf_grpo.model.files import resolve_model_path

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
        report["moe"] = _moe_check(mesh_of(engine.model))
        with torch.device("meta"):
            odd = LlamaForCausalLM(LlamaConfig(vocab_size=33, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                               num_attention_heads=4, num_key_value_heads=2, head_dim=16))
        try:
            parallelize(odd, mesh_of(engine.model))
            report["odd_vocab"] = "split"
        except ModelLoadError as err:
            report["odd_vocab"] = str(err)
        torch.save({n: t for n, t in full.items()}, Path(out) / f"full{rank}.pt")
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(report))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _moe_check(mesh) -> dict:
    """A 4-layer Qwen3.5-MoE text model (the benchmark's architecture: gated delta-net and
    full attention, 4 experts with fused gate/up weights) split over the group and refit
    from full tensors: its logits against the same model whole, on this rank."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    from mlperf_grpo.model.skeleton import materialize

    config = Qwen3_5MoeTextConfig(
        vocab_size=32, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        full_attention_interval=2)
    torch.manual_seed(0)
    whole = AutoModelForCausalLM.from_config(config).eval()
    with torch.device("meta"):
        split = AutoModelForCausalLM.from_config(config)
    materialize(parallelize(split, mesh), "cpu")
    engine = HFEngine.from_model(split)
    engine.load_weights(whole.state_dict())  # full tensors: each rank cuts its own part
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        diff = float((engine.model(input_ids=ids).logits - whole(input_ids=ids).logits).abs().max())
    packed = sorted(n for n, index in engine.weight_slices().items() if index is None)
    same = all(torch.equal(t, whole.state_dict()[n]) for n, t in engine.full_weights())
    # the plan's packed_colwise entries (transformers 5.24: the experts' gate_up_proj; 5.25 replicates the experts)
    patterns = [f"model.{k}" for k, v in (config.base_model_tp_plan or {}).items() if v == "packed_colwise"]
    plan_packed = sorted(n for n in whole.state_dict() if any(fnmatch.fnmatchcase(n, p) for p in patterns))
    return {"logit_diff": diff, "packed": packed, "plan_packed": plan_packed, "full_weights_equal": same}


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
        assert report["odd_vocab"] == ("inference.tensor_parallel_size 2 does not divide the model's vocab_size 33: "
                                       "set it to a divisor of 33")
        moe = report["moe"]
        # float32 reordering only, as LOGPROB_TOLERANCE's derivation: 4 layers x 2 row-split sums x 128 u = 6.1e-5
        assert moe["logit_diff"] <= 1e-4 and moe["full_weights_equal"]
        assert moe["packed"] == moe["plan_packed"]
        assert moe["plan_packed"] in ([], [f"model.layers.{i}.mlp.experts.gate_up_proj" for i in range(4)])
        full = torch.load(out / f"full{rank}.pt")
        assert all(torch.equal(full[n], whole[n]) for n in whole)  # full_weights gathers the file's tensors


# ---------------------------------------------------------------- training: 2 replicas x T = 2

STEP_PROMPTS, GENERATIONS = 4, 4
LOSS_TOLERANCE = 2e-4
"""The T = 2 rollouts are the T = 1 ones (same token ids, asserted) with log-probabilities
within LOGPROB_TOLERANCE (1e-4). The loss's per-token terms are ``A x ratio`` with
``ratio = exp(policy - rollout log-probability)``: a rollout log-probability off by
1e-4 changes the ratio by a factor ``e**1e-4 - 1 = 1.0e-4``, and the group advantages of
4 completions, mean-centred and divided by their std, have ``|A| <= (G - 1) / sqrt(G) =
1.5``: the token mean moves by at most 1.5e-4 < 2e-4. The gradient norm moves by the
same relative 1e-4 per token before the sum; 1e-3 relative allows for cancellation
between tokens of opposite advantage (a sum of terms each off by 1e-4 relative can be
off by more relative to a smaller total)."""


def _training_model_dir(tmp_path: Path) -> Path:
    """The built-in model with its vocabulary padded from 15 to 16 (T = 2 divides it)."""
    from mlperf_grpo.model.load import load_model

    directory = tmp_path / "model16"
    model = load_model("builtin:arithmetic-tiny", "float32")
    model.resize_token_embeddings(16, mean_resizing=False)
    model.save_pretrained(directory)
    builtin = resolve_model_path("builtin:arithmetic-tiny")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(builtin / name, directory / name)
    return directory


def _train_rank(rank: int, world: int, init_file: str, model_dir: str, out: str) -> None:
    from mlperf_grpo.config.run import RunConfig
    from mlperf_grpo.inference.tensor_parallel import rank_share
    from mlperf_grpo.tasks import arithmetic
    from mlperf_grpo.train import ranks
    from mlperf_grpo.train.engine_setup import engine_from_policy
    from mlperf_grpo.train.fsdp import load_sharded_policy, policy_weights
    from mlperf_grpo.train.grpo import PGLossOptions, group_advantages
    from mlperf_grpo.train.optimize import OptimizeSettings, optimize_step
    from mlperf_grpo.train.rollout import build_batch, generate_rollouts

    torch.set_num_threads(1)
    os.environ["TORCHELASTIC_RUN_ID"] = "test"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        here = ranks.Layout(rank, world)
        tasks = arithmetic.train_tasks(STEP_PROMPTS, 251, seed=3)
        report = {}
        for t in (1, 2):
            config = RunConfig.model_validate({"model": {"path": model_dir}, "inference": {"tensor_parallel_size": t}})
            policy = load_sharded_policy(model_dir, "cpu", None, activation_checkpointing=False)
            engine = engine_from_policy(config, policy)
            optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
            share = ranks.prompt_share(STEP_PROMPTS, here, t)
            steps = []
            for step in (1, 2):
                group = generate_rollouts(engine, tasks[share], GENERATIONS, PARAMS, seed=5, step=step,
                                          first_prompt_index=share.start)
                mine = rank_share(len(group), engine.tp_rank, engine.tp_size)
                completions = group[mine]
                rewards = torch.tensor([[arithmetic.reward(c.text, task) for c in g]
                                        for task, g in zip(tasks[share][mine], completions)])
                batch = build_batch(completions, rewards, group_advantages(rewards), engine.tokenizer.pad_token_id,
                                    engine.eos_token_ids)
                result = optimize_step(policy, optimizer, batch, OptimizeSettings(GENERATIONS, 1.0, PGLossOptions(), grad_clip_norm=1e9))
                engine.load_weights(policy_weights(policy))  # one gathered parameter at a time
                group_tokens = [[c.token_ids for c in g] for g in group]
                gathered = [None] * world
                dist.all_gather_object(gathered, group_tokens)
                steps.append({"loss": result.loss, "grad_norm": result.grad_norm, "tokens": [c.token_ids for g in completions for c in g],
                              "group_tokens": gathered})
            local = engine.weights()
            report[t] = {"steps": steps, "tp": [engine.tp_size, engine.tp_rank],
                         "engine_bytes": sum(x.numel() * x.element_size() for x in {x.data_ptr(): x for x in local.values()}.values())}
            del engine, policy, optimizer
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(report))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_replicas_of_t2_train_as_four_replicas_of_t1(tmp_path):
    """4 ranks: the T = 2 layout (2 groups of 2) generates each group's 2 prompts on both
    of its ranks, each rank trains on its 1 prompt; the losses are the T = 1 layout's
    (4 replica engines, 1 prompt each) within LOSS_TOLERANCE, on the same token ids."""
    model_dir = _training_model_dir(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(_train_rank, args=(4, str(tmp_path / "pg"), str(model_dir), str(out)), nprocs=4, join=True)
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    whole = HFEngine(str(model_dir), "float32").weights()
    total = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in whole.values()}.values())
    largest = max(t.numel() * t.element_size() for t in whole.values())
    for rank, report in enumerate(reports):
        one, two = report["1"], report["2"]
        assert one["tp"] == [1, 0] and two["tp"] == [2, rank % 2]
        assert one["engine_bytes"] == total and two["engine_bytes"] <= total / 2 + largest
        for a, b in zip(one["steps"], two["steps"]):
            assert b["tokens"] == a["tokens"]  # the rank trains on the completions T = 1 gave it
            assert b["loss"] == pytest.approx(a["loss"], abs=LOSS_TOLERANCE)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
            group = b["group_tokens"]
            assert group[2 * (rank // 2)] == group[2 * (rank // 2) + 1]  # both ranks of a group hold its completions
    # advantages not all zero: a real step. The gradient, not the loss, shows it: with
    # completions of equal length and ratio 1 the loss -mean(A) is 0 whatever A is.
    assert any(a["grad_norm"] > 0 for r in reports for a in r["1"]["steps"])


def test_a_group_generates_its_prompts_and_each_rank_trains_on_its_part():
    from mlperf_grpo.inference.tensor_parallel import rank_share
    from mlperf_grpo.train.ranks import Layout, prompt_share

    prompts = list(range(8))
    groups = [prompts[prompt_share(8, Layout(r, 4), 2)] for r in range(4)]
    assert groups == [[0, 1, 2, 3], [0, 1, 2, 3], [4, 5, 6, 7], [4, 5, 6, 7]]  # 2 groups of 2 ranks
    trained = [groups[r][rank_share(4, r % 2, 2)] for r in range(4)]
    assert trained == [[0, 1], [2, 3], [4, 5], [6, 7]]  # what T = 1 gives rank r: every prompt once, in order
    assert trained == [prompts[prompt_share(8, Layout(r, 4))] for r in range(4)]
    with pytest.raises(ValueError, match="3 rows do not divide over the 2 ranks"):
        rank_share(3, 0, 2)
