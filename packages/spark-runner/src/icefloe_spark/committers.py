"""Commit tasks on the Spark executors (``spark.commit_tasks``): a cycle's table commits run
as Spark tasks, the design's "commits across workers" for a Spark pipeline.

The coordinator in the driver stays the single decider (positions, VTTS, files per table,
commit id, fencing token) and keeps every piece of bookkeeping; it only hands each table's
:class:`~icefloe.coordination.processes.CommitTask` to :class:`SparkCommitters` instead of
committing it (the :class:`~icefloe.coordination.processes.Committers` protocol, injected as
``Coordinator(committers=...)``). The tasks of a round of a cycle (every table; then the
tables the coordinator screened again) run as **one** Spark job, a job's cost being fixed
(scheduling, shipping the function, Python workers): ``commit_tasks`` partitions, tables
spread over them largest first. The job runs in a thread of its own, in a job group and
scheduler pool of its own (``icefloe-commit``), beside the streaming query's jobs, while the
coordinator's thread renews the lease.

In a Python worker, a task builds a :class:`~icefloe.coordination.processes.CommitWorker`
(its own committer and catalog) from the picklable
:class:`~icefloe.coordination.processes.WorkerSpec` once and keeps it in the module for the
worker's later tasks (Spark reuses Python workers), so its caches stay warm.

Exactly once holds as with committer processes: each commit carries the leader's fencing
token (a deposed leader's job is refused per table) and commit id, and a table's files stay
pending until its answer is back. A task that dies (its worker killed, its executor lost) is
retried by Spark (``spark.task.maxFailures``; the retry finds a commit that landed by its
commit id, or the table's boundary, and does not make it again). Unlike a committer process, a
task may run twice at once (a speculative copy; a zombie attempt on an executor the driver
declared lost, beside its retry): each attempt merges small files under names of its own
(:func:`task_attempt`), so one never overwrites a merged file the other committed. A job that
fails for good fails every table of its round with
:class:`~icefloe.errors.CommitterProcessError`: they stay pending, back off and are committed
(or found committed) by a later cycle.
"""

from __future__ import annotations

import functools
import logging
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from pyspark import SparkContext, TaskContext
from pyspark.sql import SparkSession

from icefloe.coordination.processes import CommitAnswer, CommitTask, CommitWorker, WorkerSpec
from icefloe.errors import CommitterProcessError

log = logging.getLogger("icefloe.coordinator")

SCHEDULER_POOL = "icefloe-commit"
"""The scheduler pool of commit jobs (``spark.scheduler.pool``): under the FAIR scheduler
(the runner's default with ``spark.commit_tasks``) they share the executors with the query's
jobs instead of queueing behind them."""

Slice = list[tuple[int, CommitTask]]  # one Spark task's tables: (index in the round, task)


class SparkCommitters:
    """A coordinator's committers as Spark tasks: one Spark job per :meth:`flush` (a round
    of a cycle), ``tasks`` partitions. ``session`` returns the driver's session (it may wait
    for it: the coordinator starts before the query's session is up)."""

    def __init__(
        self,
        session: Callable[[], SparkSession],
        tasks: int,
        spec: WorkerSpec,
        scheduler_pool: str = SCHEDULER_POOL,
    ) -> None:
        if tasks < 1:
            raise ValueError(f"spark.commit_tasks must be at least 1 here (got {tasks})")
        self._session = session
        self._tasks = tasks
        self._spec = spec
        self._scheduler_pool = scheduler_pool
        # names this coordinator's committers in the Python workers: a restarted coordinator
        # (a new instance) gets new ones, with a new catalog
        self._key = uuid.uuid4().hex
        self._group = f"icefloe-commit-{spec.group_id}-{self._key[:8]}"
        self._lock = threading.Lock()
        self._queued: list[tuple[CommitTask, Future[CommitAnswer]]] = []
        self._jobs: ThreadPoolExecutor | None = None

    @property
    def job_group(self) -> str:
        """The Spark job group of this coordinator's commit jobs (Spark's UI shows it)."""
        return self._group

    def start(self) -> None:
        """Warm the Python workers up in the background (called when the coordinator becomes
        leader): a job of ``tasks`` tasks that only builds each worker's committer, so the
        first cycle does not wait as long for workers to start, import pyiceberg and open the
        catalog (docs/benchmarks.md). Spark keeps idle Python workers for later tasks; a
        failure here only costs that wait."""
        self._background().submit(self._warm)

    def _warm(self) -> None:
        try:
            context = self._session().sparkContext
            self._label(context, "start its committers")
            warm = functools.partial(warm_slices, self._key, self._spec)
            context.parallelize(range(self._tasks), self._tasks).mapPartitions(warm).count()
        except Exception as exc:
            log.info("Spark committers not warmed up (the first cycle will): %s", _cause(exc))

    def _background(self) -> ThreadPoolExecutor:
        if self._jobs is None:
            self._jobs = ThreadPoolExecutor(1, thread_name_prefix="icefloe-commit-job")
        return self._jobs

    def _label(self, context: SparkContext, what: str) -> None:
        """Put the next job of this thread in our job group and scheduler pool."""
        context.setJobGroup(
            self._group, f"icefloe {self._spec.group_id}: {what}", interruptOnCancel=False
        )
        context.setLocalProperty("spark.scheduler.pool", self._scheduler_pool)

    def worker_of(self, table: str) -> int:
        """Always 0: a table has no worker of its own (any task of a job may commit it)."""
        return 0

    def replace(self, i: int) -> None:
        """Nothing to replace: Spark starts a new Python worker for the next job."""

    def submit(self, task: CommitTask) -> Future[CommitAnswer]:
        """Queue ``task`` for the next :meth:`flush`."""
        future: Future[CommitAnswer] = Future()
        with self._lock:
            self._queued.append((task, future))
        return future

    def flush(self) -> None:
        """Run the tasks queued since the last flush (those not cancelled) as one Spark job,
        in the background; their futures resolve when it ends."""
        with self._lock:
            queued, self._queued = self._queued, []
        # a future that runs can no longer be cancelled: the cycle waits for its answer
        batch = [(t, f) for t, f in queued if f.set_running_or_notify_cancel()]
        if not batch:
            return
        self._background().submit(self._resolve, batch)

    def close(self) -> None:
        """Cancel what was never handed out; wait for a running job."""
        with self._lock:
            queued, self._queued = self._queued, []
        for _, future in queued:
            future.cancel()
        jobs, self._jobs = self._jobs, None
        if jobs is not None:
            jobs.shutdown(wait=True)

    def _resolve(self, batch: list[tuple[CommitTask, Future[CommitAnswer]]]) -> None:
        tasks = [t for t, _ in batch]
        try:
            answers = self._run_job(tasks)
        except BaseException as exc:  # every table of the round stays pending
            cause = _cause(exc)
            log.warning("Spark commit job of %d table(s) failed: %s", len(tasks), cause)
            for _, future in batch:
                future.set_exception(CommitterProcessError(f"Spark commit job failed: {cause}"))
            return
        for i, (task, future) in enumerate(batch):
            answer = answers.get(i)
            if answer is None:  # not expected: every task answers or the job fails
                error = CommitterProcessError(f"no answer for {task.request.table} from Spark")
                future.set_exception(error)
            else:
                future.set_result(answer)

    def _run_job(self, tasks: list[CommitTask]) -> dict[int, CommitAnswer]:
        """One Spark job committing ``tasks``: their answers by index."""
        context = self._session().sparkContext
        slices = spread(tasks, self._tasks)
        self._label(context, f"commit {len(tasks)} table(s)")
        run = functools.partial(commit_slices, self._key, self._spec)
        rdd = context.parallelize(slices, len(slices))
        return dict(rdd.mapPartitions(run).collect())


