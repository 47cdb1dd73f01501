"""The source of a series another trainer wrote (or ours outside a run directory): its
discovery, checks, reads, refit proof and removal, rebuilt on every torchrun rank from
its spec (:func:`source_from_spec`); ``--format`` detection (:func:`build_source`).
``checkpoint/foreign_layouts.py`` describes the layouts."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from mlperf_grpo.checkpoint import CheckpointCorruptError, CheckpointError, foreign_share, published_steps
from mlperf_grpo.checkpoint import foreign_layouts as foreign
from mlperf_grpo.checkpoint.foreign_layouts import ForeignCheckpoint
from mlperf_grpo.config.run import RunConfig
from mlperf_grpo.config.rundir import RunDir
from mlperf_grpo.evaluate.outcome import last_trained_step
from mlperf_grpo.evaluate.series import EvaluationError, RefitError, RunSeries, SeriesProblem
from mlperf_grpo.inference.base import InferenceEngine
from mlperf_grpo.logs.mllog import ParsedLog
from mlperf_grpo.model.files import check_model_path, resolve_model_path
from mlperf_grpo.model.fingerprint import sharded_fingerprint, weights_fingerprint
from mlperf_grpo.tasks import ValidationSet

SOURCE_FILE = "source.json"
"""``DIR/eval/source.json``: the series' format and what it could not check."""
ARCHITECTURE_KEY = re.compile(r"^(model_type|architectures|tie_word_embeddings|vocab_size|head_dim|hidden_act|layer_types"
                              r"|.*_size|num_.*|n_.*|.*_dim|.*_heads|.*_layers|.*experts.*)$")
"""``config.json`` keys (of the model or a nested sub-config) that define the weights'
shapes or the architecture: a checkpoint whose ``config.json`` differs from
``model.path``'s in one is refused; other keys (``dtype``, ``use_cache``, the defaults
Automodel writes with ``to_json_string(use_diff=False)``, ...) are listed in a note."""


@dataclass(frozen=True)
class OursAt(RunSeries):
    """Our trainer's series outside a run directory: teardown deletes the files our
    writer made in each ``step_N/`` (and ``tmp_step_N/``), never anything else in ``DIR``
    (its ``eval/``, lock, other files: ``foreign.remove_step_dirs``)."""

    def remove(self) -> str:
        return foreign.remove_step_dirs(self.root)


