"""The PostgreSQL coordinator's end: ordered reads of the event log, broadcasts, positions
and pruning; leadership comes from :class:`~icefloe_postgres.lease.LeaseHolder`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from icefloe.channel import ChannelPosition, ChannelRecord, CoordinatorChannel
from icefloe.errors import ChannelResetError, NotLeaderError
from icefloe.events import Event, encode_event
from icefloe_postgres.lease import LeaseHolder
from icefloe_postgres.shared import PARTITION, Conn, decode_events, notify, wait_for_rows

if TYPE_CHECKING:
    from icefloe_postgres.backend import PostgresBackend


class PostgresCoordinatorChannel(LeaseHolder, CoordinatorChannel):
    """The coordinator's end: lease row with a growing token, ordered reads, broadcasts."""

    def __init__(self, backend: PostgresBackend, coordinator_id: str) -> None:
        super().__init__(backend, coordinator_id)
        self._next = 0

    # ------------------------------------------------------------------ reading

    def seek(self, position: ChannelPosition | None) -> None:
        # None: offsets start at 0 and pruned rows are simply absent
        self._next = 0 if position is None else int(position.get(PARTITION, 0))

    def poll(self, timeout: float, max_records: int = 1000) -> list[ChannelRecord]:
        b = self._b

        def fetch() -> list[ChannelRecord]:
            rows = b.db.run(
                "read events",
                lambda c: c.execute(
                    b.q.read_events, (b.group_id, self._next, max(1, max_records))
                ).fetchall(),
            )
            # never skip a bad row: a skipped DataWritten would be silent data loss (the
            # coordinator stops there until an operator removes the row)
            good = decode_events(rows)
            if good:
                self._next = good[-1][0] + 1
            return [ChannelRecord(PARTITION, off, e) for off, e in good]

        return wait_for_rows(
            fetch, self._listener, [b.events_channel], timeout, b.config.poll_interval_s
        )

    def position(self) -> ChannelPosition:
        """The next offset :meth:`poll` will read."""
        return {PARTITION: self._next}

    # ------------------------------------------------------------------ writing

    def broadcast(self, event: Event) -> None:
        b = self._b
        token = self._token()
        payload = encode_event(event)

        def tx(conn: Conn) -> None:
            with conn.transaction():
                # a retry after an ambiguous commit must not send the event twice
                if conn.execute(b.q.broadcast_exists, (b.group_id, event.event_id)).fetchone():
                    return
                row = conn.execute(b.q.take_broadcast_seq, (b.group_id, token)).fetchone()
                if row is None:
                    raise NotLeaderError(
                        f"coordinator '{self.coordinator_id}' with token {token} is fenced"
                    )
                conn.execute(
                    b.q.insert_broadcast,
                    (b.group_id, int(row[0]), event.event_id, event.type.value, token, payload),
                )
                notify(conn, b.broadcasts_channel)

        b.db.run("broadcast", tx)

    def store_position(self, position: ChannelPosition) -> None:
        b = self._b
        token = self._token()
        parts = sorted(position)

        def tx(conn: Conn) -> None:
            with conn.transaction():
                self._check_token(conn, token)
                conn.execute(
                    b.q.upsert_position,
                    {
                        "g": b.group_id,
                        "token": token,
                        "parts": parts,
                        "offs": [int(position[p]) for p in parts],
                    },
                )

        b.db.run("store position", tx)

    def stored_position(self) -> ChannelPosition | None:
        b = self._b
        rows = b.db.run(
            "read position",
            lambda c: c.execute(b.q.read_positions, (b.group_id,)).fetchall(),
        )
        return {str(p): int(o) for p, o in rows} if rows else None

    def prune(self, before: ChannelPosition) -> int:
        b = self._b
        upto = int(before.get(PARTITION, 0))
        if upto <= 0:
            return 0
        cfg = b.config

        def tx(conn: Conn) -> int:
            with conn.transaction():
                cur = conn.execute(b.q.prune_events, (b.group_id, upto, cfg.retention_s))
                dropped = cur.rowcount
                conn.execute(b.q.prune_batches, (b.group_id, upto, cfg.retention_s))
                conn.execute(b.q.prune_broadcasts, (b.group_id, cfg.broadcast_retention_s))
            return max(0, dropped)

        return b.db.run("prune", tx)

    def channel_id(self) -> str:
        """The schema's identity row (created by migration 3 with the schema)."""
        b = self._b
        row = b.db.run("read channel id", lambda c: c.execute(b.q.channel_id).fetchone())
        if row is None:
            raise ChannelResetError(
                f"schema '{b.schema}' has lost its channel_identity row; it was tampered with "
                "or partly restored. Recreate the schema (drop it; icefloe recreates it) and "
                "see docs/operations.md (channel reset)"
            )
        return f"postgres:{row[0]}"

    def end_position(self) -> ChannelPosition:
        b = self._b
        row = b.db.run(
            "read end offset", lambda c: c.execute(b.q.end_offset, (b.group_id,)).fetchone()
        )
        return {PARTITION: 0 if row is None else int(row[0])}

    def close(self) -> None:
        self.release()
        self._listener.close()

    def simulate_crash(self) -> None:
        """A dead process: its connections vanish and it never releases; the lease row runs
        out on the database clock."""
        self._listener.close()
