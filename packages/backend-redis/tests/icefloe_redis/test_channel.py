"""The Redis channel against the real server: publish scripts, replay, fencing, leases,
broadcasts, positions, trimming and key naming."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

import pytest
import redis
from redis.crc import key_slot

from icefloe.channel import WriterBatch
from icefloe.errors import ChannelError, EventDecodeError, NotLeaderError, WriterFencedError
from icefloe.events import CommitComplete, Event, StartCommit, WriterRef
from icefloe_redis import RedisBackend, RedisCoordinatorChannel

MakeBatch = Callable[..., WriterBatch]


def test_publish_gives_consecutive_offsets_on_partition_zero(make_backend, batch_of, group_id):
    backend = make_backend()
    w = backend.writer("w1")
    ref = WriterRef("w1", w.open())
    batches = [batch_of(group_id, ref, seq, n_events=2) for seq in range(3)]
    assert all(w.publish(b) for b in batches)

    c = backend.coordinator("c")
    c.seek(None)
    records = c.poll(1.0)
    assert [r.event for r in records] == [e for b in batches for e in b.events]
    assert {r.partition for r in records} == {"0"}
    offsets = [r.offset for r in records]
    assert offsets == list(range(offsets[0], offsets[0] + 9))


def test_replayed_batch_adds_nothing_and_keeps_source_positions(make_backend, batch_of, group_id):
    backend = make_backend()
    w = backend.writer("w1")
    ref = WriterRef("w1", w.open())
    assert w.publish(batch_of(group_id, ref, 7, offset=70)) is True
    assert w.publish(batch_of(group_id, ref, 7, offset=99)) is False

    c = backend.coordinator("c")
    assert len(c.poll(0.5)) == 2
    assert [p.offset for p in w.source_positions()] == [70]
    # a new instance replaying the same key is recognised as well
    w2 = backend.writer("w1")
    assert w2.publish(batch_of(group_id, WriterRef("w1", w2.open()), 7)) is False
    assert c.poll(0.2) == []


def test_replay_of_a_pruned_batch_is_still_recognised(make_backend, batch_of, group_id):
    backend = make_backend()
    w = backend.writer("w1")
    ref = WriterRef("w1", w.open())
    w.publish(batch_of(group_id, ref, 1))
    w.publish(batch_of(group_id, ref, 2))
    c = backend.coordinator("c")
    assert c.acquire(1.0) is not None
    records = c.poll(0.5)
    end = {"0": records[-1].offset + 1}
    c.store_position(end)
    assert c.prune(end) == 4

    assert w.publish(batch_of(group_id, ref, 1)) is False
    assert w.publish(batch_of(group_id, ref, 2)) is False
    assert w.publish(batch_of(group_id, ref, 3)) is True
    assert [r.event.batch_seq for r in c.poll(0.5)] == [3, 3]


def test_batch_keys_are_exact_while_retained(make_backend, batch_of, group_id):
    """Out-of-order batch numbers are separate keys (only a pruned, committed range is
    summarised by its highest batch_seq)."""
    backend = make_backend()
    w = backend.writer("w1")
    ref = WriterRef("w1", w.open())
    assert w.publish(batch_of(group_id, ref, 5)) is True
    assert w.publish(batch_of(group_id, ref, 3)) is True
    assert w.publish(batch_of(group_id, ref, 3)) is False


def test_epochs_grow_and_older_instances_are_fenced(make_backend, batch_of, group_id):
    backend = make_backend()
    old = backend.writer("w1")
    e1 = old.open()
    new = backend.writer("w1")
    e2 = new.open()
    assert e2 > e1
    other = backend.writer("w2")
    other.open()

    with pytest.raises(WriterFencedError):
        old.publish(batch_of(group_id, WriterRef("w1", e1), 1, offset=10))
    with pytest.raises(WriterFencedError):
        old.respond(Event(group_id, CommitComplete("x"), writer=WriterRef("w1", e1)))

    c = backend.coordinator("c")
    assert c.poll(0.2) == []
    assert old.source_positions() == []
    # the fenced attempt did not take the batch key either
    assert new.publish(batch_of(group_id, WriterRef("w1", e2), 1)) is True
    assert other.publish(batch_of(group_id, WriterRef("w2", other.epoch or 0), 1)) is True
    assert len(c.poll(0.5)) == 4


def test_events_of_an_older_epoch_are_refused_by_a_newer_instance(make_backend, batch_of, group_id):
    backend = make_backend()
    first = backend.writer("w1")
    e1 = first.open()
    second = backend.writer("w1")
    second.open()
    with pytest.raises(WriterFencedError):
        second.publish(batch_of(group_id, WriterRef("w1", e1), 1))


def test_publish_needs_open_and_own_identity(make_backend, batch_of, group_id):
    backend = make_backend()
    w = backend.writer("w1")
    with pytest.raises(ChannelError, match="open"):
        w.publish(batch_of(group_id, WriterRef("w1", 1), 1))
    epoch = w.open()
    with pytest.raises(ValueError, match="w2"):
        w.publish(batch_of(group_id, WriterRef("w2", epoch), 1))


def test_a_batch_is_never_visible_in_part(make_backend, batch_of, group_id):
    """A reader polling while batches of 20 events are published sees whole batches only."""
    backend = make_backend()
    w = backend.writer("w1")
    ref = WriterRef("w1", w.open())
    c = backend.coordinator("c")
    n_batches, size = 40, 20
    done = threading.Event()

    def publish() -> None:
        try:
            for seq in range(n_batches):
                w.publish(batch_of(group_id, ref, seq, n_events=size - 1))
        finally:
            done.set()

    t = threading.Thread(target=publish)
    t.start()
    seen: Counter[int] = Counter()
    polls_with_data = 0
    while not done.is_set() or sum(seen.values()) < n_batches * size:
        records = c.poll(0.05, max_records=100_000)
        if records:
            polls_with_data += 1
        per_batch = Counter(r.event.batch_seq for r in records)
        assert set(per_batch.values()) <= {size}, per_batch
        seen.update(per_batch)
    t.join()
    assert seen == dict.fromkeys(range(n_batches), size)
    assert polls_with_data > 1


def rivals(backend: RedisBackend) -> tuple[RedisCoordinatorChannel, RedisCoordinatorChannel]:
    """Coordinators ``a`` and ``b`` of one pipeline, contending for its lease."""
    return backend.coordinator("a"), backend.coordinator("b")


def test_lease_is_exclusive_and_tokens_only_grow(make_backend):
    a, b = rivals(make_backend(lease_ttl_s=0.5))
    lease_a = a.acquire(1.0)
    assert lease_a is not None
    assert lease_a.holder == "a"
    assert b.acquire(0.1) is None
    # acquiring again while holding keeps the token
    assert a.acquire(0.0) == a.lease
    assert a.renew().token == lease_a.token

    lease_b = b.acquire(5.0)  # a stops renewing: b takes over once the lease expires
    assert lease_b is not None
    assert lease_b.token > lease_a.token
    with pytest.raises(NotLeaderError):
        a.renew()
    assert a.lease is None


def test_stale_leader_cannot_store_or_broadcast(make_backend):
    backend = make_backend(lease_ttl_s=0.3)
    a, b = rivals(backend)
    a.acquire(1.0)
    a.store_position({"0": 5})
    lease_b = b.acquire(5.0)
    assert lease_b is not None
    with pytest.raises(NotLeaderError):
        a.store_position({"0": 50})
    a.acquire(0.0)  # a loses the race; it must not get leadership back
    assert a.lease is None
    with pytest.raises(NotLeaderError):
        a.broadcast(Event(backend.group_id, StartCommit("zombie")))
    assert b.stored_position() == {"0": 5}
    b.store_position({"0": 9})
    assert a.stored_position() == {"0": 9}


def test_release_hands_over_at_once(make_backend):
    a, b = rivals(make_backend(lease_ttl_s=30.0))
    lease_a = a.acquire(1.0)
    assert lease_a is not None
    a.release()
    lease_b = b.acquire(0.0)
    assert lease_b is not None
    assert lease_b.token > lease_a.token
    with pytest.raises(NotLeaderError):
        a.store_position({"0": 1})


def test_renew_after_expiry_without_a_successor_keeps_leadership(make_backend):
    """An expired lease nobody took over is renewed: no newer token exists, so this leader is
    still the only one that can commit."""
    backend = make_backend(lease_ttl_s=0.2)
    a = backend.coordinator("a")
    lease = a.acquire(1.0)
    assert lease is not None
    r = redis.Redis.from_url(backend.config.url)
    r.delete(backend.keys.lease)  # as if it expired
    assert a.renew().token == lease.token
    assert r.exists(backend.keys.lease) == 1
    r.close()


def test_broadcasts_reach_writers_opened_before_them(make_backend, group_id):
    backend = make_backend()
    c = backend.coordinator("c")
    c.acquire(1.0)
    c.broadcast(Event(group_id, StartCommit("before")))
    w1, w2 = backend.writer("w1"), backend.writer("w2")
    w1.open()
    w2.open()
    assert w1.poll_broadcasts(0.05) == []
    c.broadcast(Event(group_id, StartCommit("one")))
    c.broadcast(Event(group_id, CommitComplete("one")))
    for w in (w1, w2):
        got = w.poll_broadcasts(1.0)
        assert [type(e.payload).__name__ for e in got] == ["StartCommit", "CommitComplete"]
        assert w.poll_broadcasts(0.05) == []


def test_poll_broadcasts_waits_for_a_late_broadcast(make_backend, group_id):
    backend = make_backend()
    c = backend.coordinator("c")
    c.acquire(1.0)
    w = backend.writer("w1")
    w.open()
    timer = threading.Timer(0.3, lambda: c.broadcast(Event(group_id, StartCommit("late"))))
    timer.start()
    got = w.poll_broadcasts(10.0)  # several XREAD BLOCKs of max_block_s each
    timer.join()
    assert [e.payload for e in got] == [StartCommit("late")]


def test_undecodable_broadcast_entries_are_skipped(make_backend, group_id):
    backend = make_backend()
    w = backend.writer("w1")
    w.open()
    r = redis.Redis.from_url(backend.config.url)
    r.xadd(backend.keys.broadcasts, {"e": b"not an event"})
    r.close()
    c = backend.coordinator("c")
    c.acquire(1.0)
    c.broadcast(Event(group_id, StartCommit("ok")))
    assert [e.payload for e in w.poll_broadcasts(1.0)] == [StartCommit("ok")]


def test_seek_and_stored_position(make_backend, batch_of, group_id):
    backend = make_backend()
    w = backend.writer("w1")
    ref = WriterRef("w1", w.open())
    for seq in range(3):
        w.publish(batch_of(group_id, ref, seq))
    c = backend.coordinator("c")
    assert c.stored_position() is None
    everything = c.poll(0.5)
    assert len(everything) == 6
    c.acquire(1.0)
    middle = {"0": everything[2].offset}
    c.store_position(middle)
    assert c.stored_position() == middle

    c2 = backend.coordinator("c2")
    c2.seek(c.stored_position())
    assert [r.offset for r in c2.poll(0.5)] == [r.offset for r in everything[2:]]
    c2.seek(None)
    assert len(c2.poll(0.5)) == 6


def test_prune_trims_only_committed_events(make_backend, batch_of, group_id, config):
    backend = make_backend(cfg=config.model_copy(update={"retain_committed_events": 1}))
    w = backend.writer("w1")
    ref = WriterRef("w1", w.open())
    for seq in range(4):
        w.publish(batch_of(group_id, ref, seq))
    c = backend.coordinator("c")
    c.acquire(1.0)
    records = c.poll(0.5)
    assert c.prune({"0": records[-1].offset + 1}) == 0  # nothing stored: nothing committed

    c.store_position({"0": records[4].offset})
    # asks for everything, gets what is committed minus the one retained event
    assert c.prune({"0": records[-1].offset + 1}) == 3
    c.seek(None)
    assert [r.offset for r in c.poll(0.5)] == [r.offset for r in records[3:]]
    assert c.prune({"0": records[4].offset}) == 0
    # batch 0 was trimmed whole: its key is summarised by the writer's pruned floor; batch 1
    # keeps an event, so its key stays exact
    assert w.publish(batch_of(group_id, ref, 0)) is False
    assert w.publish(batch_of(group_id, ref, 1)) is False


def test_every_key_of_a_pipeline_shares_one_hash_slot(make_backend, batch_of, group_id):
    backend = make_backend()
    w = backend.writer("w1")
    ref = WriterRef("w1", w.open())
    w.publish(batch_of(group_id, ref, 0))
    c = backend.coordinator("c")
    c.acquire(1.0)
    c.broadcast(Event(group_id, StartCommit("x")))
    records = c.poll(0.5)
    end = {"0": records[-1].offset + 1}
    c.store_position(end)
    c.prune(end)

    r = redis.Redis.from_url(backend.config.url)
    keys = [k.decode() for k in r.scan_iter(match=backend.keys.match_all())]
    r.close()
    prefix = f"{backend.config.key_prefix}:{{{group_id}}}:"
    assert len(keys) >= 9
    assert all(k.startswith(prefix) for k in keys)
    assert {key_slot(k.encode()) for k in keys} == {key_slot(group_id.encode())}


def test_pipelines_are_separate(make_backend, batch_of, group_id):
    a: RedisBackend = make_backend(group=group_id + "-a")
    b: RedisBackend = make_backend(group=group_id + "-b")
    wa = a.writer("w")
    wa.publish(batch_of(a.group_id, WriterRef("w", wa.open()), 0))
    assert b.coordinator("c").poll(0.1) == []
    assert len(a.coordinator("c").poll(0.5)) == 2


def test_an_undecodable_event_stops_the_coordinator_read_there(make_backend, batch_of, group_id):
    """Skipping it could skip a DataWritten: the read stops at the entry until it is removed."""
    backend = make_backend()
    w = backend.writer("w1")
    ref = WriterRef("w1", w.open())
    w.publish(batch_of(group_id, ref, 1))
    r = redis.Redis.from_url(backend.config.url)
    bad_id = f"0-{r.incr(backend.keys.event_seq)}"
    r.xadd(backend.keys.events, {"e": b"garbage"}, id=bad_id)
    w.publish(batch_of(group_id, ref, 2))

    c = backend.coordinator("c")
    assert [rec.event.batch_seq for rec in c.poll(0.5)] == [1, 1]
    for _ in range(2):
        with pytest.raises(EventDecodeError, match=bad_id):
            c.poll(0.1)
    r.xdel(backend.keys.events, bad_id)
    r.close()
    assert [rec.event.batch_seq for rec in c.poll(0.5)] == [2, 2]


def test_resp3_connections_work(make_backend, batch_of, group_id, config):
    """``?protocol=3`` in the URL changes reply shapes (XREAD answers a map)."""
    backend = make_backend(cfg=config.model_copy(update={"url": config.url + "?protocol=3"}))
    w = backend.writer("w1")
    ref = WriterRef("w1", w.open())
    assert w.publish(batch_of(group_id, ref, 1, offset=11))
    c = backend.coordinator("c")
    c.acquire(1.0)
    c.broadcast(Event(group_id, StartCommit("x")))
    assert [r.event.batch_seq for r in c.poll(0.5)] == [1, 1]
    assert [e.payload for e in w.poll_broadcasts(0.5)] == [StartCommit("x")]
    assert [p.offset for p in w.source_positions()] == [11]


def test_more_concurrent_writers_than_pooled_connections_wait_instead_of_failing(make_backend):
    """Many writers in one process share the backend's client: with redis-py's default pool,
    more than 100 concurrent broadcast polls failed with MaxConnectionsError."""
    from icefloe_redis.connection import POOL_MAX_CONNECTIONS

    backend = make_backend()
    writers = [backend.writer(f"w{i}") for i in range(POOL_MAX_CONNECTIONS + 30)]
    for w in writers:
        w.open()
    start = threading.Barrier(len(writers))
    errors = []

    def poll(w):
        start.wait()
        try:
            w.poll_broadcasts(0.3)  # a blocking read: holds a connection for its timeout
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=poll, args=(w,)) for w in writers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
