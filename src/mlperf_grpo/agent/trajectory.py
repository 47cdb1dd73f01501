"""One agent trajectory: its token ids exactly as generated and appended, which of them
the engine sampled, its turns as text, why it ended, its reward."""

from __future__ import annotations

from dataclasses import dataclass, field

END_REASONS = ("finish", "max_turns", "context", "timeout")
"""Why a trajectory ended: the model called ``finish``; ``max_turns`` turns were taken;
the next turn or observation does not fit the context (``max_context_tokens``: the
trajectory is *overlong*); the trajectory's wall-clock limit passed (an invalid sample)."""


@dataclass
class Turn:
    """One model turn and what the environment answered.

    ``action``: the turn's text as the model wrote it (special tokens kept);
    ``calls``: the parsed calls (``{"name", "arguments"}`` or ``{"error"}``);
    ``observations``: what came back, each truncated to ``max_observation_chars``;
    ``sampled_tokens`` / ``environment_tokens``: ids the engine sampled / the environment
    appended after it.
    """

    action: str
    calls: list[dict] = field(default_factory=list)
    observations: list[str] = field(default_factory=list)
    sampled_tokens: int = 0
    environment_tokens: int = 0


@dataclass
class Trajectory:
    """A whole conversation of one task, one row of the training batch.

    ``prompt_token_ids``: the first prompt (system, user, tools, generation prompt).
    ``token_ids``: everything after it, model turns and environment text interleaved,
    exactly as generated and appended. ``sampled_mask[i]`` is 1 where ``token_ids[i]`` was
    sampled by the engine, 0 where the environment or the chat template wrote it;
    ``logprobs[i]`` the engine's log-probability there (0.0 elsewhere).
    ``invalid``: not a sample (the trajectory or its tests timed out): left out of the
    advantages, the loss and pass@k. ``overlong``: ended by the context limit
    (``end_reason == "context"``), what ``grpo.overlong_filtering`` drops from the loss.
    """

    task_id: str
    seed: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    sampled_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    end_reason: str = ""
    reward: float = 0.0
    invalid: bool = False
    grade_reason: str = ""
    wall_s: float = 0.0

    @property
    def text(self) -> str:
        """The model's turns, joined (what a text reward would read)."""
        return "\n".join(t.action for t in self.turns)

    @property
    def overlong(self) -> bool:
        return self.end_reason == "context"

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.token_ids)

    @property
    def num_sampled_tokens(self) -> int:
        return sum(self.sampled_mask)

    def append(self, ids: list[int], logprobs: list[float] | None) -> None:
        """Append sampled ids (with their log-probs) or, with ``logprobs`` None, environment ids."""
        self.token_ids.extend(ids)
        self.sampled_mask.extend([0 if logprobs is None else 1] * len(ids))
        self.logprobs.extend([0.0] * len(ids) if logprobs is None else logprobs)

    def record(self, max_chars: int = 2000) -> dict:
        """The JSON record ``eval/step_N.jsonl`` keeps of it: turns (observations cut to
        ``max_chars``), end reason, reward, validity, token counts."""
        return {
            "task_id": self.task_id, "end_reason": self.end_reason, "reward": self.reward, "invalid": self.invalid,
            "grade_reason": self.grade_reason, "prompt_tokens": len(self.prompt_token_ids),
            "tokens": self.num_tokens, "sampled_tokens": self.num_sampled_tokens, "wall_s": round(self.wall_s, 3),
            "turns": [{"action": t.action[:max_chars], "calls": t.calls,
                       "observations": [o[:max_chars] for o in t.observations]} for t in self.turns],
        }
