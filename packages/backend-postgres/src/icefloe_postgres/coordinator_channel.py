"""The PostgreSQL coordinator's end: ordered reads of the event log, broadcasts, positions
and pruning; leadership comes from :class:`~icefloe_postgres.lease.LeaseHolder`."""

from __future__ import annotations

from collections.abc import Sequence

from icefloe.channel import ChannelPosition, ChannelRecord, CoordinatorChannel
from icefloe.errors import ChannelResetError, EventDecodeError, NotLeaderError
from icefloe.events import Event, decode_event, encode_event
from icefloe_postgres.database import ChannelContext, Conn, notify, wait_for_rows
from icefloe_postgres.lease import LeaseHolder

PARTITION = "0"


def decode_events(rows: Sequence[tuple[int, bytes]]) -> list[tuple[int, Event]]:
    """Decode rows in order. A row that is not an icefloe event raises only when it comes
    first; otherwise the events before it are returned and the next read raises."""
    out: list[tuple[int, Event]] = []
    for offset, payload in rows:
        try:
            out.append((offset, decode_event(payload)))
        except EventDecodeError as exc:
            if out:
                break
            raise EventDecodeError(f"event at offset {offset}: {exc}") from exc
    return out


class PostgresCoordinatorChannel(LeaseHolder, CoordinatorChannel):
    """The coordinator's end: lease row with a growing token, ordered reads, broadcasts."""

    def __init__(self, context: ChannelContext, coordinator_id: str, lease_ttl_s: float) -> None:
        super().__init__(context, coordinator_id, lease_ttl_s)
        self._next = 0
        self._through = 0  # see read_through

    # ------------------------------------------------------------------ reading

    def seek(self, position: ChannelPosition | None) -> None:
        """None: offsets start at 0 and pruned rows are simply absent. A position past the
        end of the log was reached in a schema that held more events: refuse it (rule End
        position of docs/backend-authors.md)."""
        self._next = 0 if position is None else int(position.get(PARTITION, 0))
        self._through = self._next
        if position is None:
            return
        end = self.end_position()[PARTITION]
        if self._next > end:
            raise ChannelResetError(
                f"the stored position {self._next} of pipeline '{self._ctx.group_id}' lies past "
                f"the end of its log ({end}) in schema '{self._ctx.schema}': the schema was "
                "restored from an older backup or its counter rolled back, and events published "
                "before are gone. Do not restart as is: see docs/operations.md (channel reset)"
            )

    def poll(self, timeout: float, max_records: int = 1000) -> list[ChannelRecord]:
        ctx = self._ctx

        def fetch() -> list[ChannelRecord]:
            rows = ctx.db.run(
                "read events",
                lambda c: c.execute(
                    ctx.q.read_events, (ctx.group_id, self._next, max(1, max_records))
                ).fetchall(),
            )
            # never skip a bad row: a skipped DataWritten would be silent data loss (the
            # coordinator stops there until an operator removes the row)
            good = decode_events(rows)
            if good:
                self._next = good[-1][0] + 1
            elif not rows:
                self._read_through_the_gap()
            return [ChannelRecord(PARTITION, off, e) for off, e in good]

        return wait_for_rows(
            fetch, self._listener, [ctx.events_channel], timeout, ctx.config.poll_interval_s
        )

    def position(self) -> ChannelPosition:
        """The next offset :meth:`poll` will read."""
        return {PARTITION: self._next}

    def _read_through_the_gap(self) -> None:
        """Nothing left at or after the next offset: offsets below the counter are pruned, or
        were never used (the counter starts from the clock), so the reader is through them."""
        ctx = self._ctx
        row = ctx.db.run(
            "read through",
            lambda c: c.execute(ctx.q.read_through, (ctx.group_id, self._next)).fetchone(),
        )
        if row is not None:
            self._through = max(self._through, int(row[0]))

    def read_through(self) -> ChannelPosition | None:
        """How far the reader got, counting offsets a poll found nothing at."""
        return {PARTITION: max(self._next, self._through)}

    # ------------------------------------------------------------------ writing

    def broadcast(self, event: Event) -> None:
        self.broadcast_all([event])

    def broadcast_all(self, events: Sequence[Event]) -> None:
        """All in one transaction and one notification (a commit is a round trip and a
        flush of the write-ahead log)."""
        if not events:
            return
        payloads = [(event, encode_event(event)) for event in events]
        ctx = self._ctx
        token = self._token()

        def tx(conn: Conn) -> None:
            with conn.transaction():
                sent = False
                for event, payload in payloads:
                    # a retry after an ambiguous commit must not send an event twice
                    exists = conn.execute(ctx.q.broadcast_exists, (ctx.group_id, event.event_id))
                    if exists.fetchone():
                        continue
                    row = conn.execute(ctx.q.take_broadcast_seq, (ctx.group_id, token)).fetchone()
                    if row is None:
                        raise NotLeaderError(
                            f"coordinator '{self.coordinator_id}' with token {token} is fenced"
                        )
                    seq = int(row[0])
                    conn.execute(
                        ctx.q.insert_broadcast,
                        (ctx.group_id, seq, event.event_id, event.type.value, token, payload),
                    )
                    sent = True
                if sent:
                    notify(conn, ctx.broadcasts_channel)

        ctx.db.run("broadcast", tx)

    def store_position(self, position: ChannelPosition) -> None:
        ctx = self._ctx
        token = self._token()
        parts = sorted(position)

        def tx(conn: Conn) -> None:
            with conn.transaction():
                self._check_token(conn, token)
                conn.execute(
                    ctx.q.upsert_position,
                    {
                        "g": ctx.group_id,
                        "token": token,
                        "parts": parts,
                        "offs": [int(position[p]) for p in parts],
                    },
                )

        ctx.db.run("store position", tx)

    def stored_position(self) -> ChannelPosition | None:
        ctx = self._ctx
        rows = ctx.db.run(
            "read position",
            lambda c: c.execute(ctx.q.read_positions, (ctx.group_id,)).fetchall(),
        )
        return {str(p): int(o) for p, o in rows} if rows else None

    def prune(self, before: ChannelPosition) -> int:
        ctx = self._ctx
        upto = int(before.get(PARTITION, 0))
        if upto <= 0:
            return 0
        cfg = ctx.config

        def tx(conn: Conn) -> int:
            with conn.transaction():
                cur = conn.execute(ctx.q.prune_events, (ctx.group_id, upto, cfg.retention_s))
                dropped = cur.rowcount
                conn.execute(ctx.q.prune_batches, (ctx.group_id, upto, cfg.retention_s))
                conn.execute(ctx.q.prune_broadcasts, (ctx.group_id, cfg.broadcast_retention_s))
            return max(0, dropped)

        return ctx.db.run("prune", tx)

    def channel_id(self) -> str:
        """The schema's identity row (created by migration 3 with the schema)."""
        ctx = self._ctx
        row = ctx.db.run("read channel id", lambda c: c.execute(ctx.q.channel_id).fetchone())
        if row is None:
            raise ChannelResetError(
                f"schema '{ctx.schema}' has lost its channel_identity row; it was tampered with "
                "or partly restored. Recreate the schema (drop it; icefloe recreates it) and "
                "see docs/operations.md (channel reset)"
            )
        return f"postgres:{row[0]}"

    def end_position(self) -> ChannelPosition:
        ctx = self._ctx
        row = ctx.db.run(
            "read end offset", lambda c: c.execute(ctx.q.end_offset, (ctx.group_id,)).fetchone()
        )
        return {PARTITION: 0 if row is None else int(row[0])}

    def close(self) -> None:
        self.release()
        self._listener.close()

    def simulate_crash(self) -> None:
        """A dead process: its connections vanish and it never releases; the lease row runs
        out on the database clock."""
        self._listener.close()
