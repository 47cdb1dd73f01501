"""Multi-turn agent rollouts: many trajectories in flight, tools off the decode path.

Each trajectory is a conversation kept as token ids (:class:`~.trajectory.Trajectory`).
A turn: the engine samples from the ids until ``<|im_end|>`` (or the turn's token budget);
the turn's text is parsed for tool calls (:func:`~.parser.parse_tool_calls`); the calls
run in the trajectory's own session (sandbox) on a thread pool; their observations go
through the chat template and are appended as token ids (:class:`~.chat.ChatTokens`). It
ends at ``finish``, ``max_turns``, the context limit, or the wall-clock timeout (an
invalid sample); then the session grades it (the task's tests in its final state).

Scheduling: every trajectory whose turn is due is decoded in one engine call; a
trajectory waiting for its tools (or its sandbox's start, its grading or its sandbox's
removal, all on the tool threads) is not, and waiting never blocks the others: the loop
blocks only when no trajectory is due (that time is the engine's *idle* time,
:attr:`RolloutStats.engine_idle_s`).
KV cache across turns: vLLM's prefix cache reuses a conversation's earlier turns; the
``hf`` engine re-prefills the whole conversation each turn (keeping a row's KV in the
slot decoder across turns is not written).

A turn without any tool call gets the user message OpenHands' CodeAct agent sends in
headless runs (``codeact_user_response``: :data:`CONTINUE_MESSAGE`), as the reference's
agent does.

Invalid samples (``Trajectory.invalid``; masked out of the advantages, the loss and
pass@k), as NeMo Gym's ``swe_agents`` masks them (its swe_agents/README "GRPO masking
and failure modes"; docs/agentic.md): the trajectory's wall-clock timeout (not graded); the tests'
timeout or a sandbox limit during them (``tasks/swe/grade.py``); tests that pass although
the agent stopped at its turn or context limit ("the reward is accidental").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Protocol

from mlperf_grpo.agent.chat import ChatTokens
from mlperf_grpo.agent.parser import CallError, parse_tool_calls
from mlperf_grpo.agent.tools import FINISH, Observation, ToolCall, clip
from mlperf_grpo.agent.trajectory import Trajectory, Turn
from mlperf_grpo.inference.base import Completion, SamplingParams, derive_seed

CONTINUE_MESSAGE = (
    "Please continue working on the task on whatever approach you think is suitable.\n"
    "If you think you have solved the task, please finish the interaction.\n"
    "IMPORTANT: YOU SHOULD NEVER ASK FOR HUMAN HELP.\n"
)
"""OpenHands ``evaluation/utils/shared.py:codeact_user_response`` (its text, with the
``finish`` tool named as our tool list has it)."""


@dataclass(frozen=True)
class AgentSettings:
    """The agent loop's limits (config section ``agent``; closed values: the reference's).

    ``max_new_tokens_per_turn``: None = up to the context (the reference: its max
    generation equals the context, 65,536).
    """

    max_turns: int = 30
    max_context_tokens: int = 65536
    max_new_tokens_per_turn: int | None = None
    trajectory_timeout_s: float = 1800.0
    max_observation_chars: int = 30000
    tool_threads: int = 8


@dataclass(frozen=True)
class Grade:
    """A trajectory's score (i40c's ``tasks.swe.Grade`` has these fields)."""

    reward: float
    invalid: bool
    reason: str


class Session(Protocol):
    """One trajectory's environment: a sandbox with its task's repository."""

    def messages(self) -> list[dict]:
        """The first messages (system, user) of the conversation."""

    def call(self, call: ToolCall, max_chars: int) -> Observation:
        """Run one tool call in the sandbox (``tools.execute``: text at most ``max_chars``)."""

    def grade(self) -> Grade:
        """Run the task's tests in the final state."""

    def close(self) -> None:
        """Remove the sandbox (idempotent)."""


class TurnEngine(Protocol):
    """What the loop needs of an inference engine (``HFEngine`` has it)."""

    def generate_ids(self, prompt_token_ids: list[list[int]], params: SamplingParams, seeds: list[int]) -> list[Completion]:
        ...


@dataclass
class RolloutStats:
    """Wall-clock accounting of one :func:`run_trajectories` call (seconds)."""

    wall_s: float = 0.0
    engine_busy_s: float = 0.0
    engine_idle_s: float = 0.0
    """Time the loop waited with no trajectory due for a turn (all waiting for tools,
    sandbox start-up or grading)."""
    session_start_s: list[float] = field(default_factory=list)
    engine_calls: int = 0


@dataclass
class _Running:
    trajectory: Trajectory
    session: Session | None = None
    started: float = 0.0


