"""LISTEN/NOTIFY wake-ups (with polling only as fallback), reconnecting listeners, broadcasts,
and pruning of committed events."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from icefloe.events import CommitComplete, Event, StartCommit
from icefloe.testing.conformance import make_batch
from icefloe.wakeups import Flag
from icefloe_postgres import PostgresBackend
from icefloe_postgres.listener import Listener
from icefloe_postgres.testing import BackendMaker

from .conftest import counted, open_writer, reader

T = TypeVar("T")


def spy_waits(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Record what every Listener.wait returned: True = woken by NOTIFY, False = timed out."""
    results: list[bool] = []
    real = Listener.wait

    def wait(self: Listener, channels: Any, timeout: float) -> bool:
        woke = real(self, channels, timeout)
        results.append(woke)
        return woke

    monkeypatch.setattr(Listener, "wait", wait)
    return results


def spy_writer_waits(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The same for writers, which wait on their flag of the shared listener."""
    results: list[bool] = []
    real = Flag.wait

    def wait(self: Flag, timeout: float) -> bool:
        woke = real(self, timeout)
        results.append(woke)
        return woke

    monkeypatch.setattr(Flag, "wait", wait)
    return results


def waited_while(delay_s: float, action: Callable[[], object], wait: Callable[[], T]) -> T:
    """What ``wait()`` returns while ``action`` runs on a timer ``delay_s`` into the wait."""
    timer = threading.Timer(delay_s, action)
    timer.start()
    try:
        return wait()
    finally:
        timer.join()


def terminate_sessions(backend: PostgresBackend, application_name: str) -> int:
    return counted(
        backend,
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
        " WHERE application_name = %s AND pid <> pg_backend_pid()",
        application_name,
    )


def test_poll_is_woken_by_the_publishing_transactions_notify(
    make_backend: BackendMaker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # fallback polling slower than the poll timeout: only a NOTIFY can end a wait early
    b = make_backend(poll_interval_s=600)
    w, ref = open_writer(b)
    coord = reader(b)
    waits = spy_waits(monkeypatch)
    batch = make_batch(b.group_id, ref, 1)
    recs = waited_while(0.3, lambda: w.publish(batch), lambda: coord.poll(60))
    assert [r.event.event_id for r in recs] == [e.event_id for e in batch.events]
    assert waits == [True], "the poll was not woken by NOTIFY"


def test_broadcast_wakes_writers_and_they_see_only_later_broadcasts(
    make_backend: BackendMaker, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = make_backend(poll_interval_s=600)
    coord = b.coordinator("c")
    assert coord.acquire(0) is not None
    coord.broadcast(Event(b.group_id, StartCommit("before-open")))
    w = b.writer("w")
    w.open()
    waits = spy_writer_waits(monkeypatch)
    later = Event(b.group_id, CommitComplete("after-open", 42))
    got = waited_while(0.3, lambda: coord.broadcast(later), lambda: w.poll_broadcasts(60))
    assert [e.event_id for e in got] == [later.event_id]
    assert waits == [True]


def test_poll_survives_its_listen_connection_being_killed(make_backend: BackendMaker) -> None:
    app = "icefloe-listen-kill"
    b = make_backend(application_name=app, poll_interval_s=0.2)
    w, ref = open_writer(b)
    coord = reader(b)
    assert coord.poll(0) == []
    assert terminate_sessions(b, app) >= 1
    batch = make_batch(b.group_id, ref, 1)
    assert w.publish(batch) is True
    recs = coord.poll(20)
    assert [r.event.event_id for r in recs] == [e.event_id for e in batch.events]
    # and wake-ups work again on the new connection
    nxt = make_batch(b.group_id, ref, 2)
    recs = waited_while(0.2, lambda: w.publish(nxt), lambda: coord.poll(20))
    assert [r.event.event_id for r in recs] == [e.event_id for e in nxt.events]


def test_operations_survive_every_pooled_connection_being_killed(
    make_backend: BackendMaker,
) -> None:
    app = "icefloe-pool-kill"
    b = make_backend(application_name=app, pool_min_size=2)
    w, ref = open_writer(b)
    coord = reader(b)
    assert coord.acquire(0) is not None
    published: list[str] = []
    for seq in range(4):
        terminate_sessions(b, app)
        batch = make_batch(b.group_id, ref, seq)
        assert w.publish(batch) is True
        published.extend(e.event_id for e in batch.events)
    terminate_sessions(b, app)
    coord.store_position({"0": 3})
    terminate_sessions(b, app)
    got: list[str] = []
    while len(got) < len(published):
        got.extend(r.event.event_id for r in coord.poll(5))
    assert got == published
    assert coord.stored_position() == {"0": 3}


def test_prune_drops_committed_events_and_old_batch_keys_but_keeps_the_newest(
    make_backend: BackendMaker,
) -> None:
    b = make_backend()
    w, ref = open_writer(b)
    batches = [make_batch(b.group_id, ref, seq) for seq in range(4)]
    for batch in batches:
        assert w.publish(batch) is True
    coord = reader(b)
    assert coord.acquire(0) is not None
    base = coord.poll(5)[0].offset  # offsets start from the clock
    coord.store_position({"0": base + 8})
    assert coord.prune({"0": base + 5}) == 5
    coord.seek(None)
    left = coord.poll(5)
    assert [r.offset for r in left] == list(range(base + 5, base + 8))
    assert coord.prune({"0": base + 8}) == 3
    # every batch key is pruned except the newest, which a restarted writer replays
    assert w.publish(batches[-1]) is False
    assert coord.prune({"0": base + 8}) == 0


def test_prune_respects_retention(make_backend: BackendMaker) -> None:
    b = make_backend(retention_s=3600)
    w, ref = open_writer(b)
    batch = make_batch(b.group_id, ref, 1)
    assert w.publish(batch) is True
    coord = b.coordinator("c")
    assert coord.prune({"0": 2}) == 0
    coord.seek(None)
    assert len(coord.poll(5)) == len(batch.events)
