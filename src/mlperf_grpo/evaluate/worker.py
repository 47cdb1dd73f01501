"""One evaluation worker: its engine's start-up, and the loop claim -> read (verified,
the next one prefetched) -> refit -> verify -> validate -> publish.

The serial evaluator runs one worker in its own process (:func:`evaluate_claimed`);
``evaluate --workers N`` and ``evaluate`` under torchrun run one per rank
(:func:`evaluate_rank`; rank 0 also commits in step order). The ranks are forked from a
fork server that imports this module (``evaluate/prestart.py``). Where each worker's
time went is appended to ``eval/startup.jsonl`` and ``eval/timing.jsonl``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
import time
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from mlperf_grpo.checkpoint import Checkpoint
from mlperf_grpo.config.run import RunConfig
from mlperf_grpo.config.rundir import RunDir
from mlperf_grpo.evaluate.commit import EvalPlan, StepOrderCommitter, unlogged_results, write_results
from mlperf_grpo.evaluate.launch import TorchrunRanks, WorkQueue, die_with_launcher, rank_queue
from mlperf_grpo.evaluate.prefetch import CheckpointPrefetcher
from mlperf_grpo.evaluate.series import EvalJob, RunSeries, SeriesProblem, SeriesSource, read_error, series_by_step
from mlperf_grpo.evaluate.validator import validate_suite
from mlperf_grpo.evaluate.worker_errors import WORKER_ERRORS, RankFailedError
from mlperf_grpo.evaluate.worker_group import (
    SoloWorker,
    TensorParallelGroup,
    group_size,
    join_process_group,
    watch_group,
)
from mlperf_grpo.inference.base import InferenceEngine, SamplingParams
from mlperf_grpo.inference.factory import build_engine
from mlperf_grpo.logs.mllog import now_ms
from mlperf_grpo.tasks import ValidationSet, load_validation_set
from mlperf_grpo.tasks.base import is_agentic
from mlperf_grpo.tasks.scoring import REWARD_WORKERS, VerifierError, score

RANK_MODULE = __name__
"""The module the evaluation ranks run from (:func:`evaluate_rank`): what their fork
server imports ahead (``evaluate/prestart.py``)."""

def evaluate_claimed(queue: WorkQueue, job: EvalJob, checkpoints: dict[int, Checkpoint], plan: EvalPlan,
                     engine: Callable[[], InferenceEngine], after_each=lambda: None,
                     group: SoloWorker | TensorParallelGroup | None = None) -> None:
    """One worker: claim the next pending checkpoint, refit from its prefetched verified
    read (the next one is read meanwhile), verify, validate, write its results to
    ``eval/unlogged/`` and publish its result (or its error) until none is left or the
    run is decided. ``engine()`` gives the worker's engine; it is called once, after the
    first claim, so an engine started then (:class:`EngineAtFirstUse`) starts while its
    first checkpoint is read. ``after_each()`` runs after every publish (the serial
    committer). ``group``: this rank's part of a worker spanning a tensor-parallel group
    (:class:`~mlperf_grpo.evaluate.worker_group.TensorParallelGroup`: its leader claims,
    writes and publishes; every rank reads its share, refits, verifies and generates);
    default one rank (:class:`~mlperf_grpo.evaluate.worker_group.SoloWorker`). ``validation``:
    the run's task suite and validation tasks, loaded once by the caller."""
    run, source, config = job.run, job.source, job.config
    suite, tasks = job.validation.suite, job.validation.tasks
    v = config.validation
    params = SamplingParams(v.temperature, v.top_p, config.grpo.max_new_tokens)
    group = SoloWorker(source) if group is None else group
    prefetcher = CheckpointPrefetcher(group.read, pin=_pins_host_buffers(config), reserve=group.reserve)
    try:
        claimed = _claim(queue, group, plan, checkpoints, prefetcher)
        worker_engine = engine() if claimed else None
        while claimed and group.go(queue):
            wait_start_s = time.perf_counter()
            item = prefetcher.take()
            claimed = _claim(queue, group, plan, checkpoints, prefetcher)  # read it while this one is validated
            error = group.agree(item.error)  # the group's ranks fail together
            try:
                if error is not None:
                    raise read_error(item.checkpoint, error)
                start_ms, refit_start_s = now_ms(), time.perf_counter()
                worker_engine.load_weights(item.weights)  # refit, no optimizer state; waits for the copies
                checked = source.verify(worker_engine, item.checkpoint, item.weights)
                prefetcher.release(item)
                generation_start_s = time.perf_counter()
                accuracy, results = validate_suite(worker_engine, suite, tasks, v.generations_per_task, params, config.seed,
                                                   config.agent)
                generation_stop_s = time.perf_counter()
                if group.leader:
                    write_results(run, item.checkpoint.step, results, params, config.seed, worker_engine.describe(), checked,
                                  unlogged_results(run, item.checkpoint.step))
                    record_timing(run, item.checkpoint.step, read_wait_s=refit_start_s - wait_start_s,
                                  refit_s=generation_start_s - refit_start_s, generation_s=generation_stop_s - generation_start_s,
                                  **worker_engine.generation_stats())
                    queue.publish(item.index, {"accuracy": accuracy, "start_ms": start_ms, "stop_ms": now_ms()})
            except tuple(WORKER_ERRORS.values()) as err:
                if group.leader:
                    queue.publish(item.index, {"error": type(err).__name__, "message": str(err)})
            after_each()
    finally:
        prefetcher.close()


