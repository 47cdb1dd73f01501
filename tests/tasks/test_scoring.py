"""The reward scorer (issue 8, part 4): rewards in killable worker processes under a deadline.

The reward functions live in ``reward_fixtures`` (a worker imports them by name).
"""

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import numeric_rewards
import reward_fixtures
from mlperf_grpo.errors import ConfigError
from mlperf_grpo.tasks import arithmetic, scoring
from mlperf_grpo.tasks.base import Task
from mlperf_grpo.tasks.scoring import RewardValueError, VerifierError, score
from mlperf_grpo.tasks.verify import math_reward

TESTS = Path(__file__).parents[1]


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def worker_pids() -> list[int]:
    return [w.process.pid for w in scoring._pool()._workers]


def test_scores_in_order_in_other_processes():
    tasks = arithmetic.validation_tasks(20)
    items = [(t.answer if i % 3 else "99=" + t.answer, t) for i, t in enumerate(tasks)]
    assert score(arithmetic.reward, items) == [arithmetic.reward(text, t) for text, t in items]
    assert score("mlperf_grpo.tasks.arithmetic:reward", items) == [0.0 if i % 3 == 0 else 1.0 for i in range(20)]
    pids = score(reward_fixtures.pid_reward, items)
    assert os.getpid() not in pids and set(pids) <= set(worker_pids())
    assert score(arithmetic.reward, []) == []


def test_reward_must_be_importable_by_name():
    items = [("1", Task("t", "p", "1"))]
    with pytest.raises(ValueError, match="not importable by name; define it at module level"):
        score(lambda text, task: 1.0, items)
    with pytest.raises(ValueError, match="cannot import no_such_module"):
        score("no_such_module:reward", items)
    with pytest.raises(ValueError, match="has no attribute nope"):
        score("mlperf_grpo.tasks.arithmetic:nope", items)
    with pytest.raises(ValueError, match="must be 'module:function'"):
        score("mlperf_grpo.tasks.arithmetic", items)


def test_reward_errors_and_dead_workers_are_verifier_errors():
    tasks = arithmetic.validation_tasks(8)
    with pytest.raises(RewardValueError, match=f"returned 'many' on task {tasks[0].task_id} \\(8 of 8 completions\\)"):
        score(reward_fixtures.bad_value_reward, [(t.answer, t) for t in tasks])
    items = [("die" if i == 3 else t.answer, t) for i, t in enumerate(tasks)]
    with pytest.raises(VerifierError, match=f"failed on 1 of 8 .*first: reward worker died \\(exit code 7\\) on task {tasks[3].task_id}"):
        score(reward_fixtures.dying_reward, items)
    assert score(reward_fixtures.dying_reward, [(t.answer, t) for t in tasks]) == [1.0] * 8  # the pool recovered
    # A reward that kills every worker stops after as many deaths as workers (no respawn per item).
    with pytest.raises(VerifierError, match=r"failed on 40 of 40 completions \(0 timeouts, (\d+) not scored: every worker was stuck\)") as info:
        score(reward_fixtures.dying_reward, [("die", t) for t in tasks * 5])
    assert int(re.search(r"(\d+) not scored", str(info.value)).group(1)) >= 30


@pytest.mark.parametrize("name, shown", [
    ("nan", "nan"), ("inf", "inf"), ("-inf", "-inf"), ("numpy-nan", "np.float64(nan)"), ("torch-inf", "tensor(inf)"),
    ("10**400", "1" + "0" * 56 + "..."), ("str", "'1.0'"), ("none", "None"), ("list", "[1.0]"), ("complex", "1j"),
])
def test_a_reward_that_is_not_a_finite_number_fails_the_call_naming_task_and_value(name, shown):
    tasks = arithmetic.validation_tasks(6)
    items = [(name if i in (2, 4) else "one", t) for i, t in enumerate(tasks)]
    with pytest.raises(RewardValueError) as info:
        score(numeric_rewards.value_reward, items)
    assert str(info.value) == (f"reward function numeric_rewards:value_reward returned {shown} on task {tasks[2].task_id} "
                               "(2 of 6 completions); a reward must be a finite number: fix the reward function")
    assert isinstance(info.value, VerifierError) and isinstance(info.value, ConfigError)  # bad input: exit 2


def test_finite_real_rewards_of_any_numeric_type_are_floats():
    names = ["one", "true", "half", "numpy", "torch", "-2.5"]
    items = [(name, Task(f"t{i}", "p", "1")) for i, name in enumerate(names)]
    rewards = score(numeric_rewards.value_reward, items)
    assert rewards == [1.0, 1.0, 0.5, 0.25, 0.75, -2.5] and all(type(r) is float for r in rewards)


