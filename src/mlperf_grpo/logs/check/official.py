"""The official ``mlperf-logging`` checkers, called through their Python API.

* compliance: ``mlp_compliance.make_checker`` + ``mlp_compliance.main`` with
  ``training_6.1.0/common.yaml``; the division config (closed/open) is chosen by the
  checker itself from the log's ``submission_division``.
* summarizer time-to-train: ``result_summarizer._read_result_file`` and
  ``_query_run_start_stop`` (what ``compute_score`` does per file). ``compute_score``
  itself crashes on 6.1.0: ``_compute_strong_score_standalone(return_full_scores=True)``
  returns 5 values and its ``__main__`` unpacks 4.
* RCP samples to converge: ``rcp_checker.read_submission_file``.

The checkers log through the root ``logging`` logger and can raise on odd input; every
function here captures the messages and turns a crash into a result, never an exception.
They can also take unbounded time (line normalisation is quadratic in line length, in C
code no alarm interrupts): :func:`run_official` runs all three in a child process that is
killed after a time limit, and a timeout is a result too (verdict ``TIMEOUT``).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import multiprocessing
from dataclasses import dataclass, field
from pathlib import Path

USAGE = "training"
RULESET = "6.1.0"
_SEPARATOR = "\n" + "-" * 30 + "\n"
TOKEN = ":::MLLOG "
"""What the official parser looks for in a line (``mlp_parser.ruleset_610.TOKEN``)."""


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def _captured_logging():
    """Route the root logger's records into a list (and nowhere else) for the duration."""
    root = logging.getLogger()
    capture = _Capture()
    saved_handlers, saved_level = root.handlers[:], root.level
    root.handlers = [capture]
    root.setLevel(logging.INFO)
    try:
        yield capture
    finally:
        root.handlers = saved_handlers
        root.setLevel(saved_level)


@dataclass
class ComplianceResult:
    """The compliance checker's verdict on one log.

    ``valid`` is its SUCCESS/FAILED; ``messages`` its warnings and errors, one string
    each; ``configs`` the rule files it applied (the division shows there);
    ``crashed`` the exception text when the checker itself raised (then ``valid`` is False).
    """

    valid: bool
    messages: list[str] = field(default_factory=list)
    configs: list[str] = field(default_factory=list)
    crashed: str | None = None
    not_run: str | None = None
    """Why the checker was not run, or did not finish: ``TIMEOUT`` or ``SKIPPED`` verdicts."""
    timed_out: bool = False
    file_lines: list[int] = field(default_factory=list)
    """The file line (1-based) of each line the checker numbers: its messages' "line N" is
    the 0-based index among the lines holding ``:::MLLOG`` (:func:`official_file_lines`)."""

    def file_line(self, official_line: int) -> int | None:
        """The file line of the checker's "line ``official_line``", or None when unknown."""
        return self.file_lines[official_line] if 0 <= official_line < len(self.file_lines) else None

    @property
    def verdict(self) -> str:
        if self.timed_out:
            return "TIMEOUT"
        if self.not_run:
            return "SKIPPED"
        return "SUCCESS" if self.valid else ("CRASHED" if self.crashed else "FAILED")

    @property
    def division(self) -> str | None:
        for c in self.configs:
            name = Path(c).name
            for division in ("closed", "open"):
                if name.startswith(f"{division}_") and name != f"{division}_common.yaml":
                    return division
        return None


def official_file_lines(path: Path) -> list[int]:
    """The file line (1-based) of each line the compliance checker numbers.

    Its parser (``mlp_parser.ruleset_610.parse_generator``) reads the file as latin-1 with
    universal newlines, keeps the lines containing ``':::MLLOG '`` (``strip_and_dedup``)
    and numbers them from 0: "line 80" is the 81st such line, not file line 80. Empty when
    the file cannot be read (then a message shows the checker's own index).
    """
    try:
        with open(path, encoding="latin-1") as f:
            return [n for n, line in enumerate(f, start=1) if TOKEN in line]
    except OSError:
        return []


