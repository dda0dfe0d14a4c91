"""The Kafka backend object: hands out writer and coordinator ends for one pipeline, creates
the topics on first use, and checks the cluster setup (``icefloe doctor``)."""

from __future__ import annotations

import logging
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer
from confluent_kafka.admin import ConfigResource  # type: ignore[attr-defined]  # not re-exported in the stubs

from icefloe.channel import Backend, BackendStatus, CoordinatorChannel, WriterChannel
from icefloe.errors import ChannelError, ConfigError
from icefloe_kafka.broadcasts import BroadcastReader
from icefloe_kafka.clients import KafkaClients, group_headers, record_key
from icefloe_kafka.config import SECTION, KafkaBackendConfig
from icefloe_kafka.coordinator_channel import KafkaCoordinatorChannel
from icefloe_kafka.state import pipeline_state
from icefloe_kafka.writer_channel import KafkaWriterChannel

log = logging.getLogger(__name__)

_MAX_SAFE_TXN_TIMEOUT_MS = 300_000


#: how long a health check (`icefloe doctor`, `icefloe status`) waits for a cluster that does
#: not answer: one that is up answers metadata requests in milliseconds
PROBE_TIMEOUT_S = 2.0


class KafkaBackend(Backend):
    """The default coordination backend: a control topic on a Kafka cluster."""

    def __init__(
        self,
        config: KafkaBackendConfig,
        group_id: str,
        lease_ttl_s: float = 10.0,
        *,
        source_servers: str | None = None,  # the default of config.bootstrap_servers
    ):
        beat = config.heartbeat_interval_s
        if beat is not None and beat * 2 > lease_ttl_s:
            # a standby takes over after one TTL without a heartbeat: leave room for one miss
            raise ConfigError(
                f"{SECTION}.heartbeat_interval_s",
                f"must be at most half of coordination.lease_ttl_s ({lease_ttl_s})",
                "lower it or leave it unset (lease TTL / 3)",
                beat,
            )
        self.config = config
        self.group_id = group_id
        self.lease_ttl_s = lease_ttl_s
        self.clients = KafkaClients(config, group_id, source_servers)
        # one broadcast consumer for all writers of this backend (process)
        self.broadcasts = BroadcastReader(self.clients)

    def __repr__(self) -> str:  # the config's kafka settings may hold secrets: never shown
        return (
            f"KafkaBackend(group_id={self.group_id!r}, "
            f"bootstrap_servers={self.clients.servers!r}, "
            f"control_topic={self.config.control_topic!r})"
        )

    def writer(self, writer_id: str) -> WriterChannel:
        return KafkaWriterChannel(self.clients, writer_id, self.broadcasts)

    def coordinator(self, coordinator_id: str) -> CoordinatorChannel:
        return KafkaCoordinatorChannel(
            self.clients, coordinator_id, self.lease_ttl_s, self.config.heartbeat_interval_s
        )

    def close(self) -> None:
        self.broadcasts.close()
        self.clients.close()

    def inject_undecodable(self, data: bytes, writer_id: str) -> None:
        """Conformance-suite hook: a plain (non-transactional) record with this pipeline's
        header and ``writer_id``'s key, so it lands in that writer's partition after its
        events, as a foreign client of the control topic could write it."""
        self.clients.ensure_topics()
        failed: list[KafkaError] = []

        def delivered(err: KafkaError | None, _: Message) -> None:
            if err is not None:
                failed.append(err)

        producer = Producer(self.clients._base("inject"))
        producer.produce(
            self.clients.control_topic,
            value=data,
            key=record_key(self.group_id, writer_id),
            headers=group_headers(self.group_id),
            on_delivery=delivered,
        )
        if producer.flush(self.clients.timeout) or failed:
            raise ChannelError(f"injecting a record failed: {failed or 'not delivered'}")

    # ------------------------------------------------------------------ doctor

    def probe(self) -> None:
        """Metadata of the cluster: read-only, creates nothing (raises ChannelError). Asked
        with a short timeout: a cluster that is up answers in milliseconds, and `icefloe
        doctor` should not wait the whole operation timeout to say that it is down."""
        self.clients.existing_topics(self.probe_timeout_s)

    @property
    def probe_timeout_s(self) -> float:
        return min(self.clients.timeout, PROBE_TIMEOUT_S)

    def describe(self) -> BackendStatus:
        """Leader, token, lease age and writers from the state topic (read-only); a cluster
        that does not answer fails within the probe's timeout, not the operation timeout."""
        return pipeline_state(self.clients, self.lease_ttl_s, self.probe_timeout_s)

    def doctor(self) -> list[str]:
        """Warnings about settings that weaken the guarantees or the recovery window."""
        c = self.config
        warnings: list[str] = []
        if c.transaction_timeout_ms > _MAX_SAFE_TXN_TIMEOUT_MS:
            warnings.append(
                f"transaction_timeout_ms = {c.transaction_timeout_ms}: a writer that dies "
                "inside a transaction blocks read_committed readers of its partition for this "
                "long; keep it at a few minutes at most"
            )
        try:
            existing = self.clients.existing_topics(self.probe_timeout_s)
        except ChannelError as exc:
            return [*warnings, str(exc)]
        for topic in (c.control_topic, c.state_topic_name):
            if topic not in existing:
                warnings.append(
                    f"topic '{topic}' does not exist; "
                    + (
                        "it is created on first use"
                        if c.create_topics
                        else "create_topics is false, so the backend will refuse to start"
                    )
                )
                continue
            meta = existing[topic]
            replicas = min((len(p.replicas) for p in meta.partitions.values()), default=0)
            settings = self._topic_settings(topic, warnings)
            warnings.extend(self._check_topic(topic, len(meta.partitions), replicas, settings))
        return warnings

    def _topic_settings(self, topic: str, warnings: list[str]) -> dict[str, str]:
        resource = ConfigResource(ConfigResource.Type.TOPIC, topic)
        try:
            futures = self.clients.admin().describe_configs(
                [resource], request_timeout=self.clients.timeout
            )
            entries: dict[str, Any] = next(iter(futures.values())).result()
        except KafkaException as exc:
            warnings.append(f"cannot read the configuration of topic '{topic}': {exc}")
            return {}
        return {name: e.value for name, e in entries.items() if e.value is not None}

    def _check_topic(
        self, topic: str, partitions: int, replicas: int, settings: dict[str, str]
    ) -> list[str]:
        c = self.config
        out: list[str] = []
        control = topic == c.control_topic
        if replicas == 1:
            out.append(
                f"topic '{topic}' has replication factor 1: losing one broker loses "
                "uncommitted control events (or the lease state); use 3"
            )
        min_isr = _int(settings.get("min.insync.replicas"))
        if replicas >= 3 and min_isr is not None and min_isr < 2:
            out.append(
                f"topic '{topic}' has min.insync.replicas={min_isr}; set 2 so an acknowledged "
                "transaction survives a broker failure"
            )
        if settings.get("unclean.leader.election.enable") == "true":
            out.append(
                f"topic '{topic}' allows unclean leader election, which can drop committed "
                "events; disable it"
            )
        policy = settings.get("cleanup.policy", "")
        if control:
            if partitions != c.partitions:
                out.append(
                    f"control topic '{topic}' has {partitions} partitions, configured "
                    f"{c.partitions}; never change the partition count while batches are "
                    "uncommitted (a writer's events would move to another partition)"
                )
            if "compact" in policy:
                out.append(
                    f"control topic '{topic}' has cleanup.policy={policy}: compaction deletes "
                    "all but the newest event of each writer, so files are lost; use delete"
                )
            retention = _int(settings.get("retention.ms"))
            if retention is not None and retention != -1 and retention < c.min_retention_ms:
                out.append(
                    f"control topic '{topic}' keeps events for {retention} ms, less than "
                    f"min_retention_ms={c.min_retention_ms}: a coordinator that is down "
                    "longer loses the files announced meanwhile; raise retention.ms"
                )
            size = _int(settings.get("retention.bytes"))
            if size is not None and size != -1:
                out.append(
                    f"control topic '{topic}' has retention.bytes={size}: a burst can delete "
                    "uncommitted events; use time-based retention only (-1)"
                )
        elif policy and "compact" not in policy:
            out.append(
                f"state topic '{topic}' has cleanup.policy={policy}; use compact so lease "
                "and epoch records are kept (and bounded)"
            )
        return out


def _int(value: str | None) -> int | None:
    try:
        return None if value is None else int(value)
    except ValueError:
        return None
