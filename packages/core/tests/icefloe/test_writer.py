"""WriterClient on the reference channel: what it publishes, how it answers StartCommit, and
how fencing stops it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from icefloe.channel import ChannelRecord, CoordinatorChannel
from icefloe.coordination.writer import WriterClient
from icefloe.errors import ChannelError, WriterFencedError
from icefloe.events import (
    DataComplete,
    DataFileMeta,
    DataWritten,
    Event,
    SourcePosition,
    StartCommit,
    WriterRef,
)
from icefloe.testing.memory import MemoryBackend, MemoryServer, MemoryWriterChannel

GROUP = "writer-tests"


def meta(name: str) -> DataFileMeta:
    return DataFileMeta(path=f"file:///w/{name}.parquet", record_count=3, file_size_in_bytes=30)


@pytest.fixture
def backend(memory_server: MemoryServer) -> MemoryBackend:
    return MemoryBackend(memory_server, GROUP, 5.0)


@pytest.fixture
def leader(backend: MemoryBackend) -> Iterator[CoordinatorChannel]:
    c = backend.coordinator("c")
    assert c.acquire(5) is not None
    c.seek(None)
    yield c
    c.close()


@pytest.fixture
def clients() -> Iterator[list[WriterClient]]:
    made: list[WriterClient] = []
    yield made
    for w in made:
        w.close()


def client(backend: MemoryBackend, made: list[WriterClient], writer_id: str = "w") -> WriterClient:
    w = WriterClient(backend.writer(writer_id), GROUP, writer_id, poll_interval_s=0.02)
    w.start()
    made.append(w)
    return w


def read_until(
    c: CoordinatorChannel, done: Callable[[list[ChannelRecord]], bool]
) -> list[ChannelRecord]:
    got: list[ChannelRecord] = []
    deadline = time.monotonic() + 20
    while not done(got):
        assert time.monotonic() < deadline, f"timed out; read {got}"
        got.extend(c.poll(0.1))
    return got


def answers(commit_id: str) -> Callable[[list[ChannelRecord]], bool]:
    return lambda recs: any(
        isinstance(r.event.payload, DataComplete) and r.event.payload.commit_id == commit_id
        for r in recs
    )


def test_publish_sends_one_data_written_per_table_with_files_then_a_data_complete(
    backend: MemoryBackend, leader: CoordinatorChannel, clients: list[WriterClient]
) -> None:
    w = client(backend, clients)
    pos = [SourcePosition("t", 0, 10, 99)]
    assert w.publish(
        3,
        {"ns.b": [meta("b")], "ns.a": [meta("a1"), meta("a2")], "ns.c": []},
        pos,
        {"ns.a": "uuid-a"},
    )
    recs = read_until(leader, lambda r: len(r) >= 3)
    ref = WriterRef("w", w.epoch or 0)
    assert all(r.event.writer == ref and r.event.batch_seq == 3 for r in recs)
    assert [r.event.payload for r in recs] == [
        DataWritten("ns.a", (meta("a1"), meta("a2")), table_uuid="uuid-a"),
        DataWritten("ns.b", (meta("b"),)),
        DataComplete(tuple(pos)),
    ]


def test_replayed_batch_is_refused_by_the_channel(
    backend: MemoryBackend, clients: list[WriterClient]
) -> None:
    w = client(backend, clients)
    assert w.publish(1, {"ns.a": [meta("x")]}, []) is True
    assert w.publish(1, {"ns.a": [meta("x")]}, []) is False
    restarted = client(backend, clients)
    assert restarted.publish(1, {"ns.a": [meta("y")]}, []) is False


def test_start_commit_is_answered_with_the_newest_positions(
    backend: MemoryBackend, leader: CoordinatorChannel, clients: list[WriterClient]
) -> None:
    w = client(backend, clients)
    w.publish(1, {}, [SourcePosition("t", 0, 5, 100), SourcePosition("t", 1, 7, None)])
    w.publish(2, {}, [SourcePosition("t", 0, 9, 90), SourcePosition("t", 1, 8, 50)])
    leader.broadcast(Event(GROUP, StartCommit("cycle-1")))
    recs = read_until(leader, answers("cycle-1"))
    answer = recs[-1].event
    assert answer.batch_seq == 2
    assert answer.writer == WriterRef("w", w.epoch or 0)
    assert isinstance(answer.payload, DataComplete)
    assert sorted(answer.payload.positions, key=lambda p: p.partition) == [
        SourcePosition("t", 0, 9, 100),
        SourcePosition("t", 1, 8, 50),
    ]


def test_idle_writer_answers_at_once_with_what_it_has(
    backend: MemoryBackend, leader: CoordinatorChannel, clients: list[WriterClient]
) -> None:
    w = client(backend, clients)
    leader.broadcast(Event("another-pipeline", StartCommit("not-ours")))
    leader.broadcast(Event(GROUP, StartCommit("cycle-1")))
    recs = read_until(leader, answers("cycle-1"))
    assert [r.event.payload for r in recs] == [DataComplete((), "cycle-1")]
    assert recs[0].event.batch_seq is None
    assert w.answered == 1


def test_fenced_writer_raises_and_stops_answering(
    backend: MemoryBackend, leader: CoordinatorChannel, clients: list[WriterClient]
) -> None:
    old = client(backend, clients)
    new = client(backend, clients)
    leader.broadcast(Event(GROUP, StartCommit("cycle-1")))
    recs = read_until(leader, answers("cycle-1"))
    deadline = time.monotonic() + 20
    while not old.fenced:
        assert time.monotonic() < deadline, "the old instance never noticed it was fenced"
        time.sleep(0.02)
    with pytest.raises(WriterFencedError):
        old.publish(5, {"ns.a": [meta("z")]}, [])
    assert [r.event.writer for r in recs] == [WriterRef("w", new.epoch or 0)]


def test_fenced_publish_propagates_and_stops_the_responder(
    backend: MemoryBackend, clients: list[WriterClient]
) -> None:
    old = client(backend, clients)
    client(backend, clients)
    with pytest.raises(WriterFencedError):
        old.publish(1, {"ns.a": [meta("z")]}, [])
    assert old.fenced
    with pytest.raises(WriterFencedError):
        old.publish(2, {}, [])


class _FlakyChannel(MemoryWriterChannel):
    """Fails its first broadcast poll, as a backend hiccup would."""

    failures = 1

    def poll_broadcasts(self, timeout: float) -> list[Event]:
        if self.failures:
            self.failures -= 1
            raise ChannelError("injected hiccup")
        return super().poll_broadcasts(timeout)


def test_responder_survives_a_channel_hiccup(
    backend: MemoryBackend, leader: CoordinatorChannel, clients: list[WriterClient]
) -> None:
    w = WriterClient(_FlakyChannel(backend.server, GROUP, "w"), GROUP, "w", poll_interval_s=0.02)
    w.start()
    clients.append(w)
    leader.broadcast(Event(GROUP, StartCommit("cycle-1")))
    read_until(leader, answers("cycle-1"))


def test_publish_before_start_is_an_error(backend: MemoryBackend) -> None:
    w = WriterClient(backend.writer("w"), GROUP, "w")
    with pytest.raises(RuntimeError):
        w.publish(1, {}, [])
