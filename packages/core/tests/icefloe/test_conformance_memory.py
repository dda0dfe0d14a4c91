"""The conformance suite run against the in-process reference channel (it must pass), and
against deliberately broken variants of it (it must fail): the suite can tell a correct
backend from a wrong one."""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import pytest

from icefloe.testing.conformance import BackendConformance, BackendFactory, StoreRecreator
from icefloe.testing.memory import (
    MemoryBackend,
    MemoryServer,
    recreate_memory_store,
    serve_memory_server,
)


@pytest.fixture(scope="module")
def served_server() -> Iterator[MemoryServer]:
    """One reference server in its own process: forked publisher processes reach it too."""
    with serve_memory_server() as (proxy, _):
        yield proxy


class TestMemoryBackendConformance(BackendConformance):
    @pytest.fixture
    def backend_factory(self, served_server: MemoryServer) -> BackendFactory:
        return lambda group_id, ttl: MemoryBackend(served_server, group_id, ttl)

    @pytest.fixture
    def recreate_store(self) -> StoreRecreator:
        return recreate_memory_store


class _NoWriterFencing(MemoryServer):
    def publish(
        self, group_id: str, writer_id: str, epoch: int, batch_seq: int, events: list[bytes]
    ) -> bool:
        current = self._group(group_id).epochs[writer_id]
        return super().publish(group_id, writer_id, current, batch_seq, events)


class _ReusedToken(MemoryServer):
    def acquire(
        self, group_id: str, holder: str, ttl_s: float, timeout: float
    ) -> tuple[int, float] | None:
        got = super().acquire(group_id, holder, ttl_s, timeout)
        if got is not None:
            self._group(group_id).token = 1
            return 1, got[1]
        return None


class _SkipsOneOnSeek(MemoryServer):
    def read(
        self, group_id: str, start: int, timeout: float, max_records: int
    ) -> tuple[int, list[bytes]]:
        if start > 0 and start == (self._group(group_id).stored or {}).get("0"):
            start += 1  # resumes one event too late
        return super().read(group_id, start, timeout, max_records)


class _Suite(BackendConformance):
    read_timeout_s = 2.0


@pytest.mark.parametrize(
    ("server", "test"),
    [
        (_NoWriterFencing, "test_fenced_writer_publishes_nothing"),
        (_ReusedToken, "test_single_leader_with_growing_fencing_token"),
        (_ReusedToken, "test_lease_takeover_after_leader_dies"),
        (_SkipsOneOnSeek, "test_positions_grow_and_seek_resumes_exactly_after_stored_position"),
    ],
)
def test_suite_fails_a_broken_backend(server: type[MemoryServer], test: str) -> None:
    method = getattr(_Suite(), test)
    given = {
        "backend": MemoryBackend(server(), "broken", 0.5),
        "group_id": "broken",
        "channels": [],
    }
    args = {k: v for k, v in given.items() if k in inspect.signature(method).parameters}
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        method(**args)