def record_timing(run: RunDir, step: int, **seconds: float) -> None:
    """Append one line to ``eval/timing.jsonl``: where one checkpoint's evaluation time
    went, in seconds (``read_wait_s``: waiting for its verified read, the part the
    prefetch did not hide; ``refit_s``: weights into the engine and verified;
    ``generation_s``: validation), the engine's counts of the validation's generation
    (``InferenceEngine.generation_stats``: for the ``hf`` slot decoder ``decode_steps``,
    ``rerun_steps``, ``graph_captures``, ``prefills``, ``prefill_ms``, ``cache_grows``,
    ``preempted``, ``kv_cache_peak_bytes``), which rank evaluated it, and the process
    (:func:`process_fields`). Informational only."""
    record = {"step": step, "rank": int(os.environ.get("RANK", 0)), **{k: round(v, 4) for k, v in seconds.items()},
              **process_fields()}
    with open(run.eval_dir / "timing.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def process_fields() -> dict[str, int | float | None]:
    """``{"pid": ..., "process_start_unix_s": ...}`` of the calling process, for the
    lines of ``eval/timing.jsonl`` and ``eval/startup.jsonl``: together they name the
    process that wrote a line (a pid is reused only by a later process), so the lines of
    each evaluation attempt (these files are appended to across resumes) can be told
    apart. The start time is the kernel's (``/proc/PID/stat`` field 22 after the boot
    time of ``/proc/stat``, ``proc(5)``; to the second), ``None`` where there is no
    ``/proc``."""
    return {"pid": os.getpid(), "process_start_unix_s": _process_start_unix_s(os.getpid())}


@functools.lru_cache(maxsize=None)
def _process_start_unix_s(pid: int) -> float | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot_unix_s = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                           if line.startswith("btime "))
    except (OSError, StopIteration):
        return None
    start_ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22; fields after "(comm)" start at 3
    return round(boot_unix_s + start_ticks / os.sysconf("SC_CLK_TCK"), 2)


def start_engine(run: RunDir, config: RunConfig, validation: ValidationSet, launch_unix_s: float | None = None) -> InferenceEngine:
    """This worker's engine, ready before it refits its first checkpoint: built with its
    weights unset (``refit_only``: the first refit fills every one, verified by
    fingerprint and canary), then warmed up by generating 2 tokens for the validation
    prompts of one engine batch (``validation.batch_size`` rows on a GPU, where the first
    batch of that shape pays the allocator's growth and the first kernel launches; one
    row on the CPU) and scoring one completion once per reward worker (their start and
    imports), so no checkpoint's time includes start-up. Appends where start-up went to
    ``eval/startup.jsonl`` (:func:`record_startup`).

    Args:
        launch_unix_s: Unix time (s) at which the evaluator launched the worker ranks
            (None: this is the evaluator's own process).
    Raises:
        ModelLoadError, EngineUnavailableError: the engine cannot be built.
    """
    start_unix_s, start_s = time.time(), time.perf_counter()
    engine = build_engine(config, batch_size=config.validation.batch_size, refit_only=True)
    built_s = time.perf_counter()
    try:
        suite, tasks = validation.suite, validation.tasks
        v = config.validation
        rows = v.batch_size if _engine_on_cuda(engine) else 1
        prompts = [tasks[i % len(tasks)].prompt for i in range(rows)]
        completion = engine.generate(prompts, SamplingParams(v.temperature, v.top_p, 2), seeds=list(range(rows)))[0]
        try:
            if not is_agentic(suite):  # an agent's rewards are graded in sandboxes, no reward workers
                score(suite.reward, [(completion.text, tasks[0])] * REWARD_WORKERS)  # the rewards are discarded
        except VerifierError:
            pass  # a broken reward fails the first checkpoint's validation, in step order, as without warm-up
        if _engine_on_cuda(engine):
            torch.cuda.synchronize(engine.device)
    except BaseException:
        engine.close()
        raise
    ready_s = time.perf_counter()
    record_startup(run, launch_unix_s=launch_unix_s, start_unix_s=start_unix_s,
                   engine_s=built_s - start_s, warm_up_s=ready_s - built_s)
    return engine


