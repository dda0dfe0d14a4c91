"""Kafka control-topic coordination backend for icefloe (the default).

Attributes import on first use (icefloe.plugins.lazy).
"""

from typing import TYPE_CHECKING

from icefloe.plugins.lazy import lazy_exports

if TYPE_CHECKING:
    from icefloe_kafka.backend import KafkaBackend
    from icefloe_kafka.config import KafkaBackendConfig
    from icefloe_kafka.errors import TopicMissingError

__getattr__ = lazy_exports(
    __name__,
    {
        "KafkaBackend": "icefloe_kafka.backend",
        "KafkaBackendConfig": "icefloe_kafka.config",
        "TopicMissingError": "icefloe_kafka.errors",
    },
)
__all__ = ["KafkaBackend", "KafkaBackendConfig", "TopicMissingError"]