def test_reward_timeout_uses_the_module_setting_and_counts_as_timeout(monkeypatch):
    tasks = arithmetic.validation_tasks(6)
    score(reward_fixtures.sleepy_reward, [(t.answer, t) for t in tasks])  # workers started, reward imported
    monkeypatch.setattr(scoring, "REWARD_TIMEOUT_S", 0.2)
    slow = tasks[2].task_id
    items = [("sleep 1.5" if t.task_id == slow else t.answer, t) for t in tasks]
    t0 = time.monotonic()
    with pytest.raises(VerifierError, match=f"failed on 1 of 6 completions \\(1 timeouts\\); first: timed out after 0.2 s on task {slow}"):
        score(reward_fixtures.sleepy_reward, items)
    assert time.monotonic() - t0 < 1.4


GIL_HOG = textwrap.dedent("""
    import sys, time
    from mlperf_grpo.tasks.base import Task
    from mlperf_grpo.tasks.scoring import VerifierError, score
    from mlperf_grpo.tasks.verify import math_reward
    gold = Task("power", "9^9^9 = ?", "1")
    score(math_reward, [("\\\\boxed{x+1}", Task("warm", "p", "1+x"))] * 8)  # workers up, math-verify loaded
    t0 = time.monotonic()
    try:
        score(math_reward, [("\\\\boxed{9^{9^{9}}}", gold)], timeout_s=3)
    except VerifierError as err:
        print(err)
    print(f"seconds: {time.monotonic() - t0:.2f}")
    print("after:", score(math_reward, [("\\\\boxed{1}", gold), ("\\\\boxed{2}", gold)]))
""")


