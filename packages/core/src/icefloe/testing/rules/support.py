"""What the topic modules of the conformance suite share: the rule names and the decorator that
reports a failure as a broken rule, batch and position helpers, and :class:`SuiteBase` - the
settings, fixtures and channel helpers every rule mixin builds on (one base, so each mixin
type-checks on its own and the composed class has one copy of each)."""

from __future__ import annotations

import contextlib
import functools
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeAlias, TypeVar

import pytest
from pyiceberg.catalog.sql import SqlCatalog

from icefloe.channel import (
    METHOD_RULES,
    Backend,
    ChannelPosition,
    ChannelRecord,
    CoordinatorChannel,
    Lease,
    WriterBatch,
    WriterChannel,
    introduced_in,
    upgrade_section,
)
from icefloe.errors import MissingBackendMethodError, NotLeaderError
from icefloe.events import DataComplete, DataFileMeta, DataWritten, Event, SourcePosition, WriterRef
from icefloe.testing.fixtures import make_sqlite_catalog

#: (group_id, lease_ttl_s) -> a new Backend on the shared real server.
BackendFactory = Callable[[str, float], Backend]

#: The channels a test opened, closed at its teardown (the ``channels`` fixture).
Channels: TypeAlias = list[WriterChannel | CoordinatorChannel]

#: backend -> None: delete the store ``backend``'s pipeline lives in, as an operator who drops
#: it would (the ``recreate_store`` fixture a backend's test class provides).
StoreRecreator = Callable[[Backend], None]

#: What a backend's test class provides besides ``backend_factory``, by the name a missing one
#: is reported under (like a missing method), and the rule that needs it.
FIXTURE_RULES = {"recreate_store": "Identity"}

#: The rules of ``docs/backend-authors.md`` (section 1), by the name a failing test reports.
RULES = (
    "Shared store",
    "Epochs and fencing",
    "Atomic batches",
    "Idempotent batches",
    "Order and positions",
    "One leader",
    "Lease clock",
    "Broadcasts",
    "Retention",
    "Pipelines are isolated",
    "Zero timeouts do not block",
    "Identity",
    "Numbering",
    "End position",
    "Bytes",
    "Threading",
    "Probe and describe",
)

#: a missing method (``CoordinatorChannel.channel_id``) or fixture -> the one test that reports
#: it (filled by :func:`rule`); every other test that needs it is skipped, naming that test
REPORTED_BY: dict[str, str] = {}

_F = TypeVar("_F", bound=Callable[..., Any])
_X = TypeVar("_X")


def _prefix(name: str) -> str:
    return f"rule '{name}' of docs/backend-authors.md is broken: "


def missing_in(exc: BaseException) -> tuple[str, ...]:
    """The contract methods (or fixtures) ``exc`` says are missing, looking through its
    causes (a backend may wrap the error); empty when it is another failure."""
    seen: set[int] = set()
    inner: BaseException | None = exc
    while inner is not None and id(inner) not in seen:
        if isinstance(inner, MissingBackendMethodError):
            return inner.missing
        seen.add(id(inner))
        inner = inner.__cause__ or inner.__context__
    return ()


def _not_implemented(name: str) -> str:
    if name in FIXTURE_RULES:
        return (
            f"the `{name}` fixture is not provided by the test class (docs/backend-authors.md, "
            "section 3)"
        )
    added = introduced_in(name)
    new = "" if added is None else f", new in contract {added}: see {upgrade_section(added)}"
    return f"{name}() is not implemented{new}"


def report_missing(name: str | None, reports: Sequence[str], missing: Sequence[str]) -> None:
    """Fail the test that reports a missing method or fixture (under its rule); skip every
    other test that needs it, naming where it is reported: one missing method is one
    failure, not one per test that happens to call it."""
    here = [m for m in missing if m in reports]
    if here and name is not None:
        pytest.fail(_prefix(name) + "; ".join(_not_implemented(m) for m in here))
    where = sorted({f"{m} (by {REPORTED_BY.get(m, 'no test')})" for m in missing})
    pytest.skip(f"needs what is missing and reported elsewhere: {', '.join(where)}")