def run_trajectories(
    engine: TurnEngine, chat: ChatTokens, jobs: list[tuple[str, int, Callable[[], Session]]], params: SamplingParams,
    settings: AgentSettings,
) -> tuple[list[Trajectory], RolloutStats]:
    """Run one trajectory per job ``(task_id, seed, open_session)`` to its end, all in flight together.

    Turn ``t`` of a trajectory samples with ``derive_seed(seed, t)``. Sessions are opened,
    tool calls run and trajectories graded on a pool of ``settings.tool_threads`` threads.
    Returns the trajectories in job order and the stats.
    Raises:
        Whatever a session raised (an infrastructure failure, not the model's doing);
        every open session is closed first.
    """
    stats = RolloutStats()
    start = time.perf_counter()
    runs = [_Running(Trajectory(task_id, seed, [])) for task_id, seed, _ in jobs]
    pending: dict[Future, tuple[_Running, str]] = {}
    due: list[_Running] = []
    with ThreadPoolExecutor(max_workers=settings.tool_threads, thread_name_prefix="agent-tools") as pool:
        try:
            for run, (_, _, opener) in zip(runs, jobs):
                pending[pool.submit(_timed, opener)] = (run, "open")
            while due or pending:
                if due:
                    batch, due = due, []
                    t0 = time.perf_counter()
                    _decode(engine, chat, batch, params, settings, pool, pending)
                    stats.engine_busy_s += time.perf_counter() - t0
                    stats.engine_calls += 1
                    done = [f for f in pending if f.done()]
                else:
                    t0 = time.perf_counter()
                    done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
                    stats.engine_idle_s += time.perf_counter() - t0
                for future in done:
                    run, what = pending.pop(future)
                    if _collect(run, what, future.result(), chat, settings, pool, pending, stats):
                        due.append(run)
        finally:
            for future, (_, what) in pending.items():  # a sandbox opened but not yet collected is closed too
                if not future.cancel() and what == "open" and future.exception() is None:
                    future.result()[0].close()
            for run in runs:
                if run.session is not None:
                    run.session.close()
    stats.wall_s = time.perf_counter() - start
    return [r.trajectory for r in runs], stats


def _timed(opener: Callable[[], Session]) -> tuple[Session, float]:
    t0 = time.perf_counter()
    session = opener()
    return session, time.perf_counter() - t0


def _collect(run: _Running, what: str, result: object, chat: ChatTokens, settings: AgentSettings, pool: ThreadPoolExecutor,
             pending: dict, stats: RolloutStats) -> bool:
    """Take a finished background job's result; True when the trajectory's next turn is due."""
    traj = run.trajectory
    if what == "open":
        run.session, seconds = result
        stats.session_start_s.append(seconds)
        traj.prompt_token_ids = chat.prompt_ids(run.session.messages())
        run.started = time.perf_counter()
        return True
    if what == "grade":
        traj.reward, traj.invalid, traj.grade_reason = float(result.reward), bool(result.invalid), result.reason
        if traj.reward > 0 and traj.end_reason in ("max_turns", "context"):  # NeMo Gym: "the reward is accidental"
            traj.reward, traj.invalid = 0.0, True
            traj.grade_reason = f"tests passed but the agent stopped at its {traj.end_reason} limit: masked"
    if what in ("grade", "close"):  # the session closed itself on the pool
        run.session = None
        return False
    observations, finished, full = result  # what == "tools"
    turn = traj.turns[-1]
    turn.observations = [o.text for o in observations]
    if time.perf_counter() - run.started > settings.trajectory_timeout_s:
        return _end(run, "timeout", pool, pending)
    if finished:
        return _end(run, "finish", pool, pending)
    if len(traj.turns) >= settings.max_turns:
        return _end(run, "max_turns", pool, pending)
    if full:  # the observations alone fill the context: the rest of the turn's calls did not run
        return _end(run, "context", pool, pending)
    if turn.calls:
        messages = [{"role": "tool", "content": o.text} for o in observations]
    else:
        messages, turn.observations = [{"role": "user", "content": CONTINUE_MESSAGE}], [CONTINUE_MESSAGE]
    ids = chat.environment_ids(messages)
    if traj.num_tokens + len(ids) >= settings.max_context_tokens:  # no room for a next turn
        return _end(run, "context", pool, pending)
    traj.append(ids, None)
    turn.environment_tokens += len(ids)
    return True


def _decode(engine: TurnEngine, chat: ChatTokens, batch: list[_Running], params: SamplingParams, settings: AgentSettings,
            pool: ThreadPoolExecutor, pending: dict) -> None:
    """One turn of every trajectory in ``batch`` in one engine call, then its tools on the pool."""
    live = []
    for run in batch:
        if time.perf_counter() - run.started > settings.trajectory_timeout_s:
            _end(run, "timeout", pool, pending)
        else:
            live.append(run)
    if not live:
        return
    budgets = [_budget(r.trajectory, settings) for r in live]
    ids = [r.trajectory.prompt_token_ids + r.trajectory.token_ids for r in live]
    seeds = [derive_seed(r.trajectory.seed, len(r.trajectory.turns)) for r in live]
    outs = engine.generate_ids(ids, replace(params, max_new_tokens=max(budgets)), seeds)
    for run, out, budget in zip(live, outs, budgets):
        _take_turn(run, out, budget, chat, settings, pool, pending)


