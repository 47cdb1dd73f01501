"""Rows of a local Hugging Face ``datasets`` dataset, for ``task: jsonl``.

``train_path``/``validation_path`` may name, instead of a JSONL file:

- a directory written by ``Dataset.save_to_disk`` (one split; for a ``DatasetDict``, the
  split's folder, e.g. ``gsm8k/train``), read with ``datasets.load_from_disk``;
- a ``.parquet`` or ``.arrow`` file, or a directory of them (a hub cache snapshot, e.g.
  ``.../datasets--openai--gsm8k/snapshots/<rev>/main/test-00000-of-00001.parquet``), read
  with ``Dataset.from_parquet`` / ``Dataset.from_file``.

Nothing is downloaded: ``HF_DATASETS_OFFLINE=1`` is set before ``datasets`` is imported.
``datasets`` is an optional extra (``pip install 'mlperf-grpo[datasets]'``).
"""

from __future__ import annotations

import os
from pathlib import Path

from mlperf_grpo.tasks.base import TaskError

DATA_SUFFIXES = (".parquet", ".arrow")


def is_dataset(path: Path) -> bool:
    """True when ``path`` is read with ``datasets`` (a directory, a parquet or arrow file)."""
    return path.is_dir() or path.suffix in DATA_SUFFIXES


def read_dataset_rows(path: Path) -> list[object]:
    """The rows of the dataset at ``path`` as Python objects (dicts), in dataset order.

    Raises:
        TaskError: ``datasets`` is not installed; the directory holds several splits or
            no data; the data cannot be read.
    """
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise TaskError(f"{path} is a dataset directory or file; reading it needs the 'datasets' package: "
                        "pip install 'mlperf-grpo[datasets]' (or give a JSONL file)") from None
    try:
        if path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
            data = datasets.load_from_disk(str(path))
            if isinstance(data, datasets.DatasetDict):
                raise TaskError(f"{path} holds the splits {sorted(data)}; point at one split's folder, e.g. "
                                f"{path / sorted(data)[0]}")
        else:
            files = sorted(str(p) for p in (path.rglob("*") if path.is_dir() else [path]) if p.suffix in DATA_SUFFIXES)
            if not files:
                raise TaskError(f"{path}: no dataset here (neither a save_to_disk folder nor *.parquet/*.arrow files)")
            if any(f.endswith(".arrow") for f in files):
                data = datasets.concatenate_datasets([datasets.Dataset.from_file(f) for f in files])
            else:
                data = datasets.Dataset.from_parquet(files)
    except TaskError:
        raise
    except Exception as err:  # noqa: BLE001  (datasets and pyarrow raise many types)
        raise TaskError(f"{path}: not a readable dataset ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from None
    return data.to_list()