def run_compliance(path: Path, ruleset: str = RULESET) -> ComplianceResult:
    """Run the official compliance checker (training, ``ruleset``) on one log file."""
    from mlperf_logging.compliance_checker import mlp_compliance

    mlp_compliance.enqueued_configs.clear()  # module-global queue; a crashed run may leave entries
    with _captured_logging() as capture:
        try:
            checker = mlp_compliance.make_checker(USAGE, ruleset, False, False)
            valid, *_ = mlp_compliance.main(str(path), f"{USAGE}_{ruleset}/common.yaml", checker)
            crashed = None
        except Exception as err:  # noqa: BLE001  (the checker raises on some malformed lines)
            valid, crashed = False, f"{type(err).__name__}: {err}"
    mlp_compliance.enqueued_configs.clear()
    messages, configs = [], []
    for record in capture.records:
        text = record.getMessage().strip()
        if record.levelno >= logging.WARNING:
            messages.extend(m.strip() for m in text.split(_SEPARATOR.strip()) if m.strip())
        elif text.startswith("Compliance checks:"):
            configs.append(text.split(":", 1)[1].strip())
    if crashed:
        messages.append(f"the compliance checker crashed: {crashed}")
    return ComplianceResult(valid=bool(valid), messages=messages, configs=configs, crashed=crashed,
                            file_lines=official_file_lines(path))


@dataclass
class SummarizerResult:
    """Time-to-train as the result summarizer computes it, or why it drops the run."""

    minutes: float | None
    note: str | None = None


def summarizer_time_to_train(path: Path, ruleset: str = RULESET) -> SummarizerResult:
    """Minutes from run_start to run_stop as ``result_summarizer`` scores one result file.

    The summarizer first re-runs the compliance checker and drops the run (no score)
    when it fails or when any line does not parse; then it takes the first ``run_stop``
    and the last ``run_start`` before it, ``(stop - start) / 60000``.
    """
    from mlperf_logging.compliance_checker import mlp_compliance
    from mlperf_logging.result_summarizer import result_summarizer as rs

    mlp_compliance.enqueued_configs.clear()
    with _captured_logging():
        try:
            loglines = rs._read_result_file(str(path), USAGE, ruleset)
            start, stop = rs._query_run_start_stop(loglines)
        except ValueError as err:
            return SummarizerResult(None, f"dropped by the summarizer: {err}")
        except Exception as err:  # noqa: BLE001
            return SummarizerResult(None, f"the summarizer crashed: {type(err).__name__}: {err}")
        finally:
            mlp_compliance.enqueued_configs.clear()
    return SummarizerResult((stop - start) / 60 / 1000)


@dataclass
class RCPResult:
    """Samples to converge as the RCP checker reads one log.

    ``converged`` False means the RCP checker marks the run infinite (status not success).
    """

    samples: float | int | None
    converged: bool | None
    global_batch_size: object = None
    benchmark: object = None
    note: str | None = None


def rcp_samples_to_converge(path: Path, ruleset: str = RULESET) -> RCPResult:
    """``rcp_checker.read_submission_file``: the samples_count of the last line containing
    ``eval_accuracy`` before a ``run_stop`` with status success."""
    from mlperf_logging.rcp_checker import rcp_checker

    with _captured_logging():
        try:
            not_converged, samples, gbs, benchmark = rcp_checker.read_submission_file(str(path), ruleset, False)
        except Exception as err:  # noqa: BLE001  (it crashes on null values, missing metadata, run_stop first)
            return RCPResult(None, None, note=f"the RCP checker crashed: {type(err).__name__}: {err}")
    if not_converged:
        return RCPResult(None, False, gbs, benchmark, "RCP checker: run incomplete or did not converge (counted as infinite)")
    return RCPResult(samples, True, gbs, benchmark)


OFFICIAL_TIME_LIMIT_S = 60.0
"""Default limit for the three official checkers together on one log (seconds)."""


@dataclass
class OfficialResults:
    """The three official tools' results on one log."""

    compliance: ComplianceResult
    summarizer: SummarizerResult
    rcp: RCPResult


def _run_all(path: Path) -> OfficialResults:
    return OfficialResults(run_compliance(path), summarizer_time_to_train(path), rcp_samples_to_converge(path))


def _child(conn, path: str) -> None:  # runs in the forked child
    try:
        conn.send(_run_all(Path(path)))
    except BaseException as err:  # noqa: BLE001  (reported to the parent as a crash)
        conn.send(f"{type(err).__name__}: {err}")
    finally:
        conn.close()


