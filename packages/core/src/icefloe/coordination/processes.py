"""Committer processes (``coordination.commit_processes``): a cycle's table commits run in
worker processes on the coordinator's machine, so their CPU (screening, planning, manifests,
metadata) is not bound by one interpreter's GIL.

The coordinator stays the single decider: it picks the cycle's position, VTTS and files per
table, keeps the shared bookkeeping (pending files, quarantine, backoff) and stores the
channel position once every table is done, as with threads. A worker only screens and
commits one table at a time with its own :class:`~icefloe.commit.committer.IcebergCommitter`
(and catalog) and sends back a picklable :class:`CommitAnswer`; every request carries the
leader's fencing token and commit id, so a worker of a deposed leader is refused per table by
the table's fencing token.

Each worker is a one-process :class:`~concurrent.futures.ProcessPoolExecutor` (``spawn``: the
coordinator has threads, which a fork would copy mid-lock). A table keeps its worker for the
coordinator's life, so the worker's caches (known table versions, live files) stay warm; and a
worker that dies breaks only its own executor: its tables of the cycle fail this cycle (their
files stay pending; the "already committed?" rule makes the retry safe) and a new process
is started when its tables' next task comes.

What the cycle needs of its committers is the :class:`Committers` protocol; the processes
here are one implementation, and a runner may inject another (``Coordinator(committers=...)``:
the Spark runner's commit jobs on its executors, ``spark.commit_tasks``). Core stays free of
any runner: an implementation only ships :class:`CommitTask` s to a :class:`CommitWorker`
built from the :class:`WorkerSpec` and hands back its :class:`CommitAnswer` s.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Protocol, TypeVar, cast

from icefloe.commit.committer import IcebergCommitter
from icefloe.commit.policy import TablePolicies
from icefloe.commit.request import PendingFile, TableCommitRequest, TableCommitResult
from icefloe.commit.rollback import is_replay_writer
from icefloe.commit.screening import Screening
from icefloe.coordination.settings import CatalogSpec
from icefloe.errors import (
    ChannelIdentityError,
    CommitError,
    PermanentTableError,
    RefusedFileError,
    RollbackPendingError,
    StaleFencingTokenError,
)

log = logging.getLogger("icefloe.coordinator")

E = TypeVar("E", bound=Exception)

CommitterHook = Callable[[str, str], None]
"""A picklable test hook run in a committer process with (moment, table): ``before_commit``
right before each catalog commit attempt, ``after_commit`` after the commit landed and before
the answer is sent."""


@dataclass(frozen=True)
class WorkerSpec:
    """What a committer process needs to build its committer (picklable)."""

    catalog: CatalogSpec
    group_id: str
    branch: str
    policies: TablePolicies | None
    hook: CommitterHook | None = None


@dataclass(frozen=True)
class CommitTask:
    """One table's share of a cycle, as the coordinator decided it. With ``screen`` the
    worker screens the request's files first and commits only when nothing needs the
    coordinator (no refused file, no rollback replay); without, they were screened already."""

    request: TableCommitRequest
    screen: bool


@dataclass(frozen=True)
class Verdicts:
    """A screening in a form that crosses the process boundary: the task's files by index
    (the coordinator tracks its pending files by identity, which copies do not keep)."""

    accepted: tuple[int, ...]
    refused: tuple[tuple[int, RefusedFileError], ...]

    @classmethod
    def of(cls, files: tuple[PendingFile, ...], screening: Screening) -> Verdicts:
        index = {id(f): i for i, f in enumerate(files)}
        return cls(
            tuple(index[id(f)] for f in screening.accepted),
            tuple((index[id(f)], _portable(e)) for f, e in screening.refused),
        )

    def screening(self, files: tuple[PendingFile, ...]) -> Screening:
        """The screening of the coordinator's own ``files`` (those the task was made of)."""
        return Screening(
            tuple(files[i] for i in self.accepted),
            tuple((files[i], e) for i, e in self.refused),
        )


