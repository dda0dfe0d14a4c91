"""LISTEN/NOTIFY wake-ups on a dedicated connection, with polling as the fallback.

A notification only says "look again": callers always re-query the tables after waking, so a
lost notification (connection drop, server restart) costs at most one fallback interval,
never an event. LISTEN is issued before the caller's first query, so a commit that lands
between that query and the wait still wakes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from collections.abc import Iterable
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql

from icefloe.wakeups import Flag, Wakeups

log = logging.getLogger(__name__)


def channel_name(kind: str, schema: str, group_id: str) -> str:
    """A NOTIFY channel for one pipeline; hashed because identifiers are limited to 63 bytes."""
    digest = hashlib.sha256(f"{schema}\0{group_id}".encode()).hexdigest()[:24]
    return f"icefloe_{kind}_{digest}"


class Listener:
    """One connection LISTENing on a fixed set of channels; thread-safe, reconnects lazily."""

    def __init__(
        self, dsn: str, channels: Iterable[str], connect_kwargs: dict[str, Any] | None = None
    ) -> None:
        self._dsn = dsn
        self._channels = tuple(channels)
        self._kwargs = dict(connect_kwargs or {})
        self._conn: psycopg.Connection[Any] | None = None
        self._pending: set[str] = set()
        self._session: tuple[int, datetime | None] | None = None
        self._lock = threading.Lock()
        self._closed = False

    def ensure(self) -> bool:
        """Make sure the connection is LISTENing; False when the server cannot be reached."""
        with self._lock:
            return self._connect_locked()

    def _connect_locked(self) -> bool:
        if self._closed:
            return False
        if self._conn is not None and not self._conn.closed and not self._conn.broken:
            return True
        self._drop_locked()
        try:
            conn = psycopg.connect(self._dsn, autocommit=True, **self._kwargs)
            for ch in self._channels:
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(ch)))
            row = conn.execute(
                "SELECT backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()"
            ).fetchone()
        except psycopg.Error as exc:
            log.debug("LISTEN connection unavailable (%s); polling instead", type(exc).__name__)
            return False
        self._conn = conn
        self._session = (conn.info.backend_pid, row[0] if row else None)
        # Anything may have happened while we were not listening: make callers look once.
        self._pending.update(self._channels)
        return True

    def session(self) -> tuple[int, datetime | None] | None:
        """(server pid, session start) of the LISTEN connection while it is up: it lives
        exactly as long as this client's session, so others can tell when the client died."""
        with self._lock:
            return self._session if self._conn is not None else None

    def _drop_locked(self) -> None:
        self._session = None
        if self._conn is not None:
            with contextlib.suppress(psycopg.Error):
                self._conn.close()
        self._conn = None

    def take(self, channels: Iterable[str]) -> bool:
        """Consume pending wake-ups for ``channels`` without waiting; True if there were any."""
        wanted = set(channels)
        with self._lock:
            self._collect_locked(0.0)
            hit = bool(self._pending & wanted)
            self._pending -= wanted
            return hit

    def wait(self, channels: Iterable[str], timeout: float) -> bool:
        """Wait up to ``timeout`` s for a notification on one of ``channels``.

        Returns True on a wake-up, False on timeout. Without a connection it sleeps the timeout
        (the caller's fallback poll)."""
        wanted = set(channels)
        deadline = time.monotonic() + max(0.0, timeout)
        with self._lock:
            while True:
                if self._pending & wanted:
                    self._pending -= wanted
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                if not self._connect_locked():
                    break
                self._collect_locked(remaining)
        # No connection: wait out the timeout without holding the lock.
        time.sleep(max(0.0, deadline - time.monotonic()))
        return False

    def _collect_locked(self, timeout: float) -> None:
        conn = self._conn
        if conn is None:
            return
        try:
            for n in conn.notifies(timeout=timeout, stop_after=1):
                self._pending.add(n.channel)
            # gather whatever else is already queued, without blocking
            for n in conn.notifies(timeout=0):
                self._pending.add(n.channel)
        except psycopg.Error as exc:
            log.debug("LISTEN connection lost (%s); will reconnect", type(exc).__name__)
            self._drop_locked()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._drop_locked()


class SharedListener:
    """One LISTEN connection and one thread for every writer of a backend (a process).

    Why: a dedicated LISTEN connection per writer made 256 writers need 256 server connections
    (PostgreSQL's default limit is 100). Here one thread waits for notifications and raises
    every subscriber's :class:`~icefloe.wakeups.Flag`; writers query only when theirs is up.
    The connection is opened by :meth:`ensure` (so LISTEN is in place before the caller's first
    query), re-opened by the next ``ensure`` after a loss (subscribers are woken then, as
    anything may have happened meanwhile), and closed with its last subscriber.
    """

    _WAIT_S = 0.5  # how often the thread looks whether it is still needed

    def __init__(self, dsn: str, channel: str, connect_kwargs: dict[str, Any]) -> None:
        self._dsn = dsn
        self._channel = channel
        self._kwargs = dict(connect_kwargs)
        self.wakeups = Wakeups()
        self._lock = threading.Lock()
        self._conn: psycopg.Connection[Any] | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    def subscribe(self) -> Flag:
        return self.wakeups.subscribe()

    def ensure(self) -> bool:
        """Make sure the shared connection LISTENs; False when the server cannot be reached
        (callers then poll)."""
        with self._lock:
            if self._closed:
                return False
            if self._conn is None:
                try:
                    conn = psycopg.connect(self._dsn, autocommit=True, **self._kwargs)
                    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))
                except psycopg.Error as exc:
                    log.debug("shared LISTEN connection unavailable (%s)", type(exc).__name__)
                    return False
                self._conn = conn
                self.wakeups.wake_all()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, args=(self._conn,), name="icefloe-pg-listen", daemon=True
                )
                self._thread.start()
            return True

    def _run(self, conn: psycopg.Connection[Any]) -> None:
        while True:
            with self._lock:
                if self._closed or not len(self.wakeups) or self._conn is not conn:
                    self._stop_locked(conn)
                    return
            try:
                got = any(True for _ in conn.notifies(timeout=self._WAIT_S, stop_after=1))
                got = any([True for _ in conn.notifies(timeout=0)]) or got  # drain the rest
            except psycopg.Error as exc:
                log.debug("shared LISTEN connection lost (%s); will reconnect", type(exc).__name__)
                with self._lock:
                    self._stop_locked(conn)
                self.wakeups.wake_all()  # look once, and poll until ensure() reconnects
                return
            if got:
                self.wakeups.wake_all()

    def _stop_locked(self, conn: psycopg.Connection[Any]) -> None:
        """The thread ends: close its connection and let ``ensure`` start anew."""
        if self._conn is conn:
            self._conn = None
        if self._thread is threading.current_thread():
            self._thread = None
        with contextlib.suppress(psycopg.Error):
            conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._lock:
            if self._conn is not None:
                self._stop_locked(self._conn)
