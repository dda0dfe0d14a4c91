"""Leader lease: one holder, a token that only grows, takeover on expiry or release, and
fenced leaders refused inside the transactions that write."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from psycopg import sql

from icefloe.channel import Lease
from icefloe.errors import NotLeaderError
from icefloe.events import Event, StartCommit
from icefloe_postgres.listener import Listener
from icefloe_postgres.testing import BackendMaker


def test_one_holder_and_growing_tokens_across_takeovers(make_backend: BackendMaker) -> None:
    b = make_backend(lease_ttl_s=30)
    c1, c2 = b.coordinator("c1"), b.coordinator("c2")
    l1 = c1.acquire(0)
    assert l1 is not None
    assert l1.holder == "c1"
    assert c2.acquire(0.2) is None
    # acquiring again while holding keeps the same token (and renews)
    again = c1.acquire(0)
    assert again is not None
    assert again.token == l1.token
    tokens = [l1.token]
    holder, other = c1, c2
    for _ in range(4):
        holder.release()
        lease = other.acquire(5)
        assert lease is not None
        tokens.append(lease.token)
        holder, other = other, holder
    assert tokens == sorted(tokens)
    assert len(set(tokens)) == len(tokens)


def test_fenced_leader_cannot_store_position_or_broadcast(make_backend: BackendMaker) -> None:
    b = make_backend(lease_ttl_s=30)
    old, new = b.coordinator("old"), b.coordinator("new")
    assert old.acquire(0) is not None
    old.store_position({"0": 5})
    # simulate the old leader being paused past its lease: expire it in the database
    b.db.run(
        "expire",
        lambda c: c.execute(
            sql.SQL(
                "UPDATE {} SET expires_at = clock_timestamp() - interval '1 second'"
                " WHERE group_id = %s"
            ).format(sql.Identifier(b.schema, "leases")),
            (b.group_id,),
        ),
    )
    l2 = new.acquire(5)
    assert l2 is not None
    with pytest.raises(NotLeaderError):
        old.store_position({"0": 9})
    with pytest.raises(NotLeaderError):
        old.broadcast(Event(b.group_id, StartCommit("stale")))
    with pytest.raises(NotLeaderError):
        old.renew()
    assert new.stored_position() == {"0": 5}
    w = b.writer("w")
    w.open()
    new.broadcast(Event(b.group_id, StartCommit("fresh")))
    got = w.poll_broadcasts(5)
    assert [e.payload for e in got] == [StartCommit("fresh")]


def test_takeover_after_the_leader_stops_renewing(make_backend: BackendMaker) -> None:
    b = make_backend(lease_ttl_s=1.0)
    dead, live = b.coordinator("dead"), b.coordinator("live")
    l1 = dead.acquire(0)
    assert l1 is not None
    # the dead leader never renews nor releases; the lease runs out on the database clock
    l2 = live.acquire(20)
    assert l2 is not None
    assert l2.token > l1.token
    with pytest.raises(NotLeaderError):
        dead.renew()


def test_renew_keeps_the_lease(make_backend: BackendMaker) -> None:
    b = make_backend(lease_ttl_s=3.0)
    c1, c2 = b.coordinator("c1"), b.coordinator("c2")
    l1 = c1.acquire(0)
    assert l1 is not None
    renewed = c1.renew()
    assert renewed.token == l1.token
    assert renewed.expires_at >= l1.expires_at
    assert c2.acquire(0) is None


def test_release_wakes_a_waiting_contender_through_notify(
    make_backend: BackendMaker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lease would last 10 minutes and fallback polling is slower than the contender's
    timeout, so only the NOTIFY sent by release() can let it in before it gives up."""
    b = make_backend(lease_ttl_s=600, poll_interval_s=600)
    holder, waiter = b.coordinator("holder"), b.coordinator("waiter")
    assert holder.acquire(0) is not None
    waiting = threading.Event()
    woke: list[bool] = []
    real_wait = Listener.wait

    def wait(self: Listener, channels: Any, timeout: float) -> bool:
        waiting.set()
        result = real_wait(self, channels, timeout)
        woke.append(result)
        return result

    monkeypatch.setattr(Listener, "wait", wait)
    got: list[Lease | None] = []
    t = threading.Thread(target=lambda: got.append(waiter.acquire(60)))
    t.start()
    assert waiting.wait(20), "the contender never waited"
    holder.release()
    t.join(90)
    assert len(got) == 1
    lease = got[0]
    assert lease is not None
    assert lease.holder == "waiter"
    assert woke == [True], "the contender was not woken by NOTIFY"


def test_takeover_at_once_when_the_leaders_session_dies(make_backend: BackendMaker) -> None:
    """The lease would last 10 minutes; the contender gets it because the holder's session
    (its LISTEN connection, recorded in the lease row) no longer exists on the server."""
    b = make_backend(lease_ttl_s=600)
    dead, live = b.coordinator("dead"), b.coordinator("live")
    l1 = dead.acquire(0)
    assert l1 is not None
    assert live.acquire(0) is None, "a live holder's lease was taken"
    session = dead._listener.session()
    assert session is not None
    b.db.run("kill", lambda c: c.execute("SELECT pg_terminate_backend(%s)", (session[0],)))
    l2 = live.acquire(20)
    assert l2 is not None
    assert l2.token > l1.token
    with pytest.raises(NotLeaderError):
        dead.store_position({"0": 1})
