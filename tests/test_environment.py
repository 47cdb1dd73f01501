"""The one parser of the rules' environment variables (environment.py)."""

import re
from pathlib import Path

import pytest

from mlperf_grpo import environment
from mlperf_grpo.errors import BAD_INPUT_ERRORS, EnvironmentVariableError


@pytest.mark.parametrize("value, deferred", [(None, True), ("", True), ("  ", True), ("1", True), ("0", False)])
def test_deferred_offline_eval(monkeypatch, value, deferred):
    if value is None:
        monkeypatch.delenv("DEFERRED_OFFLINE_EVAL", raising=False)
    else:
        monkeypatch.setenv("DEFERRED_OFFLINE_EVAL", value)
    assert environment.deferred_offline_eval() is deferred


@pytest.mark.parametrize("value, flag, keep", [(None, False, False), ("0", False, False), ("0", True, True),
                                               ("1", False, True), ("", False, False)])
def test_retain_checkpoints(monkeypatch, value, flag, keep):
    if value is None:
        monkeypatch.delenv("RETAIN_GRPO_CHECKPOINTS", raising=False)
    else:
        monkeypatch.setenv("RETAIN_GRPO_CHECKPOINTS", value)
    assert environment.retain_checkpoints(flag) is keep


@pytest.mark.parametrize("name, read", [("DEFERRED_OFFLINE_EVAL", environment.deferred_offline_eval),
                                        ("RETAIN_GRPO_CHECKPOINTS", lambda: environment.retain_checkpoints(True))])
def test_a_bad_switch_is_bad_input_naming_both_values(monkeypatch, name, read):
    monkeypatch.setenv(name, "yes")
    with pytest.raises(EnvironmentVariableError, match=rf"^{name} must be 0 \(.*\) or 1 \(.*\), got 'yes'$") as err:
        read()
    assert isinstance(err.value, BAD_INPUT_ERRORS)  # exit 2


@pytest.mark.parametrize("value", [" 0 ", "1 ", "\t1", "0\n"])
@pytest.mark.parametrize("name, read", [("DEFERRED_OFFLINE_EVAL", environment.deferred_offline_eval),
                                        ("RETAIN_GRPO_CHECKPOINTS", lambda: environment.retain_checkpoints(True))])
def test_a_switch_with_spaces_around_its_value_is_refused(monkeypatch, name, read, value):
    """Issue 44: the docs say any other value than 0 or 1 is refused; ' 0 ' was read as 0."""
    monkeypatch.setenv(name, value)
    with pytest.raises(EnvironmentVariableError, match=rf"^{name} must be 0 .* got {re.escape(repr(value))}$"):
        read()


def test_mllog_file_with_spaces_around_its_value_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("MLPERF_MLLOG_FILE", f" {tmp_path / 'x.log'} ")
    with pytest.raises(EnvironmentVariableError, match="MLPERF_MLLOG_FILE has spaces around its value"):
        environment.mllog_file(tmp_path / "mlperf.log")


def test_mllog_file(monkeypatch, tmp_path):
    monkeypatch.delenv("MLPERF_MLLOG_FILE", raising=False)
    assert environment.mllog_file(tmp_path / "mlperf.log") == tmp_path / "mlperf.log"
    monkeypatch.setenv("MLPERF_MLLOG_FILE", " ")
    assert environment.mllog_file(tmp_path / "mlperf.log") == tmp_path / "mlperf.log"
    monkeypatch.setenv("MLPERF_MLLOG_FILE", "/x/launcher.log")
    assert environment.mllog_file(tmp_path / "mlperf.log") == Path("/x/launcher.log")


def test_environment_and_errors_import_no_torch():
    import subprocess
    import sys

    code = "import sys, mlperf_grpo.environment, mlperf_grpo.errors, mlperf_grpo.evaluate.outcome, mlperf_grpo.step_dirs; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
