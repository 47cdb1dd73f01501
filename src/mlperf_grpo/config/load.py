"""A run config read: YAML in (YAML 1.2 floats, every path relative to the file), a
mapping validated into a :class:`~mlperf_grpo.config.run.RunConfig` with one-line errors
that name the field and how to fix it, and YAML out."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from pydantic import ValidationError

from mlperf_grpo import rules
from mlperf_grpo.config.run import RunConfig
from mlperf_grpo.config.sections import BUILTIN_PREFIX
from mlperf_grpo.errors import ConfigError


class ClosedDivisionError(ConfigError):
    """A ``division: closed`` config departs from the closed rules: one line per value."""

    def __init__(self, source: str, violations: list[rules.Violation]) -> None:
        self.violations = violations
        lines = "".join(f"\n  {v}" for v in violations)
        n = len(violations)
        super().__init__(
            f"{source}: division closed, but {n} {'value departs' if n == 1 else 'values depart'} from the closed rules "
            f"(the run does not start):{lines}"
        )


def _format_errors(err: ValidationError, source: str) -> str:
    """One line per invalid field; several lines under a heading when there are several."""
    lines = [_describe(e) for e in err.errors()]
    if len(lines) == 1:
        return f"{source}: {lines[0]}"
    body = "".join(f"\n  {line}" for line in lines)
    return f"{source}: {len(lines)} config errors (the run does not start):{body}"


def _describe(error: dict) -> str:
    field = ".".join(str(p) for p in error["loc"])
    kind = error["type"]
    if kind == "extra_forbidden":
        return f"unknown key '{field}'; remove it or check its spelling"
    if kind == "missing":
        return f"missing field '{field}'"
    msg = error["msg"].removeprefix("Value error, ")
    if isinstance(error.get("input"), dict) and kind == "value_error":
        return msg  # a rule across fields: the message names them
    if kind == "value_error":
        return f"field '{field}': {msg}"
    return f"field '{field}': {msg} (got {error.get('input')!r})"


def parse_config(data: object, source: str = "config") -> RunConfig:
    """Validate a mapping into a :class:`RunConfig`.

    A ``division: closed`` config is also checked against the closed rules.

    Raises:
        ConfigError: one line naming the wrong field; with several wrong fields, a heading
            and one line per field.
        ClosedDivisionError: closed config with departing values, one line per value.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of config keys, got {type(data).__name__}")
    try:
        config = RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, source)) from None
    if config.division == "closed":
        violations = config.closed_violations()
        if violations:
            raise ClosedDivisionError(source, violations)
    return config


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's floats: PyYAML follows YAML 1.1, whose float
    needs a dot, so ``learning_rate: 1e-5`` would be the string ``"1e-5"`` (the same
    mantissa-and-exponent form that YAML 1.2's core schema and JSON read as a number).
    Every other scalar resolves as ``yaml.safe_load`` resolves it. A key given twice in
    one mapping is an error (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else ():
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, str):
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"key '{key}' given twice", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


ConfigLoader.add_implicit_resolver(  # only the form YAML 1.1 lacks: digits, then an exponent (1e-5, -2E+3)
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"), list("-+0123456789"))


def load_config(path: str | Path | None) -> RunConfig:
    """Read a YAML config; ``None`` gives the built-in default.

    Raises:
        ConfigError: unreadable file, malformed YAML, or an invalid/unknown field.
    """
    if path is None:
        return RunConfig()
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"cannot read config {path}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text (UTF-8) YAML file") from None
    try:
        data = yaml.load(text, Loader=ConfigLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        problem = getattr(err, "problem", "") or ""
        if problem.endswith("given twice"):
            raise ConfigError(f"{path}: {problem}{where}; keep one of them") from None
        raise ConfigError(f"{path}: malformed YAML{where}; fix the syntax") from None
    config = parse_config(data, source=str(path))
    return _paths_from(config, path.parent)


PATH_KEYS = {"model": ("path",), "task": ("train_path", "validation_path"), "agent": ("prompt_files", "sandbox_root")}
"""Every key of a config that names a file or folder (``model.path`` unless ``builtin:``)."""


def _paths_from(config: RunConfig, folder: Path) -> RunConfig:
    """``config`` with every relative path (:data:`PATH_KEYS`; a list's each item) made
    absolute against ``folder``, the config file's: the one rule for paths in a config,
    whatever the working directory. The run's ``config.yaml`` records the absolute paths,
    so a later ``evaluate RUN`` from anywhere reads the same files."""
    sections = {}
    for section, keys in PATH_KEYS.items():
        part = getattr(config, section)
        updates = {}
        for key in keys:
            value = getattr(part, key)
            if isinstance(value, str):
                updates[key] = _absolute(value, folder)
            elif isinstance(value, list):
                updates[key] = [_absolute(v, folder) for v in value]
        updates = {k: v for k, v in updates.items() if v != getattr(part, k)}
        if updates:
            sections[section] = part.model_copy(update=updates)
    return config.model_copy(update=sections) if sections else config


def _absolute(value: str, folder: Path) -> str:
    """``value`` made absolute against ``folder`` (a ``builtin:`` name is kept)."""
    if value.startswith(BUILTIN_PREFIX) or Path(value).is_absolute():
        return value
    return str((folder / value).resolve())


def dump_config(config: RunConfig) -> str:
    """YAML text of a config, loadable by :func:`load_config`."""
    return yaml.safe_dump(config.model_dump(), sort_keys=False)
