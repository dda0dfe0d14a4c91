"""``icefloe status``: the pipeline's state from the backend and the catalog, without Spark and
without taking part (nothing is joined, fenced or renewed).

Per table the pipeline commits to (``[[tables]]``, the dead-letter table, dynamic tables:
:func:`icefloe.ops.tables.pipeline_tables`, with the tables batches on the channel name): the
last icefloe commit (time, rows it added, live rows with the deleted ones apart, snapshot),
source lag
(from plugins that know the source, through the ``icefloe_source_lag`` hook), quarantined
files and dead-lettered records. A table is **stuck** when the source holds records the table
has not committed and no commit came for longer than a few commit cycles, or when its commits
are *failing* (``coordination.quarantine_after_failures`` in a row, whatever the error, as the
coordinator marks it in the quarantine table; a commit since clears it): the exit status says
so, for monitoring scripts.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from icefloe.channel import Backend, BackendStatus, ChannelRecord
from icefloe.config import PipelineConfig

if TYPE_CHECKING:  # pyiceberg loads in collect(), once the servers were asked (see there)
    from collections.abc import Callable
    from concurrent.futures import Executor

    from pyiceberg.catalog import Catalog

    from icefloe.commit.committer import IcebergCommitter
    from icefloe.commit.quarantine import FailingTable
    from icefloe.commit.request import PendingFile
    from icefloe.plugins.manager import Plugins

log = logging.getLogger("icefloe.status")


@dataclass(frozen=True)
class TableStatus:
    """One target table. ``None``: unknown (not reachable, or no source of that fact)."""

    name: str
    exists: bool
    snapshot_id: int | None = None
    committed_at_ms: int | None = None
    commit_rows: int | None = None  # rows added by the last icefloe commit
    rows: int | None = None  # live rows in that snapshot: records minus deleted rows
    deleted_rows: int | None = None  # rows of its data files that position deletes remove
    rows_exact: bool = True  # False with equality deletes: ``rows`` is then an upper bound
    source_lag: int | None = None
    # the source lag is measured for the configured tables only: a dead-letter or dynamic
    # table takes a share of the records, so its recorded offsets say nothing of a lag
    lag_measured: bool = True
    pending_files: int | None = None  # announced on the channel, not covered by a commit
    pending_bytes: int | None = None
    quarantined_files: int | None = None
    stuck: bool = False
    reason: str = ""
    rollback: str = ""  # a rollback waiting for its replay, or why it cannot be replayed
    branch: str = "main"  # the branch the pipeline commits this table to
    failing_commits: int | None = None  # failed commits in a row when the alarm was raised
    failing_error: str = ""  # the error of the failure that raised it
    failing_since_ms: int | None = None  # when the first of those failures happened


@dataclass(frozen=True)
class PipelineStatus:
    name: str
    backend: str
    backend_status: BackendStatus | None
    backend_error: str | None
    tables: list[TableStatus] = field(default_factory=list)
    dead_lettered: int | None = None  # rows in the dead-letter table
    channel_stall: str | None = None  # why a reader of the channel cannot reach its end
    committers: int = 1  # threads of the leader committing a cycle's tables at once
    committer_processes: int = 0  # or: committer processes on the leader's machine
    committer_tasks: int = 0  # or: Spark tasks on the executors (spark.commit_tasks)

    @property
    def stuck(self) -> bool:
        return (
            any(t.stuck for t in self.tables)
            or self.backend_error is not None
            or self.channel_stall is not None
        )

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["stuck"] = self.stuck
        return out


def stuck_after_s(config: PipelineConfig) -> float:
    """How long without a commit, while the source is ahead, counts as stuck."""
    c = config.coordination
    return max(60.0, 3 * c.commit_interval_s + c.commit_timeout_s)


def table_status(
    catalog: Catalog,
    config: PipelineConfig,
    name: str,
    lag: int | None,
    now_ms: float,
) -> TableStatus:
    """What the newest snapshot of this pipeline on the branch says, and whether it is stuck."""
    from icefloe.commit.committer import IcebergCommitter
    from icefloe.commit.summary import RowCounts

    if not catalog.table_exists(name):
        return TableStatus(name, False, stuck=True, reason="the table does not exist")
    committer = IcebergCommitter.for_pipeline(catalog, config)
    rollback = _rollback_note(committer, name)
    state = None if rollback.startswith("RollbackNotReplayableError") else committer.state(name)
    table = catalog.load_table(name)
    snap = table.snapshot_by_id(state.snapshot_id) if state else None
    summary = snap.summary.additional_properties if snap and snap.summary else {}
    counts = RowCounts.of(summary)
    at = snap.timestamp_ms if snap else None
    quiet_s = None if at is None else (now_ms - at) / 1000
    stuck = bool(lag) and (quiet_s is None or quiet_s > stuck_after_s(config))
    reason = ""
    if stuck:
        reason = f"{lag} source records not committed and " + (
            "no commit yet" if quiet_s is None else f"no commit for {quiet_s:.0f}s"
        )
    failing = _failing(catalog, config, name)
    if failing is not None and at is not None and failing.marked_ms < at:
        failing = None  # the table committed since the alarm
    if failing is not None and not stuck:
        stuck, reason = True, f"{failing.failures} commits in a row failed"
    return TableStatus(
        name,
        True,
        snapshot_id=state.snapshot_id if state else None,
        committed_at_ms=at,
        commit_rows=_int(summary.get("added-records")),
        rows=None if counts is None else counts.live,
        deleted_rows=None if counts is None else counts.deleted,
        rows_exact=counts is None or counts.exact,
        source_lag=lag,
        lag_measured=any(t.name == name for t in config.tables),
        quarantined_files=_quarantined(
            catalog, config.name, name, config.coordination.quarantine_table
        ),
        stuck=stuck,
        reason=reason,
        rollback=rollback,
        branch=committer.branch_of(name),
        failing_commits=None if failing is None else failing.failures,
        failing_error="" if failing is None else failing.error,
        failing_since_ms=None if failing is None else failing.since_ms,
    )


def _rollback_note(committer: IcebergCommitter, name: str) -> str:
    """What a rollback of ``name`` waits for (the figures above are then the pre-rollback
    commit's, which the replay restores), or why it is refused; empty when none is pending."""
    from icefloe.errors import RollbackNotReplayableError

    try:
        pending = committer.rollback(name)
    except RollbackNotReplayableError as exc:
        return f"{type(exc).__name__}: {exc}"
    if pending is None:
        return ""
    return (
        f"rolled back from snapshot {pending.lost_snapshot_id} to "
        f"{pending.restored_snapshot_id}; new files wait for the replay by `icefloe run`"
    )


#: How long ``icefloe status`` reads the channel towards its end before it reports a stall
#: (it reports what it read; nothing is decided from it).
STATUS_READ_S = 10.0


@dataclass
class _BackendRead:
    """What the backend's server answered: its status, the channel's identity and the
    records of the pipeline from the stored position towards the channel's end."""

    status: BackendStatus | None = None
    error: str | None = None
    channel_id: str | None = None
    records: list[ChannelRecord] | None = None  # None: the channel was not read
    stall: str | None = None  # why the read did not reach the channel's end, if it did not


def _read_backend(backend: Backend, group_id: str) -> _BackendRead:
    """Ask the backend's server, on a thread of its own: nothing here imports pyiceberg, which
    the main thread imports meanwhile (the backends import none, nor does
    :mod:`icefloe.coordination.backlog`). The channel is read by a coordinator end that never
    asks for the lease, as ``icefloe maintain`` reads it; when the read does not reach the
    channel's end within :data:`STATUS_READ_S`, the records are those read so far, and
    ``stall`` says why. (The coordinator's own check, over time, is
    :class:`icefloe.coordination.stall.StallWatch`.)"""
    from icefloe.coordination.backlog import backlog
    from icefloe.errors import ChannelStalledError
    from icefloe.ops.doctor import cause_of

    out = _BackendRead()
    try:
        out.status = backend.describe()
        # no writer ever registered: nothing can be pending, and not opening the channel
        # keeps status from creating it (Kafka creates topics on first use)
        if out.status.writers == ():
            out.records = []
            return out
        channel = backend.coordinator(f"status-{uuid.uuid4().hex[:8]}")
        try:
            records: list[ChannelRecord] = []
            try:
                records.extend(backlog(channel, group_id, STATUS_READ_S))
            except ChannelStalledError as exc:
                out.stall = str(exc)
            out.channel_id, out.records = channel.channel_id(), records
        finally:
            channel.close()
    except Exception as exc:
        out.error = cause_of(exc)
    return out


def _announced(read: _BackendRead) -> dict[str, list[PendingFile]]:
    """Per table the files the channel's records announce."""
    from icefloe.coordination.reading import announced_in

    by_table: dict[str, list[PendingFile]] = {}
    for table, f in announced_in(read.records or ()):
        by_table.setdefault(table, []).append(f)
    return by_table


def _with_pending(
    status: TableStatus,
    catalog: Catalog,
    config: PipelineConfig,
    announced: tuple[str | None, dict[str, list[PendingFile]]] | None,
) -> TableStatus:
    """``status`` with the announced files its commit boundary does not cover yet (by path,
    so a replayed batch counts once); unchanged when the channel or the table was unreadable."""
    from icefloe.commit.committer import IcebergCommitter

    if announced is None or not status.exists:
        return status
    channel_id, by_table = announced
    try:
        committer = IcebergCommitter.for_pipeline(catalog, config)
        boundary = committer.boundary(status.name, channel_id)
    except Exception as exc:  # e.g. a table committed through another channel
        log.debug("no commit boundary for %s: %s", status.name, exc)
        return status
    pending = {f.meta.path: f for f in by_table.get(status.name, []) if not boundary.covers(f)}
    return replace(
        status,
        pending_files=len(pending),
        pending_bytes=sum(f.meta.file_size_in_bytes for f in pending.values()),
    )


def _rows(t: TableStatus) -> str:
    """Live rows, with the deleted ones apart."""
    from icefloe.commit.summary import describe_rows

    return "- rows" if t.rows is None else describe_rows(t.rows, t.deleted_rows, t.rows_exact)


def _int(raw: Any) -> int | None:
    return None if raw is None else int(raw)


def _quarantined(catalog: Catalog, group_id: str, table: str, quarantine_table: str) -> int | None:
    try:
        from icefloe.commit.quarantine import Quarantine

        return len(Quarantine(catalog, quarantine_table).list(group_id, table))
    except Exception:
        log.debug("quarantine unavailable", exc_info=True)
        return None


def _failing(catalog: Catalog, config: PipelineConfig, table: str) -> FailingTable | None:
    try:
        from icefloe.commit.quarantine import Quarantine

        quarantine = Quarantine(catalog, config.coordination.quarantine_table)
        return quarantine.failing(config.name).get(table)
    except Exception:
        log.debug("quarantine unavailable", exc_info=True)
        return None


def _dead_lettered(catalog: Catalog, config: PipelineConfig) -> int | None:
    errors = getattr(config, "errors", None)
    name = getattr(errors, "dead_letter_table", None)
    if not name:
        return None
    try:
        snap = catalog.load_table(name).current_snapshot()
    except Exception:
        return None
    if snap is None or snap.summary is None:
        return 0
    return _int(snap.summary.additional_properties.get("total-records")) or 0


def collect(config: PipelineConfig) -> PipelineStatus:
    """Read everything ``icefloe status`` shows.

    Why a thread: most of a status run is importing pyiceberg (its SQL catalog, its table
    models), CPU work, and the rest is waiting for servers (the backend's, the source's
    brokers). The backend is asked on a thread started before pyiceberg is imported, and the
    source-lag hook asks the source's brokers likewise (see ``icefloe_spark.plugin``), so a
    run takes about the longer of the two, not their sum (docs/benchmarks.md)."""
    from concurrent.futures import ThreadPoolExecutor

    from icefloe.ops.doctor import quiet_clients
    from icefloe.plugins.manager import get_plugins

    plugins = get_plugins()
    with quiet_clients(verbose=False), ThreadPoolExecutor(1, "icefloe-status") as pool:
        answer = _ask_backend(config, plugins, pool)
        try:
            lags = plugins.source_lag(config)
            from pyiceberg.catalog import load_catalog

            from icefloe.ops.fileio import status_properties

            properties = status_properties(config.catalog.properties)
            catalog = load_catalog(config.catalog.name, **properties)
        finally:
            read = answer()
    return _assemble(config, catalog, read, lags)


def _ask_backend(
    config: PipelineConfig, plugins: Plugins, pool: Executor
) -> Callable[[], _BackendRead]:
    """Start asking the backend on ``pool``; returns how to wait for the answer (which closes
    the backend). The backend's module and configuration load here, on the calling thread."""
    from icefloe.ops.doctor import cause_of
    from icefloe.plugins.backends import open_backend

    try:
        backend = open_backend(config, plugins)
    except Exception as exc:
        failed = _BackendRead(error=cause_of(exc))
        return lambda: failed
    asking = pool.submit(_read_backend, backend, config.name)

    def answer() -> _BackendRead:
        try:
            return asking.result()
        finally:
            backend.close()

    return answer


def _assemble(
    config: PipelineConfig,
    catalog: Catalog,
    read: _BackendRead,
    lags: dict[str, int | None],
) -> PipelineStatus:
    """The status from what the servers answered and what the tables hold."""
    from icefloe.ops.tables import pipeline_tables

    announced = None
    if read.error is None and read.records is not None:
        announced = (read.channel_id, _announced(read))
    now_ms = time.time() * 1000
    seen = () if announced is None else announced[1]
    tables = [
        _with_pending(
            table_status(catalog, config, name, lags.get(name), now_ms),
            catalog,
            config,
            announced,
        )
        for name in pipeline_tables(catalog, config, seen)
    ]
    return PipelineStatus(
        config.name,
        config.coordination.backend,
        read.status,
        read.error,
        tables,
        _dead_lettered(catalog, config),
        read.stall,
        config.coordination.commit_parallelism,
        config.coordination.commit_processes,
        config.spark.commit_tasks,
    )


def render_lines(status: PipelineStatus) -> list[str]:
    """The text view: a few lines for the pipeline, one per table."""
    b = status.backend_status
    out = [f"pipeline {status.name}  backend {status.backend}"]
    if status.backend_error:
        out.append(f"  backend unreachable: {status.backend_error}")
    elif b is not None:
        # what the backend can tell of the lease, and nothing for what it cannot (Redis keeps
        # no acquisition time)
        lease = [f"age {b.lease_age_s:.0f}s"] if b.lease_age_s is not None else []
        if b.lease_expires_in_s is not None:
            lease.append(f"expires in {b.lease_expires_in_s:.0f}s")
        out.append(
            f"  leader {b.leader or '-'}  token {b.token if b.token is not None else '-'}"
            + (f"  lease {', '.join(lease)}" if lease else "")
        )
        writers = "?" if b.writers is None else f"{len(b.writers)} ({', '.join(b.writers)})"
        out.append(f"  writers {writers}")
        # who commits: the leader decides each cycle and commits its tables on this many
        # threads (coordination.commit_parallelism) or processes on its machine
        # (coordination.commit_processes) or Spark tasks on the executors of the driver it runs
        # in (spark.commit_tasks); icefloe_table_commit_seconds times them
        if status.committer_tasks:
            n = status.committer_tasks
            out.append(f"  committers {n} (Spark tasks on the executors, with icefloe run)")
        elif status.committer_processes:
            n = status.committer_processes
            out.append(f"  committers {n} (processes on the leader's machine)")
        else:
            out.append(f"  committers {status.committers} (threads of the leader)")
    if status.dead_lettered is not None:
        out.append(f"  dead-lettered records {status.dead_lettered}")
    if status.channel_stall is not None:
        out.append(f"  CHANNEL STALLED: {status.channel_stall}")
    now = time.time()
    for t in status.tables:
        if not t.exists:
            out.append(f"  table {t.name}: STUCK: {t.reason}")
            continue
        ago = "never" if t.committed_at_ms is None else f"{now - t.committed_at_ms / 1000:.0f}s ago"
        lag = "?" if t.source_lag is None else str(t.source_lag)
        lag = f"lag {lag}, " if t.lag_measured or t.source_lag is not None else ""
        quarantined = "?" if t.quarantined_files is None else str(t.quarantined_files)
        pending = "?" if t.pending_files is None else f"{t.pending_files} ({t.pending_bytes} B)"
        on = "" if t.branch == "main" else f" (branch {t.branch})"
        line = (
            f"  table {t.name}{on}: last commit {ago} (+{t.commit_rows or 0} rows, snapshot "
            f"{t.snapshot_id or '-'}), {_rows(t)}, "
            f"{lag}pending files {pending}, quarantined files {quarantined}"
        )
        out.append(line + (f"  STUCK: {t.reason}" if t.stuck else ""))
        if t.rollback:
            out.append(f"    ROLLED BACK: {t.rollback}")
        if t.failing_commits is not None:
            out.append(
                f"    FAILING: {t.failing_commits} commits in a row failed, the last with "
                f"{t.failing_error}"
            )
    return out
