"""The commit coordinator: exactly one per pipeline turns the files announced by every writer
into one idempotent Iceberg commit per table per cycle (see ``docs/architecture.md``).

Life of a coordinator: acquire the lease (fencing token), recover (re-read every event since the
stored channel position; the committer skips what tables already hold), then loop: read events,
renew the lease, and run a commit cycle when one is due. A cycle broadcasts StartCommit, waits
until every live writer answered with DataComplete (or the commit timeout), commits each table
with pending files through :class:`~icefloe.committer.IcebergCommitter`, stores the read
position only if every table succeeded, then broadcasts the results and prunes the channel.
Losing the lease at any point drops all in-memory state and starts over from election.

Decisions worth knowing:

* Undecodable events are the backend's to report (:class:`~icefloe.errors.EventDecodeError`);
  the coordinator lets it propagate and stops instead of skipping, because a skipped
  DataWritten is silent data loss. A restart re-reads from the stored position and stops at
  the same event until an operator removes it.
* Writer liveness uses the time the coordinator read an event, except while recovering, where
  the event's own timestamp counts (otherwise every long-dead writer found in the backlog would
  look live and stall the first cycle until the commit timeout).
* The same (writer, batch, table) may arrive twice where a backend cannot dedupe at publish
  (Kafka shows records of aborted transactions on some brokers): the first copy is kept.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pyiceberg.catalog import Catalog

from icefloe import metrics
from icefloe.channel import ChannelRecord, CoordinatorChannel, Lease
from icefloe.committer import (
    CommitState,
    IcebergCommitter,
    PendingFile,
    TableCommitRequest,
    TableCommitResult,
)
from icefloe.config import CoordinationConfig
from icefloe.errors import ChannelError, NotLeaderError, StaleFencingTokenError
from icefloe.events import (
    CommitComplete,
    CommitToTable,
    DataComplete,
    DataWritten,
    Event,
    SourcePosition,
    StartCommit,
)
from icefloe.hookspecs import TableCommitted
from icefloe.plugins import Plugins, get_plugins
from icefloe.writer import merge_positions

log = logging.getLogger(__name__)

_POLL_S = 0.2  # longest single wait inside a cycle, so lease renewal keeps its pace
_MAX_RENEW_GAP_S = 5.0  # renew at least this often even when a lease never expires


@dataclass(frozen=True)
class CoordinatorSettings:
    """Commit cadence (the ``[coordination]`` keys of the pipeline configuration)."""

    commit_interval_s: float = 10.0
    commit_timeout_s: float = 30.0
    max_pending_bytes: int | None = None
    max_pending_files: int | None = None
    writer_timeout_s: float = 120.0
    branch: str = "main"

    @classmethod
    def from_config(cls, c: CoordinationConfig) -> CoordinatorSettings:
        return cls(
            commit_interval_s=c.commit_interval_s,
            commit_timeout_s=c.commit_timeout_s,
            max_pending_bytes=c.max_pending_bytes,
            max_pending_files=c.max_pending_files,
            writer_timeout_s=c.writer_timeout_s,
            branch=c.branch,
        )


@dataclass(frozen=True)
class CycleResult:
    """What one commit cycle did."""

    commit_id: str
    complete: bool  # every live writer answered -> VTTS recorded
    valid_through_ms: int | None
    tables: tuple[TableCommitResult, ...]
    failed: Mapping[str, str]  # table -> error text (left pending for the next cycle)


@dataclass(frozen=True)
class CoordinatorHooks:
    """Fault-injection points at the dangerous moments of a cycle, for tests.

    Each runs in the coordinator's thread; raising from one (e.g. a ``BaseException`` that
    nothing catches, or killing the process) simulates a crash exactly there.
    """

    before_table_commit: Callable[[str], None] | None = None
    """Before a table's commit; an ``Exception`` fails that table only."""
    after_lease_check: Callable[[str], None] | None = None
    """After the lease was renewed right before a catalog commit attempt (a zombie pausing
    here is the race invariant 3 is about)."""
    after_iceberg_commits: Callable[[CycleResult], None] | None = None
    """After every table commit of the cycle, before ``store_position``."""


@dataclass
class _Writer:
    """What the coordinator knows about one writer identity."""

    epoch: int
    last_seen_ms: float
    positions: dict[tuple[str, int], SourcePosition] = field(default_factory=dict)