def test_verifier_holding_the_interpreter_lock_times_out():
    """math-verify on 9^{9^{9}} computes a huge power holding the GIL: the old thread deadline
    never fired (no return after 45 s). Now the worker is killed at 3 s and replaced."""
    proc = subprocess.run([sys.executable, "-c", GIL_HOG], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "failed on 1 of 1 completions (1 timeouts); first: timed out after 3 s on task power" in proc.stdout
    assert 3.0 <= float(proc.stdout.split("seconds: ")[1].split()[0]) < 8.0  # 3 s + the kill, generous margin
    assert "after: [1.0, 0.0]" in proc.stdout


HUNG_VERIFIER = textwrap.dedent(f"""
    import sys, time
    sys.path.insert(0, {str(TESTS)!r})
    from mlperf_grpo.tasks import arithmetic, scoring
    from mlperf_grpo.tasks.scoring import VerifierError, score
    from reward_fixtures import pid_reward, sleepy_reward
    tasks = arithmetic.validation_tasks(10)
    while len(set(score(pid_reward, [(t.answer, t) for t in tasks * 4]))) < scoring.REWARD_WORKERS:
        pass  # every worker up and ready: the 4 stuck calls start together and time out together
    print("pids:", *[w.process.pid for w in scoring._pool()._workers])
    t0 = time.monotonic()
    try:
        score(sleepy_reward, [("sleep 3600" if t is tasks[0] else t.answer, t) for t in tasks for _ in range(4)], timeout_s=0.3)
    except VerifierError as err:
        print(err)
        print(f"seconds: {{time.monotonic() - t0:.2f}}")
""")


def test_hung_verifier_fails_in_seconds_and_lets_the_process_exit():
    """All 4 workers stuck on one task's generations: the rest are not scored, the error
    comes after ~timeout_s (not 40 x timeout_s), and the process exits leaving no worker."""
    proc = subprocess.run([sys.executable, "-c", HUNG_VERIFIER], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    # the 4 stuck calls (one per worker, sent in one pass) time out in one pass: nothing else is scored
    assert "failed on 40 of 40 completions (4 timeouts, 36 not scored: every worker was stuck)" in proc.stdout, proc.stdout
    assert float(proc.stdout.split("seconds: ")[1]) < 3.0
    pids = [int(p) for p in proc.stdout.split("pids: ")[1].splitlines()[0].split()]
    assert len(pids) == scoring.REWARD_WORKERS and not any(alive(p) for p in pids)


KILLED_PARENT = textwrap.dedent(f"""
    import sys
    sys.path.insert(0, {str(TESTS)!r})
    from mlperf_grpo.tasks import arithmetic, scoring
    from reward_fixtures import sleepy_reward
    tasks = arithmetic.validation_tasks(8)
    scoring.score(sleepy_reward, [(t.answer, t) for t in tasks])
    print(*[w.process.pid for w in scoring._pool()._workers], flush=True)
    scoring.score(sleepy_reward, [("sleep 3600 " + sys.argv[1], t) for t in tasks], timeout_s=3600)
""")


def test_workers_die_with_a_sigkilled_parent(tmp_path):
    """Busy workers (in a call that would last an hour) go when their parent is SIGKILLed."""
    proc = subprocess.Popen([sys.executable, "-c", KILLED_PARENT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == scoring.REWARD_WORKERS and all(alive(p) for p in pids)
        deadline = time.monotonic() + 30  # every worker has started an hour-long call (8 calls, fewer workers)
        while sorted(int(p.name) for p in tmp_path.iterdir()) != sorted(pids):
            assert proc.poll() is None and time.monotonic() < deadline, "the hour-long calls did not start"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in pids)
    finally:
        proc.kill()
        proc.wait()


def test_math_reward_in_workers_matches_in_process():
    task = Task("t", "q", "\\frac{1}{2}")
    texts = ["\\boxed{0.5}", "#### 1/2", "0.5000001", "so 1/2", "\\boxed{\\frac{2}{4}}", "nothing"]
    # "so 1/2": free text's final answer is its last number, 2 (a fraction must stand alone or be boxed)
    assert score(math_reward, [(t, task) for t in texts]) == [math_reward(t, task) for t in texts] == [1, 1, 0, 0, 1, 0]


def test_in_training_a_timed_out_verification_scores_0_and_is_counted():
    """Issue 44: one pathological completion no longer ends the run; it scores 0, as the
    reference's math environment scores it, and the count comes back for the step's log."""
    tasks = arithmetic.validation_tasks(6)
    score(reward_fixtures.sleepy_reward, [(t.answer, t) for t in tasks])  # workers started, reward imported
    items = [("sleep 30" if i == 2 else t.answer, t) for i, t in enumerate(tasks)]
    t0 = time.monotonic()
    rewards, timeouts = scoring.score_tolerating_timeouts(reward_fixtures.sleepy_reward, items, 0.5, timeout_s=0.3)
    assert (rewards, timeouts) == ([1.0, 1.0, 0.0, 1.0, 1.0, 1.0], 1)
    assert time.monotonic() - t0 < 10  # the stuck worker was killed, not waited for


def test_a_cancelled_scoring_stops_at_once_and_the_pool_scores_the_next_call(tmp_path):
    """Before: a score call on another thread ran to its end (its timeouts too) however its
    caller was stopping: SIGTERM waited 92 s for a hanging reward (helper break11)."""
    tasks = arithmetic.validation_tasks(8)
    score(reward_fixtures.sleepy_reward, [(t.answer, t) for t in tasks])
    items = [(f"sleep 3600 {tmp_path}", t) for t in tasks]
    cancel = threading.Event()
    threading.Timer(0.5, cancel.set).start()
    t0 = time.monotonic()
    with pytest.raises(scoring.ScoringCancelled):
        scoring.score_tolerating_timeouts(reward_fixtures.sleepy_reward, items, 0.5, timeout_s=600, cancel=cancel)
    assert time.monotonic() - t0 < 5 and any(tmp_path.iterdir())  # stopped mid-call, not after 600 s
    assert score(reward_fixtures.sleepy_reward, [(t.answer, t) for t in tasks]) == [1.0] * 8


def test_a_raising_reward_under_a_timeout_share_names_what_stopped_the_scoring():
    """Before: "N not scored: every worker was stuck", though no worker was (helper break11)."""
    bad = next(t for t in arithmetic.validation_tasks(251) if t.task_id == reward_fixtures.BAD_TASK)
    with pytest.raises(VerifierError) as err:
        scoring.score_tolerating_timeouts("reward_fixtures:crashing_reward", [("1", bad)] * 16, 0.5)
    assert "stuck" not in str(err.value) and ("not scored after the first error" in str(err.value)
                                              or "(0 timeouts)" in str(err.value)), str(err.value)


def test_in_training_more_timeouts_than_the_share_stop_at_once():
    tasks = arithmetic.validation_tasks(8)
    score(reward_fixtures.sleepy_reward, [(t.answer, t) for t in tasks])
    items = [("sleep 3600" if i % 2 else t.answer, t) for i, t in enumerate(tasks)]  # 4 of 8 hang
    t0 = time.monotonic()
    with pytest.raises(VerifierError, match=r"failed on \d+ of 8 completions \(\d+ timeouts, more than the 2 allowed"):
        scoring.score_tolerating_timeouts(reward_fixtures.sleepy_reward, items, 0.25, timeout_s=0.3)
    assert time.monotonic() - t0 < 10
    with pytest.raises(VerifierError, match=r"\(1 timeouts\)"):  # share 0: the first timeout stops, as score() does
        scoring.score_tolerating_timeouts(reward_fixtures.sleepy_reward, items[:2], 0.0, timeout_s=0.3)
