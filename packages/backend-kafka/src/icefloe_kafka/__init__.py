"""Kafka control-topic coordination backend for icefloe (the default)."""

from icefloe_kafka.backend import KafkaBackend
from icefloe_kafka.config import KafkaBackendConfig
from icefloe_kafka.errors import TopicMissingError

__all__ = ["KafkaBackend", "KafkaBackendConfig", "TopicMissingError"]
