"""The shape of one lint finding, shared by the lint rules, the checker and the output."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Finding:
    """One problem in a log.

    ``line`` is the 1-based line number in the file (None when the problem is the
    absence of a line); ``key`` the MLPerf key involved; ``problem`` what is wrong;
    ``impact`` why it matters for the score; ``rule`` the lint rule's short name.
    """

    rule: str
    line: int | None
    key: str
    problem: str
    impact: str

    @classmethod
    def at(cls, rule: str, event, problem: str, impact: str) -> "Finding":
        """A finding of ``rule`` at a log event's line and key (``event``: a
        :class:`~mlperf_grpo.logs.mllog.LogEvent`, its ``line_no`` and ``key``)."""
        return cls(rule, event.line_no, event.key, problem, impact)

    def to_dict(self) -> dict:
        """The finding as a JSON-ready mapping of its fields."""
        return asdict(self)