def _reported(test: Any) -> tuple[str | None, Sequence[str]]:
    return getattr(test, "rule", None), getattr(test, "reports", ())


@contextlib.contextmanager
def broken(name: str | None, reports: Sequence[str] = ()) -> Iterator[None]:
    """Report any failure inside the block as rule ``name`` being broken (the first rule
    named wins when checks nest); a missing method or fixture is reported by the one test
    whose ``reports`` name it and skips the others (:func:`report_missing`). ``name`` None
    (the coordinator scenarios, which rest on every rule): only the latter."""
    assert name is None or name in RULES, f"unknown rule {name!r}"
    try:
        yield
    except Exception as exc:  # any failure breaks the rule
        missing = missing_in(exc)
        if missing:
            report_missing(name, reports, missing)
        if name is None:
            raise
        pytest.fail(f"{_prefix(name)}{type(exc).__name__}: {exc}")
    except pytest.fail.Exception as exc:
        if name is None or str(exc).startswith("rule '"):
            raise
        pytest.fail(f"{_prefix(name)}{exc}")


def rule(name: str | None, reports: Sequence[str] = ()) -> Callable[[_F], _F]:
    """Mark a test as the check of one documented rule: any failure (assertion, timeout or an
    exception of the backend) is reported as that rule being broken, so an author knows which
    paragraph of the docs to read. ``reports``: the methods (``CoordinatorChannel.channel_id``)
    and fixtures this test reports when they are missing; each is reported by one test only.
    ``name`` None: a test of no single rule (skipped when something it needs is missing)."""
    assert name is None or name in RULES, f"unknown rule {name!r}"

    def decorate(test: _F) -> _F:
        @functools.wraps(test)
        def checked(*args: Any, **kwargs: Any) -> Any:
            with broken(name, reports):
                return test(*args, **kwargs)

        for missing in reports:
            assert missing in METHOD_RULES or missing in FIXTURE_RULES, missing
            assert REPORTED_BY.setdefault(missing, test.__name__) == test.__name__, (
                f"{missing} is reported by {REPORTED_BY[missing]} already"
            )
        checked.rule = name  # type: ignore[attr-defined]
        checked.reports = tuple(reports)  # type: ignore[attr-defined]
        return checked  # type: ignore[return-value]

    return decorate


def position_after(records: list[ChannelRecord]) -> dict[str, int]:
    """The position right after ``records`` (next offset per partition)."""
    pos: dict[str, int] = {}
    for r in records:
        pos[r.partition] = max(pos.get(r.partition, 0), r.offset + 1)
    return pos


def assert_same_position(got: ChannelPosition | None, want: ChannelPosition) -> None:
    """Positions are equal when every partition's next offset is (absent means 0)."""
    assert got is not None, f"no stored position, expected {dict(want)}"
    parts = set(got) | set(want)
    assert {p: got.get(p, 0) for p in parts} == {p: want.get(p, 0) for p in parts}, (
        f"stored position {dict(got)} is not {dict(want)}"
    )


def fake_file(name: str) -> DataFileMeta:
    """File metadata for channel-only tests (channels never look inside)."""
    return DataFileMeta(
        path=f"file:///conformance/{name}.parquet", record_count=1, file_size_in_bytes=1
    )


def make_batch(
    group_id: str, ref: WriterRef, seq: int, tables: tuple[str, ...] = ("ns.a",)
) -> WriterBatch:
    """A writer batch like the WriterClient builds: one DataWritten per table, one
    DataComplete."""
    pos = (SourcePosition("src", 0, seq + 1, 1000 + seq),)
    events = [
        Event(group_id, DataWritten(t, (fake_file(f"{ref.writer_id}-{seq}-{t}"),)), ref, seq)
        for t in tables
    ]
    events.append(Event(group_id, DataComplete(pos), ref, seq))
    return WriterBatch(ref, seq, tuple(events), pos)


def event_ids(batches: Sequence[WriterBatch]) -> set[str]:
    """Every event id of the given batches."""
    return {e.event_id for b in batches for e in b.events}


