"""Data-parallel training under torchrun (CPU, gloo): the same run on 1 and 2 ranks.

The end-to-end tests launch the real CLI with ``torchrun --nproc-per-node 2`` and
compare it with a plain one-process run of the same small config, step for step.
"""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from mlperf_grpo.cli import main
from mlperf_grpo.config.run import RunConfig
from mlperf_grpo.inference.hf import HFEngine
from mlperf_grpo.logs.mllog import read_log
from mlperf_grpo.model.load import load_model
from mlperf_grpo.train import collectives, engine_setup, fsdp, ranks
from mlperf_grpo.train.grpo import PGLossOptions
from mlperf_grpo.train.optimize import OptimizeSettings, optimize_step

pytestmark = pytest.mark.slow
MODEL = "builtin:arithmetic-tiny"
SMALL = """\
grpo: {num_prompts_per_step: 4, num_generations_per_prompt: 4, max_steps: 3, micro_batch_size: 4, first_eval_step: 2}
validation: {generations_per_task: 4, temperature: 1.0, top_p: 1.0}  # passes at step 2: a log the checker passes
task: {num_train_tasks: 64}
"""
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--no-python",
            str(Path(sys.executable).parent / "mlperf-grpo")]


# ---------------------------------------------------------------- layout rules


def test_prompt_shares_cover_the_step_once_in_order():
    shares = [ranks.prompt_share(16, ranks.Layout(r, 4)) for r in range(4)]
    assert [list(range(16))[s] for s in shares] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]


@pytest.mark.parametrize("grpo, needle", [
    ({"num_prompts_per_step": 3, "micro_batch_size": 16, "first_eval_step": 2}, "does not divide over 2 ranks"),
    ({"num_prompts_per_step": 4, "num_generations_per_prompt": 4, "micro_batch_size": 16, "micro_batch_tokens": None,
      "first_eval_step": 2}, "divisor of 8"),
])
def test_a_batch_that_does_not_divide_over_the_ranks_is_refused(grpo, needle):
    config = RunConfig.model_validate({"grpo": grpo})
    with pytest.raises(ranks.LayoutError, match=needle):
        ranks.check_layout(config, world_size=2)
    ranks.check_layout(config, world_size=1)  # one rank: anything goes