def record_startup(run: RunDir, **fields: float | None) -> None:
    """Append one line to ``eval/startup.jsonl``: one worker's start-up (``rank``;
    ``launch_unix_s``: when the evaluator launched the ranks, null for the evaluator's own
    worker; ``start_unix_s``: when this worker began building its engine, after its
    imports; ``engine_s``: engine built; ``warm_up_s``: the warm-up generation and
    scoring; ``pid``, ``process_start_unix_s``: :func:`process_fields`).
    Informational only."""
    record = {"rank": int(os.environ.get("RANK", 0)),
              **{k: (None if v is None else round(v, 4)) for k, v in fields.items()}, **process_fields()}
    run.eval_dir.mkdir(parents=True, exist_ok=True)
    with open(run.eval_dir / "startup.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def _claim(queue: WorkQueue, group: SoloWorker | TensorParallelGroup, plan: EvalPlan, checkpoints: dict[int, Checkpoint],
           prefetcher: CheckpointPrefetcher) -> bool:
    index = group.claim(queue)
    if index is None:
        return False
    prefetcher.submit(index, checkpoints[plan.pending_steps[index]])
    return True


def _engine_on_cuda(engine: InferenceEngine) -> bool:
    return engine.device.type == "cuda"


def _pins_host_buffers(config: RunConfig) -> bool:
    """The checkpoint reads go to pinned host memory: the ``hf`` engine on a GPU refits
    from it with one DMA per tensor (vLLM takes the weights through its own process)."""
    return config.inference.engine == "hf" and config.model.device.startswith("cuda")


class EngineAtFirstUse:
    """A worker's engine, started (:func:`start_engine`) the first time it is asked for;
    :meth:`close` closes it if it was started.

    Args:
        run, config, validation, launch_unix_s: as :func:`start_engine`'s.
    """

    def __init__(self, run: RunDir, config: RunConfig, validation: ValidationSet, launch_unix_s: float | None = None) -> None:
        self._start = lambda: start_engine(run, config, validation, launch_unix_s)
        self._engine: InferenceEngine | None = None

    def __call__(self) -> InferenceEngine:
        if self._engine is None:
            self._engine = self._start()
        return self._engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None


