"""Software-repair rows from JSONL files -> :class:`SweTask`, in file order.

Two row shapes, told apart per row:

- **NeMo Gym** (the benchmark's ``benchmark_r2e_gym_easy_{train,val}.jsonl``): the task
  is ``responses_create_params.metadata.instance_dict``, a JSON string (or object) holding
  the whole dataset row; ``metadata`` also repeats ``instance_id``, ``problem_statement``,
  ``base_commit``, ``repo`` (used when ``instance_dict`` lacks them); ``agent_ref`` is
  ignored. Source: NeMo-RL ``tools/create_r2e_gym_easy_subset_jsonl.py`` (``convert_row``)
  and NeMo Gym ``responses_api_agents/swe_agents/app.py`` (``_setup_params``).
- **Flat** R2E-Gym / SWE-bench / SWE-Gym rows: the same fields at the top level.

Fields read from the task (``instance``):

- ``instance_id`` (else ``repo_name`` + ``commit_hash``): the task id (pass@k groups by it);
- ``problem_statement``: the issue text;
- R2E-Gym: ``expected_output_json`` (the expected ``{test: status}``, :mod:`.grade`'s rule)
  and ``execution_result_content``'s ``test_file_names`` / ``test_file_codes`` (the hidden
  tests, written to ``r2e_tests/<name>``);
- SWE-bench / SWE-Gym: ``FAIL_TO_PASS``, ``PASS_TO_PASS`` (tests that must pass) and
  ``test_patch`` (the diff adding them);
- the image, the first present of ``container_formatter`` (``{instance_id}`` filled in),
  ``docker_image``, ``image_name``, ``image``;
- kept in ``metadata``: ``repo``, ``repo_name``, ``base_commit``, ``dataset_name``,
  ``split``, ``repo_language``, ``commit_hash``, ``version``;
- ours: ``repo_dir`` (a local copy of the repository at its base commit; relative to the
  file's folder), ``test_command`` and ``log_format`` (override the defaults below).

Default test commands: R2E-Gym's ``tests_cmd``
(``src/r2egym/repo_analysis/repo_analysis_args.py``: ``.venv/bin/python -W ignore -m
pytest -rA r2e_tests``, orange3 under ``xvfb-run``), read by R2E-Gym's log parser;
SWE-bench rows: ``python -m pytest -rA`` on the files ``test_patch`` touches, read by
SWE-bench's pytest parser (SWE-bench's per-repository commands, e.g. Django's
``runtests.py``, are not reproduced: give such rows a ``test_command``).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from mlperf_grpo.tasks.base import TaskError
from mlperf_grpo.tasks.jsonl import raw_rows
from mlperf_grpo.tasks.swe.grade import patched_files
from mlperf_grpo.tasks.swe.log_parsers import PARSERS
from mlperf_grpo.tasks.swe.task import Grading, SweTask

R2E_TEST_COMMAND = ("PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' "
                    ".venv/bin/python -W ignore -m pytest -rA r2e_tests")
R2E_ORANGE3_TEST_COMMAND = "QT_QPA_PLATFORM=minimal xvfb-run --auto-servernum " + R2E_TEST_COMMAND
METADATA_KEYS = ("repo", "repo_name", "base_commit", "dataset_name", "split", "repo_language", "commit_hash", "version")
IMAGE_KEYS = ("container_formatter", "docker_image", "image_name", "image")


def load_swe_rows(path: Path) -> list[SweTask]:
    """Every row of a JSONL file (or local dataset) as a :class:`SweTask`, in file order.

    Raises:
        TaskError: one line naming the file, line and key: unreadable file, a row that is
            not an object, a missing or mistyped key, a repeated id, no rows.
    """
    path = Path(path)
    tasks: list[SweTask] = []
    seen: set[str] = set()
    for _, where, row in raw_rows(path):
        task = _task(row, where, path.parent)
        if task.task_id in seen:
            raise TaskError(f"{where}: instance_id {task.task_id!r} repeats an earlier row; ids must be distinct")
        seen.add(task.task_id)
        tasks.append(task)
    if not tasks:
        raise TaskError(f"{path}: no rows")
    return tasks


def instance_of(row: object, where: str) -> dict:
    """The task fields of a row: NeMo Gym's ``instance_dict`` over its ``metadata``, or
    the row itself."""
    if not isinstance(row, dict):
        raise TaskError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    params = row.get("responses_create_params")
    if params is None:
        return row
    metadata = params.get("metadata") if isinstance(params, dict) else None
    if not isinstance(metadata, dict) or "instance_dict" not in metadata:
        raise TaskError(f"{where}: missing key 'responses_create_params.metadata.instance_dict' (a NeMo Gym row "
                        "carries the dataset row there)")
    instance = _json_field(metadata["instance_dict"], where, "instance_dict", dict)
    return {**{k: v for k, v in metadata.items() if k != "instance_dict"}, **instance}


def _task(row: object, where: str, folder: Path) -> SweTask:
    instance = instance_of(row, where)
    task_id = instance.get("instance_id")
    if task_id is None and isinstance(instance.get("repo_name"), str) and isinstance(instance.get("commit_hash"), str):
        task_id = f"{instance['repo_name']}__{instance['commit_hash']}"
    if not isinstance(task_id, str) or not task_id:
        raise TaskError(f"{where}: missing key 'instance_id' (a non-empty string)")
    where = f"{where} ({task_id})"
    statement = instance.get("problem_statement")
    if not isinstance(statement, str) or not statement.strip():
        raise TaskError(f"{where}: missing key 'problem_statement' (the issue text, a non-empty string)")
    metadata = {key: instance[key] for key in METADATA_KEYS if instance.get(key) not in (None, "")}
    return SweTask(task_id, statement, _repo_dir(instance, where, folder), _image(instance, task_id),
                   _grading(instance, where), metadata)


def _grading(instance: dict, where: str) -> Grading:
    command = instance.get("test_command")
    if command is not None and (not isinstance(command, str) or not command.strip()):
        raise TaskError(f"{where}: key 'test_command' must be a non-empty string")
    log_format = instance.get("log_format")
    if log_format is not None and log_format not in PARSERS:
        raise TaskError(f"{where}: key 'log_format' must be one of {', '.join(PARSERS)}; got {log_format!r}")
    if instance.get("expected_output_json") is not None:
        expected = _json_field(instance["expected_output_json"], where, "expected_output_json", dict)
        if not expected or not all(isinstance(v, str) for v in expected.values()):
            raise TaskError(f"{where}: key 'expected_output_json' must map test names to status strings")
        default = R2E_ORANGE3_TEST_COMMAND if instance.get("repo_name") == "orange3" else R2E_TEST_COMMAND
        return Grading(_r2e_test_files(instance, where), command or default, log_format or "pytest-r2e",
                       expected=tuple(sorted(expected.items())))
    if instance.get("FAIL_TO_PASS") is not None:
        fail_to_pass = _names(instance, "FAIL_TO_PASS", where)
        pass_to_pass = _names(instance, "PASS_TO_PASS", where) if instance.get("PASS_TO_PASS") is not None else ()
        patch = instance.get("test_patch")
        if not isinstance(patch, str) or not patch.strip():
            raise TaskError(f"{where}: missing key 'test_patch' (the diff adding the hidden tests FAIL_TO_PASS names)")
        if not fail_to_pass:
            raise TaskError(f"{where}: key 'FAIL_TO_PASS' is empty; a SWE-bench row names at least one test")
        default = "python -m pytest -rA " + " ".join(shlex.quote(p) for p in patched_files(patch))
        return Grading((), command or default, log_format or "pytest-swebench", fail_to_pass=fail_to_pass,
                       pass_to_pass=pass_to_pass, test_patch=patch)
    raise TaskError(f"{where}: missing key 'expected_output_json' (R2E-Gym) or 'FAIL_TO_PASS' + 'test_patch' "
                    "(SWE-bench / SWE-Gym): the row says nothing about how to grade")


def _r2e_test_files(instance: dict, where: str) -> tuple[tuple[str, str], ...]:
    content = instance.get("execution_result_content")
    if content is None:
        raise TaskError(f"{where}: missing key 'execution_result_content' (R2E-Gym: its test_file_names and "
                        "test_file_codes are the hidden tests)")
    result = _json_field(content, where, "execution_result_content", dict)
    names, codes = result.get("test_file_names"), result.get("test_file_codes")
    if not isinstance(names, list) or not isinstance(codes, list) or len(names) != len(codes) or not names:
        raise TaskError(f"{where}: key 'execution_result_content' needs equally long, non-empty lists "
                        "'test_file_names' and 'test_file_codes'")
    if not all(isinstance(n, str) and n and "/" not in n and n != ".." for n in names):
        raise TaskError(f"{where}: 'execution_result_content.test_file_names' must be plain file names")
    if not all(isinstance(c, str) for c in codes):
        raise TaskError(f"{where}: 'execution_result_content.test_file_codes' must be strings")
    return tuple((f"r2e_tests/{name}", code) for name, code in zip(names, codes))


def _names(instance: dict, key: str, where: str) -> tuple[str, ...]:
    names = _json_field(instance[key], where, key, list)
    if not all(isinstance(n, str) and n for n in names):
        raise TaskError(f"{where}: key {key!r} must be a list of test names")
    return tuple(names)


def _image(instance: dict, task_id: str) -> str | None:
    for key in IMAGE_KEYS:
        value = instance.get(key)
        if isinstance(value, str) and value:
            return value.replace("{instance_id}", task_id)
    return None


def _repo_dir(instance: dict, where: str, folder: Path) -> Path | None:
    value = instance.get("repo_dir")
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise TaskError(f"{where}: key 'repo_dir' must be a path")
    path = Path(value) if Path(value).is_absolute() else folder / value
    if not path.is_dir():
        raise TaskError(f"{where}: repo_dir {str(path)!r} is not a folder")
    return path


def _json_field(value: object, where: str, key: str, kind: type):
    """``value`` or, when it is a string, its JSON decoding; it must be a ``kind``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise TaskError(f"{where}: key {key!r} is not valid JSON ({err.msg})") from None
    if not isinstance(value, kind):
        raise TaskError(f"{where}: key {key!r} must be a JSON {'object' if kind is dict else 'list'}")
    return value
