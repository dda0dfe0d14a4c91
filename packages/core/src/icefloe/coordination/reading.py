"""Reading: turns channel events into the coordinator's state (writers, pending files per
table, what each table holds already) and rebuilds it on recovery.

* Writer liveness uses the time the coordinator read an event, except while recovering, where
  the event's own timestamp counts (otherwise every long-dead writer found in the backlog would
  look live and stall the first cycle until the commit timeout).
* The same (writer, batch, table) may arrive twice where a backend cannot dedupe at publish
  (Kafka shows records of aborted transactions on some brokers): the first copy is kept.
* Files already quarantined (see :mod:`icefloe.commit.quarantine`) are not taken up again when a new
  leader re-reads their events.
* A writer batch's files become pending only with its DataComplete, which carries the source
  positions the batch reached: a commit then never holds files of a batch whose positions it
  does not record (a rollback replays from those). Until then the batch is *open* and the
  position a commit records stops at its first event. A batch cut short (the writer's next
  event is not its continuation: records of an aborted transaction a broker showed) is dropped.
* Memory is bounded by ``max_pending_files/bytes``: once pending files reach the bound, the
  reader stops handling events (the rest of a polled chunk is held back, in order) until a
  cycle has committed, also while recovering and while a cycle waits for answers. Files count
  once their batch closes, so the bound falls between batches, never inside one.
* Writers not heard from within ``writer_timeout_s`` are dropped at each cycle, so their
  state does not pile up; the valid-through timestamp needs every source partition ever seen
  to be covered by a writer that answered the cycle.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from icefloe.channel import ChannelRecord, CoordinatorChannel
from icefloe.commit.committer import IcebergCommitter
from icefloe.commit.dedupe import CommitBoundary
from icefloe.commit.quarantine import Quarantine
from icefloe.commit.request import PendingFile
from icefloe.commit.rollback import is_replay_writer
from icefloe.commit.screening import same_uuid
from icefloe.coordination.backlog import READ_TO_END_S, backlog, short_of
from icefloe.coordination.settings import POLL_S, CoordinatorSettings
from icefloe.coordination.writer import merge_positions
from icefloe.errors import ChannelIdentityError, ChannelResetError
from icefloe.events import DataComplete, DataWritten, SourcePosition

log = logging.getLogger("icefloe.coordinator")

_HARD_CAP = 4  # times max_pending_*: the most files kept while some tables back off


@dataclass
class WriterState:
    """What the coordinator knows about one writer identity."""

    epoch: int
    last_seen_ms: float
    positions: dict[tuple[str, int], SourcePosition] = field(default_factory=dict)


@dataclass
class OpenBatch:
    """A writer batch whose DataWritten events were read and whose DataComplete was not yet."""

    epoch: int
    batch_seq: int
    partition: str
    offset: int  # of its first event: a commit's recorded position stops there
    written: list[tuple[ChannelRecord, DataWritten]] = field(default_factory=list)

    def continued_by(self, epoch: int, batch_seq: int | None, payload: object) -> bool:
        """Whether an event of the same writer belongs to this batch (a batch is published
        whole and contiguous per writer: DataWritten events, then its own DataComplete)."""
        same = (epoch, batch_seq) == (self.epoch, self.batch_seq)
        closes = isinstance(payload, DataComplete) and payload.commit_id is None
        return same and (isinstance(payload, DataWritten) or closes)


def now_ms() -> float:
    return time.time() * 1000.0


def announced(
    channel: CoordinatorChannel, group_id: str, timeout_s: float = READ_TO_END_S
) -> Iterator[tuple[str, PendingFile]]:
    """``(table, file)`` for every file announced on the channel from its stored position to
    its end, with where its event sits (read only: no lease, nothing stored). Shared by
    ``icefloe maintain`` (keep these files) and ``icefloe status`` (count the uncommitted).
    Raises :class:`~icefloe.errors.ChannelStalledError` when the end is not reached within
    ``timeout_s``: a shorter read would leave files of published batches unprotected."""
    yield from announced_in(backlog(channel, group_id, timeout_s))


def announced_in(records: Iterable[ChannelRecord]) -> Iterator[tuple[str, PendingFile]]:
    """``(table, file)`` for every file the DataWritten events among ``records`` announce
    (``icefloe status`` reads the records on a thread of its own, see :mod:`.backlog`)."""
    for rec in records:
        event, payload = rec.event, rec.event.payload
        if not isinstance(payload, DataWritten):
            continue
        writer = event.writer.writer_id if event.writer else ""
        # no batch number: the coordinator ignores the event; -1 lets any watermark cover it
        seq = -1 if event.batch_seq is None else event.batch_seq
        for f in payload.files:
            yield payload.table, PendingFile(f, writer, seq, rec.partition, rec.offset)


def announced_files(
    channel: CoordinatorChannel, group_id: str, timeout_s: float = READ_TO_END_S
) -> set[str]:
    """Paths of every file announced on the channel from its stored position to its end:
    published batches the coordinator has not committed yet (read only: no lease, nothing
    stored). Raises :class:`~icefloe.errors.ChannelStalledError` like :func:`announced`."""
    return {f.meta.path for _, f in announced(channel, group_id, timeout_s)}


class EventReader:
    """The coordinator's read state; single-threaded, rebuilt from the channel by a new leader."""

    def __init__(
        self,
        group_id: str,
        channel: CoordinatorChannel,
        committer: IcebergCommitter,
        settings: CoordinatorSettings,
        quarantine: Quarantine,
    ) -> None:
        self._group_id = group_id
        self._channel = channel
        self._committer = committer
        self._settings = settings
        self._quarantine = quarantine
        self.backing_off: Callable[[str], bool] = lambda table: False  # set by the cycle
        self.awaiting_replay: Callable[[str], bool] = lambda table: False  # set by the cycle
        self.reset()

    def reset(self) -> None:
        """Forget everything read: what a new leader must rebuild from the channel."""
        self.read_pos: dict[str, int] = {}
        self.stored: dict[str, int] | None = None
        self.pending: dict[str, list[PendingFile]] = {}
        self._bytes: dict[str, int] = {}  # pending bytes per table, kept with ``pending``
        self._pending_keys: set[tuple[str, int, str]] = set()
        self.writers: dict[str, WriterState] = {}
        self._open: dict[str, OpenBatch] = {}  # writer id -> its batch not closed yet
        # newest source positions of every DataComplete read (never pruned with its writer:
        # a commit records them for the batches it holds, the writer gone or not)
        self._sources: dict[tuple[str, int], SourcePosition] = {}
        self._boundaries: dict[str, CommitBoundary] = {}
        self._incarnations: dict[str, uuid.UUID] = {}  # table -> UUID its boundary is of
        self._reread: set[tuple[str, str]] = set()  # (table, UUID) read again for, once each
        self.quarantined: dict[str, set[str]] = {}  # table -> quarantined paths
        # table -> (writer_id, batch_seq) of quarantined files: batches decided already
        self.quarantined_batches: dict[str, set[tuple[str, int]]] = {}
        self._source_partitions: set[tuple[str, int]] = set()
        self._held: deque[ChannelRecord] = deque()  # polled, not handled: memory bound hit
        self._recovering = False
        self.cycle_id: str | None = None
        self.answered: set[str] = set()
        self.channel_id: str | None = None  # known once recover() ran

    # ------------------------------------------------------------------ views

    def pending_files(self) -> dict[str, int]:
        return {t: len(fs) for t, fs in self.pending.items() if fs}

    def pending_bytes(self) -> int:
        return sum(self._bytes.values())

    def pending_size(self, tables: Iterable[str]) -> tuple[int, int]:
        """Pending files and bytes of ``tables`` (cheap: per-table counts)."""
        chosen = [t for t in tables if t in self.pending]
        return sum(len(self.pending[t]) for t in chosen), sum(self._bytes[t] for t in chosen)

    def full(self) -> bool:
        """Whether pending files reached ``max_pending_files/bytes`` (stop reading).

        Files of tables backing off after a failure count only against a hard cap of
        ``_HARD_CAP`` times the bound: below it the other tables keep being read and committed
        while one table fails; at it memory wins and reading waits (a permanently failing
        table's files are quarantined after its attempts, which frees it). The files of a
        rolled-back table waiting for its replay batch count against no bound: they commit
        only with that batch, which only reading brings (counted as ready, or against the hard
        cap once more of them came first, they kept it unread for good). They are what the
        table received before the replay was published (the runner publishes it within
        ``spark.rollback_check_interval_s``); a replay that never comes is the failing alarm's
        case (``quarantine_after_failures``), resolved by the operator.
        """
        s = self._settings
        if s.max_pending_files is None and s.max_pending_bytes is None:
            return False
        counted = [t for t in self.pending if not self.awaiting_replay(t)]
        every = self.pending_size(counted)
        ready = self.pending_size(t for t in counted if not self.backing_off(t))
        for (files, size), factor in ((ready, 1), (every, _HARD_CAP)):
            if s.max_pending_files is not None and files >= s.max_pending_files * factor:
                return True
            if s.max_pending_bytes is not None and size >= s.max_pending_bytes * factor:
                return True
        return False

    @property
    def held(self) -> int:
        """Records polled but not handled yet (held back by the memory bound)."""
        return len(self._held)

    def caught_up(self, end: Mapping[str, int]) -> bool:
        """Whether every event before ``end`` (an earlier ``end_position()``) was read and
        handled: the read position, or where the channel says it read through (past entries
        that are not events), reaches it in every partition and nothing is held back."""
        return not self._held and not short_of(self.read_pos, self._channel.read_through(), end)

    def prune_writers(self) -> set[str]:
        """Drop writers not heard from within ``writer_timeout_s``; returns the live ones
        expected to answer StartCommit (a rollback's replay writer publishes one batch and
        leaves: waiting for its answer would stall every cycle until the timeout)."""
        limit = now_ms() - self._settings.writer_timeout_s * 1000.0
        for w in [w for w, s in self.writers.items() if s.last_seen_ms < limit]:
            del self.writers[w]
        return {w for w in self.writers if not is_replay_writer(w)}

    def source_positions(
        self, writers: Iterable[str] | None = None
    ) -> dict[tuple[str, int], SourcePosition]:
        """Newest source positions, over ``writers`` (default: every DataComplete read since
        the leadership began, including those of writers dropped as dead since)."""
        if writers is None:
            return dict(self._sources)
        merged: dict[tuple[str, int], SourcePosition] = {}
        for w in writers:
            state = self.writers.get(w)
            if state is not None:
                merge_positions(merged, tuple(state.positions.values()))
        return merged

    def valid_through(self, answered: Iterable[str]) -> int | None:
        """Min over source partitions of their newest record time, as reported by the writers
        that ``answered``; None if any source partition ever seen is not covered by them or
        has no record time (the design's rule: no VTTS unless every partition is covered)."""
        covered = self.source_positions(answered)
        if not covered or self._source_partitions - set(covered):
            return None
        stamps = [p.max_timestamp_ms for p in covered.values()]
        if any(t is None for t in stamps):
            return None
        return min(t for t in stamps if t is not None)

    # ------------------------------------------------------------------ reading

    def recover(self, renew_if_due: Callable[[], None]) -> int:
        """Re-read everything since the stored position; the backlog rebuilds pending files.
        Returns how many events were read."""
        self.reset()
        self.channel_id = self._channel.channel_id()
        stored = self._channel.stored_position()
        self._check_within_log("the position stored in the channel", stored or {})
        self.stored = None if stored is None else dict(stored)
        self.read_pos = dict(self.stored or {})
        self._channel.seek(stored)
        self._recovering = True
        read = 0
        # Bounded: under steady publishing the log never runs dry, so recovery ends after at
        # most one commit interval and the normal loop reads the rest of the backlog.
        deadline = time.monotonic() + self._settings.commit_interval_s
        try:
            while True:
                n = self.poll(POLL_S)
                read += n
                renew_if_due()
                if n == 0 or self.full() or time.monotonic() >= deadline:
                    break
        finally:
            self._recovering = False
        return read

    def poll(self, timeout: float) -> int:
        """Handle held-back records, then newly polled ones, until the memory bound is hit.
        Returns how many records were handled."""
        if self.full():
            time.sleep(timeout)  # a cycle must commit first; do not spin
            return 0
        if not self._held:
            self._held.extend(self._channel.poll(timeout))
        handled = 0
        while self._held and not self.full():
            self._handle(self._held.popleft())
            handled += 1
        return handled

    def _handle(self, rec: ChannelRecord) -> None:
        self.read_pos[rec.partition] = max(self.read_pos.get(rec.partition, 0), rec.offset + 1)
        event = rec.event
        if event.group_id != self._group_id:
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
        writer = self.writers.get(ref.writer_id)
        if writer is not None and ref.epoch < writer.epoch:
            log.warning(
                "ignoring %s of fenced writer %s epoch %d (seen epoch %d)",
                event.type,
                ref.writer_id,
                ref.epoch,
                writer.epoch,
            )
            return
        now = now_ms()
        seen = min(float(event.timestamp_ms), now) if self._recovering else now
        if writer is None:
            writer = self.writers[ref.writer_id] = WriterState(ref.epoch, seen)
        writer.epoch = ref.epoch
        writer.last_seen_ms = max(writer.last_seen_ms, seen)
        opened = self._open.pop(ref.writer_id, None)
        if opened is not None and not opened.continued_by(ref.epoch, event.batch_seq, payload):
            log.warning(
                "dropping batch %d of writer %s epoch %d (channel %s@%d): its DataComplete "
                "never came (the batch was not published whole, e.g. an aborted transaction)",
                opened.batch_seq,
                ref.writer_id,
                opened.epoch,
                opened.partition,
                opened.offset,
            )
            opened = None
        if isinstance(payload, DataComplete):
            merge_positions(writer.positions, payload.positions)
            merge_positions(self._sources, payload.positions)
            self._source_partitions.update((p.topic, p.partition) for p in payload.positions)
            if payload.commit_id is not None and payload.commit_id == self.cycle_id:
                self.answered.add(ref.writer_id)
            if opened is not None:  # the batch is whole: its files are pending now
                for written, dw in opened.written:
                    self._add_files(written, ref.writer_id, opened.batch_seq, dw, payload.positions)
        elif event.batch_seq is None:
            log.warning("ignoring DataWritten of %s without a batch sequence", ref.writer_id)
        else:
            if opened is None:
                opened = OpenBatch(ref.epoch, event.batch_seq, rec.partition, rec.offset)
            opened.written.append((rec, payload))
            self._open[ref.writer_id] = opened

    def _add_files(
        self,
        rec: ChannelRecord,
        writer_id: str,
        seq: int,
        dw: DataWritten,
        source: tuple[SourcePosition, ...],
    ) -> None:
        key = (writer_id, seq, dw.table)
        if key in self._pending_keys:
            return  # a second copy of a batch (replay the backend could not refuse)
        quarantined = self.quarantined_paths(dw.table)
        files = [
            PendingFile(f, writer_id, seq, rec.partition, rec.offset, dw.table_uuid, source)
            for f in dw.files
            if f.path not in quarantined
        ]
        if not files or self._holds(dw.table, dw.table_uuid, files[0]):
            return  # the table already holds this batch (all its files share one place)
        replay = len(files) == len(dw.files)  # none of these files is the quarantined one
        if replay and (writer_id, seq) in self.quarantined_batches[dw.table]:
            # decided already: its files were quarantined (those of it the table took, if any,
            # advanced the watermark). A replay in new files (a Spark batch run again, which
            # only a channel that never saw the batch lets through) would add its records to
            # the table as well as to the quarantine. A re-read of the batch itself (after a
            # crash) names its quarantined files: its other files go on
            log.warning(
                "ignoring batch %d of %s for %s again: its files were quarantined",
                seq,
                writer_id,
                dw.table,
            )
            return
        self._pending_keys.add(key)
        self.pending.setdefault(dw.table, []).extend(files)
        self._bytes[dw.table] = self._bytes.get(dw.table, 0) + sum(
            f.meta.file_size_in_bytes for f in files
        )

    def _holds(self, table: str, table_uuid: str | None, first: PendingFile) -> bool:
        """Whether ``table`` holds the batch announced at ``first``. Files written for
        another table UUID than the boundary was read from make it read again, once per
        UUID: the table may have been dropped and created again (by another engine) since,
        and what the dropped table held covers nothing in the new one (a replay published
        after a backend swap would otherwise be skipped, its records in neither)."""
        boundary = self.boundary(table)
        if (
            table_uuid is not None
            and not same_uuid(table_uuid, self._incarnations.get(table))
            and (table, table_uuid) not in self._reread
        ):
            self._reread.add((table, table_uuid))
            del self._boundaries[table]
            boundary = self.boundary(table)
        return boundary.covers(first)

    def boundary(self, table: str) -> CommitBoundary:
        """What ``table`` holds already, read once per leadership from its snapshots.

        Raises a :class:`~icefloe.errors.ChannelIdentityError` when the table's commits came
        through another, undrained channel, or record positions this channel does not reach
        (it was reset or rolled back): going on would drop new files as already committed."""
        if table not in self._boundaries:
            try:
                incarnation, boundary = self._committer.incarnation_boundary(table, self.channel_id)
                self._incarnations[table] = incarnation
            except ChannelIdentityError:
                raise
            except Exception as exc:
                # skip nothing early; the commit itself reports the problem loudly
                log.warning("cannot read icefloe state of %s: %s", table, exc)
                boundary = CommitBoundary(channel_id=self.channel_id)
                self._incarnations.pop(table, None)
            self._check_within_log(f"table '{table}'", boundary.positions)
            self._boundaries[table] = boundary
        return self._boundaries[table]

    def _check_within_log(self, what: str, positions: Mapping[str, int]) -> None:
        """Positions recorded through this channel can never lie past its end; if they do,
        the channel lost events (restored from a backup, counters rolled back)."""
        if not positions:
            return
        end = self._channel.end_position()
        beyond = {p: o for p, o in positions.items() if o > end.get(p, 0)}
        if beyond:
            raise ChannelResetError(
                f"{what} records channel positions {beyond} past the end of channel "
                f"{self.channel_id} ({dict(end)}): the channel was reset or rolled back (e.g. "
                "restored from a backup) and would number new events below what is already "
                "committed. Do not restart as is: see docs/operations.md (channel reset)"
            )

    def quarantined_paths(self, table: str) -> set[str]:
        """Paths of ``table`` quarantined by this pipeline, read once per leadership (with
        :attr:`quarantined_batches`)."""
        if table not in self.quarantined:
            try:
                # retired entries too: their files, announced again, are not pending either
                entries = self._quarantine.list(self._group_id, table, retired=True)
            except Exception as exc:
                # worst case a file is screened again; its record is not duplicated
                log.warning("cannot read the quarantine for %s: %s", table, exc)
                entries = []
            self.quarantined[table] = {e.file_path for e in entries}
            self.quarantined_batches[table] = {(e.writer_id, e.batch_seq) for e in entries}
        return self.quarantined[table]

    def note_quarantined(self, table: str, files: Iterable[PendingFile]) -> None:
        """Remember ``files`` of ``table`` as quarantined (their paths and batches)."""
        files = list(files)
        self.quarantined_paths(table).update(f.meta.path for f in files)
        self.quarantined_batches[table].update((f.writer_id, f.batch_seq) for f in files)

    def remove(self, table: str, files: Iterable[PendingFile]) -> None:
        """Forget ``files`` of ``table`` (committed or quarantined)."""
        files = list(files)
        gone = {id(f) for f in files}
        left = [f for f in self.pending.get(table, []) if id(f) not in gone]
        if left:
            self.pending[table] = left
            self._bytes[table] = sum(f.meta.file_size_in_bytes for f in left)
        else:
            self.pending.pop(table, None)
            self._bytes.pop(table, None)
        still = {(f.writer_id, f.batch_seq) for f in left}
        for f in files:
            if (f.writer_id, f.batch_seq) not in still:
                self._pending_keys.discard((f.writer_id, f.batch_seq, table))

    def committed(
        self, table: str, files: tuple[PendingFile, ...], position: dict[str, int]
    ) -> None:
        """Forget committed files; remember what the table holds now, for dedupe."""
        self.remove(table, files)
        self._boundaries[table] = self.boundary(table).advanced(position, files)

    def commit_position(self) -> dict[str, int]:
        """The read position lowered to the first event of every open batch: every
        DataWritten before it is pending, committed or quarantined, so a commit may record it
        (a batch that closes later must not look covered)."""
        position = dict(self.read_pos)
        for b in self._open.values():
            if b.offset < position.get(b.partition, 0):
                position[b.partition] = b.offset
        return position

    def safe_position(self, position: dict[str, int]) -> dict[str, int]:
        """``position`` lowered to the oldest file still pending: everything before the result
        is committed or quarantined, so it may be stored even while some table fails."""
        safe = dict(position)
        for fs in self.pending.values():
            for f in fs:
                if f.offset < safe.get(f.partition, 0):
                    safe[f.partition] = f.offset
        return safe