def test_a_process_group_that_torchrun_did_not_start_is_not_a_distributed_job(tmp_path, monkeypatch):
    """vLLM initialises ``torch.distributed`` (world size 1) inside a single process: the
    trainer must still run as one process (unsharded policy, local collectives), and
    decide "distributed" from torchrun's environment alone."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        assert not ranks.in_process_group() and not ranks.layout().distributed
        assert collectives.all_reduce_sum([1.5]) == [1.5] and collectives.broadcast_object("x") == "x"
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")  # the same group in a torchrun rank
        assert ranks.in_process_group() and ranks.layout().distributed
    finally:
        dist.destroy_process_group()


def test_single_process_features_are_refused_with_several_ranks():
    with pytest.raises(ranks.LayoutError, match="inline"):
        ranks.check_layout(RunConfig(), world_size=2, deferred=False)
    with pytest.raises(ranks.LayoutError, match="engine vllm"):
        ranks.check_layout(RunConfig.model_validate({"inference": {"engine": "vllm"}}), world_size=2)
    ranks.check_layout(RunConfig(), world_size=1, deferred=False)  # one process, no torchrun: as before


def test_torchrun_refuses_prompts_that_do_not_divide_with_one_line_per_rank(tmp_path):
    config = tmp_path / "odd.yaml"
    config.write_text(SMALL.replace("num_prompts_per_step: 4", "num_prompts_per_step: 3").replace("micro_batch_size: 4", "micro_batch_size: 2"))
    proc = subprocess.run([*TORCHRUN, "train", "--config", str(config), "--output", str(tmp_path / "run")],
                          capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=300)
    ours = [line for line in proc.stderr.splitlines() if line.startswith("mlperf-grpo: ")]
    refusal = ("error: grpo.num_prompts_per_step 3 (GBS 12) does not divide over 2 ranks: each rank generates "
               "whole prompt groups; use a multiple of 2 or another --nproc-per-node")
    assert f"mlperf-grpo: {refusal}" in ours, proc.stderr[-3000:]  # rank 0's one line
    # rank 1 refuses too, unless torchrun's SIGTERM (sent when rank 0 exited) reaches it first
    others = [line for line in ours if line != f"mlperf-grpo: {refusal}"]
    assert len(others) <= 1 and all(line in (f"mlperf-grpo: rank 1: {refusal}", "mlperf-grpo: rank 1: stopped by SIGTERM")
                                    for line in others), proc.stderr[-3000:]
    assert "exitcode  : 2" in proc.stderr and proc.returncode != 0  # torchrun reports the ranks' exit 2 and fails
    assert not (tmp_path / "run").exists()  # nothing written


def test_our_torchrun_ends_a_refusal_with_exit_2_and_no_traceback(tmp_path):
    """``python -m mlperf_grpo.torchrun``: the same refusal keeps torchrun's failure summary
    (its ``exitcode  : 2``) and ends with the rank's 2, without torchrun's traceback (exit 1)."""
    config = tmp_path / "odd.yaml"
    config.write_text(SMALL.replace("num_prompts_per_step: 4", "num_prompts_per_step: 3").replace("micro_batch_size: 4", "micro_batch_size: 2"))
    proc = subprocess.run([sys.executable, "-m", "mlperf_grpo.torchrun", *TORCHRUN[3:], "train", "--config", str(config),
                           "--output", str(tmp_path / "run")], capture_output=True, text=True, env=ENV, cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "exitcode  : 2" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_torchrun_refuses_a_tensor_parallel_size_that_does_not_divide_the_world(tmp_path):
    config = tmp_path / "tp3.yaml"
    config.write_text(SMALL + "inference: {tensor_parallel_size: 3}\n")
    proc = subprocess.run([*TORCHRUN, "train", "--config", str(config), "--output", str(tmp_path / "run")],
                          capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=300)
    refusal = ("mlperf-grpo: error: inference.tensor_parallel_size 3 does not divide the world size 2: set "
               "inference.tensor_parallel_size to a common divisor of the world size and the heads, or launch a "
               "multiple of 3 ranks")
    assert refusal in proc.stderr.splitlines(), proc.stderr[-3000:]
    assert "exitcode  : 2" in proc.stderr and proc.returncode != 0
    assert not (tmp_path / "run").exists()  # nothing written


# ---------------------------------------------------------------- one step across ranks


@contextlib.contextmanager
def _joined(rank: int, world: int, init_file: str):
    """Rank ``rank`` of a gloo group for the duration, left as training leaves it: a
    barrier after the last collective (why: :func:`collectives.barrier`), then destroyed.
    After success the rank ends with ``os._exit(0)``, skipping interpreter finalization,
    where a gloo worker still releasing a tensor aborts the process
    (pytorch/pytorch#190489): these tests check the step's values, and the CLI's own exit
    is checked by the torchrun tests below. The rank's environment says torchrun
    started it (``TORCHELASTIC_RUN_ID``), as the trainer requires of a distributed job."""
    os.environ["TORCHELASTIC_RUN_ID"] = "test"  # a spawned process's own environment
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        yield
        collectives.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _rows(batch, rows: slice, prompts: slice):
    return replace(batch, input_ids=batch.input_ids[rows], attention_mask=batch.attention_mask[rows],
                   completion_mask=batch.completion_mask[rows], rollout_logprobs=batch.rollout_logprobs[rows],
                   advantages=batch.advantages[rows], rewards=batch.rewards[prompts], sample_mask=batch.sample_mask[rows])


def _sharded_step(rank: int, world: int, init_file: str, batch, micro: int | None, out: str, reshard: bool = True,
                  tokens: int | None = None) -> None:
    with _joined(rank, world, init_file):
        torch.manual_seed(0)
        policy = fsdp.shard_policy(load_model(MODEL, "float32"), None, activation_checkpointing=True,
                                          reshard_every_micro_batch=reshard)
        opt = torch.optim.SGD(policy.parameters(), lr=1.0)
        here = ranks.Layout(rank, world)
        prompts = ranks.prompt_share(batch.rewards.shape[0], here)
        g = batch.rewards.shape[1]
        share = _rows(batch, slice(prompts.start * g, prompts.stop * g), prompts)
        result = optimize_step(policy, opt, share, OptimizeSettings(micro, 1.0, PGLossOptions(), grad_clip_norm=1e9,
                                                                 reshard_every_micro_batch=reshard,
                                                                 micro_batch_tokens=tokens, packing="always"))
        engine = HFEngine(MODEL, "float32")
        engine.load_weights(fsdp.policy_weights(policy))  # one parameter at a time
        if rank == 0:
            torch.save({"engine": engine.model.state_dict(), "loss": result.loss, "grad_norm": result.grad_norm,
                        "tokens": result.num_valid_tokens}, out)


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard-every-micro-batch", "sync-after-last"])
def test_one_step_on_two_ranks_equals_one_big_batch(tmp_path, reshard):
    """The accumulation invariant across ranks: 2 ranks x 2 micro-batches of 16 rows give
    the update of one 64-row batch in one process (global token-mean loss, summed
    gradients), and the refit engine holds exactly the updated weights; the same when
    gradients are reduced only after the last micro-batch (``reshard=False``)."""
    from test_trainer import _batch, _step

    batch = _batch()
    whole_policy = load_model(MODEL, "float32")
    whole = _step(whole_policy, batch, micro=64)
    opt = torch.optim.SGD(load_model(MODEL, "float32").parameters(), lr=0.0)
    expected = optimize_step(load_model(MODEL, "float32"), opt, batch, OptimizeSettings(64, 1.0, PGLossOptions(), 1e9))
    out = tmp_path / "rank0.pt"
    mp.spawn(_sharded_step, args=(2, str(tmp_path / "pg"), batch, 16, str(out), reshard), nprocs=2, join=True)
    got = torch.load(out)
    assert got["tokens"] == expected.num_valid_tokens == batch.num_tokens
    assert got["grad_norm"] == pytest.approx(expected.grad_norm, rel=1e-5)
    assert got["loss"] == pytest.approx(expected.loss, abs=1e-6)
    for name, tensor in whole.items():
        torch.testing.assert_close(got["engine"][name], tensor, rtol=1e-5, atol=1e-6)


def test_packed_passes_on_two_ranks_with_different_pass_counts_equal_one_big_batch(tmp_path):
    """Token-budget passes under FSDP2: rank 1 keeps 3 of its 32 rows (the others left out
    by sample_mask) and has fewer passes than rank 0; it cuts its passes or runs empty
    ones so that both make the same collectives, and the update is the one-process one."""
    from test_trainer import _batch, _step

    batch = _batch()
    batch.sample_mask[32:] = 0
    batch.sample_mask[40:43] = 1
    whole = _step(load_model(MODEL, "float32"), batch, micro=64)
    out = tmp_path / "rank0.pt"
    mp.spawn(_sharded_step, args=(2, str(tmp_path / "pg"), batch, None, str(out), True, 40), nprocs=2, join=True)
    got = torch.load(out)
    assert got["tokens"] == batch.num_tokens
    for name, tensor in whole.items():
        torch.testing.assert_close(got["engine"][name], tensor, rtol=1e-5, atol=1e-6)


def _count_collectives(rank: int, world: int, init_file: str, batch, out: str) -> None:
    with _joined(rank, world, init_file):
        counts = {"all_gather": 0, "reduce_scatter": 0}
        for name in ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor"):
            if hasattr(dist, name):  # FSDP2 calls *_single from torch 2.12 on, *_tensor before
                def counted(*args, _call=getattr(dist, name), _kind=name.rsplit("_", 1)[0].removesuffix("_into"), **kwargs):
                    counts[_kind] += 1
                    return _call(*args, **kwargs)
                setattr(dist, name, counted)
        prompts = ranks.prompt_share(batch.rewards.shape[0], ranks.Layout(rank, world))
        g = batch.rewards.shape[1]
        share = _rows(batch, slice(prompts.start * g, prompts.stop * g), prompts)
        got = {}
        for reshard in (True, False):
            policy = fsdp.shard_policy(load_model(MODEL, "float32"), None, activation_checkpointing=False,
                                              reshard_every_micro_batch=reshard)
            counts.update(all_gather=0, reduce_scatter=0)
            optimize_step(policy, torch.optim.SGD(policy.parameters(), lr=1.0), share,
                          OptimizeSettings(8, 1.0, PGLossOptions(), 1e9, reshard_every_micro_batch=reshard))
            got[reshard] = dict(counts)
        if rank == 0:
            torch.save(got, out)


def test_sync_after_last_micro_batch_gathers_and_reduces_once_a_step(tmp_path):
    """What ``reshard_every_micro_batch: false`` is for: over 4 micro-batches, each of the
    3 FSDP groups (2 decoder layers, the root) all-gathers its weights and
    reduce-scatters its gradients once in the step; with the default it all-gathers
    twice (forward, backward) and reduce-scatters once per micro-batch. (The update is
    the same: ``test_one_step_on_two_ranks_equals_one_big_batch``.)"""
    from test_trainer import _batch

    batch = _batch()  # 64 rows: 32 a rank, 4 micro-batches of 8
    groups = len(load_model(MODEL, "float32").model.layers) + 1
    out = tmp_path / "counts.pt"
    mp.spawn(_count_collectives, args=(2, str(tmp_path / "pg"), batch, str(out)), nprocs=2, join=True)
    got = torch.load(out)
    assert got[True] == {"all_gather": 4 * 2 * groups, "reduce_scatter": 4 * groups}
    assert got[False] == {"all_gather": groups, "reduce_scatter": groups}


# ---------------------------------------------------------------- building sharded


def _sharded_build(rank: int, world: int, init_file: str, model_dir: str, out: str) -> None:
    with _joined(rank, world, init_file):
        policy = fsdp.load_sharded_policy(model_dir, "cpu", None, activation_checkpointing=True,
                                                 compile_layers=True)  # as on CUDA (compiled at the first forward)
        config = RunConfig.model_validate({"model": {"path": model_dir, "dtype": "bfloat16"}})
        engine = engine_setup.engine_from_policy(config, policy)
        full = {name: t.full_tensor() for name, t in policy.state_dict().items()}  # every rank gathers
        local_rows = {name: t.to_local().shape[0] for name, t in policy.state_dict().items()}
        if rank == 0:
            torch.save({"policy": full, "policy_buffers": dict(policy.named_buffers()), "rows": local_rows,
                        "engine": engine.model.state_dict(), "engine_buffers": dict(engine.model.named_buffers()),
                        "tied": engine.model.lm_head.weight is engine.model.model.embed_tokens.weight,
                        "generation_config": engine.model.generation_config.to_dict()}, out)


def test_the_sharded_build_equals_the_one_process_load(tmp_path):
    """2 ranks build the policy on the meta device, shard it, and read only their rows of
    each tensor from a bfloat16 model split over several safetensors files: the gathered
    parameters equal ``load_model(..., "float32")``'s exactly, RoPE's recomputed buffers
    equal too, and each rank's engine holds ``load_model(..., "bfloat16")``'s weights."""
    from transformers import AutoTokenizer

    from mlperf_grpo.model.files import BUILTIN_MODEL_DIR

    model_dir = tmp_path / "bf16"
    load_model(MODEL, "bfloat16").save_pretrained(model_dir, max_shard_size="100KB")
    assert len(list(model_dir.glob("*.safetensors"))) >= 2  # the index path is taken
    AutoTokenizer.from_pretrained(BUILTIN_MODEL_DIR).save_pretrained(model_dir)
    out = tmp_path / "rank0.pt"
    mp.spawn(_sharded_build, args=(2, str(tmp_path / "pg"), str(model_dir), str(out)), nprocs=2, join=True)
    got = torch.load(out)
    whole = load_model(str(model_dir), "float32")
    expected = {name: t for name, t in whole.state_dict().items()}
    policy = {name.replace("._checkpoint_wrapped_module", ""): t for name, t in got["policy"].items()}
    assert policy.keys() == expected.keys()
    for name, tensor in expected.items():
        assert policy[name].dtype == torch.float32 and torch.equal(policy[name], tensor), name
    assert got["rows"]["model.embed_tokens.weight"] == 8  # 15 rows over 2 ranks: really sharded
    buffers = {name.replace("._checkpoint_wrapped_module", ""): t for name, t in got["policy_buffers"].items()}
    assert buffers.keys() == dict(whole.named_buffers()).keys() and buffers  # inv_freq, original_inv_freq
    for name, tensor in whole.named_buffers():
        assert torch.equal(buffers[name], tensor), name
    rollout = load_model(str(model_dir), "bfloat16")
    for name, tensor in rollout.state_dict().items():
        assert got["engine"][name].dtype == torch.bfloat16 and torch.equal(got["engine"][name], tensor), name
    for name, tensor in rollout.named_buffers():
        assert torch.equal(got["engine_buffers"][name], tensor), name
    assert got["tied"]
    assert got["generation_config"] == rollout.generation_config.to_dict()


MOE_SIZES = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 3,
             "num_experts_per_tok": 2, "num_key_value_heads": 2, "head_dim": 16}


def _sharded_gather(rank: int, world: int, init_file: str, model_dir: str, out: str) -> None:
    with _joined(rank, world, init_file):
        policy = fsdp.load_sharded_policy(model_dir, "cpu", None, activation_checkpointing=True)
        full = {name: t.full_tensor() for name, t in policy.state_dict().items()}  # every rank gathers
        rows = {name: t.to_local().shape[0] for name, t in policy.state_dict().items()}
        if rank == 0:
            torch.save({"policy": full, "rows": rows}, out)


def test_the_sharded_build_reads_moe_experts_saved_one_tensor_each(tmp_path):
    """A Qwen3-MoE model as transformers 5 saves it (each expert's gate_proj, up_proj and
    down_proj a tensor of its own; the model's parameters are the merged
    ``experts.gate_up_proj`` [E, 2I, H] and ``experts.down_proj`` [E, H, I]): 2 ranks, 3
    experts (2 on rank 0, 1 on rank 1), bfloat16 files split in several, give exactly
    ``load_model``'s parameters. (The loader used to leave the merged parameters
    unread: the run trained on uninitialised experts without a word.)"""
    from test_model_errors import _saved_model

    directory = _saved_model(tmp_path, "qwen3_moe", **MOE_SIZES)
    load_model(str(directory), "bfloat16").save_pretrained(tmp_path / "bf16", max_shard_size="40KB")
    for tokenizer_file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (tmp_path / "bf16" / tokenizer_file).write_bytes((directory / tokenizer_file).read_bytes())
    model_dir = tmp_path / "bf16"
    assert len(list(model_dir.glob("*.safetensors"))) >= 2
    out = tmp_path / "rank0.pt"
    mp.spawn(_sharded_gather, args=(2, str(tmp_path / "pg"), str(model_dir), str(out)), nprocs=2, join=True)
    got = torch.load(out)
    expected = load_model(str(model_dir), "float32").state_dict()
    policy = {name.replace("._checkpoint_wrapped_module", ""): t for name, t in got["policy"].items()}
    assert policy.keys() == expected.keys()
    assert expected["model.layers.0.mlp.experts.gate_up_proj"].shape == (3, 64, 64)
    for name, tensor in expected.items():
        assert torch.equal(policy[name], tensor), name
    rows = {name.replace("._checkpoint_wrapped_module", ""): n for name, n in got["rows"].items()}
    assert rows["model.layers.1.mlp.experts.down_proj"] == 2  # rank 0's 2 of 3 experts: really sharded


def _drop_an_expert_part(directory) -> None:
    weights = load_file(directory / "model.safetensors")
    del weights["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(weights, directory / "model.safetensors")


def _halve_moe_intermediate_size(directory) -> None:
    config = json.loads((directory / "config.json").read_text())
    config["moe_intermediate_size"] //= 2
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("damage, message", [
    (_drop_an_expert_part, "have no part 1 of expert 2 of 'model.layers.1.mlp.experts.gate_up_proj'"),
    (_halve_moe_intermediate_size, "has shape [32, 64] in the weight files but is [16, 64]"),
])
def test_the_sharded_build_refuses_missing_or_misshapen_expert_parts(tmp_path, damage, message):
    """What ``check_weights`` cannot see in a merge (a part of one expert missing, parts
    of another size than config.json gives) is one ModelLoadError naming the tensor."""
    from test_model_errors import _saved_model

    from mlperf_grpo.errors import ModelLoadError

    directory = _saved_model(tmp_path, "qwen3_moe", **MOE_SIZES)
    damage(directory)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        with pytest.raises(ModelLoadError, match=re.escape(message)) as err:
            fsdp.load_sharded_policy(str(directory), "cpu", None, activation_checkpointing=False)
        assert "\n" not in str(err.value) and str(directory) in str(err.value)
    finally:
        dist.destroy_process_group()



def test_a_buffer_the_initializer_does_not_recompute_is_refused():
    from mlperf_grpo.errors import ModelLoadError
    from mlperf_grpo.model.skeleton import materialize, model_skeleton

    model = model_skeleton(MODEL, "float32")
    model.model.layers[0].register_buffer("scale", torch.ones(3, device="meta"), persistent=False)
    with pytest.raises(ModelLoadError, match=r"does not recompute the buffer model.layers.0.scale"):
        materialize(model, "cpu")
    materialize(model_skeleton(MODEL, "float32"), "cpu")  # the model's own buffers are recomputed


# ---------------------------------------------------------------- the CLI on 1 and 2 ranks


def _stats(log: Path) -> list[dict]:
    return [e.value for e in read_log(log).events if e.key == "tracked_stats"]


def _accuracies(log: Path) -> list[tuple[int, float]]:
    return [(e.metadata["samples_count"], e.value) for e in read_log(log).events if e.key == "eval_accuracy"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    (root / "small.yaml").write_text(SMALL)
    one = root / "one"
    assert main(["run", "--config", str(root / "small.yaml"), "--output", str(one), "--retain-checkpoints"]) == 0
    two = root / "two"
    proc = subprocess.run([*TORCHRUN, "run", "--config", str(root / "small.yaml"), "--output", str(two),
                           "--retain-checkpoints"], capture_output=True, text=True, env=ENV, cwd=root, timeout=600)
    return one, two, proc


def test_two_ranks_train_step_for_step_like_one(runs):
    one, two, proc = runs
    assert (two / "eval" / "summary.json").is_file(), proc.stderr[-3000:]
    a, b = _stats(one / "mlperf.log"), _stats(two / "mlperf.log")
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5)
        # the step's loss is ~0 by construction (zero-mean group advantages, ratio 1):
        # compared absolutely, against per-token terms of size |A| ~ 1
        assert y["reduced_train_loss"] == pytest.approx(x["reduced_train_loss"], abs=1e-6)
        assert (y["reward"], y["global_valid_toks"], y["global_valid_seqs"]) == (x["reward"], x["global_valid_toks"], x["global_valid_seqs"])
    assert _accuracies(two / "mlperf.log") == _accuracies(one / "mlperf.log")
    assert _accuracies(one / "mlperf.log")[0][0] == 2 * 16  # the first checkpoint, step 2, was evaluated


def test_two_ranks_publish_the_same_checkpoints(runs):
    one, two, _ = runs
    steps = sorted(p.name for p in (one / "checkpoints").glob("step_*"))
    assert steps == sorted(p.name for p in (two / "checkpoints").glob("step_*")) == ["step_2", "step_3"]
    for step in steps:  # each rank wrote its own files: the same tensors, in other files
        files = {run: sorted((run / "checkpoints" / step).glob("*.safetensors")) for run in (one, two)}
        assert (len(files[one]), len(files[two])) == (1, 2)
        wa, wb = ({k: v for f in files[run] for k, v in load_file(f).items()} for run in (one, two))
        assert wa.keys() == wb.keys()
        for key in wa:
            torch.testing.assert_close(wb[key], wa[key], rtol=0, atol=1e-6)


def test_rank_0_alone_writes_a_log_that_describes_the_layout(runs):
    one, two, _ = runs
    from test_pipeline import official_check

    text = official_check(two / "mlperf.log")
    assert "SUCCESS" in text, text
    values = {e.key: e.value for e in read_log(two / "mlperf.log").events}
    assert values["data_parallelism"] == 2
    assert values["gradient_accumulation_steps"] == 16 // (2 * 4)
    assert {e.key: e.value for e in read_log(one / "mlperf.log").events}["data_parallelism"] == 1
    assert sum(1 for e in read_log(two / "mlperf.log").events if e.key == "run_start") == 1


def test_a_rank_killed_mid_run_takes_the_job_down_leaving_complete_checkpoints(tmp_path):
    config = tmp_path / "long.yaml"
    config.write_text(SMALL.replace("max_steps: 3", "max_steps: 200"))
    run = tmp_path / "run"
    proc = subprocess.Popen([*TORCHRUN, "train", "--config", str(config), "--output", str(run)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV, cwd=tmp_path)
    deadline = time.monotonic() + 300
    while not (run / "checkpoints" / "step_3").is_dir():
        assert proc.poll() is None and time.monotonic() < deadline, "training did not reach step 3"
        time.sleep(0.2)
    rank1 = _rank_pid(proc.pid, rank=1)
    os.kill(rank1, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0
    from test_faults_train import assert_published_checkpoints_intact

    steps = assert_published_checkpoints_intact(run / "checkpoints")
    assert steps[:2] == [2, 3] and steps == list(range(2, 2 + len(steps))) and steps[-1] < 200
    assert main(["evaluate", str(run)]) in (0, 3)  # evaluable up to its last published step
    summary = json.loads((run / "eval" / "summary.json").read_text())
    assert summary["status"] in ("success", "aborted")


def test_ctrl_c_under_torchrun_is_our_line_per_rank_rank_0s_note_and_exit_130(tmp_path):
    """Ctrl-C (SIGINT to the whole foreground process group) during training under
    ``python -m mlperf_grpo.torchrun``: each rank's one line, one note (rank 0's, naming
    the checkpoints published on disk), no traceback, exit 130. Plain torchrun ended with
    its agent's SignalException traceback and exit 1, and rank 1 printed a note too."""
    config = tmp_path / "long.yaml"
    config.write_text(SMALL.replace("max_steps: 3", "max_steps: 200"))
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "mlperf_grpo.torchrun", *TORCHRUN[3:], "train", "--config",
                             str(config), "--output", str(run)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=ENV, cwd=tmp_path, start_new_session=True)
    deadline = time.monotonic() + 300
    while not (run / "checkpoints" / "step_3").is_dir():
        assert proc.poll() is None and time.monotonic() < deadline, "training did not reach step 3"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # as the terminal's Ctrl-C: torchrun and both ranks
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr, stderr
    # rank 1's line may land after rank 0's progress bar on the same line (no newline after a bar's \r)
    ours = [m.group(0) for m in re.finditer(r"(?:mlperf-grpo:|note:)[^\r\n]*", stderr)]
    assert "mlperf-grpo: interrupted (Ctrl-C)" in ours, stderr
    assert len([line for line in ours if line.startswith("mlperf-grpo: rank 1: ")]) == 1, stderr  # (its collective may fail first)
    from test_faults_train import assert_published_checkpoints_intact

    steps = assert_published_checkpoints_intact(run / "checkpoints")
    notes = [line for line in ours if line.startswith("note:")]
    assert notes == [f"note: training ended early with checkpoints step_2..step_{steps[-1]} published and no run_stop: "
                     f"'mlperf-grpo evaluate {run}' evaluates them and writes the run's run_stop"], stderr
    assert len(ours) == 3, stderr


