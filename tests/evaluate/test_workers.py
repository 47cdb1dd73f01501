"""The torchrun ranks' coordination through their store (evaluate/launch.py), in this
process: the store is hosted here, as torchrun's agent on another node hosts it, and rank
0 is simulated by writing its keys."""

import json
import socket
import threading
import time

import pytest
import torch.distributed as dist

from mlperf_grpo.evaluate import launch as workers
from mlperf_grpo.evaluate.launch import Rank0LostError, TorchrunRanks

SILENCE_S = 1.0


@pytest.fixture
def agent_store(monkeypatch):
    """A TCPStore hosted here (the agent's), the environment of rank 1 of 2 on node 1,
    and a short silence limit; yields the store under the ranks' prefix."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    for name, value in {"TORCHELASTIC_RUN_ID": "test", "RANK": "1", "LOCAL_RANK": "0", "GROUP_RANK": "1",
                        "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(workers, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(workers, "RANK0_SILENCE_S", SILENCE_S)
    yield dist.PrefixStore("mlperf_eval/", store)


def beat_for(store, seconds):
    """Rank 0's heartbeat for ``seconds`` (a thread), then silence, as when it is SIGKILLed."""
    def beat():
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            store.add("heartbeat/0", 1)
            time.sleep(0.05)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    return thread


def beats_reaching(store, count, timeout_s=30.0):
    """Polls rank 0's heartbeat counter every 10 ms until it reaches ``count``; returns it.
    Fails after ``timeout_s`` (a heartbeat that stopped, or never started)."""
    deadline = time.monotonic() + timeout_s
    while (beats := store.add("heartbeat/0", 0)) < count:
        assert time.monotonic() < deadline, f"rank 0's heartbeat stayed at {beats}, short of {count}"
        time.sleep(0.01)
    return beats


def test_a_rank_stops_waiting_once_rank_0s_heartbeat_stands_still(agent_store):
    """Rank 0 heartbeats for twice the silence limit (the rank keeps waiting: no false
    alarm), then stops, as if killed: the rank's wait for the plan ends one silence limit
    later with one line saying so and how to resume, and the queue is failed (no worker
    claims more; a rank 0 only slow would raise that line)."""
    beating = beat_for(agent_store, 2 * SILENCE_S)
    ranks = TorchrunRanks()
    start = time.monotonic()
    with pytest.raises(Rank0LostError) as caught:
        ranks.wait_plan()
    waited_s = time.monotonic() - start
    beating.join()
    assert 3 * SILENCE_S - 0.5 < waited_s < 3 * SILENCE_S + 5.0, waited_s
    assert str(caught.value) == (
        f"rank 0 is gone (its heartbeat in the store stood still for {SILENCE_S:g} s: killed, or its node lost); this "
        "rank stops. Nothing partial was logged: run the same evaluate command again to resume the run")
    assert agent_store.get("failed").decode() == f"rank 1: {caught.value}"
    assert agent_store.check(["stop"])
    ranks.close()


def test_a_rank_takes_rank_0s_verdict_after_its_heartbeat_stopped(agent_store):
    """Rank 0 concluded (its verdict set), then exited (no heartbeat): no alarm, the
    rank takes the verdict."""
    beat_for(agent_store, 0.2).join()
    agent_store.set("verdict", json.dumps({"exit_code": 0, "error": None, "node": 0}))
    ranks = TorchrunRanks()
    time.sleep(2 * SILENCE_S)
    assert ranks.verdict() == (0, None)
    assert ranks.rank0_lost is None and not agent_store.check(["failed"])
    ranks.close()


def test_rank_0_heartbeats_from_its_own_thread(agent_store, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("GROUP_RANK", "0")
    ranks = TorchrunRanks()
    # its main thread does nothing (here: polls the store): the thread beats (every 0.05 s here)
    first = beats_reaching(agent_store, 2)
    beats_reaching(agent_store, first + 1)
    ranks.close()
    stopped = agent_store.add("heartbeat/0", 0)
    time.sleep(0.2)
    assert agent_store.add("heartbeat/0", 0) == stopped


def test_a_rank_whose_store_is_gone_stops_with_one_line(monkeypatch):
    """Without an agent's store rank 0 serves it: rank 0 killed, the store is gone, and
    the rank's wait ends at once with one line (not a store error)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rank0_store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    for name, value in {"TORCHELASTIC_RUN_ID": "test", "RANK": "1", "GROUP_RANK": "1", "WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                        "TORCHELASTIC_USE_AGENT_STORE": "False"}.items():
        monkeypatch.setenv(name, value)
    ranks = TorchrunRanks()
    del rank0_store  # its server stops with it, as with a killed rank 0
    start = time.monotonic()
    with pytest.raises(Rank0LostError, match=r"^rank 0 is gone \(the store is unreachable \(.*\): killed, or its node "
                                             r"lost\); this rank stops\. Nothing partial was logged") as caught:
        ranks.wait_plan()
    assert "\n" not in str(caught.value) and time.monotonic() - start < 10.0
    ranks.close()


def _wait_ended_in_thread(ranks):
    done = threading.Event()
    thread = threading.Thread(target=lambda: (ranks.wait_ended(), done.set()), daemon=True)
    thread.start()
    return done


def test_rank_0_waits_for_a_beating_rank_and_for_no_rank_that_is_gone(agent_store, monkeypatch):
    """Rank 0's wait for the others to stop (``wait_ended``) keeps waiting for a rank of
    a tensor-parallel worker while its heartbeat moves and its process lives, and ends
    without ``ended/1`` once its process on this host has ended (group_watch.PeerTracker)."""
    import subprocess
    import sys

    from mlperf_grpo.evaluate import group_watch

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(group_watch, "PEER_SILENCE_S", SILENCE_S)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    agent_store.set("pid/1", json.dumps({"host": socket.gethostname(), "pid": child.pid}))
    ranks = TorchrunRanks()
    try:
        done = _wait_ended_in_thread(ranks)
        end = time.monotonic() + 3 * SILENCE_S
        while time.monotonic() < end:  # beating and alive: waited for past the silence limit
            agent_store.add("alive/1", 1)
            time.sleep(0.05)
        assert not done.is_set()
        child.kill()  # rank 1 is SIGKILLed: a zombie until reaped, ended either way
        assert done.wait(timeout=5)
    finally:
        child.kill()
        child.wait()
        ranks.close()


def test_a_rank_whose_heartbeat_stands_still_is_not_waited_for(agent_store, monkeypatch):
    """A rank on another host (its pid unknown here) whose heartbeat stood still for the
    silence limit is not waited for either."""
    from mlperf_grpo.evaluate import group_watch

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(group_watch, "PEER_SILENCE_S", SILENCE_S)
    agent_store.set("pid/1", json.dumps({"host": "another-node", "pid": 1}))
    agent_store.add("alive/1", 5)
    ranks = TorchrunRanks()
    try:
        start = time.monotonic()
        ranks.wait_ended()
        assert SILENCE_S - 0.1 < time.monotonic() - start < SILENCE_S + 5
    finally:
        ranks.close()


def test_process_alive_takes_an_ended_or_zombie_process_for_ended():
    import os
    import subprocess
    import sys

    from mlperf_grpo.evaluate.group_watch import process_alive

    assert process_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while process_alive(child.pid):  # exited, not reaped: a zombie
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child.wait()
    assert not process_alive(child.pid)
