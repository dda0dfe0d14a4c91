"""Configuration of the Kafka backend: the ``[coordination.kafka]`` section.

Client settings under ``kafka`` pass through to every client the backend makes (producers,
consumers, the admin client), so security settings (``security.protocol``, ``sasl.*``,
``ssl.*``) are given once. Values under secret-looking keys are held as ``SecretStr`` and are
unwrapped only when a client is built, so a printed or logged config never shows them.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from icefloe.config import is_secret_key

SECTION = "coordination.kafka"

# Settings the backend's guarantees depend on: set by the backend, never by the user.
RESERVED_CLIENT_KEYS: dict[str, str] = {
    "bootstrap.servers": "set coordination.kafka.bootstrap_servers instead",
    "group.id": "set coordination.kafka.consumer_group_prefix instead",
    "transactional.id": "set coordination.kafka.transactional_id_prefix instead",
    "transaction.timeout.ms": "set coordination.kafka.transaction_timeout_ms instead",
    "isolation.level": "the backend always reads read_committed",
    "enable.idempotence": "transactions need the idempotent producer; it is always on",
    "enable.auto.commit": "the backend commits offsets only inside transactions",
    "enable.auto.offset.store": "the backend stores no offsets automatically",
    "enable.partition.eof": "the backend sets it per client",
    "auto.offset.reset": "the backend always starts from an explicit offset",
}

DAY_MS = 86_400_000
#: the servers of a backend built without a pipeline (no ``source.bootstrap_servers``)
DEFAULT_BOOTSTRAP_SERVERS = "127.0.0.1:9092"


def is_secret_client_key(key: str) -> bool:
    """Kafka client settings that hold secrets (core's rule plus librdkafka's PEM/OAuth
    keys, whose names do not say so)."""
    k = key.lower()
    return is_secret_key(k) or k.startswith("ssl.key.") or k == "sasl.oauthbearer.config"


class KafkaBackendConfig(BaseModel):
    """Where the control topic lives, how it is created, and client settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bootstrap_servers: str | None = Field(
        default=None,
        min_length=1,
        description="Kafka bootstrap servers of the cluster holding the control topic "
        "(default: the pipeline's source.bootstrap_servers)",
    )
    control_topic: str = Field(
        default="icefloe-control",
        pattern=r"^[A-Za-z0-9._-]{1,249}$",
        description="topic carrying the control events; pipelines may share it",
    )
    state_topic: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9._-]{1,249}$",
        description="compacted topic holding leases, fencing tokens and writer epochs "
        "(default: '<control_topic>-state')",
    )
    partitions: int = Field(default=1, ge=1, description="partitions of a created control topic")
    replication_factor: int = Field(
        default=-1, ge=-1, description="replication of created topics; -1 = broker default"
    )
    retention_ms: int = Field(
        default=7 * DAY_MS,
        ge=-1,
        description="retention.ms of a created control topic; -1 = keep forever",
    )
    min_retention_ms: int = Field(
        default=DAY_MS,
        ge=0,
        description="`doctor` warns when the control topic keeps events for less than this",
    )
    create_topics: bool = Field(
        default=True, description="create missing topics; if false, a missing topic is an error"
    )
    transactional_id_prefix: str = Field(default="icefloe", min_length=1)
    consumer_group_prefix: str = Field(default="icefloe", min_length=1)
    source_consumer_group: str | None = Field(
        default=None,
        description="consumer group that receives the source offsets of each published batch "
        "in the batch's transaction (source topics must be on the same cluster)",
    )
    transaction_timeout_ms: int = Field(default=60_000, ge=1000)
    operation_timeout_s: float = Field(
        default=30.0, gt=0, description="limit of one broker operation (transaction, admin)"
    )
    fetch_wait_max_ms: int = Field(
        default=100, ge=0, description="how long a fetch waits on the broker for new events"
    )
    heartbeat_interval_s: float | None = Field(
        default=None,
        gt=0,
        description="how often the leader writes a lease heartbeat (default: lease TTL / 3)",
    )
    kafka: dict[str, str | SecretStr] = Field(
        default_factory=dict,
        description="librdkafka settings for every client (security.protocol, sasl.*, ssl.*)",
    )

    @field_validator("kafka", mode="before")
    @classmethod
    def _wrap_secrets(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        out: dict[str, Any] = {}
        for key, raw in value.items():
            if key in RESERVED_CLIENT_KEYS:
                raise ValueError(f"'{key}' cannot be set under kafka: {RESERVED_CLIENT_KEYS[key]}")
            if isinstance(raw, bool):  # TOML booleans; librdkafka wants "true"/"false"
                raw = "true" if raw else "false"
            elif isinstance(raw, (int, float)):
                raw = str(raw)
            if is_secret_client_key(key) and not isinstance(raw, SecretStr):
                raw = SecretStr(str(raw))
            out[key] = raw
        return out

    @model_validator(mode="after")
    def _replication(self) -> KafkaBackendConfig:
        if self.replication_factor == 0:
            raise ValueError("replication_factor must be -1 (broker default) or at least 1")
        return self

    @property
    def state_topic_name(self) -> str:
        return self.state_topic or f"{self.control_topic}-state"

    def client_settings(self) -> dict[str, str]:
        """The ``kafka`` pass-through with secrets unwrapped: only for building clients."""
        return {
            k: v.get_secret_value() if isinstance(v, SecretStr) else v
            for k, v in self.kafka.items()
        }
