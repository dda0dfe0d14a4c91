"""Building Kafka clients for one backend, creating its topics, and running transactions with
the error handling confluent-kafka documents (retry retriable commits, abort abortable
transactions, report fencing as fencing)."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import (
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicCollection,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]  # stubs

from icefloe.errors import ChannelError
from icefloe.throttle import ThrottledLog
from icefloe_kafka.config import DEFAULT_BOOTSTRAP_SERVERS, SECTION, KafkaBackendConfig
from icefloe_kafka.errors import TopicMissingError

# how long a metadata request that failed on the connection is asked again (existing_topics)
_TRANSPORT_RETRY_S = 2.0


def _transient(exc: KafkaException) -> bool:
    """A failure of the connection to the broker, not an answer from it."""
    err = exc.args[0] if exc.args else None
    return isinstance(err, KafkaError) and err.code() == KafkaError._TRANSPORT


log = logging.getLogger(__name__)

# librdkafka's log, each message at most once a minute (a client retrying an unreachable
# broker repeats its connect failure at every backoff)
_client_log = ThrottledLog(logging.getLogger("icefloe_kafka.librdkafka"))

#: Header naming the pipeline of a record, so readers skip other pipelines' records without
#: decoding them and never mistake a foreign record for their own.
GROUP_HEADER = "icefloe.group"

# Codes meaning "a newer instance with this transactional.id exists". librdkafka reports
# fencing as _FENCED (sometimes fatal, sometimes not); brokers may send either of the others.
FENCED_CODES = frozenset(
    {KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH}
)

# Codes of a broker refusing the client itself (SASL or TLS): librdkafka reports them only to
# the client's error callback, and a request then fails as "broker transport failure".
REFUSED_CODES = frozenset(
    {
        KafkaError._AUTHENTICATION,
        KafkaError.SASL_AUTHENTICATION_FAILED,
        KafkaError.UNSUPPORTED_SASL_MECHANISM,
        KafkaError.ILLEGAL_SASL_STATE,
        KafkaError._SSL,
    }
)

DEFAULT_MESSAGE_MAX_BYTES = 1_000_000  # librdkafka's default message.max.bytes
STATE_SEGMENT_MS = 3_600_000  # roll state segments hourly so compaction can bound them


def kafka_error(exc: BaseException) -> KafkaError | None:
    """The KafkaError inside a KafkaException, if any."""
    if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError):
        return exc.args[0]
    return None


def is_fenced(exc: BaseException) -> bool:
    err = kafka_error(exc)
    return err is not None and err.code() in FENCED_CODES


def record_key(*parts: str) -> bytes:
    """An unambiguous key from parts (a JSON array: ids may contain any character)."""
    return json.dumps(list(parts), separators=(",", ":")).encode()


Headers = list[tuple[str, str | bytes | None]]


def group_headers(group_id: str) -> Headers:
    return [(GROUP_HEADER, group_id.encode())]


def header_group(headers: Headers | dict[str, str | bytes | None] | None) -> str | None:
    """The pipeline named by a record's headers, or None when it has none."""
    items = headers.items() if isinstance(headers, dict) else headers or ()
    for name, value in items:
        if name == GROUP_HEADER and value is not None:
            return value.decode(errors="replace") if isinstance(value, bytes) else value
    return None


def log_bounds(consumer: Consumer, topic: str, partition: int, timeout: float) -> tuple[int, int]:
    """(low, high) watermarks of a partition, asked through ``consumer``, which must be a
    ``read_uncommitted`` one (``KafkaClients.consumer(..., committed=False)``).

    Why not a read_committed consumer: it gets the last stable offset, which an open
    transaction holds back, and Tansu reports both bounds as 0 while any transaction is open
    on the partition (a killed driver leaves one), so positions inside the log look past it."""
    try:
        low, high = consumer.get_watermark_offsets(
            TopicPartition(topic, partition), timeout=timeout
        )
    except KafkaException as exc:
        raise ChannelError(f"cannot read watermarks of {topic}[{partition}]: {exc}") from exc
    return int(low), int(high)


def fetch(consumer: Consumer, max_records: int, timeout: float) -> list[Message]:
    """Up to ``max_records`` records, returning as soon as one is there (or after ``timeout``).

    Why not ``consume(max_records, timeout)`` alone: it waits the whole timeout unless
    ``max_records`` arrive, so every read of a few answers or one broadcast took the full
    timeout (cycles quantised in steps of the coordinator's 0.2 s poll)."""
    first = consumer.poll(max(timeout, 0.0))
    if first is None:
        return []
    return [first, *consumer.consume(max_records - 1, 0)] if max_records > 1 else [first]