@dataclass
class _TableMark:
    """What a table is known to hold already (from its snapshots, then our own commits)."""

    positions: dict[str, int]
    watermarks: dict[str, int]

    def covers(self, rec: ChannelRecord, writer_id: str, batch_seq: int) -> bool:
        if rec.is_before(self.positions):
            return True
        mark = self.watermarks.get(writer_id)
        return mark is not None and batch_seq <= mark


def _now_ms() -> float:
    return time.time() * 1000.0


class Coordinator:
    """The pipeline's commit coordinator; see the module docstring.

    Single-threaded: :meth:`run` (or the caller of :meth:`step`) is the only thread using the
    channel and the committer.
    """

    def __init__(
        self,
        group_id: str,
        channel: CoordinatorChannel,
        catalog: Catalog,
        settings: CoordinatorSettings | None = None,
        coordinator_id: str | None = None,
        plugins: Plugins | None = None,
        hooks: CoordinatorHooks | None = None,
    ) -> None:
        self.group_id = group_id
        self.coordinator_id = coordinator_id or f"coordinator-{uuid.uuid4().hex[:8]}"
        self.settings = settings or CoordinatorSettings()
        self._channel = channel
        self._plugins = plugins
        self._hooks = hooks or CoordinatorHooks()
        self._committer = IcebergCommitter(
            catalog, group_id, branch=self.settings.branch, before_commit=self._before_commit
        )
        self._lease: Lease | None = None
        self._renew_at = 0.0
        self._stop: threading.Event | None = None  # set by run(): cut a cycle's wait short
        self._reset()

    # ------------------------------------------------------------------ state

    def _reset(self) -> None:
        """Forget everything read: what a new leader must rebuild from the channel."""
        self._read_pos: dict[str, int] = {}
        self._stored: dict[str, int] | None = None
        self._pending: dict[str, list[PendingFile]] = {}
        self._pending_keys: set[tuple[str, int, str]] = set()
        self._writers: dict[str, _Writer] = {}
        self._marks: dict[str, _TableMark] = {}
        self._recovering = False
        self._cycle_id: str | None = None
        self._answered: set[str] = set()
        self._last_cycle_end = time.monotonic()

    @property
    def lease(self) -> Lease | None:
        """The lease while this coordinator leads, else None."""
        return self._lease

    @property
    def channel(self) -> CoordinatorChannel:
        return self._channel

    @property
    def is_leader(self) -> bool:
        return self._lease is not None

    def pending_files(self) -> dict[str, int]:
        """Files waiting for a commit, per table (for metrics and tests)."""
        return {t: len(fs) for t, fs in self._pending.items() if fs}

    def pending_bytes(self) -> int:
        return sum(f.meta.file_size_in_bytes for fs in self._pending.values() for f in fs)

    def known_writers(self) -> dict[str, int]:
        """Writer ids seen since this coordinator became leader, with their newest epoch."""
        return {w: s.epoch for w, s in self._writers.items()}

    @property
    def read_position(self) -> dict[str, int]:
        return dict(self._read_pos)

    # ------------------------------------------------------------------ loop

    def run(self, stop: threading.Event) -> None:
        """Elect, recover and run cycles until ``stop`` is set; then release the lease.

        Channel errors (a backend hiccup) are logged and retried after a pause; anything else
        (a decode error, a bug) propagates, because skipping it could lose data.
        """
        self._stop = stop
        try:
            while not stop.is_set():
                try:
                    self.step(timeout=_POLL_S)
                except ChannelError:
                    # start over from election: state read so far may have gaps now
                    log.exception("%s: channel error; starting over", self.coordinator_id)
                    with contextlib.suppress(ChannelError):
                        self._release()
                    self._drop_leadership()
                    stop.wait(1.0)
        finally:
            self._release()

    def step(self, timeout: float = 0.1) -> CycleResult | None:
        """One loop iteration: try to lead (and recover), or read events, renew the lease and
        commit when due. Returns the cycle's result when one ran."""
        if self._lease is None:
            self._try_lead(timeout)
            return None
        try:
            self._poll(timeout)
            self._renew_if_due()
            if self._cycle_due():
                return self._cycle()
        except NotLeaderError:
            log.warning("%s: lost leadership; dropping state", self.coordinator_id)
            self._drop_leadership()
        return None

    def commit_now(self) -> CycleResult:
        """Run a commit cycle now. Raises NotLeaderError when not (or no longer) leading."""
        if self._lease is None:
            raise NotLeaderError(f"{self.coordinator_id} is not the leader")
        try:
            return self._cycle()
        except NotLeaderError:
            self._drop_leadership()
            raise

    def close(self) -> None:
        """Release the lease (another coordinator takes over at once) and the channel."""
        self._release()
        self._channel.close()

    # ------------------------------------------------------------------ leadership

    def _try_lead(self, timeout: float) -> bool:
        lease = self._channel.acquire(timeout)
        if lease is None:
            return False
        self._set_lease(lease)
        metrics.LEADERSHIP_CHANGES.labels("acquired").inc()
        metrics.IS_LEADER.set(1)
        log.info(
            "%s: leading pipeline %s with fencing token %d",
            self.coordinator_id,
            self.group_id,
            lease.token,
        )
        try:
            self._recover()
        except NotLeaderError:
            self._drop_leadership()
            return False
        return True

    def _set_lease(self, lease: Lease) -> None:
        self._lease = lease
        now = time.monotonic()
        # renew a third of the way into the lease, so two renewals can fail before it expires
        self._renew_at = now + min(max(lease.expires_at - now, 0.0) / 3, _MAX_RENEW_GAP_S)

    def _renew(self) -> None:
        try:
            self._set_lease(self._channel.renew())
        except NotLeaderError:
            self._lease = None
            raise

    def _renew_if_due(self) -> None:
        if time.monotonic() >= self._renew_at:
            self._renew()

    def _before_commit(self) -> None:
        """Runs right before each catalog commit attempt: prove we still lead."""
        self._renew()
        if self._hooks.after_lease_check is not None:
            self._hooks.after_lease_check(self.coordinator_id)

    def _drop_leadership(self) -> None:
        if self._lease is not None:
            metrics.LEADERSHIP_CHANGES.labels("lost").inc()
        metrics.IS_LEADER.set(0)
        self._lease = None
        self._reset()
        self._update_pending_gauges()

    def _update_pending_gauges(self) -> None:
        metrics.PENDING_FILES.set(sum(len(fs) for fs in self._pending.values()))
        metrics.PENDING_BYTES.set(
            sum(f.meta.file_size_in_bytes for fs in self._pending.values() for f in fs)
        )

    def _release(self) -> None:
        if self._lease is not None:
            try:
                self._channel.release()
            finally:
                self._drop_leadership()

    # ------------------------------------------------------------------ reading

    def _recover(self) -> None:
        """Re-read everything since the stored position; the backlog rebuilds pending files."""
        self._reset()
        stored = self._channel.stored_position()
        self._stored = None if stored is None else dict(stored)
        self._read_pos = dict(self._stored or {})
        self._channel.seek(stored)
        self._recovering = True
        read = 0
        # Bounded: under steady publishing the log never runs dry, so recovery ends after at
        # most one commit interval and the normal loop reads the rest of the backlog.
        deadline = time.monotonic() + self.settings.commit_interval_s
        while True:
            n = self._poll(_POLL_S)
            read += n
            self._renew_if_due()
            if n == 0 or time.monotonic() >= deadline:
                break
        self._recovering = False
        self._last_cycle_end = time.monotonic()
        log.info(
            "%s: recovered from %s: %d events, %d pending files, %d writers",
            self.coordinator_id,
            self._stored,
            read,
            sum(self.pending_files().values()),
            len(self._writers),
        )

    def _poll(self, timeout: float) -> int:
        records = self._channel.poll(timeout)
        for rec in records:
            self._handle(rec)
        if records:
            self._update_pending_gauges()
        return len(records)

    def _handle(self, rec: ChannelRecord) -> None:
        self._read_pos[rec.partition] = max(self._read_pos.get(rec.partition, 0), rec.offset + 1)
        event = rec.event
        if event.group_id != self.group_id:
            return  # another pipeline on a shared channel
        payload = event.payload
        if not isinstance(payload, (DataWritten, DataComplete)):
            return  # coordinator broadcasts echoed by a single-log backend
        ref = event.writer
        if ref is None:
            log.warning(
                "ignoring %s at %s:%d without a writer", event.type, rec.partition, rec.offset
            )
            return
        writer = self._writers.get(ref.writer_id)
        if writer is not None and ref.epoch < writer.epoch:
            log.warning(
                "ignoring %s of fenced writer %s epoch %d (seen epoch %d)",
                event.type,
                ref.writer_id,
                ref.epoch,
                writer.epoch,
            )
            return
        now = _now_ms()
        seen = min(float(event.timestamp_ms), now) if self._recovering else now
        if writer is None:
            writer = self._writers[ref.writer_id] = _Writer(ref.epoch, seen)
        writer.epoch = ref.epoch
        writer.last_seen_ms = max(writer.last_seen_ms, seen)
        if isinstance(payload, DataComplete):
            merge_positions(writer.positions, payload.positions)
            if payload.commit_id is not None and payload.commit_id == self._cycle_id:
                self._answered.add(ref.writer_id)
        elif event.batch_seq is None:
            log.warning("ignoring DataWritten of %s without a batch sequence", ref.writer_id)
        else:
            self._add_files(rec, ref.writer_id, event.batch_seq, payload)

    def _add_files(self, rec: ChannelRecord, writer_id: str, seq: int, dw: DataWritten) -> None:
        key = (writer_id, seq, dw.table)
        if key in self._pending_keys:
            return  # a second copy of a batch (replay the backend could not refuse)
        if self._mark(dw.table).covers(rec, writer_id, seq):
            return  # the table already holds this batch
        self._pending_keys.add(key)
        self._pending.setdefault(dw.table, []).extend(
            PendingFile(f, writer_id, seq, rec.partition, rec.offset, dw.table_uuid)
            for f in dw.files
        )

    def _mark(self, table: str) -> _TableMark:
        """What ``table`` holds already, read once per leadership from its snapshots."""
        if table not in self._marks:
            try:
                state: CommitState | None = self._committer.state(table)
            except Exception as exc:
                # skip nothing early; the commit itself reports the problem loudly
                log.warning("cannot read icefloe state of %s: %s", table, exc)
                state = None
            self._marks[table] = _TableMark(
                dict(state.positions) if state else {}, dict(state.watermarks) if state else {}
            )
        return self._marks[table]

    # ------------------------------------------------------------------ cycles

    def _cycle_due(self) -> bool:
        s = self.settings
        if time.monotonic() - self._last_cycle_end >= s.commit_interval_s:
            return True
        if (
            s.max_pending_files is not None
            and sum(self.pending_files().values()) >= s.max_pending_files
        ):
            return True
        return s.max_pending_bytes is not None and self.pending_bytes() >= s.max_pending_bytes

    def _live_writers(self) -> set[str]:
        limit = _now_ms() - self.settings.writer_timeout_s * 1000.0
        return {w for w, s in self._writers.items() if s.last_seen_ms >= limit}

    def _source_positions(self) -> dict[tuple[str, int], SourcePosition]:
        merged: dict[tuple[str, int], SourcePosition] = {}
        for w in self._writers.values():
            merge_positions(merged, tuple(w.positions.values()))
        return merged

    def _valid_through(self) -> int | None:
        """Min over source partitions of their newest record time; None if any is unknown."""
        stamps = [p.max_timestamp_ms for p in self._source_positions().values()]
        if not stamps or any(t is None for t in stamps):
            return None
        return min(t for t in stamps if t is not None)

    def _cycle(self) -> CycleResult:
        with metrics.COMMIT_CYCLE_SECONDS.time():
            cycle = self._run_cycle()
        result = "failed" if cycle.failed else "complete" if cycle.complete else "partial"
        metrics.COMMIT_CYCLES.labels(result).inc()
        for r in cycle.tables:
            if r.snapshot_id is not None:
                metrics.TABLE_COMMITS.labels(r.table).inc()
        self._update_pending_gauges()
        return cycle

    def _run_cycle(self) -> CycleResult:
        commit_id = str(uuid.uuid4())
        expected = self._live_writers()
        self._cycle_id, self._answered = commit_id, set()
        try:
            self._channel.broadcast(Event(self.group_id, StartCommit(commit_id)))
            deadline = time.monotonic() + self.settings.commit_timeout_s
            while not expected <= self._answered:
                left = deadline - time.monotonic()
                if left <= 0 or (self._stop is not None and self._stop.is_set()):
                    break  # commit what was read, as a partial cycle
                self._poll(min(left, _POLL_S))
                self._renew_if_due()
            complete = expected <= self._answered
        finally:
            self._cycle_id = None
        # the decision point: everything read so far (and only that) goes into this cycle
        return self._commit(commit_id, complete, sorted(expected - self._answered))

    def _commit(self, commit_id: str, complete: bool, silent: list[str]) -> CycleResult:
        position = dict(self._read_pos)
        vtts = self._valid_through() if complete else None
        if not complete and self._stop is not None and self._stop.is_set():
            # a normal stop cuts the wait short: nothing is wrong with the silent writers
            log.info(
                "commit %s: stopping; committing what was read without waiting for %s",
                commit_id,
                silent,
            )
        elif not complete:
            log.warning(
                "commit %s: no answer from %s within %.1fs; partial commit without VTTS",
                commit_id,
                silent,
                self.settings.commit_timeout_s,
            )
        sources: dict[str, dict[int, int]] = {}
        for (topic, part), p in self._source_positions().items():
            sources.setdefault(topic, {})[part] = p.offset
        results: list[TableCommitResult] = []
        failed: dict[str, str] = {}
        for table in sorted(t for t, fs in self._pending.items() if fs):
            files = tuple(self._pending[table])
            try:
                if self._hooks.before_table_commit is not None:
                    self._hooks.before_table_commit(table)
                result = self._committer.commit(
                    TableCommitRequest(
                        table=table,
                        commit_id=commit_id,
                        files=files,
                        positions=position,
                        source_offsets=sources,
                        fencing_token=self._token(),
                        valid_through_ms=vtts,
                    )
                )
            except (NotLeaderError, StaleFencingTokenError) as exc:
                # a newer leader exists: stop here, it re-reads and finishes our work
                raise NotLeaderError(f"{self.coordinator_id}: {exc}") from exc
            except Exception as exc:  # tables commit independently; this one stays pending
                log.error("commit %s: table %s failed: %s", commit_id, table, exc)
                failed[table] = f"{type(exc).__name__}: {exc}"
                continue
            self._committed(table, files, position)
            results.append(result)
        cycle = CycleResult(commit_id, complete, vtts, tuple(results), failed)
        if self._hooks.after_iceberg_commits is not None:
            self._hooks.after_iceberg_commits(cycle)
        if not failed and position != self._stored:
            self._channel.store_position(position)
            self._stored = position
        for r in results:
            self._channel.broadcast(
                Event(self.group_id, CommitToTable(commit_id, r.table, r.snapshot_id, vtts))
            )
            self._notify(r, vtts)
        if not failed:
            self._channel.broadcast(Event(self.group_id, CommitComplete(commit_id, vtts)))
            if self._stored:
                self._channel.prune(self._stored)
        self._last_cycle_end = time.monotonic()
        log.info(
            "commit %s: %s, vtts=%s, %d tables committed (%d files, %d records), %d failed%s",
            commit_id,
            "complete" if complete else "partial",
            vtts,
            sum(1 for r in results if r.snapshot_id is not None),
            sum(r.data_files for r in results),
            sum(r.records for r in results),
            len(failed),
            f": {failed}" if failed else "",
        )
        return cycle

    def _token(self) -> int:
        if self._lease is None:
            raise NotLeaderError(f"{self.coordinator_id} is not the leader")
        return self._lease.token

    def _committed(
        self, table: str, files: tuple[PendingFile, ...], position: dict[str, int]
    ) -> None:
        """Forget committed files; remember what the table holds now, for dedupe."""
        self._pending[table] = self._pending[table][len(files) :]
        mark = self._marks.setdefault(table, _TableMark({}, {}))
        for p, o in position.items():
            mark.positions[p] = max(mark.positions.get(p, 0), o)
        for f in files:
            self._pending_keys.discard((f.writer_id, f.batch_seq, table))
            mark.watermarks[f.writer_id] = max(
                mark.watermarks.get(f.writer_id, f.batch_seq), f.batch_seq
            )

    def _notify(self, result: TableCommitResult, vtts: int | None) -> None:
        plugins = self._plugins or get_plugins()
        plugins.after_table_commit(
            TableCommitted(
                group_id=self.group_id,
                table=result.table,
                commit_id=result.commit_id,
                snapshot_id=result.snapshot_id,
                data_files=result.data_files,
                records=result.records,
                valid_through_ms=vtts,
            )
        )
