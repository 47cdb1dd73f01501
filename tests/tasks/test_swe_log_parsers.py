"""tasks/swe/log_parsers.py, grade.compare and the hidden files' archive on hand-written
input: each reader gives the per-test statuses its reference gives, and each rule
compares them as its reference does."""

from __future__ import annotations

import io
import tarfile

import pytest

from mlperf_grpo.tasks.swe.grade import compare, hidden_files_tar
from mlperf_grpo.tasks.swe.task import Grading
from mlperf_grpo.tasks.swe.log_parsers import parse_pytest_r2e, parse_pytest_swebench, parse_unittest

UNITTEST_311 = """\
test_above_range (r2e_tests.test_bounds.ClampTest.test_above_range) ... ok
test_below_range (r2e_tests.test_bounds.ClampTest.test_below_range) ... FAIL
test_bad (r2e_tests.test_bounds.ClampTest.test_bad) ... ERROR
test_later (r2e_tests.test_bounds.ClampTest.test_later) ... skipped 'not yet'
test_known (r2e_tests.test_bounds.ClampTest.test_known) ... expected failure
test_lucky (r2e_tests.test_bounds.ClampTest.test_lucky) ... unexpected success
test_documented (r2e_tests.test_bounds.ClampTest.test_documented)
Clamps from above. ... ok

======================================================================
FAIL: test_below_range (r2e_tests.test_bounds.ClampTest.test_below_range)
----------------------------------------------------------------------
AssertionError: 10 != 0

Ran 7 tests in 0.001s

FAILED (failures=1, errors=1, skipped=1, expected failures=1, unexpected successes=1)
"""

PYTEST_RA = """\
============================= test session starts ==============================
collected 4 items

r2e_tests/test_1.py .F.E                                                 [100%]

=========================== short test summary info ============================
\x1b[32mPASSED\x1b[0m r2e_tests/test_1.py::TestFillna::test_fillna
PASSED r2e_tests/test_1.py::test_plain[1]
FAILED r2e_tests/test_1.py::TestFillna::test_other - AssertionError: assert 1 == 2
ERROR r2e_tests/test_1.py::test_setup - RuntimeError
==================== 1 failed, 2 passed, 1 error in 0.12s =====================
"""


def test_unittest_verbose_lines_of_python_3_11_and_docstrings():
    assert parse_unittest(UNITTEST_311) == {
        "r2e_tests.test_bounds.ClampTest.test_above_range": "PASSED",
        "r2e_tests.test_bounds.ClampTest.test_below_range": "FAILED",
        "r2e_tests.test_bounds.ClampTest.test_bad": "ERROR",
        "r2e_tests.test_bounds.ClampTest.test_later": "SKIPPED",
        "r2e_tests.test_bounds.ClampTest.test_known": "XFAIL",
        "r2e_tests.test_bounds.ClampTest.test_lucky": "XPASS",
        "r2e_tests.test_bounds.ClampTest.test_documented": "PASSED",
    }


def test_unittest_ids_of_python_3_10_get_their_method_name():
    log = "test_x (r2e_tests.test_a.T) ... ok\ntest_a (unittest.loader._FailedTest.test_a) ... ERROR\n"
    assert parse_unittest(log) == {"r2e_tests.test_a.T.test_x": "PASSED",
                                   "unittest.loader._FailedTest.test_a": "ERROR"}


def test_pytest_the_r2e_gym_way_names_tests_without_the_file():
    assert parse_pytest_r2e(PYTEST_RA) == {"TestFillna.test_fillna": "PASSED", "test_plain[1]": "PASSED",
                                           "TestFillna.test_other": "FAILED", "test_setup": "ERROR"}
    assert parse_pytest_r2e(PYTEST_RA.replace("short test summary info", "summary")) == {}  # no -rA section


def test_pytest_the_swe_bench_way_names_tests_by_node_id():
    assert parse_pytest_swebench(PYTEST_RA) == {
        "r2e_tests/test_1.py::TestFillna::test_fillna": "PASSED", "r2e_tests/test_1.py::test_plain[1]": "PASSED",
        "r2e_tests/test_1.py::TestFillna::test_other": "FAILED", "r2e_tests/test_1.py::test_setup": "ERROR"}


def _expected(*pairs: tuple[str, str]) -> Grading:
    return Grading((), "true", "pytest-r2e", expected=pairs)


def test_r2e_rule_needs_the_same_tests_with_the_same_statuses():
    grading = _expected(("T.a - AssertionError", "PASSED"), ("T.b", "FAILED"))
    assert compare(grading, {"T.a": "PASSED", "T.b": "FAILED"}) == (True, "passed")  # names cut at " - "
    assert compare(grading, {"T.a": "PASSED", "T.b": "PASSED"}) == (False, "T.b: PASSED, expected FAILED")
    assert compare(grading, {"T.a": "PASSED"}) == (False, "1 tests ran, 2 expected")
    assert compare(grading, {"T.a": "PASSED", "T.b": "FAILED", "T.c": "PASSED"}) == (False, "3 tests ran, 2 expected")
    assert compare(grading, {"T.a": "PASSED", "T.z": "FAILED"}) == (False, "T.z: FAILED, expected no such test")


def test_swe_bench_rule_needs_every_named_test_passed_or_xfail():
    grading = Grading((), "true", "pytest-swebench", fail_to_pass=("t::a",), pass_to_pass=("t::b",), test_patch="")
    assert compare(grading, {"t::a": "PASSED", "t::b": "XFAIL", "t::other": "FAILED"}) == (True, "passed")
    assert compare(grading, {"t::a": "FAILED", "t::b": "PASSED"}) == (False, "FAIL_TO_PASS t::a: FAILED")
    assert compare(grading, {"t::a": "PASSED"}) == (False, "PASS_TO_PASS t::b: did not run")


def test_hidden_files_stay_inside_the_repository():
    archive = tarfile.open(fileobj=io.BytesIO(hidden_files_tar((("r2e_tests/test_a.py", "x = 1\n"),))))
    member = archive.getmember("r2e_tests/test_a.py")
    assert (member.mode, member.mtime, archive.extractfile(member).read()) == (0o644, 0, b"x = 1\n")
    for bad in ("/etc/passwd", "../outside.py", "r2e_tests/../../x.py", ""):
        with pytest.raises(ValueError, match="is not inside the repository"):
            hidden_files_tar(((bad, ""),))