def _cause(exc: BaseException) -> str:
    """One line on why a job failed: Spark's own exception (Py4J's first line only names the
    JVM call), cut short (it quotes the Python traceback of the failed task)."""
    java = getattr(exc, "java_exception", None)
    text = str(java) if java is not None else str(exc)
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    first = lines[0] if lines else type(exc).__name__
    return first if len(first) <= 300 else first[:300] + "..."


def _cost(task: CommitTask) -> float:
    """A table commit's rough cost: mostly per table (loads, manifest list, metadata, the
    catalog commit), a little per file (manifest entries)."""
    return 1.0 + len(task.request.files) / 10


def spread(tasks: list[CommitTask], n: int) -> list[Slice]:
    """``tasks`` over at most ``n`` slices: the largest tables (pending bytes) first, each to
    the slice with the least cost so far, so every slice ends at about the same time and the
    biggest commits start earliest; each slice keeps that order."""

    def size(i: int) -> int:
        return sum(f.meta.file_size_in_bytes for f in tasks[i].request.files)

    slices: list[Slice] = [[] for _ in range(min(n, len(tasks)))]
    load = [0.0] * len(slices)
    for i in sorted(range(len(tasks)), key=lambda i: (-size(i), tasks[i].request.table)):
        s = min(range(len(slices)), key=lambda k: (load[k], k))
        slices[s].append((i, tasks[i]))
        load[s] += _cost(tasks[i])
    return slices


# --------------------------------------------------------------- in the Python worker

_KEEP = 2  # committers a Python worker keeps (a restarted coordinator's replaces the old)
_committers: OrderedDict[str, CommitWorker] = OrderedDict()


def _committer(key: str, spec: WorkerSpec) -> CommitWorker:
    """This Python worker's committer for the coordinator ``key``, built on first use."""
    worker = _committers.get(key)
    if worker is None:
        worker = _committers[key] = CommitWorker(spec)
        while len(_committers) > _KEEP:
            _committers.popitem(last=False)
    else:
        _committers.move_to_end(key)
    return worker


def warm_slices(key: str, spec: WorkerSpec, items: Iterable[int]) -> Iterator[int]:
    """A warm-up task's body: build this Python worker's committer, commit nothing."""
    _committer(key, spec)
    return iter(items)


def task_attempt(context: TaskContext | None) -> str:
    """How this Spark task attempt names its runs of commits ("" outside a task): by its task
    attempt id, which no other attempt of the application shares. Attempt numbers would not
    do: they restart in every stage, and a cycle's second round (the tables screened again) is
    a job of its own with the same commit id, whose attempts may overlap the first round's."""
    return "" if context is None else f"spark-task-{context.taskAttemptId()}"


def commit_slices(
    key: str, spec: WorkerSpec, slices: Iterable[Slice]
) -> Iterator[tuple[int, CommitAnswer]]:
    """A Spark task's body: commit its slice's tables one after another."""
    worker = _committer(key, spec)
    attempt = task_attempt(TaskContext.get())
    for tables in slices:
        for i, task in tables:
            yield i, worker.run(task, attempt)