def evaluate_rank(run_dir: str, mllog_file: str, plan: EvalPlan, show_progress: bool,
                  launch_unix_s: float | None = None, validation: ValidationSet | None = None,
                  series: dict | None = None) -> dict | None:
    """A torchrun rank of ``evaluate --workers N`` (or of ``evaluate`` under torchrun):
    one engine on device ``LOCAL_RANK`` (CUDA) or a CPU process with its share of its
    node's cores, started (:func:`start_engine`)
    once the rank has claimed its first checkpoint, while that one is read (a rank that
    claims nothing starts none); rank 0 also commits (a thread with its own store
    connection) to ``mllog_file`` (the evaluator's, resolved when it took the lock).
    Dies with the launching evaluator (it holds the lock; :func:`die_with_launcher`).
    ``launch_unix_s``: when the evaluator launched the ranks (Unix s; for
    ``eval/startup.jsonl``). With the ``hf`` engine and ``inference.tensor_parallel_size``
    T > 1 (under torchrun, world = workers x T): the rank joins a process group, every
    rank builds its engine at once (tensor-parallel over ranks ``w T .. w T + T - 1``),
    and the ``T`` ranks of a group are one worker
    (:class:`~mlperf_grpo.evaluate.worker_group.TensorParallelGroup`). ``validation``: the
    evaluator's task suite and validation tasks when this is its own process (rank 0 of
    torchrun's ranks); ``None`` in a launched rank's process: loaded here, once.
    ``series``: another trainer's series (``ForeignSeries.rank_spec``: its layout and the
    config's path; ``run_dir`` is then its folder), else the run directory's own.

    Returns:
        rank 0: ``None`` or ``{"error": class name, "message": ...}``; others ``None``.
    """
    die_with_launcher()
    # one process, one bar: a thread lock, not tqdm's default multiprocessing one (a named
    # semaphore that, in a forkserver rank, the evaluator's resource tracker would report
    # leaked when the launcher stops the rank with SIGTERM)
    tqdm.set_lock(threading.RLock())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    run = RunDir(Path(run_dir))
    config, source = rank_series(run, series)
    if config.model.device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    t = group_size(config)
    joined = join_process_group(config) if t > 1 else False
    engine: EngineAtFirstUse | None = None
    failure: list[dict] = []
    committer_thread, watch = None, None
    try:
        validation = load_validation_set(config) if validation is None else validation
        engine = EngineAtFirstUse(run, config, validation, launch_unix_s)
        checkpoints = series_by_step(source)
        queue = rank_queue(len(plan.pending_steps), serve=True)
        watch = watch_group(queue.store, rank, t)  # T > 1: from before the engine's collectives on
        with watch.watching() if watch is not None else contextlib.nullcontext():  # a dead peer: one line, the job ends
            # T > 1: every rank of the world builds its engine now (the groups' mesh is a collective)
            group = TensorParallelGroup(engine(), queue.store, rank // t, source) if t > 1 else None
            if rank == 0:
                committer_thread = _start_committer(StepOrderCommitter(
                    run, config, Path(mllog_file), plan, checkpoints, rank_queue(len(plan.pending_steps), serve=False),
                    show_progress), failure)
            evaluate_claimed(queue, EvalJob(run, source, config, validation), checkpoints, plan, engine, group=group)
    except BaseException as err:
        if committer_thread is not None:  # rank 0: its committer waits for no result more
            with contextlib.suppress(Exception):
                queue.fail(f"rank 0: {type(err).__name__}: {err}")
        raise
    finally:
        if watch is not None:
            watch.close()
        if engine is not None:
            engine.close()
        if joined:
            torch.distributed.destroy_process_group()
    if committer_thread is not None:
        committer_thread.join()
    return failure[0] if failure else None


def _start_committer(committer: StepOrderCommitter, failure: list[dict]) -> threading.Thread:
    """Rank 0's committer, in a thread of its own: it commits in step order until the
    run is decided; a worker error it meets is appended to ``failure``."""
    def commit_all() -> None:
        try:
            committer.advance(block=True)
        except tuple(WORKER_ERRORS.values()) as err:
            failure.append({"error": type(err).__name__, "message": str(err)})
        finally:
            committer.close()

    thread = threading.Thread(target=commit_all, name="commit-in-step-order")
    thread.start()
    return thread


def rank_series(run: RunDir, series: dict | None) -> tuple[RunConfig, SeriesSource]:
    """A rank's config and series: the run directory's (``run.json``, ``checkpoints/``),
    or, for another trainer's series (``series``: ``ForeignSeries.rank_spec``), the
    config file rank 0 loaded and that series.

    Raises:
        RunDirError, ConfigError: the run directory or the config is not usable.
    """
    if series is None:
        return run.load()[0], RunSeries(run.checkpoints)
    from mlperf_grpo.config.load import load_config
    from mlperf_grpo.evaluate.foreign_source import source_from_spec

    return load_config(Path(series["config_file"])), source_from_spec(series)


def join_evaluation(run_dir: Path | None, ranks: TorchrunRanks) -> int:
    """A rank other than 0 of ``evaluate`` under torchrun (``RUN_DIR``, or another
    trainer's series: rank 0's plan names the folder and the series): wait for rank 0's
    plan and evaluate as a worker (:func:`evaluate_rank`), or nothing when rank 0
    concluded without a plan (nothing to evaluate, or it failed first); then tell rank 0
    this rank stopped (with its error if it failed) and wait for rank 0 to conclude.
    Writes only what a worker writes (``eval/unlogged/``, ``eval/timing.jsonl``,
    ``eval/startup.jsonl``).

    Returns:
        this rank's exit code (:meth:`TorchrunRanks.verdict`).
    Raises:
        RankFailedError: rank 0 failed, and this rank is on another node (its message).
        whatever :func:`evaluate_rank` raises (reported to rank 0 first).
    """
    shared = ranks.wait_plan()
    try:
        if shared is not None:
            p = shared["plan"]
            plan = EvalPlan(p["pending_steps"], p["problem"] and SeriesProblem(**p["problem"]), p["final_step"])
            evaluate_rank(shared.get("run_dir", str(run_dir)), shared["mllog_file"], plan, show_progress=False,
                          series=shared.get("series"))
    except BaseException as err:
        with contextlib.suppress(Exception):  # best effort (rank 0 may be gone): this error is the one raised
            ranks.end(failure=f"rank {ranks.rank}: {type(err).__name__}: {err}")
        raise
    ranks.end()
    exit_code, error = ranks.verdict()
    if error is not None and exit_code:
        raise RankFailedError(f"rank 0 failed: {error}")
    return exit_code
