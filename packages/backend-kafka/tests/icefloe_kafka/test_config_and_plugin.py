"""Configuration, secrets handling and registration through the ``icefloe`` entry point."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr, ValidationError

from icefloe.config import config_from_dict, redacted_dict
from icefloe.errors import ChannelError, ConfigError
from icefloe.plugins.backends import backend_config, open_backend
from icefloe.plugins.manager import new_plugins
from icefloe.testing.cli import failed_check, write_config
from icefloe_kafka import KafkaBackend, KafkaBackendConfig
from icefloe_kafka.clients import KafkaClients
from icefloe_kafka.embedded import EmbeddedKafkaBroker, free_port

SECRET = "s3cr3t-sasl-pw"


def pipeline(coordination: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": "orders",
        "source": {"topics": ["orders"]},
        "tables": [{"name": "sales.orders"}],
        "coordination": coordination,
    }


def test_kafka_is_the_default_backend_and_comes_from_the_entry_point(
    kafka_broker: EmbeddedKafkaBroker,
) -> None:
    plugins = new_plugins(autoload=True)
    spec = plugins.backend("kafka")
    assert spec.config_model is KafkaBackendConfig
    assert plugins.distributions  # loaded from installed distributions, not by hand
    config = config_from_dict(
        pipeline({"kafka": {"bootstrap_servers": kafka_broker.bootstrap_servers}})
    )
    assert config.coordination.backend == "kafka"
    backend = open_backend(config, plugins)
    try:
        assert isinstance(backend, KafkaBackend)
        assert backend.group_id == "orders"
        assert backend.config.bootstrap_servers == kafka_broker.bootstrap_servers
        assert backend.lease_ttl_s == config.coordination.lease_ttl_s
    finally:
        backend.close()


def test_the_broker_defaults_to_the_sources_servers() -> None:
    """Issue 24 item 4: without [coordination.kafka] bootstrap_servers the backend silently
    used 127.0.0.1:9092, not the cluster the pipeline reads."""
    data = pipeline({})
    data["source"] = {**data["source"], "bootstrap_servers": "source-a:9093,source-b:9093"}
    backend = open_backend(config_from_dict(data), new_plugins(autoload=True))
    try:
        assert isinstance(backend, KafkaBackend)
        assert backend.clients.servers == "source-a:9093,source-b:9093"
    finally:
        backend.close()
    data["coordination"] = {"kafka": {"bootstrap_servers": "control:9092"}}
    backend = open_backend(config_from_dict(data), new_plugins(autoload=True))
    try:
        assert isinstance(backend, KafkaBackend)
        assert backend.clients.servers == "control:9092"  # set explicitly: it wins
    finally:
        backend.close()


def test_doctor_line_for_an_unreachable_broker_names_the_key_and_the_error_once(
    tmp_path: Path,
) -> None:
    """The broker followed the source's servers by default; when it is down, doctor says
    which key to set and prints Kafka's error once (it was printed twice)."""
    port = free_port()  # nothing listens there
    data = pipeline({})
    data["source"] = {**data["source"], "bootstrap_servers": f"127.0.0.1:{port}"}
    data["catalog"] = {"name": "c", "properties": {"type": "sql", "uri": "sqlite://"}}
    line = failed_check(write_config(tmp_path / "p.toml", data), "backend kafka server")
    assert f"cannot reach the Kafka cluster at 127.0.0.1:{port}" in line, line
    assert "coordination.kafka.bootstrap_servers" in line, line
    assert "source.bootstrap_servers" in line, line
    assert line.count("Broker transport failure") == 1, line