@dataclass(frozen=True)
class ForeignSeries:
    """A NeMo-RL or manifest series (see ``checkpoint/foreign_layouts.py``)."""

    root: Path
    format: str
    global_batch_size: int
    manifest: Path | None = None
    config_file: Path | None = None
    """The config the evaluation was given (the other torchrun ranks load it: :meth:`rank_spec`)."""
    hf_config: Path | None = None
    """model.path's ``config.json``: maps a Megatron checkpoint's tensor names."""

    def discover(self) -> tuple[list[ForeignCheckpoint], list[Path], SeriesProblem | None]:
        if self.format == foreign.HF_DIRS:
            try:
                return foreign.read_manifest(self.manifest, self.global_batch_size), [], None
            except CheckpointError as err:
                raise EvaluationError(str(err)) from None
        found, ignored, unreadable = foreign.discover_nemo_rl(self.root, self.global_batch_size, self.hf_config)
        return found, ignored, None if unreadable is None else SeriesProblem(len(found), unreadable[1])

    def check(self, checkpoints: list[ForeignCheckpoint], config: RunConfig, validation: ValidationSet,
              log: ParsedLog) -> tuple[list[str], SeriesProblem | None]:
        """As :func:`series.check_series`, with what these layouts record (no evaluation
        settings: ``validation`` is not read; the config is compared with what the log
        recorded instead, ``evaluate.settings.logged_differences``).

        Raises:
            EvaluationError: no checkpoints; the first not at the first eval step; no
                ``run_start``; the first checkpoint's tensors or ``config.json`` differ from
                ``model.path``'s (the model the engine is built from).
        Returns:
            ``(notes, problem)``: the notes (``config.json`` keys that differ from
            ``model.path``'s without defining the architecture); the first fault (a gap, a step or ``consumed_samples``
            that disagrees, a weight-update time not increasing, tensors differing from the
            first checkpoint's, a series ending before the log's last trained step).
        """
        s0 = config.first_eval_step
        if not checkpoints:
            raise EvaluationError(f"no checkpoints found in {self.root}; the series must start at the first eval step {s0}")
        if checkpoints[0].step != s0:
            raise EvaluationError(f"first checkpoint is step {checkpoints[0].step} ({checkpoints[0].record}), "
                                  f"but the first eval step is {s0}")
        if not log.find("run_start"):
            raise EvaluationError("the MLPerf log has no run_start; was training logged to another file?")
        model_dir = check_model_path(config.model.path)
        try:
            first = foreign.tensor_specs(checkpoints[0])
        except CheckpointError as err:
            raise EvaluationError(str(err)) from None
        notes = _check_against_model(checkpoints[0], first, model_dir)
        previous = int(log.find("run_start")[0].time_ms or 0)
        for index, c in enumerate(checkpoints):
            fault = self._fault(c, first, s0 + index, previous, config)
            if fault is not None:
                return notes, SeriesProblem(index, fault)
            previous = c.info.training_step_end_time_ms
        last_trained = last_trained_step(log)[0]
        if checkpoints[-1].step < last_trained:
            return notes, SeriesProblem(len(checkpoints), (
                f"the last checkpoint is step {checkpoints[-1].step}, but the log trained to step {last_trained}: restore "
                f"the checkpoints of steps {checkpoints[-1].step + 1}..{last_trained} (a shorter series is not a shorter run)"))
        return notes, None

    @staticmethod
    def _fault(c: ForeignCheckpoint, first: dict, expected_step: int, previous_ms: int, config: RunConfig) -> str | None:
        if c.step != expected_step:
            return f"checkpoint series has a gap: missing step {expected_step}"
        if c.info.current_step != c.step:
            return f"{c.record}: current_step {c.info.current_step} differs from the checkpoint's step {c.step}"
        prompts = c.step * config.grpo.num_prompts_per_step
        if c.info.consumed_samples is not None and c.info.consumed_samples != prompts:
            return (f"{c.record}: consumed_samples {c.info.consumed_samples} != step {c.step} x num_prompts_per_step "
                    f"{config.grpo.num_prompts_per_step} = {prompts} (trained with another global batch size?)")
        if c.info.training_step_end_time_ms <= previous_ms:
            return (f"{c.record}: weight-update time {c.info.training_step_end_time_ms} is not after {previous_ms} "
                    "(run_start or the previous checkpoint)")
        try:
            specs = foreign.tensor_specs(c)
        except CheckpointError as err:
            return str(err)
        if specs != first:
            differing = sorted(set(specs) ^ set(first)) or sorted(n for n in specs if specs[n] != first[n])
            return f"{c.path}: tensor names, shapes or dtypes differ from the first checkpoint's (first difference: {differing[0]!r})"
        return None

    def read(self, checkpoint: ForeignCheckpoint, buffers=None, stop=None):
        """The tensors (``buffers`` and ``stop`` unused: these layouts are read whole by
        their own readers)."""
        try:
            return foreign.read_weights(checkpoint)
        except CheckpointCorruptError as err:
            raise EvaluationError(f"{err}; no earlier checkpoint passed, so the run cannot be scored past it: restore it "
                                  "and run evaluate again (it resumes there)") from None
        except CheckpointError as err:
            raise EvaluationError(str(err)) from None

    def read_share(self, checkpoint: ForeignCheckpoint, slices: dict, buffers, group_rank: int, group_size: int,
                   stop=None):
        """A tensor-parallel rank's slices (``checkpoint/foreign_share.py``); errors as
        :meth:`read`'s reader raises them (the group combines them first)."""
        return foreign_share.read_foreign_share(checkpoint, slices, buffers, group_rank, group_size, stop)

    def reserve_share(self, buffers, checkpoint: ForeignCheckpoint, slices: dict) -> None:
        foreign_share.reserve_foreign_share(buffers, checkpoint, slices)

    def rank_spec(self) -> dict:
        """This source as JSON for the other torchrun ranks (:func:`source_from_spec`)."""
        return {"root": str(self.root), "format": self.format, "global_batch_size": self.global_batch_size,
                "manifest": None if self.manifest is None else str(self.manifest),
                "config_file": None if self.config_file is None else str(Path(self.config_file).resolve()),
                "hf_config": None if self.hf_config is None else str(Path(self.hf_config).resolve())}

    def verify(self, engine: InferenceEngine, checkpoint: ForeignCheckpoint, weights) -> str:
        """The engine's tensors equal those read (no canary: the layout records none). A
        tensor-parallel engine (``tp_size > 1``; ``weights`` its slices): the v2
        fingerprint of the engine's slices and that of the slices read, each combined over
        ``engine.tp_group`` (:func:`~mlperf_grpo.model.fingerprint.sharded_fingerprint`, two
        collectives: every rank of the group calls this), so each is the fingerprint of
        the full tensors.

        Raises:
            RefitError: they differ, or the group's slices do not add up to the tensors.
        """
        if getattr(engine, "tp_size", 1) == 1:
            want = weights_fingerprint({n: t.to(engine.dtype) for n, t in weights.items()})
            if engine.weights_fingerprint(list(weights)) != want:
                raise RefitError(f"{checkpoint.path}: the engine's weights differ from the checkpoint after refit")
            return "fingerprint of the tensors read (no canary or fingerprint recorded by the trainer)"
        shapes = {n: shape for n, (_, shape) in foreign.tensor_specs(checkpoint).items()}
        dtype = str(engine.dtype).removeprefix("torch.")
        specs = {n: (dtype, shapes[n]) for n in weights}
        blocks = foreign_share.share_blocks(specs, engine.weight_slices())
        read_slices = {n: tuple(slice(o, o + k) for o, k in zip(*blocks[n])) for n in weights}
        own = engine.weights()
        try:
            want = sharded_fingerprint({n: t.to(engine.dtype) for n, t in weights.items()}, read_slices, specs, engine.tp_group)
            got = sharded_fingerprint({n: own[n] for n in weights}, engine.weight_slices(), specs, engine.tp_group)
        except ValueError as err:
            raise RefitError(f"{checkpoint.path}: {err}") from None
        if got != want:
            raise RefitError(f"{checkpoint.path}: the engine's weights differ from the checkpoint after refit")
        return (f"fingerprint of the tensors read, combined over the {engine.tp_size} ranks' slices (no canary or "
                "fingerprint recorded by the trainer)")

    def published_steps(self) -> list[int]:
        if self.format == foreign.HF_DIRS:
            try:
                return [c.step for c in foreign.read_manifest(self.manifest, self.global_batch_size) if c.path.is_dir()]
            except CheckpointError:
                return []
        return published_steps(self.root)

    def remove(self) -> str:
        """Teardown keeps another trainer's series: the rule's teardown is of the
        benchmark's own deferred checkpoints, and these files (a NeMo-RL results folder, a
        manifest's directories anywhere on disk) are that trainer's and its user's.
        Returns the one line saying so."""
        return (f"note: kept the checkpoints of {self.root} ({self.format}: another trainer's series is never deleted "
                "by the evaluator); delete them yourself once they are not needed")