@dataclass(frozen=True)
class CommitAnswer:
    """What a worker did with a :class:`CommitTask`. ``verdicts`` is set when the
    coordinator must act before a commit (refused files or a replay: nothing was committed);
    else every file was accepted and ``result`` or ``error`` tells the commit's outcome."""

    verdicts: Verdicts | None = None
    result: TableCommitResult | None = None
    error: Exception | None = None
    seconds: float = 0.0  # the worker's time on the task (icefloe_table_commit_seconds)


class CommitWorker:
    """A committer's state, wherever it runs (a committer process, a Spark task's Python
    worker): its committer, and the table it commits (for the hook)."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.hook = spec.hook
        self.table = ""
        self.committer = IcebergCommitter(
            spec.catalog.load(),
            spec.group_id,
            branch=spec.branch,
            policies=spec.policies,
            before_commit=self._before_commit if spec.hook is not None else None,
        )

    def _before_commit(self) -> None:
        if self.hook is not None:
            self.hook("before_commit", self.table)

    def run(self, task: CommitTask, run_attempt: str = "") -> CommitAnswer:
        """Screen and commit ``task``; ``run_attempt`` names this run when another run of the
        task may overlap it (:meth:`~icefloe.commit.committer.IcebergCommitter.commit`)."""
        started = time.monotonic()
        answer = self._run(task, run_attempt)
        return dataclasses.replace(answer, seconds=time.monotonic() - started)

    def _run(self, task: CommitTask, run_attempt: str) -> CommitAnswer:
        request = task.request
        self.table = request.table
        try:
            if task.screen:
                files = request.files
                screening = self.committer.screen(request.table, files, request.channel_id)
                if screening.refused or any(is_replay_writer(f.writer_id) for f in files):
                    return CommitAnswer(verdicts=Verdicts.of(files, screening))
            result = self.committer.commit(request, run_attempt)
        except Exception as exc:
            return CommitAnswer(error=_portable(exc))
        if self.hook is not None:
            self.hook("after_commit", request.table)
        return CommitAnswer(result=result)


_worker: CommitWorker | None = None  # the committer of this process, when it is a worker


def _start_worker(spec: WorkerSpec) -> None:
    global _worker
    _watch_parent()
    _worker = CommitWorker(spec)


def _watch_parent() -> None:
    """End this process when the coordinator's dies (kill -9 included). Why: a spawned worker
    holds both ends of its task queue, so it never sees EOF and would wait for tasks forever,
    holding catalog connections, next to the coordinator that replaces the dead one."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="icefloe-committer-parent", daemon=True).start()


def _ready() -> int:
    """A task that only makes the executor start its process; returns the process id."""
    return os.getpid()


def _run_task(task: CommitTask) -> CommitAnswer:
    assert _worker is not None, "not a committer process"
    return _worker.run(task)


# what the coordinator tells apart, most specific first: an error that does not survive
# pickling is sent as the first of these it is an instance of, with its message
_KINDS: tuple[type[Exception], ...] = (
    StaleFencingTokenError,
    ChannelIdentityError,
    RollbackPendingError,
    PermanentTableError,
    RefusedFileError,
    CommitError,
)


def _portable(exc: E) -> E:
    """``exc``, or a stand-in of the kind the coordinator acts on when it cannot be pickled
    (an unpicklable answer would break the pool, not just fail the table)."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        kind = next((k for k in _KINDS if isinstance(exc, k)), RuntimeError)
        return cast(E, kind(f"{type(exc).__name__}: {exc}"))
    return exc


class Committers(Protocol):
    """What a cycle needs of its committers (:meth:`CommitCycle._run_in_processes`). A task
    that cannot be answered (its committer died) fails its future with BrokenProcessPool or
    :class:`~icefloe.errors.CommitterProcessError`: its table fails this cycle and stays
    pending, and ``replace(worker_of(table))`` is called once the cycle's answers are in."""

    def start(self) -> None:
        """Get ready without waiting (called when the coordinator becomes leader)."""

    def submit(self, task: CommitTask) -> Future[CommitAnswer]:
        """Queue ``task``; it may wait for the next :meth:`flush` to be handed out."""
        ...

    def flush(self) -> None:
        """Hand out the tasks submitted since the last flush. Why: an implementation with a
        fixed cost per hand-out (a Spark job) runs a cycle's round of tables as one; the
        cycle calls it after each round of submits."""

    def worker_of(self, table: str) -> int:
        """Which committer commits ``table`` (for :meth:`replace`)."""
        ...

    def replace(self, i: int) -> None:
        """Committer ``i`` died: drop it, so later tasks get a new one."""

    def close(self) -> None:
        """Stop every committer once its queued tasks are done."""