def test_status_of_an_unreachable_cluster_waits_the_probe_timeout_not_the_operation_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 24 item 8: `icefloe status` waited the operation timeout (30 s) for a cluster that
    was down; a health check waits at most 2 s per server."""
    cfg = KafkaBackendConfig(bootstrap_servers=f"127.0.0.1:{free_port()}")
    backend = KafkaBackend(cfg, "g")
    asked: list[float | None] = []

    def existing_topics(timeout_s: float | None = None) -> dict[str, object]:
        asked.append(timeout_s)
        return {}

    monkeypatch.setattr(backend.clients, "existing_topics", existing_topics)
    backend.describe()
    backend.probe()
    backend.doctor()
    assert asked == [2.0, 2.0, 2.0]
    backend.close()


def test_wrong_keys_name_the_key_and_the_fix() -> None:
    plugins = new_plugins(autoload=True)
    bad = config_from_dict(pipeline({"kafka": {"partitions": 0}}))
    with pytest.raises(ConfigError) as err:
        backend_config(bad, plugins)
    assert err.value.key == "coordination.kafka.partitions"
    typo = config_from_dict(pipeline({"kafka": {"bootstrap_server": "x:9092"}}))
    with pytest.raises(ConfigError) as err:
        backend_config(typo, plugins)
    assert err.value.key == "coordination.kafka.bootstrap_server"


@pytest.mark.parametrize(
    "key",
    ["isolation.level", "transactional.id", "group.id", "enable.auto.commit", "bootstrap.servers"],
)
def test_settings_the_guarantees_rest_on_cannot_be_overridden(key: str) -> None:
    with pytest.raises(ValidationError, match=key):
        KafkaBackendConfig.model_validate({"kafka": {key: "x"}})


def test_client_settings_pass_through_and_secrets_are_never_shown() -> None:
    cfg = KafkaBackendConfig.model_validate(
        {
            "kafka": {
                "security.protocol": "SASL_SSL",
                "sasl.mechanism": "SCRAM-SHA-512",
                "sasl.username": "icefloe",
                "sasl.password": SECRET,
                "ssl.key.pem": SECRET,
                "socket.keepalive.enable": True,
                "message.max.bytes": 2_000_000,
            }
        }
    )
    assert isinstance(cfg.kafka["sasl.password"], SecretStr)
    assert isinstance(cfg.kafka["ssl.key.pem"], SecretStr)
    settings = cfg.client_settings()
    assert settings["sasl.password"] == SECRET
    assert settings["security.protocol"] == "SASL_SSL"
    assert settings["socket.keepalive.enable"] == "true"
    assert settings["message.max.bytes"] == "2000000"
    for shown in (repr(cfg), str(cfg), str(redacted_dict(cfg)), repr(KafkaBackend(cfg, "g"))):
        assert SECRET not in shown
    # every client the backend builds gets the pass-through settings
    backend = KafkaBackend(cfg, "g")
    conf = backend.clients._base("test")
    assert conf["sasl.username"] == "icefloe"
    assert conf["sasl.password"] == SECRET


def test_unreachable_cluster_errors_and_logs_hide_the_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    cfg = KafkaBackendConfig.model_validate(
        {
            "bootstrap_servers": f"127.0.0.1:{free_port()}",  # nothing listens there
            "operation_timeout_s": 1.0,
            "kafka": {
                "security.protocol": "SASL_PLAINTEXT",
                "sasl.mechanism": "PLAIN",
                "sasl.username": "u",
                "sasl.password": SECRET,
            },
        }
    )
    backend = KafkaBackend(cfg, "g")
    with pytest.raises(ChannelError) as err:
        backend.writer("w").open()
    assert "127.0.0.1" in str(err.value)
    assert SECRET not in str(err.value)
    warnings = backend.doctor()
    assert any("cannot reach" in w for w in warnings)
    assert SECRET not in " ".join(warnings)
    assert SECRET not in caplog.text


def test_state_topic_defaults_next_to_the_control_topic() -> None:
    assert KafkaBackendConfig(control_topic="ctl").state_topic_name == "ctl-state"
    assert KafkaBackendConfig(state_topic="st").state_topic_name == "st"
    with pytest.raises(ValidationError, match="replication_factor"):
        KafkaBackendConfig(replication_factor=0)


def test_heartbeat_interval_must_leave_room_for_a_missed_beat() -> None:
    cfg = KafkaBackendConfig(heartbeat_interval_s=6.0)
    with pytest.raises(ConfigError) as err:
        KafkaBackend(cfg, "g", lease_ttl_s=10.0)
    assert err.value.key == "coordination.kafka.heartbeat_interval_s"
    assert KafkaBackend(cfg, "g", lease_ttl_s=12.0).lease_ttl_s == 12.0


def test_an_unreachable_cluster_logs_its_connect_failure_once_not_at_every_retry(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """librdkafka logs a connect failure at every reconnect backoff: 55 identical ERROR lines in
    a 3 s metadata request, 315 before `icefloe run` said the cluster is unreachable, all
    printed at once above that error. One is enough; the error names the fix."""
    port = free_port()  # nothing listens there
    clients = KafkaClients(KafkaBackendConfig(bootstrap_servers=f"127.0.0.1:{port}"), "g")
    caplog.set_level(logging.ERROR, logger="icefloe_kafka.librdkafka")
    try:
        with pytest.raises(ChannelError, match="cannot reach the Kafka cluster"):
            clients.existing_topics(timeout_s=3.0)
        clients.admin().poll(0)  # librdkafka hands its queued log lines over in a poll
    finally:
        clients.close()
    failures = [r.getMessage() for r in caplog.records if f":{port} failed" in r.getMessage()]
    assert len(failures) == 1, failures
