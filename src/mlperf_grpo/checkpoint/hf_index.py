"""Which safetensors files of another trainer's Hugging Face model directory hold its
weights, and which file each tensor is read from.

The rule (the layout transformers' ``save_pretrained`` writes: a sharded save writes
``model.safetensors.index.json``, whose ``weight_map`` names each tensor's file):

- **With an index**, the weights are exactly the files its ``weight_map`` names, each
  tensor read from the file the index names for it. Refused, naming the file: a named
  file that is missing; a ``*.safetensors`` file beside them that the index does not
  name (a left-over of an earlier save: transformers ``modeling_utils`` loads a
  ``model.safetensors`` before it looks at the index, so the folder means two different
  models); a tensor the index names that its file lacks; a tensor stored in a file the
  index does not name for it (a stale copy from an interrupted re-save).
- **Without an index**, every ``*.safetensors`` file of the folder (one file, or the
  per-rank files of a sharded save, whose slices may share a tensor); a whole tensor
  stored in two files is refused.

Nothing is ignored: which weights are scored never depends on file names or their order.
"""

from __future__ import annotations

import json
from pathlib import Path

from mlperf_grpo.checkpoint.format import INDEX_FILE, CheckpointError


def weight_map(folder: Path) -> dict[str, str] | None:
    """The index's ``weight_map`` (tensor name -> file name), or None without an index.

    Raises:
        CheckpointError: the index is not JSON or has no ``weight_map`` object of strings.
    """
    path = folder / INDEX_FILE
    if not path.is_file():
        return None
    try:
        mapping = json.loads(path.read_text()).get("weight_map")
    except (OSError, ValueError, AttributeError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors index ({err}); the checkpoint is corrupt") from None
    if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
        raise CheckpointError(f"{path}: 'weight_map' must map each tensor name to a file name")
    return mapping


def weight_files(folder: Path) -> tuple[Path, ...]:
    """The folder's weight files by the rule above (empty when it has none).

    Raises:
        CheckpointError: a file the index names is missing, or a ``*.safetensors`` file
            the index does not name lies beside them; one line naming the file.
    """
    mapping = weight_map(folder)
    present = sorted(folder.glob("*.safetensors"))
    if mapping is None:
        return tuple(present)
    named = sorted({folder / name for name in mapping.values()})
    missing = [p for p in named if not p.is_file()]
    if missing:
        raise CheckpointError(f"{missing[0]} is missing ({INDEX_FILE} names it); the checkpoint is incomplete: "
                              "restore the file")
    unnamed = [p for p in present if p not in named]
    if unnamed:
        raise CheckpointError(f"{unnamed[0]} is not named by {folder / INDEX_FILE} (a left-over of an earlier save?); "
                              "which weights the checkpoint holds is ambiguous: move the file out of the folder")
    return tuple(named)


def check_placement(folder: Path, names_by_file: dict[Path, list[str]], whole: bool) -> None:
    """Each tensor in exactly one file, and in the file the index names for it.

    ``names_by_file``: the tensor names each weight file's header lists; ``whole``: the
    files hold whole tensors (not per-rank slices, which may share a tensor).

    Raises:
        CheckpointError: a tensor stored twice, in a file the index does not name for it,
            or missing from the file the index names; names the tensor and the files.
    """
    mapping = weight_map(folder)
    for name, file in (mapping or {}).items() if whole else ():  # before any copy is called stale
        if name not in names_by_file.get(folder / file, [name]):
            raise CheckpointError(f"{folder / file} lacks tensor {name!r}, which {INDEX_FILE} places there; "
                                  "the checkpoint is incomplete (or its index wrong): re-save the checkpoint")
    seen: dict[str, Path] = {}
    for path, names in names_by_file.items():
        for name in names:
            if mapping is not None and name in mapping and folder / mapping[name] != path:
                raise CheckpointError(f"{path} holds tensor {name!r}, which {INDEX_FILE} places in {mapping[name]} "
                                      "(a stale copy from an interrupted save?); remove the copy or re-save the checkpoint")
            if mapping is not None and name not in mapping:
                raise CheckpointError(f"{path} holds tensor {name!r}, which {INDEX_FILE} does not name; "
                                      "re-save the checkpoint so that the index lists every tensor")
            if whole and name in seen:
                raise CheckpointError(f"tensor {name!r} is stored twice, in {seen[name]} and {path}; which copy is the "
                                      "checkpoint's is ambiguous: remove the stale file")
            seen.setdefault(name, path)
    for name, file in (mapping or {}).items():
        if name not in seen:
            raise CheckpointError(f"{folder / file} lacks tensor {name!r}, which {INDEX_FILE} places there; "
                                  "the checkpoint is incomplete")
