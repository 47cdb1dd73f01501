"""tasks/swe/rows.py on hand-written rows of each format (a NeMo Gym row shaped like the
benchmark's ``benchmark_r2e_gym_easy_val.jsonl``, a raw R2E-Gym row, a SWE-bench / SWE-Gym
row), bad rows as one line, and the tiny suite's JSONL round trip through the script."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from mlperf_grpo.errors import BAD_INPUT_ERRORS
from mlperf_grpo.tasks import load_suite, train_tasks, validation_tasks
from mlperf_grpo.tasks.base import TaskError
from mlperf_grpo.tasks.swe import load_swe_rows, tiny_suite
from mlperf_grpo.tasks.swe.rows import R2E_ORANGE3_TEST_COMMAND, R2E_TEST_COMMAND

COMMIT = "0a8d3a7a1e9b8c7d6e5f4a3b2c1d0e9f8a7b6c5d"
BASE = "9f8e7d6c5b4a39281706f5e4d3c2b1a098765432"
TEST_CODE = "import pytest\n\n\ndef test_fillna():\n    assert True\n"


def r2e_instance(instance_id: str = f"pandas-dev__pandas-{COMMIT}") -> dict:
    """An R2E-Gym row as NeMo-RL's converter puts it into ``instance_dict`` (JSON fields as strings)."""
    return {"FAIL_TO_PASS": [], "PASS_TO_PASS": [], "created_at": "2017-05-01", "hints_text": "", "version": "",
            "instance_id": instance_id, "base_commit": BASE, "repo": "pandas-dev/pandas",
            "problem_statement": "fillna drops the index name", "repo_name": "pandas",
            "docker_image": f"namanjain12/pandas_final:{COMMIT}", "commit_hash": COMMIT,
            "expected_output_json": json.dumps({"TestFillna.test_fillna - AssertionError": "PASSED",
                                                "TestFillna.test_other": "PASSED"}),
            "execution_result_content": json.dumps({"test_file_names": ["test_1.py"], "test_file_codes": [TEST_CODE],
                                                    "new_commit_hash": COMMIT}),
            "container_formatter": f"/swe-bench-images/namanjain12_pandas_final_{COMMIT}.sif",
            "dataset_name": "R2E-Gym/R2E-Gym-Subset", "split": "val"}


def nemo_gym_row(instance: dict) -> dict:
    """The benchmark's row shape (NeMo-RL ``create_r2e_gym_easy_subset_jsonl.convert_row``)."""
    metadata = {"instance_id": instance["instance_id"], "base_commit": BASE, "dataset_name": "R2E-Gym/R2E-Gym-Subset",
                "split": "val", "problem_statement": instance["problem_statement"], "hints_text": "", "version": "",
                "created_at": "2017-05-01", "instance_dict": json.dumps(instance), "repo": "pandas-dev/pandas"}
    return {"responses_create_params": {"input": [], "metadata": metadata, "model": "default", "temperature": 1.0,
                                        "top_p": 1.0},
            "agent_ref": {"type": "responses_api_agents", "name": "swe_agents_val"}}


def swe_bench_row() -> dict:
    """A SWE-bench Verified / SWE-Gym row (list fields as JSON strings, as the datasets ship them)."""
    patch = ("diff --git a/astropy/tests/test_sep.py b/astropy/tests/test_sep.py\n--- a/astropy/tests/test_sep.py\n"
             "+++ b/astropy/tests/test_sep.py\n@@ -1 +1,2 @@\n x = 1\n+def test_nested(): pass\n")
    return {"repo": "astropy/astropy", "instance_id": "astropy__astropy-12907", "base_commit": BASE,
            "patch": "diff --git a/x b/x\n", "test_patch": patch, "problem_statement": "separability of nested models",
            "hints_text": "", "created_at": "2022-03-03", "version": "4.3",
            "FAIL_TO_PASS": json.dumps(["astropy/tests/test_sep.py::test_nested"]),
            "PASS_TO_PASS": json.dumps(["astropy/tests/test_sep.py::test_plain[1]"]),
            "environment_setup_commit": BASE}


