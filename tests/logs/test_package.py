"""`mlperf-grpo package`: refusals (fast) and three closed runs packaged end to end (slow)."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mlperf_grpo.cli import main
from mlperf_grpo.logs.mllog import read_log
from mlperf_grpo.logs.package import olympic_score_min

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_fewer_than_three_runs_is_refused(tmp_path, capsys):
    assert main(["package", str(tmp_path / "a"), str(tmp_path / "b"), "--system", "s", "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "needs 3 runs; got 2" in err and err.count("\n") == 1


def test_run_dir_without_log_is_refused(tmp_path, capsys):
    runs = []
    for i in range(3):
        d = tmp_path / f"r{i}"
        d.mkdir()
        (d / "config.yaml").write_text("division: open\n")
        (d / "run.json").write_text(f'{{"mllog_file": "{d / "mlperf.log"}"}}\n')
        runs.append(str(d))
    assert main(["package", *runs, "--system", "s", "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "no MLPerf log at" in err and err.count("\n") == 1
    assert main(["package", str(tmp_path), *runs[:2], "--system", "s", "--output", str(tmp_path / "o")]) == 2
    assert "is not a run directory" in capsys.readouterr().err


def test_olympic_score_drops_fastest_and_slowest():
    assert olympic_score_min([60000, 120000, 600000]) == 2.0
    assert olympic_score_min([60000, None, 120000]) == 2.0  # unconverged run counts as slowest
    assert olympic_score_min([60000, None, None]) is None
    assert olympic_score_min([60000, 120000, 180000], scaling_factor=1.5) == 3.0


@pytest.mark.slow
def test_three_closed_runs_pass_the_official_checkers(tmp_path, capsys, monkeypatch):
    """Closed runs of the built-in pipeline: run 0 deferred (the default), runs 1-2 inline
    (DEFERRED_OFFLINE_EVAL=0). Each log must be accepted as closed by the compliance
    checker; the package must pass package_checker and rcp_checker; the scores must match."""
    base = yaml.safe_load((CONFIGS / "closed-gbs256.yaml").read_text())
    runs = []
    for i, seed in enumerate((1, 2, 3)):
        cfg = tmp_path / f"closed{seed}.yaml"
        cfg.write_text(yaml.safe_dump({**base, "seed": seed, "grpo": {**base["grpo"], "max_steps": 22}}))
        run = tmp_path / f"run{seed}"
        monkeypatch.setenv("DEFERRED_OFFLINE_EVAL", "1" if i == 0 else "0")
        assert main(["run", "--config", str(cfg), "--output", str(run)]) == 0
        runs.append(str(run))
    capsys.readouterr()
    check = subprocess.run(
        [sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training", "--ruleset", "6.1.0",
         "--log_output", str(tmp_path / "cc.log"), str(Path(runs[1]) / "mlperf.log")],
        capture_output=True, text=True, cwd=tmp_path)
    assert "closed_qwen35_397b_grpo.yaml" in check.stdout + check.stderr
    assert "SUCCESS" in check.stdout + check.stderr

    # The runs trained with the reference algorithm, and say so in the log as the reference does.
    log = read_log(Path(runs[0]) / "mlperf.log")
    assert log.first_value("truncated_importance_sampling_type") == "seq-mask-tis"
    assert (log.first_value("truncated_importance_sampling_ratio_min"), log.first_value("truncated_importance_sampling_ratio")) == (0.999, 1.002)
    tracked = {ev.metadata["step"]: ev.value for ev in log.find("tracked_stats")}
    assert [tracked[s]["rollout_weights_version"] for s in (1, 2, 3, 10)] == [0, 0, 1, 8]  # one-step-async
    assert all(v["exposed_generation_time"] >= 0 and v["weight_sync_time"] >= 0 for v in tracked.values())
    # our checker (official checkers + offline-eval lint) is clean on the deferred run
    assert main(["check", str(Path(runs[0]) / "mlperf.log")]) == 0, capsys.readouterr().out

    monkeypatch.chdir(tmp_path)  # relative paths, as a user types them
    out = tmp_path / "submission"
    code = main(["package", *[Path(r).name for r in runs], "--system", "tiny_cpu", "--output", "submission"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "package_checker: PASS" in text and "rcp_checker: PASS" in text and "result_summarizer: PASS" in text
    assert (out / "results/tiny_cpu/qwen35_397b_grpo/result_2.txt").is_file()
    assert (out / "systems/tiny_cpu.json").is_file()
    ours, theirs = re.search(r"score \(olympic mean time-to-train\): ([\d.]+) min; summarizer: ([\d.]+) min \(match\)", text).groups()
    assert abs(float(ours) - float(theirs)) < 1e-6
    assert len(re.findall(r"result_\d\.txt: success, samples_count \d+", text)) == 3


def test_the_same_run_directory_twice_is_refused(tmp_path, capsys):
    run = tmp_path / "r"
    run.mkdir()
    assert main(["package", str(run), str(run), str(tmp_path / "." / "r"), "--system", "s", "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "is given twice" in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_implementation_folder_holds_what_reproduces_the_run(tmp_path):
    from mlperf_grpo.logs.package import _copy_source, project_root

    root = project_root()
    dest = tmp_path / "impl"
    _copy_source(root, dest)
    for name in ("pyproject.toml", "README.md", "configs/closed-gbs256.yaml", "src/mlperf_grpo/cli/app.py"):
        assert (dest / name).is_file(), name
    assets = sorted(p.relative_to(root / "src") for p in (root / "src/mlperf_grpo/assets").rglob("*") if p.is_file())
    assert assets and all((dest / "src" / a).is_file() for a in assets)
    assert not list(dest.rglob("__pycache__"))


@pytest.mark.parametrize("where", ["under-a-file", "read-only"])
def test_an_output_that_cannot_be_written_is_one_line_before_anything_runs(tmp_path, capsys, where):
    """Issue 44: package --output on a read-only file system gave the raw errno text, exit 1."""
    if where == "under-a-file":
        (tmp_path / "a-file").write_text("mine\n")
        output = tmp_path / "a-file" / "submission"
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ro)], capture_output=True).returncode:
            pytest.skip("cannot mount a read-only tmpfs here (needs root)")
        output = ro / "submission"
    try:
        runs = [str(tmp_path / f"r{i}") for i in range(3)]
        assert main(["package", *runs, "--system", "s", "--output", str(output)]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith(f"mlperf-grpo: error: --output {output}: ") and "choose a folder this user may write" in line
    finally:
        if where == "read-only":
            subprocess.run(["umount", str(tmp_path / "ro")])


OPEN_PASSING = {1: 4, 3: 4, 4: 4}
"""Open runs that pass (seed: max_steps), measured on CPU: the built-in model at learning
rate 3e-5 passes at step 4 (seeds 1 and 4) and 3 (seed 3); 251 validation tasks, as the
package checker needs."""


@pytest.fixture(scope="module")
def open_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("open_package")
    runs = []
    for seed, steps in OPEN_PASSING.items():
        cfg = base / f"open{seed}.yaml"
        cfg.write_text(yaml.safe_dump({"division": "open", "seed": seed, "optimizer": {"learning_rate": 3e-5},
                                       "grpo": {"num_prompts_per_step": 2, "max_steps": steps, "first_eval_step": 1,
                                                "micro_batch_size": 32}}))
        assert main(["run", "--config", str(cfg), "--output", str(base / f"run{seed}")]) == 0
        runs.append(base / f"run{seed}")
    return runs


@pytest.mark.slow
def test_open_runs_are_packaged_without_the_rcp_check(open_runs, tmp_path, capsys):
    """Issue 44: package of open runs exited 1 on the RCP check, which the official package
    checker runs for the closed division only."""
    capsys.readouterr()
    code = main(["package", *map(str, open_runs), "--system", "tiny_cpu", "--output", str(tmp_path / "o")])
    text = capsys.readouterr().out
    assert "(system tiny_cpu, open division)" in text and "rcp_checker: SKIPPED" in text, text
    assert "package_checker: PASS" in text and code == 0, text
    assert not (tmp_path / "o" / "checker_logs" / "rcp_checker.txt").exists()


@pytest.mark.slow
def test_two_copies_of_one_run_are_refused(open_runs, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(open_runs[0], copy)
    (copy / "run.json").write_text(json.dumps({"mllog_file": "mlperf.log"}))
    assert main(["package", str(open_runs[0]), str(copy), str(open_runs[1]), "--system", "s",
                 "--output", str(tmp_path / "o")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert f"{copy} and {open_runs[0]} hold the same run" in line, line
    assert not (tmp_path / "o").exists()
