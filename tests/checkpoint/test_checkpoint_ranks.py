"""Checkpoints written by every rank (CPU, gloo): the shard plan, the same published
directory as one rank, and a rank killed while it writes."""

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import load_file

import mlperf_grpo
from mlperf_grpo.checkpoint import (
    AsyncCheckpointer,
    CheckpointWriteError,
    RankGroup,
    TrainingInfo,
    engine_checkpoint_weights,
    read_training_info,
    write_checkpoint,
)
from mlperf_grpo.checkpoint.direct_io import ALIGNMENT_BYTES
from mlperf_grpo.checkpoint.format import END_FILE, INDEX_FILE
from mlperf_grpo.checkpoint.shard_plan import plan_shards, tensor_bytes
from mlperf_grpo.checkpoint.staging import unique_tensors

# what the spawned ranks import stays light (torch, the checkpoint package): not
# mlperf_grpo.model.load* or transformers, seconds per process on a busy machine
MODEL_DIR = Path(mlperf_grpo.__file__).parent / "assets" / "arithmetic-tiny"
"""The built-in model ``builtin:arithmetic-tiny`` (``mlperf_grpo.model.files.BUILTIN_MODEL_DIR``)."""
SHARD_BYTES = 40_000
"""Several files per rank of the tiny model (266 KB of bfloat16 weights)."""


def _info(step: int) -> TrainingInfo:
    return TrainingInfo(step, step * 4, 1_000 + step, step * 16, 16, 4, "bfloat16", [0.0])


def _weights() -> dict[str, torch.Tensor]:
    """The tiny model's bfloat16 weights, changed from the shipped ones so that no tensor
    is all zeros or ones, with ``lm_head.weight`` tied to the embeddings (the model's
    ``tie_word_embeddings``) as in its state dict."""
    torch.manual_seed(0)
    state = {n: (t.to(torch.bfloat16) + torch.randn(t.shape).to(torch.bfloat16))
             for n, t in load_file(MODEL_DIR / "model.safetensors").items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


# ---------------------------------------------------------------- the plan


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_each_tensor_has_one_owner_in_whole_files_and_no_rank_more_than_its_share_plus_one_tensor(world):
    sizes = [5000, 17, 40_000, 3, 3, 12_000, 999, 64_000, 1, 8000, 8000, 250]
    specs = [(f"t{i:02d}", torch.empty(n, dtype=torch.bfloat16, device="meta")) for i, n in enumerate(sizes)]
    plan = plan_shards(specs, world, max_shard_size=20_000)
    total, largest = sum(2 * n for n in sizes), 2 * max(sizes)
    owners = [owner for owner, _ in plan.files]
    assert owners == sorted(owners)  # rank 0's files first, then rank 1's, ...: one global numbering
    assert sorted(t for _, group in plan.files for t in group) == [n for n, _ in specs]  # each once
    for rank in range(world):
        owned = sum(tensor_bytes(t) for t in plan.owned(rank).values())
        assert owned <= total / world + largest, (rank, owned)
    names = plan.file_names()
    assert names[0] == f"model-00001-of-{len(names):05d}.safetensors" and len(set(names)) == len(names)
    assert set(plan.weight_map().values()) == set(names)


def test_the_tests_model_is_the_builtin_one():
    from mlperf_grpo.model.files import BUILTIN_MODEL_DIR
    from mlperf_grpo.model.load import load_model

    assert MODEL_DIR == BUILTIN_MODEL_DIR
    state = load_model("builtin:arithmetic-tiny", "bfloat16").state_dict()
    assert state.keys() == _weights().keys() and "lm_head.weight" not in unique_tensors(state)  # tied as here


def test_one_rank_plans_the_files_a_one_process_writer_always_wrote():
    state = unique_tensors(_weights())
    plan = plan_shards(state.items(), 1, max_shard_size=SHARD_BYTES)
    split = split_torch_state_dict_into_shards(state, max_shard_size=SHARD_BYTES)
    assert [list(group) for _, group in plan.files] == list(split.filename_to_tensors.values())
    assert plan.weight_map() == dict(sorted(split.tensor_to_filename.items()))


class _Engine:
    """The engine interface's checkpoint side (inference/base.py): ``weights()`` this
    rank's tensors (tied names sharing storage), ``full_weights()`` every full tensor in
    name order, fresh each time (a gather at ``tp_size > 1``)."""

    def __init__(self, state: dict[str, torch.Tensor], tp_size: int) -> None:
        self.state, self.tp_size, self.iterated = state, tp_size, 0

    def weights(self) -> dict[str, torch.Tensor]:
        return self.state

    def full_weights(self):
        for name in sorted(self.state):
            self.iterated += 1
            yield name, self.state[name].clone()


def test_a_replica_engine_is_staged_from_its_weights_and_a_sharded_one_from_its_full_weights():
    state = _weights()
    replica = _Engine(state, tp_size=1)
    assert engine_checkpoint_weights(replica) is state and replica.iterated == 0  # no communication
    sharded = _Engine(state, tp_size=2)
    pairs = list(engine_checkpoint_weights(sharded))
    assert [n for n, _ in pairs] == sorted(unique_tensors(state))  # the tied lm_head.weight once
    assert sharded.iterated == len(state)  # the collective is consumed to its end


# ---------------------------------------------------------------- N ranks write, rank 0 publishes


def _write_on_ranks(rank: int, world: int, init_file: str, root: str, out: str) -> None:
    os.environ["TORCHELASTIC_RUN_ID"] = "test"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    state = _weights()
    writer = AsyncCheckpointer(Path(root), MODEL_DIR, max_in_flight=2, max_shard_size=SHARD_BYTES,
                               group=RankGroup.of_process_group())
    writer.prepare(state)
    writer.save(state, _info(2))  # a state dict (a replica engine's weights())
    tied = state.keys() - unique_tensors(state).keys()
    pairs = lambda: ((n, state[n].clone()) for n in sorted(state) if n not in tied)  # noqa: E731  as full_weights() at T > 1
    writer.prepare(pairs())
    writer.save(pairs(), _info(3))
    slots = [{"flat": s.flat.numel(), "tensors": sum(tensor_bytes(t) for t in s.tensors.values()), "files": len(s.files)}
             for s in writer._slots]
    writer.finish()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"staged_bytes": writer.staged_bytes, "slots": slots,
                                                         "published": writer.published_steps}))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # see test_distributed._joined: gloo's workers at interpreter exit (pytorch/pytorch#190489)


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    index = json.loads((directory / INDEX_FILE).read_text())["weight_map"]
    out = {}
    for name in sorted(set(index.values())):
        out.update(load_file(directory / name))
    assert sorted(out) == sorted(index)
    return out