def _rank_pid(torchrun_pid: int, rank: int) -> int:
    """The pid of the worker with ``RANK=rank`` among torchrun's descendants."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if f"RANK={rank}".encode() in env and _descends(ppid, torchrun_pid):
            return int(proc.name)
    raise AssertionError(f"no rank {rank} worker under pid {torchrun_pid}")


def _descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
    return False


def test_the_sharded_build_refuses_a_merge_it_does_not_perform(tmp_path, monkeypatch):
    """A conversion other than stacking experts and concatenating their parts (here a
    stack along dim 1) is refused in one line before anything is read, naming the way
    out, instead of loading wrong rows."""
    from test_model_errors import _saved_model
    from transformers import conversion_mapping
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    from mlperf_grpo.errors import ModelLoadError

    directory = _saved_model(tmp_path, "qwen3_moe", **MOE_SIZES)
    odd = [WeightConverter(source_patterns=["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"],
                           target_patterns="mlp.experts.gate_up_proj", operations=[MergeModulelist(dim=0), Concatenate(dim=1)]),
           WeightConverter(source_patterns="mlp.experts.*.down_proj.weight", target_patterns="mlp.experts.down_proj",
                           operations=[MergeModulelist(dim=1)])]
    monkeypatch.setattr(conversion_mapping, "get_model_conversion_mapping", lambda model, *a, **k: odd)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        with pytest.raises(ModelLoadError, match=r"is merged into model\.layers\.\d\.mlp\.experts\.down_proj by "
                                                 r"\['MergeModulelist'\].*train it in one process"):
            fsdp.load_sharded_policy(str(directory), "cpu", None, activation_checkpointing=False)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("model_type, sizes", [
    ("gpt_neox", {"hidden_size": 64, "intermediate_size": 128, "tie_word_embeddings": False}),  # gpt_neox.layers; embed_out saved for lm_head
    ("gpt2", {"n_embd": 64}),  # transformer.h
])
def test_the_sharded_build_takes_other_layer_lists_and_saved_names(tmp_path, model_type, sizes):
    """Models whose decoder layers are not ``model.layers``, and whose output head is saved
    under another name than its parameter (GPT-NeoX's ``embed_out``), shard and load to
    ``load_model``'s parameters (they used to be refused: "no model.layers")."""
    from test_model_errors import _saved_model

    directory = _saved_model(tmp_path, model_type, **sizes)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        policy = fsdp.load_sharded_policy(str(directory), "cpu", None, activation_checkpointing=True)
        got = {fsdp._plain_name(n): t.full_tensor() for n, t in policy.state_dict().items()}
    finally:
        dist.destroy_process_group()
    expected = load_model(str(directory), "float32").state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
