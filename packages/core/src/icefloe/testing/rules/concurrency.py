"""Rules under concurrency: writers publishing at once from threads of one Backend and from
forked processes with their own Backend while the coordinator reads (visibility order is
position order, no gaps, whole batches), and channels used from threads other than their
creator."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TypeVar

import pytest

from icefloe.channel import Backend, ChannelRecord, CoordinatorChannel
from icefloe.events import DataComplete, Event, StartCommit, WriterRef
from icefloe.testing.rules.support import (
    BackendFactory,
    Channels,
    SuiteBase,
    broken,
    event_ids,
    events_of,
    make_batch,
    opened_backend,
    position_after,
    rule,
)

T = TypeVar("T")


def in_thread(call: Callable[[], T], timeout: float) -> T:
    """Run ``call`` on a new thread and return its result (or raise its exception)."""
    out: list[T] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as exc:  # re-raised on the caller's thread
            err.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if err:
        raise err[0]
    if not out:
        pytest.fail(f"a call on another thread did not return within {timeout}s")
    return out[0]


def publish_run(backend: Backend, group_id: str, writer_id: str, n: int) -> list[list[str]]:
    """Open a writer and publish ``n`` two-table batches; the event ids of each batch."""
    ch = backend.writer(writer_id)
    try:
        ref = WriterRef(writer_id, ch.open())
        out = []
        for seq in range(n):
            batch = make_batch(group_id, ref, seq, tables=("ns.a", "ns.b"))
            if ch.publish(batch) is not True:
                raise AssertionError(f"{writer_id} batch {seq} was refused as a replay")
            out.append([e.event_id for e in batch.events])
        return out
    finally:
        ch.close()


def _publish_in_child(
    factory: BackendFactory, group_id: str, ttl: float, writer_id: str, n: int, conn: Connection
) -> None:
    """Child process: its own Backend from the factory, as a Spark executor builds one."""
    try:
        with opened_backend(factory, group_id, ttl) as backend:
            conn.send(("ok", publish_run(backend, group_id, writer_id, n)))
    except BaseException as exc:  # reported to the parent
        conn.send(("error", repr(exc)))
    finally:
        conn.close()


class ConcurrencyRules(SuiteBase):
    """Order and positions and Atomic batches under concurrent publishers, Threading."""

    def _concurrent_read(
        self, coord: CoordinatorChannel, group_id: str, running: Callable[[], bool]
    ) -> tuple[list[ChannelRecord], dict[str, int | None]]:
        """Read while publishers run (and until the channel is quiet after): this pipeline's
        records, and for each event the poll that returned it - None when that poll was cut by
        ``max_records``, which may legitimately end inside a batch."""
        records: list[ChannelRecord] = []
        poll_of: dict[str, int | None] = {}
        quiet, n = 0, 0
        deadline = time.monotonic() + self.read_timeout_s * 3
        while running() or quiet < 3:
            if time.monotonic() > deadline:
                pytest.fail(f"publishers did not finish within {self.read_timeout_s * 3}s")
            got = coord.poll(0.2, max_records=100)
            n += 1
            for r in got:
                if r.event.group_id == group_id:
                    records.append(r)
                    poll_of[r.event.event_id] = None if len(got) >= 100 else n
            quiet = 0 if (got or running()) else quiet + 1
        return records, poll_of

    def _check_concurrent_visibility(
        self,
        backend: Backend,
        channels: Channels,
        group_id: str,
        read: tuple[list[ChannelRecord], dict[str, int | None]],
        published: dict[str, list[list[str]]],
    ) -> None:
        records, poll_of = read
        wanted = {i for batches in published.values() for b in batches for i in b}
        missing = wanted - {r.event.event_id for r in records}
        # read again from the start: anything that became visible behind the concurrent reader
        # (below a position it had already passed) shows up here but was missed above
        fresh = backend.coordinator("re-reader")
        channels.append(fresh)
        fresh.seek(None)
        again = self.read_until(fresh, group_id, self.has_events(wanted))
        assert not missing, (
            f"{len(missing)} events became visible at positions the reader had already passed "
            "(visibility order must equal position order)"
        )
        last: dict[str, int] = {}
        for r in records:
            assert r.offset > last.get(r.partition, -1), (
                f"poll went backwards or repeated: {r.partition}@{r.offset} after "
                f"{last.get(r.partition)}"
            )
            last[r.partition] = r.offset
        for part in {r.partition for r in records} | {r.partition for r in again}:
            assert [(r.offset, r.event.event_id) for r in again if r.partition == part] == [
                (r.offset, r.event.event_id) for r in records if r.partition == part
            ], f"partition {part} re-read from the start differs from what was read while "
            "publishing (gaps)"
        for writer_id, batches in published.items():
            assert events_of(records, writer_id) == [i for b in batches for i in b], (
                f"writer {writer_id}'s events are not its batches whole and in publish order"
            )
        for b in (b for batches in published.values() for b in batches):
            with broken("Atomic batches"):
                where = {poll_of[e] for e in b}
                assert len(where) == 1 or None in where, (
                    "a batch became visible in parts: its events came in separate polls "
                    f"{sorted(w for w in where if w is not None)}"
                )

    @rule("Order and positions")
    def test_concurrent_publishers_from_threads(
        self, backend: Backend, group_id: str, channels: Channels
    ) -> None:
        """Writer channels of one Backend publish from several threads at once while the
        coordinator reads: no event appears below a position already read, nothing is
        skipped, batches are whole, each writer's batches keep their order."""
        coord, _ = self.leader(backend, channels, "c")
        coord.seek(None)
        published: dict[str, list[list[str]]] = {}
        errors: list[BaseException] = []

        def run(writer_id: str) -> None:
            try:
                published[writer_id] = publish_run(
                    backend, group_id, writer_id, self.concurrent_batches
                )
            except BaseException as exc:  # reported by the test thread
                errors.append(exc)

        threads = [
            threading.Thread(target=run, args=(f"t{i}",), daemon=True)
            for i in range(self.concurrent_writers)
        ]
        for t in threads:
            t.start()
        read = self._concurrent_read(coord, group_id, lambda: any(t.is_alive() for t in threads))
        assert not errors, f"a publisher thread failed: {errors[0]!r}"
        self._check_concurrent_visibility(backend, channels, group_id, read, published)

    @rule("Order and positions")
    def test_concurrent_publishers_from_processes(
        self, backend: Backend, backend_factory: BackendFactory, group_id: str, channels: Channels
    ) -> None:
        """The same with writers in forked child processes, each with its own Backend from the
        factory (how Spark executors publish)."""
        coord, _ = self.leader(backend, channels, "c")
        coord.seek(None)
        ctx = multiprocessing.get_context("fork")
        pipes = []
        procs = []
        for i in range(self.concurrent_writers):
            parent, child = ctx.Pipe(duplex=False)
            args = (backend_factory, group_id, self.lease_ttl_s, f"p{i}", self.concurrent_batches)
            proc = ctx.Process(target=_publish_in_child, args=(*args, child), daemon=True)
            proc.start()
            child.close()
            pipes.append(parent)
            procs.append(proc)
        try:
            try:
                # publishing ends when a child sends its result; closing its clients after
                # that is not what the read must outlast (the finally below reaps them)
                read = self._concurrent_read(
                    coord,
                    group_id,
                    lambda: any(
                        p.is_alive() and not pipe.poll(0)
                        for p, pipe in zip(procs, pipes, strict=True)
                    ),
                )
            except pytest.fail.Exception as exc:
                # say where the publishers were: still publishing, or done but not exited
                where = [
                    f"p{i}: {'result sent' if pipe.poll(0) else 'no result'}, "
                    f"{'alive' if proc.is_alive() else f'exit {proc.exitcode}'}"
                    for i, (pipe, proc) in enumerate(zip(pipes, procs, strict=True))
                ]
                pytest.fail(f"{exc} ({'; '.join(where)})")
            published: dict[str, list[list[str]]] = {}
            for i, pipe in enumerate(pipes):
                assert pipe.poll(self.read_timeout_s), f"child p{i} sent no result"
                status, value = pipe.recv()
                assert status == "ok", f"publisher process p{i} failed: {value}"
                published[f"p{i}"] = value
        finally:
            for proc in procs:
                proc.join(self.read_timeout_s)
                if proc.is_alive():
                    proc.kill()
        self._check_concurrent_visibility(backend, channels, group_id, read, published)

    @rule("Threading")
    def test_channels_work_from_threads_other_than_their_creator(
        self, backend: Backend, group_id: str, channels: Channels
    ) -> None:
        """Every call below runs on a new thread, none on the one that made the channel (the
        writer client and the coordinator call from their own threads)."""
        w = backend.writer("w")
        coord = backend.coordinator("c")
        channels.extend([w, coord])
        ref = WriterRef("w", in_thread(w.open, self.read_timeout_s))
        batch = make_batch(group_id, ref, 0)
        assert in_thread(lambda: w.publish(batch), self.read_timeout_s) is True
        assert in_thread(lambda: coord.acquire(self.read_timeout_s), self.read_timeout_s * 2)
        in_thread(lambda: coord.seek(None), self.read_timeout_s)
        recs = in_thread(
            lambda: self.read_until(coord, group_id, self.has_events(event_ids([batch]))),
            self.read_timeout_s * 2,
        )
        sent = Event(group_id, StartCommit("threads"))
        in_thread(lambda: coord.broadcast(sent), self.read_timeout_s)
        in_thread(lambda: coord.renew(), self.read_timeout_s)
        in_thread(lambda: coord.store_position(position_after(recs)), self.read_timeout_s)
        got = in_thread(
            lambda: self.broadcasts_until(w, lambda evs: sent in evs), self.read_timeout_s * 2
        )
        assert sent in got
        in_thread(lambda: w.respond(Event(group_id, DataComplete((), "threads"), ref, 0)), 20)
        in_thread(coord.release, self.read_timeout_s)
