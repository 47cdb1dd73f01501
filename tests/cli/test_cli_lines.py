"""The CLI's stop and note lines under torchrun: one write each, tagged with the rank.

torchrun's ranks share one stderr; a line written in two pieces (``print`` writes the
newline separately when stderr is unbuffered) can run into another rank's line, as two
ranks' "training ended early" notes did after a SIGTERM to torchrun.
"""

import argparse
import contextlib
import signal

import pytest

from mlperf_grpo.cli import app as cli
from mlperf_grpo.cli.commands import Progress


class _Writes:
    """A stderr that records each ``write`` call separately."""

    def __init__(self):
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass


@pytest.fixture
def rank_1(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("RANK", "1")


def _published_run(tmp_path):
    run = tmp_path / "run"
    for step in (2, 3):
        (run / "checkpoints" / f"step_{step}").mkdir(parents=True)
    (run / "checkpoints" / "tmp_step_4").mkdir()  # unfinished: not named
    return run


def test_only_rank_0_notes_the_published_checkpoints(tmp_path, monkeypatch, rank_1):
    """Rank 1 reads checkpoints/ while rank 0 may still publish those in flight: its note
    could name another list than the final one (it did under torchrun), so it says nothing."""
    run = _published_run(tmp_path)
    err = _Writes()
    monkeypatch.setattr("sys.stderr", err)
    cli._note_unfinished_run(Progress(phase="train", run_dir=run))
    assert err.writes == []
    monkeypatch.setenv("RANK", "0")
    cli._note_unfinished_run(Progress(phase="train", run_dir=run))
    assert err.writes == [
        f"note: training ended early with checkpoints step_2..step_3 published and no run_stop: "
        f"'mlperf-grpo evaluate {run}' evaluates them and writes the run's run_stop\n"
    ]


def test_rank_0_note_has_no_tag(tmp_path, monkeypatch):
    run = _published_run(tmp_path)
    err = _Writes()
    monkeypatch.setattr("sys.stderr", err)
    cli._note_unfinished_run(Progress(phase="train", run_dir=run))
    assert len(err.writes) == 1 and err.writes[0].startswith("note: training ended early with checkpoints step_2..step_3")


def test_a_stopped_rank_says_which_rank_it_is_in_one_write(tmp_path, monkeypatch, rank_1):
    """SIGTERM to a torchrun rank other than 0 during ``train``: its stop line is tagged,
    like its error lines, in one write, and is all it says (the note is rank 0's)."""
    run = _published_run(tmp_path)

    def stopped(args, progress):
        progress.phase, progress.run_dir = "train", run
        signal.raise_signal(signal.SIGTERM)  # the CLI's GracefulStop turns it into Terminated

    args = argparse.Namespace(command="train")
    monkeypatch.setattr(cli, "build_parser", lambda: argparse.Namespace(parse_args=lambda argv: args))
    monkeypatch.setitem(cli.COMMANDS, "train", stopped)
    monkeypatch.setattr(cli, "_process_group", lambda args: contextlib.nullcontext())  # no process group joined
    err = _Writes()
    monkeypatch.setattr("sys.stderr", err)
    assert cli.main([]) == cli.EXIT_TERMINATED
    assert err.writes[0] == "mlperf-grpo: rank 1: stopped by SIGTERM\n"
    assert len(err.writes) == 1


@pytest.mark.parametrize("rank_exit, shell_exit", [(2, 2), (3, 3), (1, 1), (-9, 137), (-15, 143)])
def test_a_failed_ranks_code_is_reported_as_a_shell_would(rank_exit, shell_exit):
    """``python -m mlperf_grpo.torchrun``: torchrun records a rank killed by signal N as -N."""
    from mlperf_grpo.torchrun import exit_code_of_failure

    assert exit_code_of_failure(rank_exit) == shell_exit


@pytest.mark.parametrize("argv, line", [
    (["evaluate", "--workers", "0", "run"],
     "mlperf-grpo: error: evaluate: argument --workers: must be a whole number >= 1, got '0' "
     "(see 'mlperf-grpo evaluate --help')\n"),
    (["plan", "--dtype", "int8"],
     "mlperf-grpo: error: plan: argument --dtype: invalid choice: 'int8' (choose from 'bfloat16', 'float32') "
     "(see 'mlperf-grpo plan --help')\n"),
    (["merge", "--train", "a.log"],
     "mlperf-grpo: error: merge: the following arguments are required: --eval, --output/-o "
     "(see 'mlperf-grpo merge --help')\n"),
    (["bogus"], None),
    ([], "mlperf-grpo: error: the following arguments are required: COMMAND (see 'mlperf-grpo --help')\n"),
])
def test_a_refused_command_line_is_one_line_and_exit_2(capsys, argv, line):
    """argparse's refusal (a new-user trial): one ``mlperf-grpo: error:`` line naming the
    subcommand, not the usage block and ``mlperf-grpo evaluate: error:``."""
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "usage:" not in captured.err
    assert captured.err.startswith("mlperf-grpo: error: ")
    if line is not None:
        assert captured.err == line
