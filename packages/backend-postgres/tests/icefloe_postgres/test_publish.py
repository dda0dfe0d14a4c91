"""Publishing: one transaction with epoch fencing, idempotent batch keys, source positions
stored with the events, and appends serialised so commit order equals offset order."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from icefloe.channel import ChannelRecord, WriterBatch
from icefloe.errors import ChannelError, WriterFencedError
from icefloe.events import DataComplete, DataWritten, Event, SourcePosition, WriterRef
from icefloe.testing.conformance import fake_file, make_batch
from icefloe_postgres import PostgresBackend, PostgresCoordinatorChannel
from icefloe_postgres.testing import BackendMaker
from icefloe_postgres.writer_channel import PostgresWriterChannel

from .conftest import counted, open_writer, reader


def consecutive(offsets: list[int]) -> bool:
    """Offsets follow each other without holes (they start from the clock, not from 0)."""
    return bool(offsets) and offsets == list(range(offsets[0], offsets[0] + len(offsets)))


def read_all(coord: PostgresCoordinatorChannel, want: int, timeout: float = 20.0) -> list[Any]:
    got: list[ChannelRecord] = []
    deadline = time.monotonic() + timeout
    while len(got) < want:
        if time.monotonic() > deadline:
            pytest.fail(f"read {len(got)} of {want} events")
        got.extend(coord.poll(0.2))
    return got


def count_rows(backend: PostgresBackend, table: str) -> int:
    from psycopg import sql

    query = sql.SQL("SELECT count(*) FROM {} WHERE group_id = %s")
    return counted(backend, query.format(sql.Identifier(backend.schema, table)), backend.group_id)


def test_open_fences_older_instance_and_nothing_of_it_is_appended(
    make_backend: BackendMaker,
) -> None:
    b = make_backend()
    old = b.writer("w")
    e1 = old.open()
    new = b.writer("w")
    e2 = new.open()
    assert e2 > e1
    with pytest.raises(WriterFencedError):
        old.publish(make_batch(b.group_id, WriterRef("w", e1), 1))
    with pytest.raises(WriterFencedError):
        old.respond(Event(b.group_id, DataComplete(()), WriterRef("w", e1)))
    assert count_rows(b, "events") == 0
    assert count_rows(b, "batches") == 0
    assert new.publish(make_batch(b.group_id, WriterRef("w", e2), 1)) is True


def test_publish_before_open_is_refused(make_backend: BackendMaker) -> None:
    b = make_backend()
    w = b.writer("never-opened")
    with pytest.raises(ChannelError, match="open"):
        w.publish(make_batch(b.group_id, WriterRef("never-opened", 1), 1))


def test_replayed_batch_key_is_a_no_op_and_positions_are_stored_with_it(
    make_backend: BackendMaker,
) -> None:
    b = make_backend()
    w, ref = open_writer(b)
    batch = make_batch(b.group_id, ref, 3)
    assert w.publish(batch) is True
    assert w.source_positions() == batch.source_positions
    # a restarted writer replays batch 3 with different (newer) positions: nothing changes
    w2 = b.writer("w")
    ref2 = WriterRef("w", w2.open())
    replay = WriterBatch(
        ref2,
        3,
        (Event(b.group_id, DataComplete((SourcePosition("src", 0, 99),)), ref2, 3),),
        (SourcePosition("src", 0, 99),),
    )
    assert w2.publish(replay) is False
    assert w2.publish(replay) is False
    assert w2.source_positions() == batch.source_positions
    assert count_rows(b, "events") == len(batch.events)
    nxt = make_batch(b.group_id, ref2, 4)
    assert w2.publish(nxt) is True
    assert w2.source_positions() == nxt.source_positions


def test_failed_publish_is_all_or_nothing(make_backend: BackendMaker) -> None:
    """An event id that already exists makes the insert fail late in the transaction: neither
    the batch key, nor its source positions, nor any offset survive."""
    b = make_backend()
    w, ref = open_writer(b)
    first = make_batch(b.group_id, ref, 1)
    assert w.publish(first) is True
    clash = WriterBatch(
        ref,
        2,
        (
            Event(b.group_id, DataWritten("ns.a", (fake_file("x"),)), ref, 2),
            first.events[0],  # duplicate event id
        ),
        (SourcePosition("src", 0, 50),),
    )
    with pytest.raises(psycopg.errors.UniqueViolation):
        w.publish(clash)
    assert count_rows(b, "batches") == 1
    assert w.source_positions() == first.source_positions
    good = make_batch(b.group_id, ref, 2)
    assert w.publish(good) is True
    coord = reader(b)
    recs = read_all(coord, len(first.events) + len(good.events))
    assert consecutive([r.offset for r in recs]), "offsets must have no holes"
    assert [r.event.event_id for r in recs] == [e.event_id for e in (*first.events, *good.events)]


def test_retry_after_an_ambiguous_commit_reports_success_and_adds_nothing(
    make_backend: BackendMaker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commit reaches the server but the client sees the connection fail: the retry must
    find the batch already there, say it was published, and not append it twice."""
    b = make_backend()
    w, ref = open_writer(b)
    real_run = b.db.run
    lost_acks = {"publish": 1}

    def run(what: str, fn: Callable[..., Any], timeout: float | None = None) -> Any:
        def lose_ack(conn: psycopg.Connection[Any]) -> Any:
            result = fn(conn)  # committed
            if lost_acks.get(what, 0) > 0:
                lost_acks[what] -= 1
                raise psycopg.OperationalError("server closed the connection unexpectedly")
            return result

        return real_run(what, lose_ack, timeout)

    monkeypatch.setattr(b.db, "run", run)
    batch = make_batch(b.group_id, ref, 1)
    assert w.publish(batch) is True
    assert lost_acks["publish"] == 0
    # the same key from a later call is a replay, not this call's retry
    assert w.publish(batch) is False
    assert count_rows(b, "events") == len(batch.events)
    lost_acks["respond"] = 1
    w.respond(Event(b.group_id, DataComplete((), "c1"), ref))
    assert count_rows(b, "events") == len(batch.events) + 1


