"""SASL: the client settings under ``coordination.kafka.kafka`` reach every librdkafka client,
and a broker refusing them says why, without the password.

The bundled broker (Tansu 0.6.0) requires SASL (SCRAM-SHA-512) with ``--authentication``, but
its memory storage keeps no SCRAM credentials (``tansu user create`` answers OK and stores
nothing), so no user can log in: the SCRAM exchange runs and the broker answers
``unknown-user``. That proves the settings reach librdkafka and the broker; a successful login
needs a broker that stores users (Apache Kafka), see docs/backends/kafka.md.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from icefloe.errors import ChannelError
from icefloe_kafka import KafkaBackend
from icefloe_kafka.embedded import EmbeddedKafkaBroker

from .conftest import backend_config_for

pytestmark = pytest.mark.integration  # starts a broker of its own

SECRET = "kafka-pw-Sekrit-9092"
SASL = {
    "security.protocol": "SASL_PLAINTEXT",
    "sasl.mechanism": "SCRAM-SHA-512",
    "sasl.username": "icefloe",
    "sasl.password": SECRET,
}


@pytest.fixture(scope="module")
def authenticating_broker(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EmbeddedKafkaBroker]:
    log = tmp_path_factory.mktemp("tansu-auth") / "broker.log"
    with EmbeddedKafkaBroker(log_path=log, extra_args=("--authentication",)) as broker:
        yield broker


def refusal(broker: EmbeddedKafkaBroker, settings: dict[str, str]) -> str:
    """The error of opening a writer with these client settings (3 s operation timeout)."""
    config = backend_config_for(broker.bootstrap_servers, operation_timeout_s=3.0, kafka=settings)
    backend = KafkaBackend(config, "sasl-test", 2.0)
    try:
        with pytest.raises(ChannelError) as info:
            backend.writer("w").open()
    finally:
        backend.close()
    return str(info.value)


def test_sasl_settings_reach_the_broker_and_its_refusal_is_named_without_the_password(
    authenticating_broker: EmbeddedKafkaBroker, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG):
        message = refusal(authenticating_broker, SASL)
    # the SCRAM exchange ran as the configured user: the broker knows no such user
    assert "SASL SCRAM authentication failed" in message
    assert "unknown-user" in message
    assert "coordination.kafka.kafka" in message  # where the settings to check are
    assert authenticating_broker.log_path is not None
    for text in (message, caplog.text, Path(authenticating_broker.log_path).read_text()):
        assert SECRET not in text


def test_without_sasl_settings_the_broker_refuses_the_client(
    authenticating_broker: EmbeddedKafkaBroker,
) -> None:
    message = refusal(authenticating_broker, {})
    assert "cannot reach the Kafka cluster" in message
    assert "SASL" not in message
