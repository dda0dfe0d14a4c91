"""Errors of the Kafka backend (all are icefloe's typed errors)."""

from __future__ import annotations

from icefloe.errors import ConfigError
from icefloe_kafka.config import SECTION


class TopicMissingError(ConfigError):
    """A topic the backend needs does not exist and could not (or may not) be created."""

    def __init__(self, topic: str, reason: str, fix: str) -> None:
        self.topic = topic
        super().__init__(
            f"{SECTION}.create_topics", f"topic '{topic}' does not exist and {reason}", fix
        )