def _check_against_model(checkpoint: ForeignCheckpoint, specs: dict, model_dir: Path) -> list[str]:
    """The checkpoint holds the tensors of ``model.path``'s model (names and shapes;
    a tied ``lm_head.weight`` may be absent from either) and its ``config.json``, when
    it has one, describes the same architecture (:func:`config_differences`).

    Returns:
        Notes: the other keys its ``config.json`` differs in.
    Raises:
        EvaluationError: other tensors or shapes, or an architecture key differs (names
            the first key and both values).
    """
    model_files = sorted(model_dir.glob("*.safetensors"))
    if model_files:
        model = foreign.tensor_specs(ForeignCheckpoint(0, model_dir, None, model_dir, "safetensors", tuple(model_files)))  # type: ignore[arg-type]
        tied = {"lm_head.weight"}
        missing = sorted(set(model) - set(specs) - tied)
        unknown = sorted(set(specs) - set(model) - tied)
        if missing or unknown:
            raise EvaluationError(
                f"{checkpoint.path}: its tensors are not those of model.path {model_dir} (missing {missing[:3]}, "
                f"unknown {unknown[:3]}); evaluate with the model the series was trained from")
        shapes = [n for n in specs if n in model and specs[n][1] != model[n][1]]
        if shapes:
            raise EvaluationError(f"{checkpoint.path}: tensor {shapes[0]!r} has shape {specs[shapes[0]][1]}, "
                                  f"model.path's has {model[shapes[0]][1]}; evaluate with the model the series was trained from")
    if checkpoint.config_dir is None:
        return []
    path = checkpoint.config_dir / "config.json"
    try:
        architecture, other = config_differences(json.loads(path.read_text()), json.loads((model_dir / "config.json").read_text()))
    except (OSError, ValueError) as err:
        raise EvaluationError(f"{path}: not readable JSON ({err})") from None
    if architecture:
        key, (theirs, ours) = next(iter(architecture.items()))
        raise EvaluationError(
            f"{path} describes another model than {model_dir / 'config.json'} ({key}: {theirs!r} vs {ours!r}"
            f"{f', and {len(architecture) - 1} more' if len(architecture) > 1 else ''}); the engine is built from "
            "model.path: evaluate with the model the series was trained from")
    if not other:
        return []
    return [f"note: {path} differs from model.path's config.json only in keys that do not define the architecture "
            f"(not used: the engine is built from model.path): {', '.join(sorted(other))}"]


