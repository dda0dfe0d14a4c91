"""`icefloe status` reads the Kafka backend's lease and writers without taking part, on the
real broker."""

from __future__ import annotations

import uuid
from typing import Any, cast

import pytest
from confluent_kafka import Consumer

from .conftest import LEASE_TTL_S, BackendMaker


def test_describe_before_anything_ran_knows_no_leader(make_backend: BackendMaker) -> None:
    backend = make_backend(f"describe-{uuid.uuid4().hex[:8]}")
    state = backend.describe()
    assert state.leader is None
    assert state.token is None


def test_describe_reports_the_leader_token_age_and_writers(make_backend: BackendMaker) -> None:
    group = f"describe-{uuid.uuid4().hex[:8]}"
    backend = make_backend(group)
    writer = backend.writer("w-1")
    writer.open()
    coordinator = backend.coordinator("coord-a")
    lease = coordinator.acquire(30.0)
    assert lease is not None
    try:
        # a second backend object, as `icefloe status` opens its own
        state = make_backend(group).describe()
        assert state.leader is not None
        assert state.leader.startswith("coord-a/"), state  # the id and this instance's tag
        assert state.token == lease.token
        assert state.writers == ("w-1",)
        assert state.lease_age_s is not None
        assert state.lease_age_s >= 0
        assert state.lease_expires_in_s is not None
        assert state.lease_expires_in_s <= LEASE_TTL_S + 5  # clock skew allowance
        # read-only: the leader still holds its lease and can renew with the same token
        assert coordinator.renew().token == lease.token
        # another pipeline sharing the state topic sees none of it
        other = make_backend(f"describe-{uuid.uuid4().hex[:8]}").describe()
        assert other.leader is None
        assert other.writers == ()
    finally:
        coordinator.release()
        coordinator.close()
        writer.close()
    after = make_backend(group).describe()
    assert after.leader is None  # released
    assert after.writers == ("w-1",)


class _Recording:
    """A real consumer that records the calls made on it, in order."""

    def __init__(self, consumer: Consumer) -> None:
        self._consumer = consumer
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._consumer, name)
        if callable(attr):
            self.calls.append(name)
        return attr


def test_describe_reads_the_state_topic_with_its_leader_known_and_a_short_fetch_wait(
    make_backend: BackendMaker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The state reader asks its own consumer for the topic's metadata before it assigns the
    partitions: assigned first, librdkafka could look up the start offset before it knew the
    leader and retry only 500 ms later (half a second of `icefloe status`, at random). And
    status's read-once reader waits 10 ms, not ``fetch_wait_max_ms``, for the empty fetch that
    shows it the end."""
    group = f"describe-{uuid.uuid4().hex[:8]}"
    writer = make_backend(group).writer("w-1")
    writer.open()
    backend = make_backend(group)
    made: list[tuple[_Recording, dict[str, Any]]] = []
    real = backend.clients.consumer

    def recording(*args: Any, **kwargs: Any) -> Consumer:
        consumer = _Recording(real(*args, **kwargs))
        made.append((consumer, kwargs))
        return cast(Consumer, consumer)

    monkeypatch.setattr(backend.clients, "consumer", recording)
    try:
        assert backend.describe().writers == ("w-1",)
    finally:
        writer.close()
    [(reader, kwargs)] = made
    assert kwargs["fetch_wait_ms"] == 10
    assert "list_topics" in reader.calls
    assert reader.calls.index("list_topics") < reader.calls.index("assign"), reader.calls