class KafkaClients:
    """Every client of one backend is built here, from one config, so the pass-through
    settings reach all of them and the reserved ones cannot be overridden."""

    def __init__(
        self, config: KafkaBackendConfig, group_id: str, source_servers: str | None = None
    ) -> None:
        self.config = config
        self.group_id = group_id
        #: the cluster holding the topics: the section's servers, else the source's
        self.servers = config.bootstrap_servers or source_servers or DEFAULT_BOOTSTRAP_SERVERS
        self._servers_from = (
            f"{SECTION}.bootstrap_servers"
            if config.bootstrap_servers or not source_servers
            else f"source.bootstrap_servers, as {SECTION}.bootstrap_servers is not set"
        )
        self._admin: AdminClient | None = None
        self._lock = threading.Lock()
        self._topics_ready = False
        self._plain: Producer | None = None  # shared by this backend's writers: answers
        self._refused: str | None = None  # why the broker last refused the admin client

    @property
    def control_topic(self) -> str:
        return self.config.control_topic

    @property
    def state_topic(self) -> str:
        return self.config.state_topic_name

    @property
    def timeout(self) -> float:
        return self.config.operation_timeout_s

    def _base(self, role: str) -> dict[str, Any]:
        conf: dict[str, Any] = {
            "bootstrap.servers": self.servers,
            "client.id": f"icefloe-{self.group_id}-{role}",
            "logger": _client_log,
        }
        conf.update(self.config.client_settings())
        return conf

    @property
    def max_record_bytes(self) -> int:
        """The largest record producers may send: librdkafka's message.max.bytes."""
        raw = self.config.client_settings().get("message.max.bytes", DEFAULT_MESSAGE_MAX_BYTES)
        return int(raw)

    def transactional_id(self, member: str) -> str:
        return f"{self.config.transactional_id_prefix}-{self.group_id}-{member}"

    def consumer_group(self, member: str) -> str:
        return f"{self.config.consumer_group_prefix}-{self.group_id}-{member}"

    def producer(self, transactional_id: str, role: str) -> Producer:
        conf = self._base(role)
        conf.update(
            {
                "transactional.id": transactional_id,
                "transaction.timeout.ms": self.config.transaction_timeout_ms,
                "enable.idempotence": True,
            }
        )
        return Producer(conf)

    def send_plain(self, value: bytes, key: bytes, partition: int) -> None:
        """Append one record to the control topic outside any transaction and wait until the
        broker has it; raises :class:`ChannelError` when it could not be delivered.

        One idempotent producer serves every writer of this backend (process): answers of
        many writers produced at once travel in a few requests instead of one transaction
        each (see ``KafkaWriterChannel.respond`` for why no transaction is needed)."""
        with self._lock:
            if self._plain is None:
                conf = self._base("answers")
                # one record per batch (still many batches per request): some brokers (the
                # bundled Tansu 0.6) report a partition's end as the base offset of its last
                # batch + 1, which would put answers past the end the reset check trusts
                conf.update({"enable.idempotence": True, "linger.ms": 2, "batch.num.messages": 1})
                self._plain = Producer(conf)
            producer = self._plain
        done = threading.Event()
        failed: list[KafkaError] = []

        def delivered(err: KafkaError | None, _msg: Any) -> None:
            if err is not None:
                failed.append(err)
            done.set()

        try:
            producer.produce(
                self.control_topic,
                value=value,
                key=key,
                partition=partition,
                headers=group_headers(self.group_id),
                on_delivery=delivered,
            )
        except (KafkaException, BufferError) as exc:
            raise ChannelError(f"cannot send to {self.control_topic}: {exc}") from exc
        deadline = time.monotonic() + self.timeout
        while not done.is_set() and time.monotonic() < deadline:
            producer.poll(0.05)  # serves whichever writer's delivery reports are due
        if failed or not done.is_set():
            why = failed[0].str() if failed else f"no delivery report within {self.timeout}s"
            if failed and failed[0].fatal():
                with self._lock:  # a fatal idempotence error: the next answer gets a new one
                    if self._plain is producer:
                        self._plain = None
            raise ChannelError(f"sending to {self.control_topic}[{partition}] failed: {why}")

    def consumer(
        self,
        group_id: str,
        role: str,
        *,
        eof: bool = False,
        committed: bool = True,
        fetch_wait_ms: int | None = None,
    ) -> Consumer:
        """An assign-mode consumer (never joins its group) reading committed records only
        (``committed=False``: every record; only for looking up the log's high watermark).
        ``fetch_wait_ms``: instead of ``fetch_wait_max_ms``, for a reader that reads to the
        end once (it sees the end only when a fetch there returns empty, after this wait)."""
        wait = self.config.fetch_wait_max_ms if fetch_wait_ms is None else fetch_wait_ms
        conf: dict[str, Any] = {"fetch.wait.max.ms": wait}
        conf.update(self._base(role))
        conf.update(
            {
                "group.id": group_id,
                "isolation.level": "read_committed" if committed else "read_uncommitted",
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "enable.partition.eof": eof,
                "auto.offset.reset": "earliest",
            }
        )
        return Consumer(conf)

    def admin(self) -> AdminClient:
        with self._lock:
            if self._admin is None:
                conf = self._base("admin")
                conf["error_cb"] = self._note_refusal
                self._admin = AdminClient(conf)
            return self._admin

    def _note_refusal(self, err: KafkaError) -> None:
        if err.code() in REFUSED_CODES:
            self._refused = err.str()

    def admin_failed(self, what: str, exc: KafkaException) -> ChannelError:
        """``what`` failed with ``exc``; when the broker refused the client's SASL or TLS
        handshake meanwhile, the error says so (librdkafka reports that only to the error
        callback, which ``poll`` serves) and where the settings are."""
        with self._lock:
            admin = self._admin
        if admin is not None:
            admin.poll(0)
        text = f"{what}: {exc}"
        refused, self._refused = self._refused, None  # reported once, not on later failures
        if refused is not None:
            text += (
                f"; the broker refused the client: {refused} (check security.protocol, "
                "sasl.* and ssl.* under coordination.kafka.kafka)"
            )
        return ChannelError(text)

    def partitions(self, topic: str) -> list[int]:
        """Partition ids of an existing topic. The backend's topics are ensured first: some
        brokers create a topic that a metadata request names, with their default partition
        count (4 on the bundled broker), not the configured one."""
        if topic in (self.control_topic, self.state_topic):
            self.ensure_topics()
        try:
            md = self.admin().list_topics(topic=topic, timeout=self.timeout)
        except KafkaException as exc:
            raise self.admin_failed(f"cannot read metadata of topic '{topic}'", exc) from exc
        t = md.topics.get(topic)
        if t is None or t.error is not None or not t.partitions:
            raise ChannelError(f"topic '{topic}' has no partitions ({t.error if t else 'absent'})")
        return sorted(t.partitions)

    def channel_id(self) -> str:
        """``kafka:<cluster id>/<control topic>/<topic id>`` (the topic id is new whenever the
        topic is created anew)."""
        self.ensure_topics()
        topic = self.control_topic
        admin = self.admin()
        try:
            cluster = admin.list_topics(topic=topic, timeout=self.timeout).cluster_id
            described = admin.describe_topics(TopicCollection([topic]))[topic].result(
                timeout=self.timeout
            )
        except KafkaException as exc:
            raise self.admin_failed(f"cannot describe topic '{topic}'", exc) from exc
        topic_id = described.topic_id
        if topic_id is None:
            raise ChannelError(
                f"the cluster gives topic '{topic}' no topic id (Kafka 2.8+ does); icefloe "
                "needs it to tell a recreated control topic from the original"
            )
        return f"kafka:{cluster}/{topic}/{topic_id}"

    def existing_topics(self, timeout_s: float | None = None) -> dict[str, Any]:
        """All topics of the cluster (metadata of every topic, so nothing is auto-created);
        ``timeout_s`` defaults to the operation timeout."""
        wait = self.timeout if timeout_s is None else timeout_s
        # a refused or dropped connection fails at once (_TRANSPORT), also when it is a blip of
        # a busy broker (seen in CI: one of several publisher processes starting together), so
        # it is asked again for a short while; a cluster that is down still fails within it
        retry_until = time.monotonic() + min(wait, _TRANSPORT_RETRY_S)
        while True:
            try:
                return dict(self.admin().list_topics(timeout=wait).topics)
            except KafkaException as exc:
                if _transient(exc) and time.monotonic() < retry_until:
                    time.sleep(0.2)
                    continue
                where = f"cannot reach the Kafka cluster at {self.servers} ({self._servers_from})"
                failed = self.admin_failed(where, exc)  # names a refused SASL/TLS handshake too
                raise ChannelError(  # Kafka's error once: no chained copy of it
                    f"{failed}. Fix: start it, or set {SECTION}.bootstrap_servers to the "
                    "cluster that holds the control topic"
                ) from None

    def wanted_topics(self) -> list[NewTopic]:
        c = self.config
        control = NewTopic(
            c.control_topic,
            num_partitions=c.partitions,
            replication_factor=c.replication_factor,
            config={"cleanup.policy": "delete", "retention.ms": str(c.retention_ms)},
        )
        state = NewTopic(
            c.state_topic_name,
            num_partitions=1,
            replication_factor=c.replication_factor,
            config={"cleanup.policy": "compact", "segment.ms": str(STATE_SEGMENT_MS)},
        )
        return [control, state]

    def ensure_topics(self) -> None:
        """Create the control and state topics when missing (once per backend)."""
        if self._topics_ready:
            return
        existing = self.existing_topics()
        missing = [t for t in self.wanted_topics() if t.topic not in existing]
        if missing and not self.config.create_topics:
            t = missing[0]
            policy = (t.config or {}).get("cleanup.policy")
            raise TopicMissingError(
                t.topic,
                "create_topics is false",
                f"create it (e.g. kafka-topics.sh --create --topic {t.topic} --partitions "
                f"{t.num_partitions} --config cleanup.policy={policy}) "
                "or set create_topics = true",
            )
        if missing:
            futures = self.admin().create_topics(
                missing, operation_timeout=self.timeout, request_timeout=self.timeout
            )
            for name, future in futures.items():
                try:
                    future.result()
                    log.info("created topic %s", name)
                except KafkaException as exc:
                    err = kafka_error(exc)
                    if err is not None and err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                        continue  # another client created it first
                    if name in self.existing_topics():
                        continue
                    raise TopicMissingError(
                        name,
                        f"creating it failed ({err.str() if err else exc})",
                        "let the backend's principal create topics (ACL CREATE) or have an "
                        "administrator create it with the settings in docs/backends/kafka.md",
                    ) from exc
        self._topics_ready = True

    def close(self) -> None:
        with self._lock:
            self._admin = None  # AdminClient has no close(); dropping it ends its threads
            plain, self._plain = self._plain, None
        if plain is not None:
            plain.flush(self.timeout)