def write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_nemo_gym_row_like_the_benchmarks(tmp_path):
    rows = [nemo_gym_row(r2e_instance(f"pandas-dev__pandas-{n}{COMMIT[1:]}")) for n in range(3)]
    tasks = load_swe_rows(write_rows(tmp_path / "benchmark_r2e_gym_easy_val.jsonl", rows))
    assert [t.task_id for t in tasks] == [f"pandas-dev__pandas-{n}{COMMIT[1:]}" for n in range(3)]  # row order kept
    task = tasks[0]
    assert task.problem_statement == "fillna drops the index name"
    assert task.image == f"/swe-bench-images/namanjain12_pandas_final_{COMMIT}.sif"
    assert task.repo_dir is None
    assert task.grading.test_files == (("r2e_tests/test_1.py", TEST_CODE),)
    assert task.grading.test_command == R2E_TEST_COMMAND and task.grading.log_format == "pytest-r2e"
    assert task.grading.expected == (("TestFillna.test_fillna - AssertionError", "PASSED"),
                                     ("TestFillna.test_other", "PASSED"))
    assert task.metadata["base_commit"] == BASE and task.metadata["repo"] == "pandas-dev/pandas"


def test_a_raw_r2e_gym_row(tmp_path):
    raw = {k: v for k, v in r2e_instance().items() if k not in ("instance_id", "container_formatter")}
    raw["repo_name"] = "orange3"
    task = load_swe_rows(write_rows(tmp_path / "r2e.jsonl", [raw]))[0]
    assert task.task_id == f"orange3__{COMMIT}"
    assert task.image == f"namanjain12/pandas_final:{COMMIT}"
    assert task.grading.test_command == R2E_ORANGE3_TEST_COMMAND


def test_raw_r2e_gym_rows_from_a_local_parquet_dataset(tmp_path):
    parquet = pytest.importorskip("pyarrow.parquet")
    import pyarrow

    raw = {k: v for k, v in r2e_instance().items() if k not in ("instance_id", "container_formatter", "FAIL_TO_PASS",
                                                                  "PASS_TO_PASS")}
    parquet.write_table(pyarrow.Table.from_pylist([raw]), tmp_path / "train-00000-of-00001.parquet")
    task = load_swe_rows(tmp_path / "train-00000-of-00001.parquet")[0]
    assert task.task_id == f"pandas__{COMMIT}" and task.grading.test_files == (("r2e_tests/test_1.py", TEST_CODE),)


def test_a_swe_bench_row(tmp_path):
    task = load_swe_rows(write_rows(tmp_path / "swe.jsonl", [swe_bench_row()]))[0]
    grading = task.grading
    assert task.task_id == "astropy__astropy-12907" and task.image is None
    assert grading.expected is None and grading.test_files == ()
    assert grading.fail_to_pass == ("astropy/tests/test_sep.py::test_nested",)
    assert grading.pass_to_pass == ("astropy/tests/test_sep.py::test_plain[1]",)
    assert grading.test_command == "python -m pytest -rA astropy/tests/test_sep.py"
    assert grading.log_format == "pytest-swebench" and grading.test_patch.startswith("diff --git")


def _without(row: dict, key: str) -> dict:
    return {k: v for k, v in row.items() if k != key}