CommittersFactory = Callable[[WorkerSpec], Committers]
"""Builds a coordinator's committers from what each committer needs (injected by a runner)."""


class CommitterPool:
    """``size`` committer processes, each a one-process executor; a table keeps its
    process (assigned on first sight to the process with the fewest tables)."""

    def __init__(self, size: int, spec: WorkerSpec) -> None:
        if size < 1:
            raise ValueError(f"a committer pool needs at least one process (got {size})")
        self._spec = spec
        self._context = multiprocessing.get_context("spawn")
        self._executors: list[ProcessPoolExecutor | None] = [None] * size
        self._assigned: dict[str, int] = {}
        self._load = [0] * size

    @property
    def size(self) -> int:
        return len(self._executors)

    def worker_of(self, table: str) -> int:
        """The index of the process that commits ``table``."""
        i = self._assigned.get(table)
        if i is None:
            i = min(range(len(self._load)), key=lambda k: (self._load[k], k))
            self._assigned[table] = i
            self._load[i] += 1
        return i

    def start(self) -> None:
        """Start every process now, without waiting: a new leader's first cycle should not
        wait for interpreters to start and import pyiceberg."""
        for i in range(len(self._executors)):
            self._executor(i).submit(_ready)

    def pids(self) -> list[int]:
        """The processes' ids, each started if need be (waits for them)."""
        futures = [self._executor(i).submit(_ready) for i in range(len(self._executors))]
        return [f.result() for f in futures]

    def _executor(self, i: int) -> ProcessPoolExecutor:
        executor = self._executors[i]
        if executor is None:
            executor = ProcessPoolExecutor(
                1, mp_context=self._context, initializer=_start_worker, initargs=(self._spec,)
            )
            self._executors[i] = executor
        return executor

    def submit(self, task: CommitTask) -> Future[CommitAnswer]:
        """Queue ``task`` on its table's process (started on first use, or anew when it
        died). A dead process shows as a future failing with BrokenProcessPool."""
        i = self.worker_of(task.request.table)
        executor = self._executor(i)
        try:
            return executor.submit(_run_task, task)
        except BrokenProcessPool:
            self.replace(i)
            return self.submit(task)

    def flush(self) -> None:
        """Nothing to do: :meth:`submit` hands each task to its process at once."""

    def replace(self, i: int) -> None:
        """Drop process ``i`` (it died); the next task of its tables starts a new one."""
        executor = self._executors[i]
        self._executors[i] = None
        if executor is not None:
            log.warning("committer process %d died; it is replaced", i)
            executor.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Stop every process once its queued tasks are done."""
        executors, self._executors = self._executors, [None] * len(self._executors)
        for executor in executors:
            if executor is not None:
                executor.shutdown(wait=True, cancel_futures=True)


def pool_for(
    size: int,
    catalog: CatalogSpec | None,
    group_id: str,
    branch: str,
    policies: TablePolicies | None,
    hook: CommitterHook | None,
    factory: CommittersFactory | None = None,
) -> Committers | None:
    """The committers ``factory`` builds (a runner's), or the pool
    ``coordination.commit_processes`` asks for; None: commit in-process."""
    if factory is None and size <= 0:
        return None
    if factory is not None and size > 0:
        raise ValueError(
            f"coordination.commit_processes = {size} and committers injected by the runner "
            "(e.g. spark.commit_tasks) both commit a cycle's tables: set "
            "coordination.commit_processes = 0 to commit on the runner's, or drop the other"
        )
    what = "coordination.commit_processes" if factory is None else "a runner's committers"
    if catalog is None:
        raise ValueError(
            f"{what} needs the catalog's configuration (name and properties) to build each "
            "committer's catalog: set CoordinatorSettings.catalog "
            "(CoordinatorSettings.for_pipeline does)"
        )
    spec = WorkerSpec(catalog, group_id, branch, policies, hook)
    return CommitterPool(size, spec) if factory is None else factory(spec)