def _abort_quietly(producer: Producer, timeout: float) -> None:
    try:
        producer.abort_transaction(timeout)
    except KafkaException as exc:  # already aborted, fenced or dead: nothing more to undo
        log.debug("abort_transaction failed: %s", exc)


def _raise_failure(
    producer: Producer,
    exc: KafkaException,
    fenced: Callable[[str], ChannelError],
    timeout: float,
) -> None:
    err = kafka_error(exc)
    text = err.str() if err is not None else str(exc)
    if is_fenced(exc):
        raise fenced(text) from exc
    if err is not None and err.txn_requires_abort():
        _abort_quietly(producer, timeout)
        raise ChannelError(f"Kafka transaction aborted, nothing was published: {text}") from exc
    if err is not None and err.fatal():
        raise ChannelError(f"Kafka producer failed for good ({text}); reopen it") from exc
    _abort_quietly(producer, timeout)
    raise ChannelError(f"Kafka transaction failed: {text}") from exc


def run_transaction(
    producer: Producer,
    body: Callable[[], None],
    timeout: float,
    fenced: Callable[[str], ChannelError],
) -> None:
    """Run ``body`` (produce / send offsets) in one transaction and commit it.

    Raises ``fenced(text)`` when a newer instance with the same transactional.id exists, and
    :class:`ChannelError` for every other failure (after aborting what can be aborted).
    """
    deadline = time.monotonic() + timeout
    try:
        producer.begin_transaction()
        body()
    except KafkaException as exc:
        _raise_failure(producer, exc, fenced, timeout)
    except BaseException:
        _abort_quietly(producer, timeout)
        raise
    while True:
        try:
            producer.commit_transaction(max(deadline - time.monotonic(), 0.1))
            return
        except KafkaException as exc:
            err = kafka_error(exc)
            if err is not None and err.retriable() and time.monotonic() < deadline:
                continue  # documented: a retriable commit error means "call commit again"
            _raise_failure(producer, exc, fenced, timeout)
