"""Test logs -> ``{test name: status}``, the way each reference reads them.

Statuses are pytest's words: ``PASSED``, ``FAILED``, ``ERROR``, ``SKIPPED``, ``XFAIL``,
``XPASS``. Three readers:

- ``pytest-r2e``: R2E-Gym's ``parse_log_pytest``
  (``src/r2egym/repo_analysis/execution_log_parser.py``): only the part after
  ``short test summary info`` (``pytest -rA``) counts; a line holding ``PASSED`` /
  ``FAILED`` / ``ERROR`` names the test by its ``::`` parts after the file joined with
  ``.``, cut at `` - `` (``r2e_tests/test_1.py::TestX::test_y`` -> ``TestX.test_y``).
  ANSI colour codes are removed first, as R2E-Gym's ``run_tests`` does.
- ``pytest-swebench``: SWE-bench's ``parse_log_pytest``
  (``swebench/harness/log_parsers``): a line starting with a status word names the test
  by its second field, the full node id (``pkg/test_a.py::test_b[1]``).
- ``unittest``: ``python -m unittest -v`` (the tiny suite, so a sandbox needs nothing but
  ``python3``): ``name (module.Class.name) ... ok`` -> ``module.Class.name: PASSED``;
  ``FAIL`` -> FAILED, ``ERROR`` -> ERROR, ``skipped ...`` -> SKIPPED, ``expected
  failure`` -> XFAIL, ``unexpected success`` -> XPASS. Python 3.10 writes the id without
  the method (``(module.Class)``); the method name is appended then.
"""

from __future__ import annotations

import re

STATUSES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
_ANSI = re.compile(r"\x1b\[[0-9;]*m|\r")
_UNITTEST_OUTCOMES = {"ok": "PASSED", "FAIL": "FAILED", "ERROR": "ERROR", "expected failure": "XFAIL",
                      "unexpected success": "XPASS"}


def strip_ansi(log: str) -> str:
    """``log`` without ANSI colour codes and carriage returns (R2E-Gym's ``run_tests``)."""
    return _ANSI.sub("", log)


def parse_pytest_r2e(log: str) -> dict[str, str]:
    """R2E-Gym's reading of a ``pytest -rA`` log (see the module docstring)."""
    statuses: dict[str, str] = {}
    log = strip_ansi(log)
    if "short test summary info" not in log:
        return statuses
    for line in log.split("short test summary info", 1)[1].strip().split("\n"):
        for status in ("PASSED", "FAILED", "ERROR"):
            if status in line:
                statuses[".".join(line.split("::")[1:]).split(" - ")[0]] = status
                break
    return statuses


def parse_pytest_swebench(log: str) -> dict[str, str]:
    """SWE-bench's reading of a ``pytest -rA`` log (see the module docstring)."""
    statuses: dict[str, str] = {}
    for line in strip_ansi(log).split("\n"):
        if not any(line.startswith(s) for s in STATUSES):
            continue
        if line.startswith("FAILED"):
            line = line.replace(" - ", " ")
        fields = line.split()
        if len(fields) > 1:
            statuses[fields[1]] = fields[0]
    return statuses


def parse_unittest(log: str) -> dict[str, str]:
    """``python -m unittest -v`` log -> ``{module.Class.method: status}``.

    A test whose docstring ``-v`` prints puts ``... outcome`` on the next line; both forms
    are read.
    """
    statuses: dict[str, str] = {}
    lines = strip_ansi(log).split("\n")
    for number, line in enumerate(lines):
        head = re.match(r"^(\w+) \(([\w.]+)\)(.*)$", line)
        if head is None:
            continue
        method, test_id, rest = head.groups()
        outcome_text = rest.partition(" ... ")[2] if " ... " in rest else None
        if outcome_text is None and number + 1 < len(lines) and " ... " in lines[number + 1]:
            outcome_text = lines[number + 1].rpartition(" ... ")[2]
        if outcome_text is None:
            continue
        outcome_text = outcome_text.strip()
        status = "SKIPPED" if outcome_text.startswith("skipped") else _UNITTEST_OUTCOMES.get(outcome_text)
        if status is None:
            continue
        name = test_id if test_id.endswith("." + method) else f"{test_id}.{method}"
        statuses[name] = status
    return statuses


PARSERS = {"unittest": parse_unittest, "pytest-r2e": parse_pytest_r2e, "pytest-swebench": parse_pytest_swebench}
"""``Grading.log_format`` -> reader."""
