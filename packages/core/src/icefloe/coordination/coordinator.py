"""The commit coordinator: exactly one per pipeline turns the files announced by every writer
into one idempotent Iceberg commit per table per cycle (see ``docs/architecture.md``).

Life of a coordinator: acquire the lease (fencing token), recover (re-read every event since the
stored channel position; the committer skips what tables already hold), then loop: read events,
renew the lease, and run a commit cycle when one is due. A cycle broadcasts StartCommit, waits
until every live writer answered with DataComplete (or the commit timeout), commits each table
with pending files through :class:`~icefloe.commit.committer.IcebergCommitter`, stores the read
position only if every table succeeded, then broadcasts the results and prunes the channel.
Losing the lease at any point drops all in-memory state and starts over from election.

Decisions worth knowing:

* Undecodable events are the backend's to report (:class:`~icefloe.errors.EventDecodeError`);
  the coordinator lets it propagate and stops instead of skipping, because a skipped
  DataWritten is silent data loss. A restart re-reads from the stored position and stops at
  the same event until an operator removes it.
* The roles live in :mod:`icefloe.coordination`: leadership (lease, renewal, fencing token),
  reading (events into writers and pending files) and the cycle; this class wires them and
  owns the loop. Whether a table already holds a file is decided by
  :class:`icefloe.commit.dedupe.CommitBoundary` alone, for the reader and the committer alike.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Mapping

from pyiceberg.catalog import Catalog

from icefloe import metrics
from icefloe.channel import ChannelPosition, CoordinatorChannel, Lease
from icefloe.commit.committer import IcebergCommitter
from icefloe.commit.quarantine import Quarantine
from icefloe.coordination.cycle import CommitCycle
from icefloe.coordination.leadership import Leadership
from icefloe.coordination.processes import CommittersFactory, pool_for
from icefloe.coordination.reading import EventReader
from icefloe.coordination.settings import (
    POLL_S,
    CoordinatorHooks,
    CoordinatorSettings,
    CycleResult,
)
from icefloe.coordination.stall import StallWatch
from icefloe.errors import ChannelError, NotLeaderError, StaleFencingTokenError
from icefloe.plugins.manager import Plugins

__all__ = ["Coordinator", "CoordinatorHooks", "CoordinatorSettings", "CycleResult"]

log = logging.getLogger("icefloe.coordinator")


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
        committers: CommittersFactory | None = None,
    ) -> None:
        """``committers``: builds the committers of a cycle's tables in place of committing in
        this process (a runner's, e.g. Spark tasks on its executors); needs
        ``settings.catalog``, and cannot be combined with ``settings.commit_processes``."""
        self.group_id = group_id
        self.coordinator_id = coordinator_id or f"coordinator-{uuid.uuid4().hex[:8]}"
        self.settings = settings or CoordinatorSettings()
        hooks = hooks or CoordinatorHooks()
        self._channel = channel
        self._leadership = Leadership(channel, self.coordinator_id, hooks.after_lease_check)
        committer = IcebergCommitter(
            catalog,
            group_id,
            branch=self.settings.branch,
            before_commit=self._leadership.before_commit,
            policies=self.settings.policies,
        )
        quarantine = Quarantine(catalog, self.settings.quarantine_table)
        self._quarantine = quarantine
        s = self.settings
        self._pool = pool_for(
            s.commit_processes,
            s.catalog,
            group_id,
            s.branch,
            s.policies,
            hooks.in_committer,
            committers,
        )
        self._reader = EventReader(group_id, channel, committer, self.settings, quarantine)
        self._stall = StallWatch(self.settings.stall_after_s)
        self._failing_gauged: set[str] = set()  # tables icefloe_table_failing reports
        self._stall_check_at = 0.0  # monotonic time of the next end_position() look-up
        self.channel_stalled_s: float | None = None
        """How long the channel has been stalled (see :mod:`icefloe.coordination.stall`)."""
        self._cycle = CommitCycle(
            group_id,
            self.coordinator_id,
            channel,
            committer,
            self._reader,
            self._leadership,
            self.settings,
            hooks,
            plugins,
            quarantine,
            self._pool,
        )

    # ------------------------------------------------------------------ views

    @property
    def lease(self) -> Lease | None:
        """The lease while this coordinator leads, else None."""
        return self._leadership.lease

    @property
    def channel(self) -> CoordinatorChannel:
        return self._channel

    @property
    def is_leader(self) -> bool:
        return self._leadership.lease is not None

    def pending_files(self) -> dict[str, int]:
        """Files waiting for a commit, per table (for metrics and tests)."""
        return self._reader.pending_files()

    def pending_bytes(self) -> int:
        return self._reader.pending_bytes()

    def awaiting_replay(self, table: str) -> bool:
        """Whether ``table``'s files wait for its rollback's replay batch, not read yet (its
        last attempt failed with RollbackPendingError): a drain reads on to that batch."""
        return self._cycle.awaiting_replay(table)

    def known_writers(self) -> dict[str, int]:
        """Writer ids seen since this coordinator became leader, with their newest epoch."""
        return {w: s.epoch for w, s in self._reader.writers.items()}

    @property
    def quarantined_files(self) -> int:
        """Files this coordinator quarantined since it started (a metric)."""
        return self._cycle.quarantined_files

    @property
    def read_position(self) -> dict[str, int]:
        return dict(self._reader.read_pos)

    # ------------------------------------------------------------------ loop

    def run(self, stop: threading.Event) -> None:
        """Elect, recover and run cycles until ``stop`` is set; then release the lease.

        Channel errors (a backend hiccup) are logged and retried after a pause; anything else
        (a decode error, a bug) propagates, because skipping it could lose data.
        """
        self._cycle.stop = stop
        try:
            while not stop.is_set():
                try:
                    self.step(timeout=POLL_S)
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
        if self._leadership.lease is None:
            self._try_lead(timeout)
            return None
        try:
            if self._reader.poll(timeout):
                self._update_pending_gauges()
            self._watch_stall()
            self._leadership.renew_if_due()
            if self._cycle.due():
                return self._run_cycle()
        except NotLeaderError:
            log.warning("%s: lost leadership; dropping state", self.coordinator_id)
            self._drop_leadership()
        return None

    def read(self, timeout: float) -> int:
        """Read events and renew the lease, without running a cycle, for a caller that decides
        when to commit (``icefloe drain``). Returns how many events were handled; 0 when not
        leading (after a lost lease the state is dropped and :meth:`step` elects again)."""
        if self._leadership.lease is None:
            return 0
        try:
            n = self._reader.poll(timeout)
            self._leadership.renew_if_due()
        except NotLeaderError:
            log.warning("%s: lost leadership; dropping state", self.coordinator_id)
            self._drop_leadership()
            return 0
        self._update_pending_gauges()
        return n

    def caught_up(self, end: ChannelPosition) -> bool:
        """Whether every event before ``end`` (an earlier ``channel.end_position()``) has been
        read and handled (none held back by the memory bound)."""
        return self._leadership.lease is not None and self._reader.caught_up(end)

    def pending_full(self) -> bool:
        """Whether pending files reached ``max_pending_files/bytes`` (reading waits for a
        cycle)."""
        return self._reader.full()

    def commit_now(self, wait_for_writers: bool = True) -> CycleResult:
        """Run a commit cycle now; without ``wait_for_writers`` it asks no writer (they are
        stopped) and commits what was read as a partial cycle. Raises NotLeaderError when not
        (or no longer) leading."""
        if self._leadership.lease is None:
            raise NotLeaderError(f"{self.coordinator_id} is not the leader")
        try:
            return self._run_cycle(wait_for_writers)
        except NotLeaderError:
            self._drop_leadership()
            raise

    def _run_cycle(self, wait_for_writers: bool = True) -> CycleResult:
        """A commit cycle, measured (``icefloe.metrics``)."""
        with metrics.COMMIT_CYCLE_SECONDS.time():
            cycle = self._cycle.run(wait_for_writers)
        result = "failed" if cycle.failed else "complete" if cycle.complete else "partial"
        metrics.COMMIT_CYCLES.labels(result).inc()
        for r in cycle.tables:
            if r.snapshot_id is not None:
                metrics.TABLE_COMMITS.labels(r.table).inc()
        for table, n in cycle.quarantined.items():
            metrics.FILES_QUARANTINED.labels(table).inc(n)
        self._update_pending_gauges()
        self._update_failing_gauges(cycle.failing)
        return cycle

    def _update_failing_gauges(self, failing: Mapping[str, int]) -> None:
        for table in self._failing_gauged - failing.keys():
            metrics.TABLE_FAILING.labels(table).set(0)
        for table, failures in failing.items():
            metrics.TABLE_FAILING.labels(table).set(failures)
        self._failing_gauged = set(failing)

    def _watch_stall(self) -> None:
        """Compare the read position with the channel's end, a few times per ``stall_after_s``
        (the end is a server round trip), and report a stall once it lasts that long."""
        now = time.monotonic()
        if now < self._stall_check_at:
            return
        self._stall_check_at = now + min(5.0, self.settings.stall_after_s / 4)
        try:
            end = self._channel.end_position()
        except ChannelError as exc:  # a stall check must not stop the coordinator
            log.debug("%s: cannot read the channel's end: %s", self.coordinator_id, exc)
            return
        read = self._reader.read_pos
        stalled = self._stall.observe(read, end, now, held=self._reader.full())
        if stalled is not None and self.channel_stalled_s is None:
            log.warning(
                "%s: control channel stalled: its end moved on to %s while the read position "
                "stayed at %s for %.0fs; a transaction left open by another producer (Kafka "
                "read_committed), a lost assignment or a server fault holds the read back",
                self.coordinator_id,
                dict(end),
                dict(read),
                stalled,
            )
        elif stalled is None and self.channel_stalled_s is not None:
            log.info("%s: control channel reads again (read %s)", self.coordinator_id, dict(read))
        self.channel_stalled_s = stalled
        metrics.CHANNEL_STALLED_SECONDS.set(stalled or 0.0)

    def _update_pending_gauges(self) -> None:
        metrics.PENDING_FILES.set(sum(self._reader.pending_files().values()))
        metrics.PENDING_BYTES.set(self._reader.pending_bytes())

    def close(self) -> None:
        """Release the lease (another coordinator takes over at once), the channel and the
        committer processes."""
        try:
            self._release()
            self._channel.close()
        finally:
            if self._pool is not None:
                self._pool.close()

    # ------------------------------------------------------------------ leadership

    def _try_lead(self, timeout: float) -> bool:
        lease = self._leadership.acquire(timeout)
        if lease is None:
            return False
        metrics.LEADERSHIP_CHANGES.labels("acquired").inc()
        metrics.IS_LEADER.set(1)
        log.info(
            "%s: leading pipeline %s with fencing token %d",
            self.coordinator_id,
            self.group_id,
            lease.token,
        )
        if not self._fence(lease.token):
            return False
        try:
            read = self._reader.recover(self._leadership.renew_if_due)
        except NotLeaderError:
            self._drop_leadership()
            return False
        self._cycle.restart_clock()
        if self._pool is not None:
            self._pool.start()
        log.info(
            "%s: recovered from %s: %d events, %d pending files, %d writers",
            self.coordinator_id,
            self._reader.stored,
            read,
            sum(self._reader.pending_files().values()),
            len(self._reader.writers),
        )
        return True

    def _fence(self, token: int) -> bool:
        """Raise this leadership's fence in the quarantine before recovery reads anything
        (:meth:`~icefloe.commit.quarantine.Quarantine.fence`): a deposed leader still
        running cannot add entries this leader would not read, nor retire any. False when a
        newer leader raised its own (this lease is lost). Any other failure (the catalog
        refuses or is down) gives the lease back and propagates, as a failed start does:
        leading unfenced would let a zombie's entries in."""
        channel_id = self._channel.channel_id()
        try:
            self._quarantine.fence(self.group_id, token, channel_id)
        except StaleFencingTokenError as exc:
            log.warning("%s: lost leadership: %s", self.coordinator_id, exc)
            self._drop_leadership()
            return False
        except Exception:
            try:
                with contextlib.suppress(ChannelError):  # the lease expires anyway
                    self._release()
            finally:
                self._drop_leadership()
            raise
        return True

    def _drop_leadership(self) -> None:
        if self._leadership.lease is not None:
            metrics.LEADERSHIP_CHANGES.labels("lost").inc()
        metrics.IS_LEADER.set(0)
        self._leadership.drop()
        self._reader.reset()
        self._cycle.restart_clock()
        self._stall = StallWatch(self.settings.stall_after_s)  # a new leader judges anew
        self.channel_stalled_s = None
        metrics.CHANNEL_STALLED_SECONDS.set(0.0)
        self._update_failing_gauges({})  # the next leader reports them

    def _release(self) -> None:
        metrics.IS_LEADER.set(0)
        try:
            self._leadership.release()
        finally:
            self._reader.reset()