BAD_ROWS = [
    ("[1, 2]", "a row must be a JSON object"),
    (json.dumps({"responses_create_params": {"metadata": {}}}), "'responses_create_params.metadata.instance_dict'"),
    (json.dumps(nemo_gym_row(r2e_instance()) | {"responses_create_params": {"metadata": {"instance_dict": "{x"}}}),
     "key 'instance_dict' is not valid JSON"),
    (json.dumps(_without(swe_bench_row(), "instance_id")), "missing key 'instance_id'"),
    (json.dumps(_without(swe_bench_row(), "problem_statement")), "missing key 'problem_statement'"),
    (json.dumps(_without(swe_bench_row(), "test_patch")), "missing key 'test_patch'"),
    (json.dumps(_without(_without(swe_bench_row(), "FAIL_TO_PASS"), "PASS_TO_PASS")),
     "missing key 'expected_output_json' (R2E-Gym) or 'FAIL_TO_PASS' + 'test_patch'"),
    (json.dumps(swe_bench_row() | {"FAIL_TO_PASS": "[]"}), "key 'FAIL_TO_PASS' is empty"),
    (json.dumps(_without(r2e_instance(), "execution_result_content")), "missing key 'execution_result_content'"),
    (json.dumps(r2e_instance() | {"expected_output_json": "[]"}), "key 'expected_output_json' must be a JSON object"),
    (json.dumps(r2e_instance() | {"log_format": "tap"}), "key 'log_format' must be one of"),
    (json.dumps(r2e_instance() | {"repo_dir": "no/such/folder"}), "is not a folder"),
]


@pytest.mark.parametrize(("line", "message"), BAD_ROWS, ids=[m[:40] for _, m in BAD_ROWS])
def test_a_bad_row_is_one_line_naming_file_line_and_key(tmp_path, line, message):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(swe_bench_row() | {"instance_id": "ok__1"}) + "\n\n" + line + "\n")
    with pytest.raises(TaskError) as caught:
        load_swe_rows(path)
    text = str(caught.value)
    assert "\n" not in text and text.startswith(f"{path}:3") and message in text, text
    assert isinstance(caught.value, BAD_INPUT_ERRORS)  # exit 2 at the command line


def test_repeated_ids_and_empty_files_are_refused(tmp_path):
    with pytest.raises(TaskError, match="repeats an earlier row"):
        load_swe_rows(write_rows(tmp_path / "twice.jsonl", [swe_bench_row(), swe_bench_row()]))
    with pytest.raises(TaskError, match="no rows"):
        load_swe_rows(write_rows(tmp_path / "empty.jsonl", []))


def _script():
    path = Path(__file__).resolve().parents[2] / "scripts" / "make_swe_tiny_jsonl.py"
    spec = importlib.util.spec_from_file_location("make_swe_tiny_jsonl", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_jsonl(tmp_path_factory) -> tuple[dict[str, Path], Path]:
    """The script's files, and the folder the suite was materialised in."""
    cache = tmp_path_factory.mktemp("cache")
    return _script().write(tmp_path_factory.mktemp("out"), cache), cache


def test_the_tiny_suite_round_trips_through_nemo_gym_jsonl(tiny_jsonl):
    files, cache = tiny_jsonl
    for split in ("train", "validation"):
        read, shipped = load_swe_rows(files[split]), tiny_suite(split, cache)
        assert read[0].repo_dir.parent.parent.parent == files[split].parent  # repos/<split>/<task> beside the file
        assert [t.task_id for t in read] == [t.task_id for t in shipped]
        for a, b in zip(read, shipped):
            assert (a.problem_statement, a.grading, a.metadata) == (b.problem_statement, b.grading, b.metadata)
            assert sorted(p.name for p in a.repo_dir.iterdir()) == sorted(p.name for p in b.repo_dir.iterdir())
        row = json.loads(files[split].read_text().splitlines()[0])
        assert set(row) == {"responses_create_params", "agent_ref"}
        assert json.loads(row["responses_create_params"]["metadata"]["instance_dict"])["instance_id"] == read[0].task_id


def test_task_name_swe_reads_the_files_through_load_suite(tiny_jsonl):
    from mlperf_grpo.config_sections import TaskConfig

    files, cache = tiny_jsonl
    config = type("Config", (), {"task": TaskConfig(name="swe", train_path=str(files["train"]),
                                                    validation_path=str(files["validation"]))})()
    suite = load_suite(config)
    assert suite.agentic
    assert [t.task_id for t in train_tasks(suite, 5, 12, seed=7)] == [t.task_id for t in tiny_suite("train", cache)[:5]]
    assert len(validation_tasks(suite, 12)) == 12
    with pytest.raises(TaskError, match="set validation.num_tasks to 12"):
        validation_tasks(suite, 251)
