"""A :class:`SweTask` as a NeMo Gym JSONL row, the shape of the benchmark's
``benchmark_r2e_gym_easy_*.jsonl`` (read back by :func:`.rows.load_swe_rows`).

Row layout as NeMo-RL ``tools/create_r2e_gym_easy_subset_jsonl.py`` (``convert_row``)
writes it: ``responses_create_params`` with an empty ``input``, ``metadata`` (the ids,
the issue and ``instance_dict``: the whole task row as a JSON string), the sampling
settings, and ``agent_ref``. R2E-Gym keys carry the grading (``expected_output_json`` and
``execution_result_content`` as JSON strings); ``repo_dir``, ``test_command`` and
``log_format`` are ours (:mod:`.rows`).
"""

from __future__ import annotations

import json
from pathlib import PurePosixPath

from mlperf_grpo import rules
from mlperf_grpo.tasks.swe.task import SweTask

AGENT_REF = {"train": "swe_agents_train", "validation": "swe_agents_val"}
"""``agent_ref.name`` per split (NeMo Gym ``swebench_openhands_training.yaml``'s agents)."""


def nemo_gym_row(task: SweTask, split: str, repo_dir: str | None) -> dict:
    """The NeMo Gym row of an R2E-Gym-graded ``task`` (``task.grading.expected`` set).

    Args:
        split: ``train`` or ``validation`` (sampling settings and ``agent_ref``).
        repo_dir: the row's ``repo_dir`` (relative to the JSONL file's folder), or None.
    Raises:
        ValueError: the task is not graded by an expected test outcome.
    """
    grading = task.grading
    if grading.expected is None or any(not path.startswith("r2e_tests/") for path, _ in grading.test_files):
        raise ValueError(f"{task.task_id}: only R2E-Gym-style tasks (expected outcome, r2e_tests/ files) are written")
    execution = {"test_file_names": [PurePosixPath(p).name for p, _ in grading.test_files],
                 "test_file_codes": [text for _, text in grading.test_files]}
    instance = {"FAIL_TO_PASS": [], "PASS_TO_PASS": [], "instance_id": task.task_id,
                "problem_statement": task.problem_statement, **task.metadata, "split": split,
                "expected_output_json": json.dumps(dict(grading.expected)),
                "execution_result_content": json.dumps(execution),
                "test_command": grading.test_command, "log_format": grading.log_format}
    if repo_dir is not None:
        instance["repo_dir"] = repo_dir
    if task.image is not None:
        instance["container_formatter"] = task.image
    validation = split == "validation"
    metadata = {"instance_id": task.task_id, "base_commit": task.metadata.get("base_commit"),
                "dataset_name": task.metadata.get("dataset_name"), "split": split,
                "problem_statement": task.problem_statement, "hints_text": "", "version": "", "created_at": "",
                "instance_dict": json.dumps(instance), "repo": task.metadata.get("repo")}
    return {"responses_create_params": {
                "input": [], "metadata": metadata, "model": "default",
                "temperature": rules.VALIDATION_TEMPERATURE if validation else rules.ROLLOUT_TEMPERATURE,
                "top_p": rules.VALIDATION_TOP_P if validation else rules.ROLLOUT_TOP_P},
            "agent_ref": {"type": "responses_api_agents", "name": AGENT_REF[split]}}
