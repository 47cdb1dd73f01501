"""The names of checkpoint directories: ``step_N/`` (published) and ``tmp_step_N/`` (a
write in flight, renamed to ``step_N/`` when complete). Torch-free; the one place the
names and their pattern are written."""

from __future__ import annotations

import re
from pathlib import Path

STEP_DIR = re.compile(r"^step_(\d+)$")
"""A published checkpoint's directory name; group 1 is its step."""

CHECKPOINT_DIR = re.compile(r"^(tmp_)?step_\d+$")
"""A checkpoint directory of ours, published or in flight (what teardown deletes)."""

TMP_PREFIX = "tmp_step_"


def step_dir_name(step: int) -> str:
    """``step_N``: the published directory of the checkpoint after step ``step``."""
    return f"step_{step}"


def tmp_step_dir_name(step: int) -> str:
    """``tmp_step_N``: the directory the checkpoint of step ``step`` is written into."""
    return f"{TMP_PREFIX}{step}"


def step_of(name: str) -> int | None:
    """The step of a published directory name ``step_N``, else ``None``."""
    match = STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def published_steps(checkpoint_root: Path) -> list[int]:
    """Steps of the published ``step_N/`` directories under ``checkpoint_root``, ascending
    (names only: a ``tmp_step_N/`` is unfinished and not counted); none when it is absent."""
    if not checkpoint_root.is_dir():
        return []
    return sorted(s for p in checkpoint_root.iterdir() if (s := step_of(p.name)) is not None and p.is_dir())
