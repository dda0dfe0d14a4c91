"""Errors of the Kafka backend (all are icefloe's typed errors)."""

from __future__ import annotations

from icefloe.errors import ChannelError, ConfigError
from icefloe_kafka.config import SECTION


class TopicMissingError(ConfigError):
    """A topic the backend needs does not exist and could not (or may not) be created."""

    def __init__(self, topic: str, reason: str, fix: str) -> None:
        self.topic = topic
        super().__init__(
            f"{SECTION}.create_topics", f"topic '{topic}' does not exist and {reason}", fix
        )


class BatchTooLargeError(ChannelError):
    """A writer batch holds an event larger than a Kafka record may be; nothing was published.

    Each DataWritten (one table's files of one batch) is one record, and a batch is one
    transaction. Refused before producing, so the batch is published whole or not at all.
    """

    def __init__(self, writer_id: str, table: str, size: int, limit: int) -> None:
        self.writer_id = writer_id
        self.table = table
        self.size = size
        self.limit = limit
        super().__init__(
            f"writer {writer_id}: the batch's DataWritten for table '{table}' is {size:,} bytes, "
            f"above the Kafka record limit of {limit:,} bytes (message.max.bytes); nothing was "
            "published. Write fewer, larger files per batch (fewer rows per trigger or a larger "
            "write.target-file-size-bytes), or raise coordination.kafka.kafka."
            '"message.max.bytes" together with the control topic\'s max.message.bytes'
        )