def _budget(traj: Trajectory, settings: AgentSettings) -> int:
    room = settings.max_context_tokens - traj.num_tokens
    cap = settings.max_new_tokens_per_turn
    return max(1, min(room, cap) if cap is not None else room)


def _take_turn(run: _Running, out: Completion, budget: int, chat: ChatTokens, settings: AgentSettings,
               pool: ThreadPoolExecutor, pending: dict) -> None:
    traj = run.trajectory
    sampled = out.token_ids[:budget]
    ended = chat.end_of_turn_id in sampled
    if ended:
        sampled = sampled[:sampled.index(chat.end_of_turn_id) + 1]
    traj.append(sampled, list(out.logprobs[:len(sampled)]))
    text = chat.tokenizer.decode(sampled, skip_special_tokens=False).removesuffix(chat.end_of_turn)
    turn = Turn(action=text, sampled_tokens=len(sampled))
    traj.turns.append(turn)
    if not ended:
        if traj.num_tokens >= settings.max_context_tokens - 1:  # the turn ran into the context limit
            _end(run, "context", pool, pending)
            return
        closing = chat.encode(chat.end_of_turn)  # a turn cut by its own budget is closed by the environment
        traj.append(closing, None)
        turn.environment_tokens += len(closing)
    parsed = parse_tool_calls(text, chat.tools)
    turn.calls = [{"error": c.message} if isinstance(c, CallError) else {"name": c.name, "arguments": c.arguments}
                  for c in parsed.calls]
    limits = _CallLimits(settings.max_observation_chars, run.started + settings.trajectory_timeout_s,
                         settings.max_context_tokens - traj.num_tokens, chat.count)
    pending[pool.submit(_run_calls, run.session, parsed.calls, limits)] = (run, "tools")


@dataclass(frozen=True)
class _CallLimits:
    """A turn's bounds on its calls: ``max_chars`` each observation; the trajectory's
    ``deadline`` (``time.perf_counter()``); ``room``: the tokens left in the context, which
    the observations' tokens (``count``) may not reach."""

    max_chars: int
    deadline: float
    room: int
    count: Callable[[str], int]


def _run_calls(session: Session, calls: list, limits: _CallLimits) -> tuple[list[Observation], bool, bool]:
    """Every call of a turn in order: ``(observations, finished, full)``. A ``finish`` (an
    observation with ``finished``) ends the turn's calls; so does the trajectory's deadline (a
    turn of a thousand calls would otherwise run them all before its timeout is seen), and so
    do observations whose tokens reach the room left in the context (``full``: the trajectory
    ends there, as it would once they were tokenised; a turn of a thousand calls of 30,000
    characters each would otherwise hold and tokenise them all). A ``finish`` right after
    them still runs: its turn adds nothing to the context, and the honest "look, then finish"
    turn would otherwise end "context" with its reward masked."""
    observations, tokens = [], 0
    for i, call in enumerate(calls):
        if time.perf_counter() > limits.deadline:
            break
        if isinstance(call, CallError):  # it echoes the call
            observation = Observation(clip(call.message, limits.max_chars), finished=False, error=True)
        else:
            observation = session.call(call, limits.max_chars)  # at most max_chars (tools.clip)
        observations.append(observation)
        if observation.finished:
            return observations, True, False
        tokens += limits.count(observation.text)
        if tokens >= limits.room and not _is_finish(calls[i + 1:i + 2]):
            return observations, False, True
    return observations, False, tokens >= limits.room


def _is_finish(calls: list) -> bool:
    """Whether ``calls`` is one ``finish`` call (not a malformed one)."""
    return len(calls) == 1 and isinstance(calls[0], ToolCall) and calls[0].name == FINISH


def _end(run: _Running, reason: str, pool: ThreadPoolExecutor, pending: dict) -> bool:
    """End the trajectory; grade it unless it timed out (an invalid sample). Returns False."""
    traj = run.trajectory
    traj.end_reason = reason
    traj.wall_s = time.perf_counter() - run.started
    if reason == "timeout":
        traj.invalid, traj.grade_reason = True, f"trajectory timeout ({traj.wall_s:.0f} s)"
        pending[pool.submit(run.session.close)] = (run, "close")
    else:
        pending[pool.submit(_grade_and_close, run.session)] = (run, "grade")
    return False


def _grade_and_close(session: Session) -> Grade:
    """``session.grade()``, then its sandbox removed, on the pool: removing a large tree
    never holds up the loop's next engine call."""
    try:
        return session.grade()
    finally:
        session.close()
