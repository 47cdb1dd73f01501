"""Tasks from JSON-lines files: ``task: {name: jsonl, train_path, validation_path}``.

One JSON object per line (or, for a path that is a directory or a parquet/arrow file, one
row of a local Hugging Face dataset: :mod:`mlperf_grpo.tasks.hf_datasets`). The fields (names set in the config; defaults shown):

- ``id``: a string or integer, distinct within a file (pass@k groups by it); with
  ``id_field: null`` the id is ``<file stem>-<line number>``;
- ``prompt``: the prompt text (GSM8K: ``prompt_field: question``);
- ``answer``: the answer text; its final answer by the free-text rule of
  :mod:`mlperf_grpo.tasks.verify` (``#### 72`` -> ``72``, the last ``\\boxed{}``, ...) is
  the gold answer, so a GSM8K row's worked solution can be used as it is;
- ``messages`` (optional): a chat, ``[{"role": ..., "content": ...}, ...]``. When the
  model's tokenizer has a chat template, the prompt is
  ``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)``
  (the same string in training and evaluation); without a template, ``prompt`` is used.
  The last message must be the user's: a chat ending with the assistant's answer (a
  supervised fine-tuning row) would put the answer in every prompt, and is refused
  naming the row and the role.

The validation file must hold exactly ``validation.num_tasks`` rows; the training pool is
``task.num_train_tasks`` rows of the training file, drawn with the run seed. A validation
id or prompt that is also a training one is refused (the two sets must not overlap). Rewards use
:func:`mlperf_grpo.tasks.verify.math_reward`. Every problem is a :class:`TaskError`: one
line naming the file, the line and the fix.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from mlperf_grpo.tasks.base import Task, TaskError
from mlperf_grpo.tasks.hf_datasets import is_dataset, read_dataset_rows
from mlperf_grpo.tasks.verify import final_answer

REWARD = "mlperf_grpo.tasks.verify:math_reward"


def _messages(value: object, where: str) -> list[dict]:
    ok = isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)
    if not ok:
        raise TaskError(f"{where}: 'messages' must be a non-empty list of {{\"role\": str, \"content\": str}}")
    if value[-1]["role"] != "user":
        raise TaskError(f"{where}: 'messages' ends with a message of role {value[-1]['role']!r}; the last must be the user's "
                        "(the chat template would put it, an answer included, in every prompt): drop the trailing "
                        "messages or the field")
    return value


def read_rows(path: Path, id_field: str | None, prompt_field: str, answer_field: str) -> list[tuple[Task, list | None]]:
    """``(task, messages or None)`` per row of a JSONL file, in file order.

    Raises:
        TaskError: unreadable file, a line that is not a JSON object, a missing or
            mistyped field, an answer with no final answer, a repeated id, no rows.
    """
    rows: list[tuple[Task, list | None]] = []
    seen: set[str] = set()
    for number, where, row in raw_rows(path):
        if not isinstance(row, dict):
            raise TaskError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
        fields = [f for f in (id_field, prompt_field, answer_field) if f is not None]
        missing = [f for f in fields if f not in row]
        if missing:
            raise TaskError(f"{where}: missing field {missing[0]!r} (set task.{_config_key(missing[0], id_field, prompt_field)} "
                            "if the data names it differently)")
        task_id = f"{path.stem}-{number}" if id_field is None else row[id_field]
        if isinstance(task_id, bool) or not isinstance(task_id, (str, int)) or str(task_id) == "":
            raise TaskError(f"{where}: field {id_field!r} must be a non-empty string or an integer")
        task_id = str(task_id)
        prompt, answer = row[prompt_field], row[answer_field]
        if not isinstance(prompt, str) or not prompt:
            raise TaskError(f"{where}: field {prompt_field!r} must be a non-empty string")
        if isinstance(answer, bool) or not isinstance(answer, (str, int)):
            raise TaskError(f"{where}: field {answer_field!r} must be a string or an integer")
        gold = final_answer(str(answer))
        if gold is None:
            raise TaskError(f"{where}: field {answer_field!r} has no final answer (a number, '#### n' or '\\boxed{{...}}')")
        if task_id in seen:
            raise TaskError(f"{where}: id {task_id!r} repeats an earlier row; ids must be distinct")
        seen.add(task_id)
        # null = absent: a datasets/parquet column holds null where a row has no chat
        messages = _messages(row["messages"], where) if row.get("messages") is not None else None
        rows.append((Task(task_id, prompt, gold), messages))
    if not rows:
        raise TaskError(f"{path}: no rows")
    return rows


def raw_rows(path: Path) -> list[tuple[int, str, object]]:
    """``(number, where, row)`` per row: JSON lines (blank lines skipped, ``where`` is
    ``file:line``), or the rows of a local ``datasets`` dataset (``where`` is ``path row n``).

    Raises:
        TaskError: the file is unreadable, not UTF-8, or a line is not JSON.
    """
    if is_dataset(path):
        return [(n, f"{path} row {n}", row) for n, row in enumerate(read_dataset_rows(path), start=1)]
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise TaskError(f"cannot read task file {path}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise TaskError(f"{path}: not a UTF-8 text file") from None
    out = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            out.append((number, f"{path}:{number}", json.loads(line)))
        except json.JSONDecodeError as err:
            raise TaskError(f"{path}:{number}: not valid JSON ({err.msg}); each line must be one JSON object") from None
    return out


def _config_key(field: str, id_field: str | None, prompt_field: str) -> str:
    return "id_field" if field == id_field else "prompt_field" if field == prompt_field else "answer_field"


class JsonlSuite:
    """A task suite over two JSONL files (see the module docstring).

    Args:
        train_path, validation_path: the files.
        id_field, prompt_field, answer_field: row field names.
        chat_template: ``messages -> prompt`` (the tokenizer's ``apply_chat_template``),
            or None when the tokenizer has no chat template.
    Raises:
        TaskError: see :func:`read_rows`; a validation id that is also a training id.
    """

    reward = REWARD

    def __init__(self, train_path: str, validation_path: str, id_field: str | None, prompt_field: str,
                 answer_field: str, chat_template=None) -> None:
        self.train_path, self.validation_path = Path(train_path), Path(validation_path)
        fields = (id_field, prompt_field, answer_field)
        self._train = [self._prompted(r, chat_template) for r in read_rows(self.train_path, *fields)]
        self._validation = [self._prompted(r, chat_template) for r in read_rows(self.validation_path, *fields)]
        for what, key in (("id", lambda t: t.task_id), ("prompt", lambda t: t.prompt)):
            shared = {key(t) for t in self._train} & {key(t) for t in self._validation}
            if shared:
                raise TaskError(f"{self.validation_path}: {what} {sorted(shared)[0]!r} is also in {self.train_path}; "
                                "training and validation tasks must not overlap")

    @staticmethod
    def _prompted(row: tuple[Task, list | None], chat_template) -> Task:
        task, messages = row
        if messages is None or chat_template is None:
            return task
        return Task(task.task_id, chat_template(messages), task.answer)

    def validation_tasks(self, num_tasks: int) -> list[Task]:
        """Every validation row, in file order.

        Raises:
            TaskError: the file does not hold exactly ``num_tasks`` rows.
        """
        if len(self._validation) != num_tasks:
            raise TaskError(f"{self.validation_path} has {len(self._validation)} rows; validation.num_tasks is "
                            f"{num_tasks}: the validation file must hold exactly validation.num_tasks rows")
        return list(self._validation)

    def train_tasks(self, num_tasks: int, num_validation_tasks: int, seed: int) -> list[Task]:
        """``num_tasks`` training rows drawn with ``seed``.

        Raises:
            TaskError: the file has fewer rows than ``num_tasks``.
        """
        if num_tasks > len(self._train):
            raise TaskError(f"{self.train_path} has {len(self._train)} rows; task.num_train_tasks is {num_tasks}: "
                            f"set task.num_train_tasks to at most {len(self._train)}")
        rows = list(self._train)
        random.Random(seed).shuffle(rows)
        return rows[:num_tasks]