def not_run(reason: str, *, timed_out: bool = False) -> OfficialResults:
    """Results for a log the official tools were not run on, or did not finish (``reason``, one line)."""
    return OfficialResults(ComplianceResult(False, [reason], not_run=reason, timed_out=timed_out),
                           SummarizerResult(None, f"no summarizer result: {reason}"),
                           RCPResult(None, None, note=f"no RCP checker result: {reason}"))


class _ParsedRuleFiles:
    """Stands in for the ``yaml`` module inside ``mlp_compliance``: each distinct rule-file
    text is parsed once per process and every ``load`` returns a deep copy of that parse.

    The compliance checker parses its rule files (``common.yaml``, the division's and the
    benchmark's) with pure-Python PyYAML on every run, and the summarizer runs it again:
    about half of the official tools' time on a normal log. The checker still opens and
    reads each file every time; the key is the text read, so the result is exactly
    ``yaml.load(text, Loader)``, and the copy keeps one run's changes from the next.
    Attributes other than ``load`` are the real ``yaml`` module's.
    """

    def __init__(self, yaml_module) -> None:
        self._yaml = yaml_module
        self._parsed: dict[tuple[str, object], object] = {}

    def __getattr__(self, name: str):
        return getattr(self._yaml, name)

    def load(self, stream, Loader):  # noqa: N803  (yaml.load's own argument name)
        text = stream if isinstance(stream, str) else stream.read()
        if (text, Loader) not in self._parsed:
            self._parsed[text, Loader] = self._yaml.load(text, Loader=Loader)
        return copy.deepcopy(self._parsed[text, Loader])

    def warm(self, folder: Path) -> None:
        """Parse every rule file in ``folder`` as the checker reads them (``open`` in text
        mode, ``BaseLoader``), so that children forked afterwards find them parsed."""
        for rule_file in sorted(folder.glob("*.yaml")):
            with open(rule_file) as f:
                self.load(f, Loader=self._yaml.BaseLoader)


def preload_checkers() -> None:
    """Import the three official tools (seconds, the first time) in this process, and
    parse the ruleset's rule files once (:class:`_ParsedRuleFiles`, about 0.1 s)."""
    from mlperf_logging.compliance_checker import mlp_compliance
    from mlperf_logging.rcp_checker import rcp_checker  # noqa: F401
    from mlperf_logging.result_summarizer import result_summarizer  # noqa: F401

    if not isinstance(mlp_compliance.yaml, _ParsedRuleFiles):
        rule_files = _ParsedRuleFiles(mlp_compliance.yaml)
        rule_files.warm(Path(mlp_compliance.__file__).parent / f"{USAGE}_{RULESET}")
        mlp_compliance.yaml = rule_files


def run_official(path: Path, time_limit_s: float = OFFICIAL_TIME_LIMIT_S) -> OfficialResults:
    """Compliance checker, summarizer and RCP checker on ``path`` within ``time_limit_s``.

    They run in a forked child process (``spawn`` where fork is unavailable); when it has
    not answered within the limit it is killed and every result says so (compliance
    verdict ``TIMEOUT``). A child that dies is a ``CRASHED`` compliance result. Never raises.
    """
    preload_checkers()  # once, here: a forked child then starts with them loaded and parsed
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(sender, str(path)), daemon=True)
    child.start()
    sender.close()
    try:
        answer = receiver.recv() if receiver.poll(time_limit_s) else None
    except (EOFError, OSError):
        answer = "the checkers' process died"
    finally:
        if child.is_alive():
            child.kill()
        child.join()
        receiver.close()
    if answer is None:
        return not_run(f"the official checkers did not finish within {time_limit_s:g} s (killed)", timed_out=True)
    if isinstance(answer, str):
        crashed = f"{answer} (exit code {child.exitcode})"
        return OfficialResults(ComplianceResult(False, [f"the compliance checker crashed: {crashed}"], crashed=crashed),
                               SummarizerResult(None, f"the summarizer crashed: {crashed}"),
                               RCPResult(None, None, note=f"the RCP checker crashed: {crashed}"))
    return answer
