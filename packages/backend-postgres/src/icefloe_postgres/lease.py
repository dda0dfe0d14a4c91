"""Leadership of a pipeline in PostgreSQL: a lease row with a token that only grows, judged by
the database clock, taken over at once when the holder's LISTEN session is gone."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

from icefloe.channel import Lease
from icefloe.errors import ChannelError, NotLeaderError
from icefloe_postgres.database import ChannelContext, Conn, notify

log = logging.getLogger(__name__)


class LeaseHolder:
    """The leadership half of the coordinator's end (acquire, renew, release, token checks)."""

    def __init__(self, context: ChannelContext, coordinator_id: str, lease_ttl_s: float) -> None:
        self._ctx = context
        self._lease_ttl_s = lease_ttl_s
        self.coordinator_id = coordinator_id
        # identifies this instance in the lease row (a restarted process with the same
        # coordinator_id is a different instance and must not inherit the lease)
        self.instance = uuid.uuid4().hex
        self._lease: Lease | None = None
        self._lock = threading.RLock()
        self._listener = context.db.listener([context.events_channel, context.lease_channel])

    def _make_lease(self, token: int, remaining: float, started: float) -> Lease:
        # measured from before the request was sent: never later than the server's deadline
        lease = Lease(token=token, holder=self.coordinator_id, expires_at=started + remaining)
        self._lease = lease
        return lease

    def _lease_params(self, token: int | None = None) -> dict[str, Any]:
        session = self._listener.session()
        return {
            "g": self._ctx.group_id,
            "holder": self.coordinator_id,
            "instance": self.instance,
            "ttl": self._lease_ttl_s,
            "pid": None if session is None else session[0],
            "started": None if session is None else session[1],
            "token": token,
        }

    def _try_acquire(self) -> tuple[Lease | None, float]:
        """One attempt; returns the lease, or None and how long the current one has left."""
        ctx = self._ctx

        def tx(conn: Conn) -> tuple[tuple[int, float] | None, float]:
            with conn.transaction():
                row = conn.execute(ctx.q.lease_for_update, (ctx.group_id,)).fetchone()
                if row is None:
                    got = conn.execute(ctx.q.insert_lease, self._lease_params()).fetchone()
                    return (None, 0.0) if got is None else ((int(got[0]), float(got[1])), 0.0)
                instance, token, expired, remaining, holder_gone = row
                if instance == self.instance:
                    query, params = ctx.q.renew_lease, self._lease_params(token)
                elif instance is None or expired or holder_gone:
                    if holder_gone and not expired:
                        log.info("lease holder's session is gone; taking over")
                    query, params = ctx.q.take_lease, self._lease_params()
                else:
                    return None, max(0.0, float(remaining))
                got = conn.execute(query, params).fetchone()
                assert got is not None
                return (int(got[0]), float(got[1])), 0.0

        started = time.monotonic()
        got, remaining = ctx.db.run("lease acquire", tx)
        if got is None:
            return None, remaining
        with self._lock:
            return self._make_lease(got[0], got[1], started), 0.0

    def acquire(self, timeout: float) -> Lease | None:
        ctx = self._ctx
        deadline = time.monotonic() + max(0.0, timeout)
        self._listener.ensure()
        while True:
            self._listener.take([ctx.lease_channel])
            lease, others_left = self._try_acquire()
            if lease is not None:
                return lease
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            # woken by release(); else re-check when the holder's lease should have run out
            wait = min(remaining, ctx.config.poll_interval_s, max(0.01, others_left))
            self._listener.wait([ctx.lease_channel], wait)

    def renew(self) -> Lease:
        ctx = self._ctx
        with self._lock:
            lease = self._lease
            if lease is None:
                raise NotLeaderError(f"coordinator '{self.coordinator_id}' holds no lease")
            started = time.monotonic()
            try:
                row = ctx.db.run(
                    "lease renew",
                    lambda c: c.execute(
                        ctx.q.renew_lease, self._lease_params(lease.token)
                    ).fetchone(),
                    # past the lease's own end, leadership cannot be vouched for anyway
                    timeout=min(ctx.config.retry_timeout_s, max(0.0, lease.expires_at - started)),
                )
            except ChannelError as exc:
                raise NotLeaderError(f"could not renew the lease: {exc}") from exc
            if row is None:
                self._lease = None
                raise NotLeaderError(
                    f"coordinator '{self.coordinator_id}' lost the lease (token {lease.token})"
                )
            return self._make_lease(int(row[0]), float(row[1]), started)

    def release(self) -> None:
        ctx = self._ctx
        with self._lock:
            if self._lease is None:
                return
            self._lease = None

        def tx(conn: Conn) -> None:
            with conn.transaction():
                conn.execute(ctx.q.release_lease, (ctx.group_id, self.instance))
                notify(conn, ctx.lease_channel)

        try:
            ctx.db.run("lease release", tx, timeout=min(5.0, ctx.config.retry_timeout_s))
        except ChannelError as exc:
            # the lease simply runs out; nothing is unsafe about that
            log.warning("could not release the lease, it will expire instead: %s", exc)

    def _token(self) -> int:
        with self._lock:
            if self._lease is None:
                raise NotLeaderError(f"coordinator '{self.coordinator_id}' holds no lease")
            return self._lease.token

    def _check_token(self, conn: Conn, token: int) -> None:
        row = conn.execute(self._ctx.q.lease_token_for_share, (self._ctx.group_id,)).fetchone()
        if row is None or int(row[0]) != token:
            current = None if row is None else int(row[0])
            raise NotLeaderError(
                f"coordinator '{self.coordinator_id}' with token {token} is fenced "
                f"(current token {current})"
            )
