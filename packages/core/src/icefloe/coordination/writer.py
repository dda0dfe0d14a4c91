"""The writer side of the protocol, backend-agnostic: what a runner (the Spark driver) uses to
publish a finished batch and to answer the coordinator's StartCommit.

A :class:`WriterClient` wraps one :class:`~icefloe.channel.WriterChannel`. Its responder thread
answers every StartCommit at once with a DataComplete carrying the newest source positions,
so an idle writer never stalls a commit cycle. All channel calls (publish, respond and the
broadcast poll) are serialised by one lock: a DataComplete answer then always follows the
batches it vouches for, and backends need not make channels thread-safe.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence

from icefloe.channel import WriterBatch, WriterChannel
from icefloe.errors import WriterFencedError
from icefloe.events import (
    CommitComplete,
    DataComplete,
    DataFileMeta,
    DataWritten,
    Event,
    SourcePosition,
    StartCommit,
    WriterRef,
)

log = logging.getLogger("icefloe.writer")

_NO_WAIT_S = 0.01  # "do not wait" without 0, which some clients read as "wait forever"


def merge_positions(
    into: dict[tuple[str, int], SourcePosition], positions: tuple[SourcePosition, ...]
) -> None:
    """Per source partition keep the furthest offset and the newest record time seen."""
    for p in positions:
        key = (p.topic, p.partition)
        old = into.get(key)
        if old is None:
            into[key] = p
            continue
        stamps = [t for t in (old.max_timestamp_ms, p.max_timestamp_ms) if t is not None]
        into[key] = SourcePosition(
            p.topic, p.partition, max(old.offset, p.offset), max(stamps) if stamps else None
        )


class WriterClient:
    """One writer instance: publishes batches and answers StartCommit from a daemon thread.

    The client owns the channel it is given: :meth:`close` closes it.
    """

    def __init__(
        self,
        channel: WriterChannel,
        group_id: str,
        writer_id: str,
        poll_interval_s: float = 0.1,
    ) -> None:
        self.group_id = group_id
        self.writer_id = writer_id
        self._channel = channel
        self._poll_interval_s = poll_interval_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ref: WriterRef | None = None
        self._positions: dict[tuple[str, int], SourcePosition] = {}
        self._last_seq: int | None = None
        self._fenced: WriterFencedError | None = None
        self.answered = 0  # StartCommits answered (metrics, tests)
        # commit id -> last batch_seq published when we answered it: its CommitComplete means
        # every batch up to that one is in the tables (run --once waits for this)
        self._answered_seq: dict[str, int | None] = {}
        self.committed_through: int | None = None

    @property
    def epoch(self) -> int | None:
        return None if self._ref is None else self._ref.epoch

    @property
    def fenced(self) -> bool:
        return self._fenced is not None

    def start(self) -> int:
        """Open the channel (fencing older instances of this writer id), start answering
        StartCommit, and return this instance's epoch."""
        if self._ref is not None:
            raise RuntimeError(f"writer {self.writer_id} already started")
        with self._lock:
            self._ref = WriterRef(self.writer_id, self._channel.open())
        self._thread = threading.Thread(
            target=self._respond_loop, name=f"icefloe-writer-{self.writer_id}", daemon=True
        )
        self._thread.start()
        return self._ref.epoch

    def publish(
        self,
        batch_seq: int,
        files: Mapping[str, Sequence[DataFileMeta]],
        positions: Sequence[SourcePosition],
        table_uuids: Mapping[str, str] | None = None,
    ) -> bool:
        """Publish one finished batch atomically: a DataWritten per table with files and one
        DataComplete with the source positions reached. Returns False when the backend knew
        the batch already (a replay). Raises WriterFencedError when a newer instance exists."""
        ref = self._started()
        uuids = table_uuids or {}
        events = [
            Event(
                self.group_id,
                DataWritten(table, tuple(fs), table_uuid=uuids.get(table)),
                ref,
                batch_seq,
            )
            for table, fs in sorted(files.items())
            if fs
        ]
        pos = tuple(positions)
        events.append(Event(self.group_id, DataComplete(pos), ref, batch_seq))
        batch = WriterBatch(ref, batch_seq, tuple(events), pos)
        with self._lock:
            if self._fenced is not None:
                raise self._fenced
            try:
                published = self._channel.publish(batch)
            except WriterFencedError as exc:
                self._fence(exc)
                raise
            merge_positions(self._positions, pos)
            self._last_seq = batch_seq if self._last_seq is None else max(self._last_seq, batch_seq)
        return published

    def close(self) -> None:
        """Stop answering and close the channel (fences nothing)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            self._channel.close()

    # ------------------------------------------------------------------ responder

    def _started(self) -> WriterRef:
        if self._ref is None:
            raise RuntimeError(f"writer {self.writer_id}: call start() first")
        return self._ref

    def _fence(self, exc: WriterFencedError) -> None:
        if self._fenced is None:
            log.error("writer %s epoch %s is fenced: %s", self.writer_id, self.epoch, exc)
        self._fenced = exc
        self._stop.set()

    def _respond_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._respond_once()
            except WriterFencedError:
                return  # recorded by _fence; the next publish raises it
            except Exception:  # a backend hiccup must not kill the responder
                log.exception("writer %s: answering StartCommit failed; retrying", self.writer_id)
            self._stop.wait(self._poll_interval_s)

    def _respond_once(self) -> None:
        ref = self._started()
        with self._lock:
            if self._stop.is_set():
                return
            # a zero-timeout poll under the lock: publishes are never held up by a wait
            events = self._channel.poll_broadcasts(_NO_WAIT_S)
            for event in events:
                if event.group_id != self.group_id:
                    continue
                if isinstance(event.payload, CommitComplete):
                    self._commit_completed(event.payload.commit_id)
                    continue
                if not isinstance(event.payload, StartCommit):
                    continue
                answer = DataComplete(tuple(self._positions.values()), event.payload.commit_id)
                try:
                    self._channel.respond(Event(self.group_id, answer, ref, self._last_seq))
                except WriterFencedError as exc:
                    self._fence(exc)
                    raise
                self.answered += 1
                self._answered_seq[event.payload.commit_id] = self._last_seq

    def _commit_completed(self, commit_id: str) -> None:
        seq = self._answered_seq.pop(commit_id, None)
        if seq is not None and (self.committed_through is None or seq > self.committed_through):
            self.committed_through = seq
        if len(self._answered_seq) > 100:  # cycles whose CommitComplete never came (failed)
            for stale in list(self._answered_seq)[:-100]:
                del self._answered_seq[stale]