def events_of(records: Iterable[ChannelRecord], writer_id: str) -> list[str]:
    """The event ids ``writer_id`` published among ``records``, in the order read."""
    return [
        r.event.event_id
        for r in records
        if r.event.writer and r.event.writer.writer_id == writer_id
    ]


def refused(*calls: Callable[[], object]) -> None:
    """Each call raises NotLeaderError, made in the order given (a stale leader's first call
    must meet the fence itself, not a flag an earlier refusal set)."""
    for call in calls:
        with pytest.raises(NotLeaderError):
            call()


@contextlib.contextmanager
def opened_backend(factory: BackendFactory, group_id: str, ttl: float) -> Iterator[Backend]:
    """A Backend from the factory, closed afterwards."""
    b = factory(group_id, ttl)
    try:
        yield b
    finally:
        b.close()


class SuiteBase:
    """Settings, fixtures and helpers of every rule mixin; see :mod:`icefloe.testing.conformance`
    for what a backend's subclass provides and may tune."""

    #: lease TTL given to every backend made by the factory
    lease_ttl_s: ClassVar[float] = 1.5
    #: how long a test waits for events, broadcasts or a lease before failing
    read_timeout_s: ClassVar[float] = 20.0

    # ------------------------------------------------------------------ what subclasses provide

    @pytest.fixture
    def backend_factory(self) -> BackendFactory:
        """Override: return ``(group_id, lease_ttl_s) -> Backend`` on the real server."""
        raise NotImplementedError(
            "subclass BackendConformance and provide a `backend_factory` fixture"
        )

    #: True for backends whose pipelines share one log (Kafka's control topic): ``poll`` may
    #: then return other pipelines' events, which the coordinator skips by group id.
    shared_log: ClassVar[bool] = False
    #: writers (threads, and processes) and batches each in the concurrency tests
    concurrent_writers: ClassVar[int] = 3
    concurrent_batches: ClassVar[int] = 8

    # ------------------------------------------------------------------ shared fixtures

    @pytest.fixture
    def group_id(self) -> str:
        return f"conformance-{uuid.uuid4().hex[:12]}"

    @pytest.fixture
    def recreate_store(self) -> StoreRecreator:
        """Override: ``backend -> None`` deletes the store the pipeline of ``backend`` lives
        in, with everything in it, as an operator who drops it would (PostgreSQL: drop the
        schema; Redis: delete the pipeline's keys; Kafka: delete the control topic), so the
        next Backend the factory makes creates it anew. The rules Identity and Numbering use
        it; without it they report it missing (once, like a missing method)."""

        def missing(backend: Backend) -> None:
            raise MissingBackendMethodError("no recreate_store fixture", ("recreate_store",))

        return missing

    @pytest.fixture
    def backend(
        self, backend_factory: BackendFactory, group_id: str, request: pytest.FixtureRequest
    ) -> Iterator[Backend]:
        with self._made(backend_factory, group_id, request) as b:
            yield b

    @pytest.fixture
    def other_backend(
        self, backend_factory: BackendFactory, group_id: str, request: pytest.FixtureRequest
    ) -> Iterator[Backend]:
        """A second Backend object of the same pipeline, as another process would build."""
        with self._made(backend_factory, group_id, request) as b:
            yield b

    @contextlib.contextmanager
    def _made(
        self, factory: BackendFactory, group_id: str, request: pytest.FixtureRequest
    ) -> Iterator[Backend]:
        """A Backend from the factory, closed afterwards. A Backend class missing a method
        fails in the factory, before the test runs: reported as the test would report it
        (:func:`report_missing`)."""
        try:
            b = factory(group_id, self.lease_ttl_s)
        except Exception as exc:
            missing = missing_in(exc)
            if not missing:
                raise
            report_missing(*_reported(request.function), missing)
            raise  # not reached: report_missing fails or skips
        try:
            yield b
        finally:
            b.close()

    @pytest.fixture
    def channels(self) -> Iterator[Channels]:
        """Channels a test opens; closed at teardown (errors ignored: some are fenced or
        'dead')."""
        opened: Channels = []
        yield opened
        for ch in reversed(opened):
            # teardown of channels a test fenced or "killed" may fail; that is expected
            with contextlib.suppress(Exception):
                ch.close()

    @pytest.fixture
    def catalog(self, tmp_path: Path) -> SqlCatalog:
        return make_sqlite_catalog(tmp_path / "iceberg")

    # ------------------------------------------------------------------ helpers

    def writer(
        self, backend: Backend, channels: Channels, writer_id: str
    ) -> tuple[WriterChannel, WriterRef]:
        ch = backend.writer(writer_id)
        channels.append(ch)
        return ch, WriterRef(writer_id, ch.open())

    def publish_one(
        self, backend: Backend, group_id: str, channels: Channels, seq: int
    ) -> tuple[WriterChannel, WriterRef, WriterBatch]:
        """A fresh writer ``w`` and its batch ``seq``, published and accepted."""
        w, ref = self.writer(backend, channels, "w")
        batch = make_batch(group_id, ref, seq)
        assert w.publish(batch) is True
        return w, ref, batch

    def publish_batches(
        self, backend: Backend, group_id: str, channels: Channels, n: int
    ) -> list[WriterBatch]:
        """``n`` batches (seq 0..n-1) published by a fresh writer ``w``, each accepted."""
        w, ref = self.writer(backend, channels, "w")
        batches = [make_batch(group_id, ref, seq) for seq in range(n)]
        for b in batches:
            assert w.publish(b) is True
        return batches

    def leader(
        self, backend: Backend, channels: Channels, name: str
    ) -> tuple[CoordinatorChannel, Lease]:
        ch = backend.coordinator(name)
        channels.append(ch)
        lease = ch.acquire(self.read_timeout_s)
        assert lease is not None, f"{name} could not acquire the lease of a fresh pipeline"
        return ch, lease

    def take_over(
        self, backend: Backend, channels: Channels, name: str, before: Lease, why: str
    ) -> tuple[CoordinatorChannel, Lease]:
        """A new coordinator ``name`` acquires the lease after ``before``'s holder gave it up
        (``why`` says how it must have been freed) with a greater token."""
        ch = backend.coordinator(name)
        channels.append(ch)
        lease = ch.acquire(self.read_timeout_s)
        assert lease is not None, why
        assert lease.token > before.token
        return ch, lease

    def read_from_start(
        self, backend: Backend, channels: Channels, group_id: str, ids: set[str], name: str = "c"
    ) -> tuple[CoordinatorChannel, list[ChannelRecord]]:
        """A new leader ``name`` reads the pipeline from its start until it has read ``ids``;
        the channel and this pipeline's records."""
        coord, _ = self.leader(backend, channels, name)
        coord.seek(None)
        return coord, self.read_until(coord, group_id, self.has_events(ids))

    def read_until(
        self,
        channel: CoordinatorChannel,
        group_id: str,
        done: Callable[[list[ChannelRecord]], bool],
    ) -> list[ChannelRecord]:
        """Poll (this pipeline's records only) until ``done(records)`` or fail at the
        deadline."""
        return self._gather_until(
            lambda: (r for r in channel.poll(0.2) if r.event.group_id == group_id),
            done,
            lambda got: f"read {len(got)} records",
        )

    def broadcasts_until(
        self, channel: WriterChannel, done: Callable[[list[Event]], bool]
    ) -> list[Event]:
        return self._gather_until(
            lambda: channel.poll_broadcasts(0.2),
            done,
            lambda got: f"got {len(got)} broadcasts: {got[:3]}",
        )

    def _gather_until(
        self,
        poll: Callable[[], Iterable[_X]],
        done: Callable[[list[_X]], bool],
        progress: Callable[[list[_X]], str],
    ) -> list[_X]:
        """Gather what ``poll()`` returns until ``done(gathered)``; at the deadline fail,
        saying the ``progress`` made."""
        got: list[_X] = []
        deadline = time.monotonic() + self.read_timeout_s
        while not done(got):
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {self.read_timeout_s}s; {progress(got)}")
            got.extend(poll())
        return got

    @staticmethod
    def has_events(ids: set[str]) -> Callable[[list[ChannelRecord]], bool]:
        return lambda recs: ids <= {r.event.event_id for r in recs}
