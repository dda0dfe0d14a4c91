"""A PostgreSQL writer's end: registers with a growing epoch, publishes a batch in one
transaction (epoch check, batch key, events under the append lock, source positions, NOTIFY)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence

from icefloe.channel import WriterBatch, WriterChannel
from icefloe.errors import ChannelError, EventDecodeError, WriterFencedError
from icefloe.events import Event, SourcePosition, decode_event, encode_event
from icefloe_postgres.database import ChannelContext, Conn, notify

log = logging.getLogger("icefloe_postgres.writer")


class _ReplayError(Exception):
    """Raised inside a transaction to roll it back when the batch key already exists."""


class PostgresWriterChannel(WriterChannel):
    """A writer instance's end: fenced by epoch, publishes in one transaction."""

    def __init__(self, context: ChannelContext, writer_id: str) -> None:
        self._ctx = context
        self.writer_id = writer_id
        self.epoch: int | None = None
        self._broadcast_seq = 0
        self._listener = context.db.shared_listener(context.broadcasts_channel)
        self._woken = self._listener.subscribe()

    def open(self) -> int:
        ctx = self._ctx

        def register(conn: Conn) -> tuple[int, int]:
            with conn.transaction():
                row = conn.execute(ctx.q.open_writer, (ctx.group_id, self.writer_id)).fetchone()
                head = conn.execute(ctx.q.broadcast_head, (ctx.group_id,)).fetchone()
            assert row is not None
            return int(row[0]), int(head[0]) if head else 0

        # Listen first so that no broadcast committed after open() can be missed.
        self._listener.ensure()
        self.epoch, self._broadcast_seq = ctx.db.run("writer open", register)
        return self.epoch

    def _check_epoch(self, conn: Conn, epoch: int) -> None:
        row = conn.execute(
            self._ctx.q.writer_epoch, (self._ctx.group_id, self.writer_id)
        ).fetchone()
        if row is None:
            raise ChannelError(f"writer '{self.writer_id}' was never opened; call open() first")
        current = int(row[0])
        if current > epoch:
            raise WriterFencedError(
                f"writer '{self.writer_id}' epoch {epoch} is fenced by epoch {current}"
            )
        if current < epoch:
            raise ChannelError(
                f"writer '{self.writer_id}' epoch {epoch} was never issued (newest {current})"
            )

    def _append(
        self,
        conn: Conn,
        events: Sequence[Event],
        epoch: int,
        batch_seq: int | None,
    ) -> int:
        """Take the pipeline's append lock, assign offsets and insert; returns the first."""
        q = self._ctx.q
        row = conn.execute(
            q.take_offsets, (len(events), self._ctx.group_id, len(events))
        ).fetchone()
        if row is None:
            raise ChannelError(
                f"pipeline '{self._ctx.group_id}' is not registered in schema '{self._ctx.schema}'"
            )
        first = int(row[0])
        conn.execute(
            q.insert_events,
            {
                "g": self._ctx.group_id,
                "first": first,
                "w": self.writer_id,
                "epoch": epoch,
                "seq": batch_seq,
                "ids": [e.event_id for e in events],
                "types": [e.type.value for e in events],
                "payloads": [encode_event(e) for e in events],
            },
        )
        return first

    def _validate(self, events: Sequence[Event]) -> None:
        for e in events:
            if e.group_id != self._ctx.group_id:
                raise ValueError(
                    f"event for pipeline '{e.group_id}' sent on pipeline '{self._ctx.group_id}'"
                )
            if e.writer is not None and e.writer.writer_id != self.writer_id:
                raise ValueError(
                    f"event of writer '{e.writer.writer_id}' sent by writer '{self.writer_id}'"
                )

    def _epoch_for(self, events: Sequence[Event]) -> int:
        for e in events:
            if e.writer is not None:
                return e.writer.epoch
        if self.epoch is None:
            raise ChannelError(f"writer '{self.writer_id}' was never opened; call open() first")
        return self.epoch

    def publish(self, batch: WriterBatch) -> bool:
        if batch.writer.writer_id != self.writer_id:
            raise ValueError(
                f"batch of writer '{batch.writer.writer_id}' sent by writer '{self.writer_id}'"
            )
        if not batch.events:
            raise ValueError("a writer batch has at least one event")
        self._validate(batch.events)
        ctx = self._ctx
        q = ctx.q
        epoch = batch.writer.epoch
        key = (ctx.group_id, self.writer_id, batch.batch_seq)
        # last position per source partition (the upsert may touch a row only once)
        sources = {(p.topic, p.partition): p for p in batch.source_positions}
        # tells a retry of this very call (after an ambiguous commit) from a replay
        publish_id = uuid.uuid4().hex

        def tx(conn: Conn) -> bool:
            try:
                with conn.transaction():
                    self._check_epoch(conn, epoch)
                    existing = conn.execute(q.batch_exists, key).fetchone()
                    if existing is not None:
                        return bool(existing[0] == publish_id)
                    first = self._append(conn, batch.events, epoch, batch.batch_seq)
                    # a concurrent publish of the same key would block here, then conflict
                    if not conn.execute(
                        q.insert_batch, (*key, epoch, first, len(batch.events), publish_id)
                    ).fetchone():
                        raise _ReplayError
                    if sources:
                        conn.execute(
                            q.upsert_sources,
                            {
                                "g": ctx.group_id,
                                "w": self.writer_id,
                                "seq": batch.batch_seq,
                                "topics": [t for t, _ in sources],
                                "parts": [p for _, p in sources],
                                "offs": [s.offset for s in sources.values()],
                                "tss": [s.max_timestamp_ms for s in sources.values()],
                            },
                        )
                    notify(conn, ctx.events_channel)
                return True
            except _ReplayError:
                return False

        return ctx.db.run("publish", tx)

    def respond(self, event: Event) -> None:
        self._validate([event])
        ctx = self._ctx
        epoch = self._epoch_for([event])

        def tx(conn: Conn) -> None:
            with conn.transaction():
                self._check_epoch(conn, epoch)
                # a retry after an ambiguous commit must not append the event twice
                if conn.execute(ctx.q.event_exists, (ctx.group_id, event.event_id)).fetchone():
                    return
                self._append(conn, [event], epoch, event.batch_seq)
                notify(conn, ctx.events_channel)

        ctx.db.run("respond", tx)

    def poll_broadcasts(self, timeout: float) -> list[Event]:
        """Query the broadcasts only when the shared listener was notified since the last
        query (or the LISTEN connection is down, or ``poll_interval_s`` passed): an idle
        writer then costs no query and no connection of its own. The flag is lowered before
        the query, so a NOTIFY (sent at commit) that arrives during the query raises it again
        and the next poll reads."""
        return self._woken.read(
            self._read_broadcasts,
            self._listener.ensure,
            timeout,
            self._ctx.config.poll_interval_s,
        )

    def _read_broadcasts(self) -> list[Event]:
        ctx = self._ctx
        rows = ctx.db.run(
            "read broadcasts",
            lambda c: c.execute(
                ctx.q.read_broadcasts, (ctx.group_id, self._broadcast_seq, 1000)
            ).fetchall(),
        )
        events: list[Event] = []
        for seq, payload in rows:
            self._broadcast_seq = int(seq)
            try:
                events.append(decode_event(payload))
            except EventDecodeError as exc:
                # a writer can only ignore it: an unanswered StartCommit merely times out
                log.warning("skipping undecodable broadcast %d: %s", seq, exc)
        return events

    def source_positions(self) -> tuple[SourcePosition, ...]:
        """The source positions stored with this writer's newest published batch: where a
        restarted writer resumes (they were committed in the same transaction as its files)."""
        ctx = self._ctx
        rows = ctx.db.run(
            "read source positions",
            lambda c: c.execute(ctx.q.source_positions, (ctx.group_id, self.writer_id)).fetchall(),
        )
        return tuple(SourcePosition(t, int(p), int(o), ts) for t, p, o, ts in rows)

    def close(self) -> None:
        self._woken.close()  # the shared connection closes with its last writer