def _pause_after_offsets(
    monkeypatch: pytest.MonkeyPatch, writer_id: str
) -> tuple[threading.Event, threading.Event]:
    """Make ``writer_id``'s next publish stop inside its transaction right after it took its
    offsets (the moment a sequence-based log would expose a gap)."""
    took, go = threading.Event(), threading.Event()
    real = PostgresWriterChannel._append

    def append(self: PostgresWriterChannel, *args: Any, **kwargs: Any) -> int:
        first = real(self, *args, **kwargs)
        if self.writer_id == writer_id and not took.is_set():
            took.set()
            assert go.wait(30), "test never released the paused publisher"
        return first

    monkeypatch.setattr(PostgresWriterChannel, "_append", append)
    return took, go


def _waiting_on_lock(backend: PostgresBackend, application_name: str) -> bool:
    query = (
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE application_name = %s AND wait_event_type = 'Lock'"
    )
    return counted(backend, query, application_name) > 0


def test_no_event_becomes_visible_below_a_position_already_read(
    make_backend: BackendMaker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writer A takes its offsets and stalls before commit; writer B publishes meanwhile. B
    must wait for A (commit order == offset order), so a coordinator that reads while A is
    stalled sees neither, and afterwards reads A's batch and then B's, with no offset skipped."""
    app = f"icefloe-order-{random.randrange(1 << 30)}"
    b = make_backend(application_name=app)
    wa, wb = b.writer("a"), b.writer("b")
    ra, rb = WriterRef("a", wa.open()), WriterRef("b", wb.open())
    coord = reader(b)
    assert coord.poll(0) == []
    took, go = _pause_after_offsets(monkeypatch, "a")
    batch_a, batch_b = make_batch(b.group_id, ra, 1), make_batch(b.group_id, rb, 1)
    results: dict[str, bool] = {}
    ta = threading.Thread(target=lambda: results.__setitem__("a", wa.publish(batch_a)))
    ta.start()
    assert took.wait(20)
    tb = threading.Thread(target=lambda: results.__setitem__("b", wb.publish(batch_b)))
    try:
        tb.start()
        # B either queues behind A's lock (correct) or commits past it (the hazard)
        deadline = time.monotonic() + 20
        while not _waiting_on_lock(b, app) and tb.is_alive():
            assert time.monotonic() < deadline, "B's publish neither finished nor waited"
            time.sleep(0.05)
        assert coord.poll(0) == [], "an event became visible while an earlier append was open"
        assert "b" not in results
    finally:
        go.set()
    ta.join(20)
    tb.join(20)
    assert results == {"a": True, "b": True}
    recs = read_all(coord, len(batch_a.events) + len(batch_b.events))
    assert [r.event.event_id for r in recs] == [
        e.event_id for e in (*batch_a.events, *batch_b.events)
    ]
    assert consecutive([r.offset for r in recs])


def test_concurrent_publishers_with_a_concurrent_reader_lose_nothing(
    make_backend: BackendMaker,
) -> None:
    """Several writers publish at once while the coordinator reads in small steps: the reader
    ends with every event exactly once, offsets strictly increasing, every batch contiguous."""
    b = make_backend(pool_max_size=6)
    n_writers, n_batches = 5, 12
    writers = []
    for i in range(n_writers):
        ch = b.writer(f"w{i}")
        writers.append((ch, WriterRef(f"w{i}", ch.open())))
    published: dict[str, list[str]] = {}
    lock = threading.Lock()
    start = threading.Barrier(n_writers + 1)
    errors: list[BaseException] = []

    def publish(ch: PostgresWriterChannel, ref: WriterRef) -> None:
        try:
            start.wait()
            for seq in range(n_batches):
                batch = make_batch(b.group_id, ref, seq, tables=("ns.a", "ns.b"))
                assert ch.publish(batch) is True
                with lock:
                    published.setdefault(ref.writer_id, []).extend(e.event_id for e in batch.events)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=publish, args=w) for w in writers]
    for t in threads:
        t.start()
    coord = reader(b)
    start.wait()
    got: list[ChannelRecord] = []
    while any(t.is_alive() for t in threads):
        got.extend(coord.poll(0.05, max_records=7))
    for t in threads:
        t.join()
    assert errors == []
    total = n_writers * n_batches * 3
    got.extend(read_all(coord, total - len(got)) if len(got) < total else [])
    assert coord.poll(0) == []
    ids = [r.event.event_id for r in got]
    assert len(ids) == total
    assert len(set(ids)) == total
    assert consecutive([r.offset for r in got]), "offsets skipped or reordered"
    for writer_id, expected in published.items():
        mine = [r for r in got if r.event.writer and r.event.writer.writer_id == writer_id]
        assert [r.event.event_id for r in mine] == expected
        # each batch's three events sit at consecutive offsets
        for k in range(0, len(mine), 3):
            assert [r.offset for r in mine[k : k + 3]] == list(
                range(mine[k].offset, mine[k].offset + 3)
            )


def test_a_foreign_row_in_the_log_stops_the_reader_instead_of_being_skipped(
    make_backend: BackendMaker,
) -> None:
    """Skipping an undecodable row could skip a DataWritten: the coordinator must see an
    EventDecodeError at that offset, after every good event before it."""
    from psycopg import sql

    from icefloe.errors import EventDecodeError

    b = make_backend()
    w, ref = open_writer(b)
    batch = make_batch(b.group_id, ref, 1)
    assert w.publish(batch) is True

    def insert_garbage(conn: psycopg.Connection[Any]) -> None:
        with conn.transaction():
            row = conn.execute(b.q.take_offsets, (1, b.group_id, 1)).fetchone()
            assert row is not None
            conn.execute(
                sql.SQL(
                    "INSERT INTO {} (group_id, event_offset, event_id, event_type, payload)"
                    " VALUES (%s, %s, 'junk', 'JUNK', %s)"
                ).format(sql.Identifier(b.schema, "events")),
                (b.group_id, row[0], b"not an event"),
            )

    b.db.run("garbage", insert_garbage)
    coord = reader(b)
    recs = coord.poll(5)
    assert [r.event.event_id for r in recs] == [e.event_id for e in batch.events]
    for _ in range(2):  # it stays stuck there
        with pytest.raises(EventDecodeError, match=f"offset {recs[-1].offset + 1}"):
            coord.poll(1)