@torch.no_grad()
def _logits(directory: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    return model(input_ids=torch.arange(12).view(1, 12) * 5 % model.config.vocab_size).logits


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_publish_the_one_rank_checkpoint_each_staging_its_share(tmp_path, world):
    state = _weights()
    reference = write_checkpoint(tmp_path / "one", state, _info(2), MODEL_DIR, max_shard_size=SHARD_BYTES)
    mp.spawn(_write_on_ranks, args=(world, str(tmp_path / "pg"), str(tmp_path / "ranks"), str(tmp_path)),
             nprocs=world, join=True)
    want, want_info = _tensors(reference), read_training_info(reference)
    assert "lm_head.weight" not in want  # tied: stored once
    for step in (2, 3):  # from a state dict, and from (name, tensor) pairs
        got_dir = tmp_path / "ranks" / f"step_{step}"
        got = _tensors(got_dir)
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)  # bit-identical
        info = read_training_info(got_dir)
        assert info.weights["fingerprint"] == want_info.weights["fingerprint"]
        assert info.weights["tensors"] == want_info.weights["tensors"]
        owners = {json.loads((got_dir / INDEX_FILE).read_text())["weight_map"][n] for n in got}
        assert len(owners) >= world  # every rank wrote files of its own
        assert torch.equal(_logits(got_dir), _logits(reference))
    assert json.loads((tmp_path / "ranks" / END_FILE).read_text())["last_published_step"] == 3
    from test_faults_train import assert_published_checkpoints_intact  # every shard's recorded hash

    assert assert_published_checkpoints_intact(tmp_path / "ranks") == [2, 3]
    total = sum(tensor_bytes(t) for t in want.values())
    largest = max(tensor_bytes(t) for t in want.values())
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    assert reports[0]["published"] == [2, 3] and all(not r["published"] for r in reports[1:])
    for r in reports:
        assert r["staged_bytes"] == sum(s["flat"] for s in r["slots"])
        for slot in r["slots"]:
            assert slot["tensors"] <= total / world + largest
            # each file adds its header (under 4 KiB here) and the padding to 4 KiB boundaries
            assert slot["flat"] <= total / world + largest + 2 * ALIGNMENT_BYTES * slot["files"]


