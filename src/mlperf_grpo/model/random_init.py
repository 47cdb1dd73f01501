"""Shipped models without weights: a model directory holding ``random_init.json``
(``{"seed": S}``) and no weight file is built from its ``config.json`` with
``torch.manual_seed(S)`` on first use, saved with its other files into a cache folder,
and used from there (``builtin:swe-tiny``: ``scripts/make_swe_tiny_model.py``). The
repository ships text files only; the same seed, files, torch and transformers give the
same weights.

The cache folder is ``$MLPERF_GRPO_CACHE`` or ``~/.cache/mlperf-grpo``, then
``models/<name>-<hash of the files and library versions>``; it is written under a
temporary name and renamed, so concurrent first uses (ranks) never see half a model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

RANDOM_INIT_FILE = "random_init.json"


def needs_random_init(directory: Path) -> bool:
    """True for a model directory with ``random_init.json`` and no safetensors weights."""
    return (directory / RANDOM_INIT_FILE).is_file() and not any(directory.glob("*.safetensors*"))


def cache_root() -> Path:
    return Path(os.environ.get("MLPERF_GRPO_CACHE") or Path.home() / ".cache" / "mlperf-grpo")


def materialized(directory: Path) -> Path:
    """The cached model directory with weights for ``directory`` (built now if missing).

    Raises:
        ModelLoadError: ``random_init.json`` is not ``{"seed": int}`` or the config does not build.
    """
    import torch
    import transformers

    files = sorted(p for p in directory.iterdir() if p.is_file())
    digest = hashlib.sha256(f"{torch.__version__} {transformers.__version__}".encode())
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    target = cache_root() / "models" / f"{directory.name}-{digest.hexdigest()[:16]}"
    if (target / "model.safetensors").is_file():
        return target
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for path in files:
            shutil.copy(path, tmp / path.name)
        _save_random_model(directory, tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process renamed its copy first: same files
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _save_random_model(directory: Path, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from mlperf_grpo.errors import ModelLoadError

    try:
        seed = json.loads((directory / RANDOM_INIT_FILE).read_text())["seed"]
        if not isinstance(seed, int):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise ModelLoadError(f"{directory / RANDOM_INIT_FILE} must be {{\"seed\": <int>}}") from None
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hf_logging.disable_progress_bar()
    model.save_pretrained(out)  # model.safetensors and generation_config.json (the shipped one is kept)
    shutil.copy(directory / "generation_config.json", out / "generation_config.json")
