"""The log writer commits whole groups of lines; the reader never crashes."""

import json
import os

from mlperf_grpo.logs import mllog
from mlperf_grpo.logs.mllog import MLLogWriter, parse_log_text, read_log, time_to_train_ms


def test_lines_reach_the_file_only_on_commit(tmp_path):
    path = tmp_path / "log.txt"
    w = MLLogWriter(path)
    w.start("run_start", time_ms=1000)
    w.event("eval_accuracy", 0.5, metadata={"samples_count": 256}, time_ms=1500)
    assert path.read_text() == ""
    w.commit()
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    d = json.loads(lines[1].removeprefix(":::MLLOG "))
    assert d["key"] == "eval_accuracy" and d["value"] == 0.5 and d["time_ms"] == 1500
    assert d["metadata"]["samples_count"] == 256
    assert d["metadata"]["file"].endswith("test_mllog.py")  # the caller, not our wrapper


def test_a_non_durable_commit_writes_without_fsync_and_sync_makes_it_durable(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(mllog.os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    path = tmp_path / "log.txt"
    w = MLLogWriter(path)
    w.start("block_start", metadata={"samples_count": 0}, time_ms=1000)
    w.commit(durable=False)  # the trainer's per-step events: in the file, no fsync on the clock
    assert len(path.read_text().splitlines()) == 1 and synced == []
    w.sync()  # the checkpoint writer, before it publishes
    assert synced == [str(path)]
    w.end("block_stop", metadata={"samples_count": 256}, time_ms=2000)
    w.commit()  # durable by default
    assert len(path.read_text().splitlines()) == 2 and synced == [str(path)] * 2


def test_reader_and_time_to_train(tmp_path):
    path = tmp_path / "log.txt"
    w = MLLogWriter(path)
    w.start("run_start", time_ms=1000)
    w.end("run_stop", metadata={"status": "success"}, time_ms=61000)
    w.commit()
    log = read_log(path)
    assert [e.key for e in log.events] == ["run_start", "run_stop"]
    assert time_to_train_ms(log) == 60000


def test_reader_reports_bad_json_lines():
    log = parse_log_text('noise\n:::MLLOG {"key": "a", "value": 1}\n:::MLLOG {broken\n')
    assert [e.key for e in log.events] == ["a"]
    assert log.bad_lines[0][0] == 3
