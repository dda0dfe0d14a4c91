"""Topic creation (or the typed error when it is not allowed) and `doctor` warnings, on the real
broker."""

from __future__ import annotations

import uuid

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic  # type: ignore[attr-defined]

from icefloe_kafka import KafkaBackend, TopicMissingError
from icefloe_kafka.clients import STATE_SEGMENT_MS
from icefloe_kafka.embedded import EmbeddedKafkaBroker

from .conftest import BackendMaker


def open_writer(backend: KafkaBackend) -> int:
    """Open (and close) a writer: the first use of a backend, which checks the topics."""
    w = backend.writer("w")
    try:
        return w.open()
    finally:
        w.close()


def unique(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


def topic_settings(admin: AdminClient, topic: str) -> dict[str, str]:
    futures = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, topic)])
    entries = next(iter(futures.values())).result(timeout=20)
    return {k: e.value for k, e in entries.items()}


def create_topic(admin: AdminClient, topic: str, partitions: int, **config: str) -> None:
    for f in admin.create_topics([NewTopic(topic, partitions, 1, config=config)]).values():
        f.result(timeout=20)


@pytest.fixture
def admin(kafka_broker: EmbeddedKafkaBroker) -> AdminClient:
    return AdminClient({"bootstrap.servers": kafka_broker.bootstrap_servers})


def test_missing_topics_are_created_with_the_configured_settings(
    make_backend: BackendMaker, admin: AdminClient
) -> None:
    control = unique("ctl")
    backend = make_backend("g", control_topic=control, partitions=2, retention_ms=123_456_789)
    open_writer(backend)
    topics = admin.list_topics(timeout=20).topics
    assert len(topics[control].partitions) == 2
    assert len(topics[f"{control}-state"].partitions) == 1
    ctl = topic_settings(admin, control)
    assert ctl["retention.ms"] == "123456789"
    assert ctl.get("cleanup.policy", "delete") == "delete"
    state = topic_settings(admin, f"{control}-state")
    assert state["cleanup.policy"] == "compact"
    assert state["segment.ms"] == str(STATE_SEGMENT_MS)


@pytest.mark.parametrize(
    "first_use",
    ["end_position", "channel_id", "writer"],  # end_position: what `icefloe status` asks first
)
def test_every_first_use_creates_the_control_topic_with_the_configured_partitions(
    make_backend: BackendMaker, admin: AdminClient, first_use: str
) -> None:
    """Issue 24 item 5: a coordinator end asked for its end position first got the topic the
    broker auto-creates on a metadata request (4 partitions on the bundled broker), not 2."""
    control = unique("ctl")
    backend = make_backend("g", control_topic=control, partitions=2)
    if first_use == "writer":
        open_writer(backend)
    else:
        channel = backend.coordinator("c")
        try:
            getattr(channel, first_use)()
        finally:
            channel.close()
    topics = admin.list_topics(timeout=20).topics
    assert len(topics[control].partitions) == 2
    assert len(topics[f"{control}-state"].partitions) == 1
    assert not [w for w in backend.doctor() if "partitions" in w]  # doctor agrees


def test_missing_topic_without_permission_to_create_is_a_typed_error(
    make_backend: BackendMaker, admin: AdminClient
) -> None:
    control = unique("ctl")
    backend = make_backend("g", control_topic=control, create_topics=False)
    with pytest.raises(TopicMissingError) as err:
        open_writer(backend)
    assert err.value.topic == control
    assert err.value.key == "coordination.kafka.create_topics"
    assert "create_topics = true" in str(err.value)
    assert control not in admin.list_topics(timeout=20).topics, "nothing may be created"
    with pytest.raises(TopicMissingError):
        backend.coordinator("c").acquire(1.0)
    # an administrator creates them: the same backend now works without creating anything
    create_topic(admin, control, 1, **{"retention.ms": "604800000"})
    create_topic(admin, f"{control}-state", 1, **{"cleanup.policy": "compact"})
    assert open_writer(backend) > 0


def test_doctor_warns_about_settings_that_weaken_guarantees(
    make_backend: BackendMaker, admin: AdminClient
) -> None:
    control = unique("ctl")
    create_topic(admin, control, 2, **{"cleanup.policy": "compact", "retention.ms": "60000"})
    create_topic(admin, f"{control}-state", 1, **{"cleanup.policy": "delete"})
    backend = make_backend("g", control_topic=control, partitions=3, transaction_timeout_ms=900_000)
    warnings = backend.doctor()
    text = "\n".join(warnings)
    assert "replication factor 1" in text  # the test broker has one replica
    assert "cleanup.policy=compact" in text
    assert "keeps events for 60000 ms" in text
    assert "has 2 partitions, configured 3" in text
    assert "state topic" in text
    assert "use compact" in text
    assert "transaction_timeout_ms = 900000" in text


def test_doctor_on_a_healthy_setup_only_reports_the_single_replica(
    make_backend: BackendMaker,
) -> None:
    backend = make_backend("g", control_topic=unique("ctl"))
    assert any("does not exist" in w for w in backend.doctor())
    open_writer(backend)
    warnings = backend.doctor()
    assert warnings
    assert all("replication factor 1" in w for w in warnings), warnings
