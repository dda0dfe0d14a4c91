"""The driver-side publish server and the commit worker's client, over a real Unix socket."""

from __future__ import annotations

import logging
import threading
from multiprocessing.connection import Client

import pytest

from icefloe.events import DataFileMeta, SourcePosition
from icefloe_spark.sink.publish import PublishError, PublishRequest, PublishServer, RemotePublisher


class Recorder:
    """Stands in for the WriterClient: remembers batch keys, answers False on a repeat."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.seen: list[PublishRequest] = []
        self.fail = fail
        self.lock = threading.Lock()

    def publish(self, request: PublishRequest) -> bool:
        if self.fail is not None:
            raise self.fail
        with self.lock:
            repeat = any(r.batch_seq == request.batch_seq for r in self.seen)
            self.seen.append(request)
            return not repeat


def request(seq: int) -> PublishRequest:
    return PublishRequest(
        batch_seq=seq,
        files={
            "db.t": (
                DataFileMeta(
                    path=f"file:///w/{seq}.parquet", record_count=3, file_size_in_bytes=10
                ),
            )
        },
        positions=(SourcePosition("topic", 0, 42, 1000),),
        table_uuids={"db.t": "u-1"},
        records=3,
    )


def test_request_travels_to_the_driver_and_back() -> None:
    recorder = Recorder()
    server = PublishServer(recorder)
    try:
        client = RemotePublisher(server.address, server.secret, timeout_s=10)
        assert client.publish(request(0)) is True
        assert client.publish(request(0)) is False  # a replayed batch reports "already there"
        assert client.publish(request(1)) is True
        assert [r.batch_seq for r in recorder.seen] == [0, 0, 1]
        assert recorder.seen[0] == request(0)
    finally:
        server.close()


def test_publish_failure_fails_the_commit() -> None:
    server = PublishServer(Recorder(fail=RuntimeError("backend down")))
    try:
        with pytest.raises(PublishError, match="backend down"):
            RemotePublisher(server.address, server.secret, timeout_s=10).publish(request(0))
    finally:
        server.close()


def test_wrong_secret_is_refused_and_nothing_is_published() -> None:
    recorder = Recorder()
    server = PublishServer(recorder)
    try:
        with pytest.raises(Exception, match=r"digest|authentication|AuthenticationError"):
            Client(server.address, family="AF_UNIX", authkey=b"not the secret")
        # the server keeps serving after a rejected peer
        assert RemotePublisher(server.address, server.secret, timeout_s=10).publish(request(5))
        assert [r.batch_seq for r in recorder.seen] == [5]
    finally:
        server.close()


def test_stopped_server_makes_the_commit_fail_loudly() -> None:
    server = PublishServer(Recorder())
    address, secret = server.address, server.secret
    server.close()
    with pytest.raises(PublishError, match="cannot reach"):
        RemotePublisher(address, secret, timeout_s=5).publish(request(0))


def test_bad_records_are_reported_once_by_the_driver_naming_only_what_happened(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The line comes from the driver's publisher (the run's log format applies; the sink's
    commit runs in a Python worker), once per batch added, and a skip-mode batch does not
    say `0 dead-lettered to -`."""
    from icefloe.testing.memory import MemoryBackend, MemoryServer
    from icefloe_spark.sink.publish import WriterPublisher

    def request(seq: int, skipped: int, dead_lettered: int) -> PublishRequest:
        return PublishRequest(seq, {}, (), {}, 10, skipped, dead_lettered)

    backend = MemoryBackend(MemoryServer(), "g")
    publisher = WriterPublisher(backend, "g", "w", dead_letter_table="db.dlq").start()
    try:
        with caplog.at_level(logging.WARNING, logger="icefloe_spark"):
            publisher.publish(request(0, 3, 0))
            publisher.publish(request(1, 0, 2))
            publisher.publish(request(1, 0, 2))  # a replay: already said
            publisher.publish(request(2, 0, 0))
    finally:
        publisher.close()
    assert [r.getMessage() for r in caplog.records] == [
        "batch 0: bad records: 3 skipped",
        "batch 1: bad records: 2 dead-lettered to db.dlq",
    ]
    assert [getattr(r, "event", None) for r in caplog.records] == ["bad_records"] * 2