def _rank_1_fails_at_step_3(rank: int, world: int, init_file: str, root: str, out: str) -> None:
    os.environ["TORCHELASTIC_RUN_ID"] = "test"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    real = AsyncCheckpointer._write_shard

    def write_shard(path, shard, slot):
        if rank == 1 and path.parent.name == "tmp_step_3":
            raise OSError(errno.EIO, "Input/output error")
        return real(path, shard, slot)

    AsyncCheckpointer._write_shard = staticmethod(write_shard)
    state = _weights()
    writer = AsyncCheckpointer(Path(root), MODEL_DIR, max_in_flight=2, max_shard_size=SHARD_BYTES,
                               group=RankGroup.of_process_group())
    writer.prepare(state)
    errors = []
    for step in (2, 3, 4):
        try:
            writer.save(state, _info(step))
        except CheckpointWriteError as err:  # step 3's failure, seen at a later step boundary
            errors.append(f"save: {err}")
            break
    try:
        writer.finish()
    except CheckpointWriteError as err:
        errors.append(f"finish: {err}")
    Path(out, f"rank{rank}.json").write_text(json.dumps({"errors": errors, "published": writer.published_steps}))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


@pytest.mark.slow
def test_a_failed_write_on_another_rank_fails_the_step_on_rank_0_and_publishes_nothing_after_it(tmp_path):
    mp.spawn(_rank_1_fails_at_step_3, args=(2, str(tmp_path / "pg"), str(tmp_path / "ranks"), str(tmp_path)),
             nprocs=2, join=True)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0["published"] == [2]  # not step_3, nor step_4 past it
    assert sorted(p.name for p in (tmp_path / "ranks").iterdir()) == ["step_2", END_FILE]
    assert any("rank 1 could not write its part of step_3: cannot write checkpoint" in e and "Input/output error" in e
               for e in rank0["errors"]), rank0
    assert rank1["errors"] and all("tmp_step_3: Input/output error" in e for e in rank1["errors"]), rank1
    assert json.loads((tmp_path / "ranks" / END_FILE).read_text())["reason"] == "write_failed"


# ---------------------------------------------------------------- a rank killed while it writes

SMALL = """\
grpo: {num_prompts_per_step: 4, num_generations_per_prompt: 4, max_steps: 6, micro_batch_size: 4, first_eval_step: 2}
validation: {generations_per_task: 4, temperature: 1.0, top_p: 1.0}  # passes at step 2
task: {num_train_tasks: 64}
"""

RANK_1_HANGS_IN_STEP_3 = textwrap.dedent(
    """
    import os, sys, threading
    from pathlib import Path
    from mlperf_grpo.checkpoint import rank_group
    from mlperf_grpo.checkpoint.writer import AsyncCheckpointer
    from mlperf_grpo.cli import main
    rank_group.STALL_S = 2.0  # rank 0 takes a silent rank for dead sooner than the default
    real = AsyncCheckpointer._write_shard
    def write_shard(path, shard, slot):
        if os.environ["RANK"] == "1" and path.parent.name == "tmp_step_3":
            (Path(sys.argv[1]) / "rank1_writes_step_3").touch()  # the test kills this rank now
            threading.Event().wait()
        return real(path, shard, slot)
    AsyncCheckpointer._write_shard = staticmethod(write_shard)
    sys.exit(main(sys.argv[2:]))
    """
)


@pytest.mark.slow
def test_a_rank_killed_while_it_writes_publishes_nothing_half_written(tmp_path):
    from test_distributed import ENV, _rank_pid
    from test_faults_train import assert_published_checkpoints_intact

    from mlperf_grpo.cli import main

    (tmp_path / "small.yaml").write_text(SMALL)
    (tmp_path / "hang.py").write_text(RANK_1_HANGS_IN_STEP_3)
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(tmp_path / "hang.py"), str(tmp_path), "train", "--config", str(tmp_path / "small.yaml"),
                             "--output", str(run)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=ENV, cwd=tmp_path)
    deadline = time.monotonic() + 300
    # rank 1 is inside its write of step 3, and step 2 (written by another writer thread) is out
    while not ((tmp_path / "rank1_writes_step_3").exists() and (run / "checkpoints" / "step_2").is_dir()):
        assert proc.poll() is None and time.monotonic() < deadline, "rank 1 did not reach its write of step 3"
        time.sleep(0.05)
    os.kill(_rank_pid(proc.pid, rank=1), signal.SIGKILL)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert assert_published_checkpoints_intact(run / "checkpoints") == [2]  # step_3 (and later) not published
    end = json.loads((run / "checkpoints" / END_FILE).read_text())  # rank 0 gave up on rank 1 and said so
    assert (end["last_published_step"], end["reason"]) == (2, "write_failed"), stderr[-3000:]
    assert main(["evaluate", str(run)]) == 0  # the published series, as today: step 2 passes
    summary = json.loads((run / "eval" / "summary.json").read_text())
    assert summary["status"] == "success"