def config_differences(theirs: dict, ours: dict) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """``(architecture, other)``: dotted key -> (their value, our value) for every key
    whose value differs between two ``config.json`` contents, each first completed with
    transformers' defaults for its ``model_type`` (so a default written out equals one
    left out), split by :data:`ARCHITECTURE_KEY` on the last part of the key."""
    flat_theirs, flat_ours = _flat(_with_defaults(theirs)), _flat(_with_defaults(ours))
    differing = {k: (flat_theirs.get(k), flat_ours.get(k)) for k in sorted(set(flat_theirs) | set(flat_ours))
                 if flat_theirs.get(k) != flat_ours.get(k)}
    architecture = {k: v for k, v in differing.items() if ARCHITECTURE_KEY.match(k.rsplit(".", 1)[-1])}
    return architecture, {k: v for k, v in differing.items() if k not in architecture}


def _with_defaults(config: dict) -> dict:
    """``config`` with the defaults of its ``model_type``'s transformers config class
    filled in (unchanged when transformers does not know the type)."""
    from transformers import CONFIG_MAPPING

    try:
        return {**config, **CONFIG_MAPPING[config["model_type"]].from_dict(dict(config)).to_dict()}
    except Exception:  # noqa: BLE001  (an unknown or malformed type: compare as written)
        return config


def _flat(config: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and key.endswith("_config"):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _recorded_format(run: RunDir) -> str | None:
    """The format an earlier evaluation of this series recorded (``eval/source.json``):
    after teardown the checkpoints are gone, and a finished evaluation is still reported."""
    try:
        recorded = json.loads((run.eval_dir / SOURCE_FILE).read_text()).get("format")
    except (OSError, ValueError, AttributeError):
        return None
    return recorded if recorded in foreign.FORMATS else None


def source_from_spec(spec: dict) -> ForeignSeries:
    """The :class:`ForeignSeries` of :meth:`ForeignSeries.rank_spec` (another torchrun rank's)."""
    return ForeignSeries(Path(spec["root"]), spec["format"], int(spec["global_batch_size"]),
                         None if spec["manifest"] is None else Path(spec["manifest"]),
                         None if spec["config_file"] is None else Path(spec["config_file"]),
                         None if spec.get("hf_config") is None else Path(spec["hf_config"]))


def build_source(checkpoints: Path, fmt: str, config: RunConfig, config_file: Path | None = None):
    """The series source for ``--checkpoints`` and ``--format`` (``auto`` detects it);
    ``config_file``: the config's path, recorded for the other torchrun ranks.

    Raises:
        CheckpointError: the layout is not recognised, or ``--format`` names another one.
    """
    root = checkpoints.parent if checkpoints.is_file() else checkpoints
    if not checkpoints.exists():
        raise CheckpointError(f"--checkpoints {checkpoints} does not exist")
    detected = _recorded_format(RunDir(root)) or foreign.detect_format(checkpoints)
    if fmt != "auto" and fmt != detected:
        raise CheckpointError(f"--format {fmt}, but {checkpoints} holds the {detected} layout; pass --format {detected} or auto")
    if detected == foreign.OURS:
        return OursAt(root)
    manifest = checkpoints if checkpoints.is_file() else checkpoints / foreign.MANIFEST_FILE
    return ForeignSeries(root, detected, config.global_batch_size, manifest if detected == foreign.HF_DIRS else None,
                         config_file, resolve_model_path(config.model.path) / "config.json")
