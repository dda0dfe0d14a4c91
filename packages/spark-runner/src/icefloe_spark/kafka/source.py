"""``icefloe-kafka``: a Kafka source for Spark Structured Streaming in Python.

Spark's own Kafka source is a JVM connector that PySpark wheels do not ship; this one uses
PySpark's Python Data Source API and confluent-kafka, and produces the same columns (key,
value, topic, partition, offset, timestamp, timestampType, headers) as Arrow record batches.

Offsets are Spark offsets, ``{"topic": {"partition": next offset}}``, checkpointed by Spark.
A micro-batch reads the fixed range [start, end) of each partition, one Spark input
partition per Kafka partition, so a replayed batch reads exactly the same records (the
exactly-once sink relies on it).

Options (Spark-style names; keys are case-insensitive):

* ``kafka.bootstrap.servers`` (required); every other ``kafka.*`` option goes to the
  confluent-kafka clients without the prefix (e.g. ``kafka.security.protocol``).
* ``subscribe`` (or ``topics``): comma-separated topic names, or ``subscribePattern``: a
  regular expression (Python ``re``) that whole topic names match, re-read at every batch so
  matching topics created later are read too (internal ``__`` topics never match). Exactly
  one of the two.
* ``startingOffsets``: ``earliest`` (default), ``latest``, JSON ``{"topic": {"0": 42}}``
  (-2 = earliest, -1 = latest; partitions not listed start at earliest) or ``table``: resume
  from the ``icefloe.source-offsets`` the pipeline recorded in its Iceberg tables (needs
  ``icefloe.tables``, ``icefloe.groupId``, ``icefloe.catalog.name`` and the catalog's
  properties as ``icefloe.catalog.<key>``). Used only when the query has no checkpoint.
  ``Pipeline`` (``icefloe run``) does not leave it at that: it passes the greater of these
  and the offsets the batches still on the channel reached (see :mod:`icefloe.coordination.resume`).
* ``startingOffsetsByTimestamp``: JSON ``{"topic": {"0": 1700000000000}}`` (epoch ms):
  each listed partition starts at its first record stamped at or after that time (Kafka's
  offsets-for-times lookup), or at its end when none is that new; partitions not listed start
  at earliest. Takes precedence over ``startingOffsets``; used only without a checkpoint.
* ``maxOffsetsPerTrigger`` (or ``maxRecordsPerBatch``): records per micro-batch, shared
  among partitions in proportion to their lag.
* ``failOnDataLoss`` (default true): fail when records between the checkpoint and the
  broker's earliest offset are gone; false: log it and go on from the earliest.
* ``probeHighWatermark`` (``auto``, the default; ``true``; ``false``): learn a partition's
  end from a fetch response, not only from a ListOffsets request, for brokers whose
  ListOffsets lags behind the log end (the embedded Tansu 0.6 answers the last *batch's* base
  offset + 1). ``auto`` probes only partitions whose listed end has not moved since the last
  trigger: while records arrive no probe is made (a lagging end is read by the next
  trigger), and once they stop, one fetch finds a tail the listing hides. On Apache Kafka,
  whose listing is exact, that fetch returns at once with the same end.
* ``pollTimeoutMs`` (default 30000): how long a task waits for records it knows exist.
* ``maxRecordsPerPartition``: split a partition's range of a micro-batch into input
  partitions of at most this many offsets (default: one input partition per Kafka partition).

``icefloe-kafka-ranges`` plans exactly as ``icefloe-kafka`` but its rows are the ranges
themselves (``topic, partition, start, end``), one per input partition: the ``icefloe`` sink
reads each range in its own task (:func:`read_ranges`), so records never cross into the JVM.

New partitions (and topics created after the start) are picked up from their earliest
offset: the batch that discovers one records it at its earliest offset, the next reads it.
"""

from __future__ import annotations

import bisect
import difflib
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, cast, get_args

import numpy as np
import pyarrow as pa
from confluent_kafka import (
    TIMESTAMP_CREATE_TIME,
    TIMESTAMP_LOG_APPEND_TIME,
    Consumer,
    IsolationLevel,
    KafkaError,
    KafkaException,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, OffsetSpec  # type: ignore[attr-defined]
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    ReadMinRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from icefloe.config import matching_topics
from icefloe.errors import ConfigError, IcefloeError
from icefloe_spark.runtime import workergc

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from icefloe.config import PipelineConfig

log = logging.getLogger("icefloe_spark.source")

SOURCE_NAME = "icefloe-kafka"
RANGES_SOURCE_NAME = "icefloe-kafka-ranges"

KAFKA_SCHEMA = StructType(
    [
        StructField("key", BinaryType()),
        StructField("value", BinaryType()),
        StructField("topic", StringType()),
        StructField("partition", IntegerType()),
        StructField("offset", LongType()),
        StructField("timestamp", TimestampType()),
        StructField("timestampType", IntegerType()),
        StructField(
            "headers",
            ArrayType(
                StructType([StructField("key", StringType()), StructField("value", BinaryType())])
            ),
        ),
    ]
)
# exactly what Spark checks returned batches against
KAFKA_ARROW_SCHEMA: pa.Schema = to_arrow_schema(KAFKA_SCHEMA, timezone="UTC")
RANGE_SCHEMA = StructType(
    [
        StructField("topic", StringType()),
        StructField("partition", IntegerType()),
        StructField("start", LongType()),
        StructField("end", LongType()),
    ]
)
RANGE_ARROW_SCHEMA: pa.Schema = to_arrow_schema(RANGE_SCHEMA, timezone="UTC")

EARLIEST, LATEST = -2, -1  # Spark's markers in JSON starting offsets
_READ_BATCH = 20_000

Offsets = dict[str, dict[str, int]]  # topic -> partition (as text, JSON keys) -> next offset
TP = tuple[str, int]


class KafkaSourceError(IcefloeError):
    """The source cannot deliver the records a micro-batch asked for."""


class DataLossError(KafkaSourceError):
    """Records between the last processed offset and the broker's earliest offset are gone."""


# --------------------------------------------------------------------------- options


def _bool(options: Mapping[str, str], key: str, default: bool) -> bool:
    raw = options.get(key.lower())
    if raw is None:
        return default
    if str(raw).lower() in ("true", "false"):
        return str(raw).lower() == "true"
    raise ConfigError(f"option '{key}'", "must be true or false", f"set {key} to true/false", raw)


ProbeMode = Literal["auto", "true", "false"]
PROBE_MODES: tuple[str, ...] = get_args(ProbeMode)


def probe_mode(options: Mapping[str, str]) -> ProbeMode:
    """``probeHighWatermark`` of reader options (any key case): auto, true or false."""
    raw = {k.lower(): v for k, v in options.items()}.get("probehighwatermark", "auto")
    value = str(raw).lower()
    if value in PROBE_MODES:
        return cast(ProbeMode, value)
    raise ConfigError(
        "option 'probeHighWatermark'",
        "must be auto, true or false",
        "leave it unset (auto) or set it to true/false",
        raw,
    )


def _int(options: Mapping[str, str], key: str, default: int | None) -> int | None:
    raw = options.get(key.lower())
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ConfigError(f"option '{key}'", "must be a positive integer", "fix the value", raw)
    return value


@dataclass(frozen=True)
class SourceOptions:
    """The parsed, picklable options of one query's source."""

    bootstrap_servers: str
    topics: tuple[str, ...]
    starting_offsets: str = "earliest"
    topic_pattern: str | None = None  # subscribePattern: whole-name regex instead of topics
    #: startingOffsetsByTimestamp: ``{topic: {partition: epoch ms}}`` (then starting_offsets
    #: is ``"timestamp"``)
    starting_timestamps: Offsets = field(default_factory=dict)
    max_records: int | None = None
    fail_on_data_loss: bool = True
    probe_high_watermark: ProbeMode = "auto"
    poll_timeout_s: float = 30.0
    max_partition_records: int | None = None  # maxRecordsPerPartition: split longer ranges
    client_conf: dict[str, str] = field(default_factory=dict)
    catalog_name: str = "default"
    catalog_properties: dict[str, str] = field(default_factory=dict)
    tables: tuple[str, ...] = ()
    group_id: str | None = None
    branch: str = "main"
    branches: dict[str, str] = field(default_factory=dict)  # tables on another branch

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SourceOptions:
        opts = {str(k).lower(): str(v) for k, v in options.items()}
        servers = opts.get("kafka.bootstrap.servers")
        if not servers:
            raise ConfigError(
                "option 'kafka.bootstrap.servers'",
                "is required",
                '.option("kafka.bootstrap.servers", "host:9092")',
            )
        raw_topics = opts.get("subscribe", opts.get("topics", ""))
        topics = tuple(t.strip() for t in raw_topics.split(",") if t.strip())
        pattern = opts.get("subscribepattern") or None
        if bool(topics) == (pattern is not None):
            raise ConfigError(
                "option 'subscribe' / 'subscribePattern'",
                "exactly one of them must be given",
                '.option("subscribe", "topic1,topic2") or .option("subscribePattern", "orders-.*")',
                raw_topics or pattern,
            )
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ConfigError(
                    "option 'subscribePattern'",
                    f"is not a regular expression ({exc})",
                    "fix the pattern (Python re syntax, matched against whole topic names)",
                    pattern,
                ) from None
        starting = opts.get("startingoffsets", "earliest").strip()
        if starting.lower() in ("earliest", "latest", "table"):
            starting = starting.lower()
        else:
            _parse_offsets_json(starting)  # validate now, at query start
        stamps_raw = opts.get("startingoffsetsbytimestamp")
        stamps: Offsets = {}
        if stamps_raw:  # takes precedence over startingOffsets, as in Spark's Kafka source
            stamps = _parse_offsets_json(stamps_raw, "startingOffsetsByTimestamp")
            starting = "timestamp"
        tables = tuple(t.strip() for t in opts.get("icefloe.tables", "").split(",") if t.strip())
        group_id = opts.get("icefloe.groupid")
        if starting == "table" and (not tables or not group_id):
            raise ConfigError(
                "option 'startingOffsets'",
                "'table' needs the options icefloe.tables and icefloe.groupId",
                "set them to the pipeline's tables (comma-separated) and name",
                starting,
            )
        max_records = _int(opts, "maxOffsetsPerTrigger", None)
        max_records = _int(opts, "maxRecordsPerBatch", max_records)
        poll_ms = _int(opts, "pollTimeoutMs", 30_000)
        prefix = "icefloe.catalog."
        return cls(
            bootstrap_servers=servers,
            topics=topics,
            topic_pattern=pattern,
            starting_offsets=starting,
            starting_timestamps=stamps,
            max_records=max_records,
            fail_on_data_loss=_bool(opts, "failOnDataLoss", True),
            probe_high_watermark=probe_mode(opts),
            poll_timeout_s=(poll_ms or 30_000) / 1000.0,
            max_partition_records=_int(opts, "maxRecordsPerPartition", None),
            client_conf={
                k[len("kafka.") :]: v
                for k, v in opts.items()
                if k.startswith("kafka.") and k != "kafka.bootstrap.servers"
            },
            catalog_name=opts.get("icefloe.catalog.name", "default"),
            catalog_properties={
                k[len(prefix) :]: v
                for k, v in opts.items()
                if k.startswith(prefix) and k != "icefloe.catalog.name"
            },
            tables=tables,
            group_id=group_id,
            branch=opts.get("icefloe.branch", "main"),
            branches=json.loads(opts.get("icefloe.branches", "{}")),
        )

    def subscribed(self, names: Iterable[str]) -> list[str]:
        """The topics among ``names`` this query reads."""
        return matching_topics(names, self.topics, self.topic_pattern)

    def _base_conf(self) -> dict[str, Any]:
        return {
            "bootstrap.servers": self.bootstrap_servers,
            "logger": logging.getLogger("icefloe_spark.kafka"),
        }

    def consumer_conf(self) -> dict[str, Any]:
        """Consumer settings: the user's ``kafka.*`` options, then what bounded reads need."""
        conf: dict[str, Any] = {
            "group.id": f"icefloe-source-{uuid.uuid4().hex}",  # required; never joined
            # reads are bounded: at a range's or the log's end, a fetch that waits for more
            # data (500 ms by default) only delays the EOF that ends the read
            "fetch.wait.max.ms": 10,
            **self._base_conf(),
            **self.client_conf,
        }
        conf.update(
            {
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "enable.partition.eof": True,
                "auto.offset.reset": "error" if self.fail_on_data_loss else "earliest",
            }
        )
        return conf

    def admin_conf(self) -> dict[str, Any]:
        # consumer-only options would only draw warnings from an admin client
        shared = ("security.", "sasl.", "ssl.", "client.", "socket.", "broker.", "metadata.")
        extra = {k: v for k, v in self.client_conf.items() if k.startswith(shared)}
        return {**self._base_conf(), **extra}

    def isolation_level(self) -> IsolationLevel:
        level = self.client_conf.get("isolation.level", "read_committed")
        return (
            IsolationLevel.READ_UNCOMMITTED
            if level == "read_uncommitted"
            else IsolationLevel.READ_COMMITTED
        )


READER_OPTIONS = (
    "subscribe",
    "topics",
    "subscribePattern",
    "startingOffsets",
    "startingOffsetsByTimestamp",
    "maxOffsetsPerTrigger",
    "maxRecordsPerBatch",
    "failOnDataLoss",
    "probeHighWatermark",
    "pollTimeoutMs",
    "maxRecordsPerPartition",
)
_READER_PREFIXES = ("kafka.", "icefloe.")


def check_reader_options(options: Mapping[str, str], where: str) -> None:
    """Refuse option names the source does not know: Spark passes any name through, so a
    misspelt ``probeHighWaterMark`` would otherwise be ignored silently."""
    # exact spelling, although Spark matches case-insensitively: icefloe reads some of these
    # itself (the progress view reads probeHighWatermark) and one spelling avoids surprises
    known = {name.lower(): name for name in READER_OPTIONS}
    for key in options:
        if key in READER_OPTIONS or key.startswith(_READER_PREFIXES):
            continue
        close = difflib.get_close_matches(key.lower(), list(known), n=1, cutoff=0.6)
        hint = f"did you mean '{known[close[0]]}'? " if close else ""
        raise ConfigError(
            where,
            f"unknown reader option '{key}'",
            f"{hint}known options: {', '.join(READER_OPTIONS)} and kafka.* client settings",
            key,
        )


def _parse_offsets_json(text: str, option: str = "startingOffsets") -> Offsets:
    try:
        raw = json.loads(text)
        out = {
            str(topic): {str(int(p)): int(o) for p, o in parts.items()}
            for topic, parts in raw.items()
        }
    except (ValueError, AttributeError, TypeError):
        raise ConfigError(
            f"option '{option}'",
            'is not JSON like {"topic": {"0": 42}}'
            if option != "startingOffsets"
            else 'is not earliest, latest, table or JSON like {"topic": {"0": 42}}',
            "fix the value",
            text,
        ) from None
    return out


def source_options(config: PipelineConfig) -> dict[str, str]:
    """Reader options for a pipeline configuration (what ``icefloe run`` passes). Catalog
    properties (which may hold credentials) are passed only when ``starting_offsets`` is
    ``table``, the one mode that reads them."""
    src = config.source
    opts = {
        "kafka.bootstrap.servers": src.bootstrap_servers,
        **(
            {"subscribePattern": src.topic_pattern}
            if src.topic_pattern is not None
            else {"subscribe": ",".join(src.topics)}
        ),
        "startingOffsets": (
            src.starting_offsets
            if isinstance(src.starting_offsets, str)
            else json.dumps(src.starting_offsets)
        ),
        **{f"kafka.{k}": v for k, v in src.kafka.items()},
    }
    if src.starting_offsets == "table":
        opts.update(
            {
                "icefloe.tables": ",".join(t.name for t in config.tables),
                "icefloe.groupId": config.name,
                "icefloe.branch": config.coordination.branch,
                "icefloe.branches": json.dumps(
                    {
                        t.name: t.branch
                        for t in config.tables
                        if t.branch not in (None, config.coordination.branch)
                    }
                ),
                "icefloe.catalog.name": config.catalog.name,
                **{f"icefloe.catalog.{k}": v for k, v in config.catalog.properties.items()},
            }
        )
    if src.max_records_per_batch is not None:
        opts["maxOffsetsPerTrigger"] = str(src.max_records_per_batch)
    check_reader_options(src.reader_options, "source.reader_options")
    opts.update(src.reader_options)
    return opts


def table_source_offsets(
    catalog_properties: Mapping[str, str],
    tables: Sequence[str],
    group_id: str,
    catalog_name: str = "default",
    branch: str = "main",
    branches: Mapping[str, str] | None = None,
) -> dict[str, dict[int, int]]:
    """The source offsets the pipeline ``group_id`` recorded in its tables' newest snapshots
    (``icefloe.source-offsets``), merged by taking each partition's highest offset.

    Highest, not lowest: a table that received no rows of a range gets no snapshot for it, so
    its offsets legitimately lag; restarting from the lowest would duplicate rows in the
    others. Tables that do not exist or have no snapshot of the group are skipped. Each table
    is read on its branch: ``branches`` names those not on ``branch``.
    """
    from pyiceberg.catalog import load_catalog

    from icefloe.commit.policy import TablePolicies, TablePolicy
    from icefloe.coordination.resume import committed

    catalog = load_catalog(catalog_name, **dict(catalog_properties))
    policies = TablePolicies(
        TablePolicy(branch=branch), {t: TablePolicy(branch=b) for t, b in (branches or {}).items()}
    )
    return committed(catalog, group_id, tables, policies).source_offsets


# --------------------------------------------------------------------------- planning


class KafkaInputPartition(InputPartition):
    """Records [start, end) of one Kafka partition."""

    def __init__(self, topic: str, partition: int, start: int, end: int) -> None:
        super().__init__((topic, partition, start, end))
        self.topic = topic
        self.partition = partition
        self.start = start
        self.end = end


def split_limit(lags: Mapping[TP, int], limit: int) -> dict[TP, int]:
    """Share ``limit`` records among partitions in proportion to their lag (largest remainders
    first, ties by topic and partition), never giving a partition more than its lag."""
    total = sum(lags.values())
    if total <= limit:
        return dict(lags)
    shares = {tp: limit * lag / total for tp, lag in lags.items()}
    out = {tp: int(s) for tp, s in shares.items()}
    left = limit - sum(out.values())
    order = sorted(lags, key=lambda tp: (-(shares[tp] - out[tp]), tp))
    for tp in order:
        if left <= 0:
            break
        if out[tp] < lags[tp]:
            out[tp] += 1
            left -= 1
    return out


def _int_of(value: int | None) -> int:
    """Offsets and partitions of consumed messages are always set (typed as optional)."""
    if value is None:
        raise KafkaSourceError("the Kafka client returned a message without offset/partition")
    return value


def _flat(offsets: Mapping[str, Mapping[str, int]]) -> dict[TP, int]:
    return {(t, int(p)): int(o) for t, parts in offsets.items() for p, o in parts.items()}


def _nest(flat: Mapping[TP, int]) -> Offsets:
    out: Offsets = {}
    for (t, p), o in sorted(flat.items()):
        out.setdefault(t, {})[str(p)] = o
    return out


class KafkaStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Driver side: offsets and planning. Executor side: :meth:`read` (on a pickled copy,
    without the driver's clients)."""

    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        self._admin: AdminClient | None = None
        self._probe: Consumer | None = None
        self._latest: dict[TP, int] | None = None
        self._target: dict[TP, int] | None = None  # Trigger.AvailableNow's end
        self._listed: dict[TP, int] = {}  # the last ListOffsets answer (auto probing)
        self._settled: dict[TP, int] = {}  # the ends bounds() last returned (auto probing)

    def __getstate__(self) -> dict[str, Any]:
        return {"options": self.options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.options = state["options"]
        self._admin, self._probe, self._latest, self._target = None, None, None, None
        self._listed, self._settled = {}, {}

    # ---- broker queries (driver)

    def admin(self) -> AdminClient:
        if self._admin is None:
            self._admin = AdminClient(self.options.admin_conf())
        return self._admin

    def _timeout(self) -> float:
        return max(self.options.poll_timeout_s, 1.0)

    def topic_partitions(self) -> list[TP]:
        """Current partitions of the subscribed topics (a missing topic has none yet)."""
        meta = self.admin().list_topics(timeout=self._timeout())
        out = []
        for topic in self.options.subscribed(meta.topics):
            tmeta = meta.topics[topic]
            if tmeta.error is not None:
                continue
            out += [(topic, p) for p in sorted(tmeta.partitions)]
        return out

    def _list_offsets(self, tps: Sequence[TP], spec: OffsetSpec) -> dict[TP, int]:
        return {tp: int(info.offset) for tp, info in self._list_offset_infos(tps, spec).items()}

    def _list_offset_infos(self, tps: Sequence[TP], spec: OffsetSpec) -> dict[TP, Any]:
        if not tps:
            return {}
        request = {TopicPartition(t, p): spec for t, p in tps}
        futures = self.admin().list_offsets(
            request,
            isolation_level=self.options.isolation_level(),
            request_timeout=self._timeout(),
        )
        return {(tp.topic, tp.partition): f.result() for tp, f in futures.items()}

    def _offsets_at(self, stamps: Mapping[TP, int], latest: Mapping[TP, int]) -> dict[TP, int]:
        """Per partition, the first offset whose record timestamp is at or after the given
        epoch ms (Kafka's ListOffsets by time); the partition's end when no record is that new
        yet. Partitions the broker does not list are left out (they start at earliest)."""
        known = [tp for tp in stamps if tp in latest]
        out: dict[TP, int] = {}
        for tp in known:  # one request per partition: each has its own time
            found = self._list_offset_infos([tp], OffsetSpec.for_timestamp(stamps[tp]))[tp]
            # no record that new: Kafka answers offset -1; Tansu 0.6 answers offset 0 with
            # timestamp -1, so the timestamp decides
            none = found.offset < 0 or found.timestamp < 0
            out[tp] = latest[tp] if none else int(found.offset)
        return out

    def bounds(self, tps: Sequence[TP]) -> tuple[dict[TP, int], dict[TP, int]]:
        """(earliest, latest) offsets of ``tps``."""
        earliest = self._list_offsets(tps, OffsetSpec.earliest())  # type: ignore[no-untyped-call]
        latest = self._list_offsets(tps, OffsetSpec.latest())  # type: ignore[no-untyped-call]
        mode = self.options.probe_high_watermark
        if mode != "false":
            first = not self._listed
            # probed: ends listed twice the same, and ends listed below one already settled
            # on (a lagging listing that moved, but not yet to where reading got: Tansu lists
            # a partition's last batch base + 1, so trusting it failed a 64-partition run
            # with "offset 12 is outside the broker's range [0, 2]")
            still = {
                tp
                for tp, end in latest.items()
                if self._listed.get(tp) == end or end < self._settled.get(tp, end)
            }
            self._listed = dict(latest)
            latest = self._probe_latest(
                earliest, latest, set(latest) if mode == "true" or first else still
            )
            self._settled.update(latest)
        return earliest, latest

    def _probe_latest(
        self, earliest: dict[TP, int], listed: dict[TP, int], which: set[TP]
    ) -> dict[TP, int]:
        """The end of each partition of ``which`` as a fetch response reports it: fetch from
        the last listed offset and take the end-of-partition position (or the last offset
        seen); the others keep their listed end."""
        todo = {
            tp: max(listed[tp] - 1, earliest[tp])
            for tp in which & set(listed)
            if listed[tp] > earliest[tp]
        }
        result = dict(listed)
        if not todo:
            return result
        if self._probe is None:
            self._probe = Consumer(self.options.consumer_conf())
        self._probe.assign([TopicPartition(t, p, o) for (t, p), o in todo.items()])
        pending = set(todo)
        deadline = time.monotonic() + self._timeout()
        try:
            while pending and time.monotonic() < deadline:
                for msg in self._probe.consume(num_messages=10_000, timeout=0.02):
                    tp = (str(msg.topic()), _int_of(msg.partition()))
                    err = msg.error()
                    if err is None:
                        result[tp] = max(result[tp], _int_of(msg.offset()) + 1)
                    elif err.code() == KafkaError._PARTITION_EOF:
                        result[tp] = max(result[tp], _int_of(msg.offset()))
                        pending.discard(tp)
                    else:
                        log.warning("probing the end of %s failed: %s", tp, err)
                        pending.discard(tp)
        finally:
            self._probe.unassign()
        return result

    # ---- Spark's streaming contract (driver)

    def initialOffset(self) -> dict[str, Any]:  # noqa: N802 (Spark's name)
        tps = self.topic_partitions()
        earliest, latest = self.bounds(tps)
        start = self.options.starting_offsets
        chosen: dict[TP, int]
        if start == "earliest":
            chosen = dict(earliest)
        elif start == "latest":
            chosen = dict(latest)
        else:
            if start == "table":
                assert self.options.group_id is not None
                recorded = table_source_offsets(
                    self.options.catalog_properties,
                    self.options.tables,
                    self.options.group_id,
                    self.options.catalog_name,
                    self.options.branch,
                    self.options.branches,
                )
                given = {(t, p): o for t, parts in recorded.items() for p, o in parts.items()}
                log.info("resuming from the offsets recorded in the tables: %s", recorded)
            elif start == "timestamp":
                given = self._offsets_at(_flat(self.options.starting_timestamps), latest)
            else:
                given = _flat(_parse_offsets_json(start))
            chosen = {}
            for tp in tps:
                offset = given.get(tp, EARLIEST)
                chosen[tp] = (
                    earliest[tp]
                    if offset == EARLIEST
                    else latest[tp]
                    if offset == LATEST
                    else offset
                )
            # offsets of subscribed partitions the broker does not list (yet) are kept as given
            chosen.update(
                {
                    tp: o
                    for tp, o in given.items()
                    if tp not in chosen and o >= 0 and self.options.subscribed([tp[0]])
                }
            )
        return _nest(chosen)

    def prepareForTriggerAvailableNow(self) -> None:  # noqa: N802 (Spark's name)
        """Fix the end of an AvailableNow run: what the partitions hold now, nothing later
        (partitions that appear later are not read by this run)."""
        tps = self.topic_partitions()
        self._target = self.bounds(tps)[1]

    def getDefaultReadLimit(self) -> ReadLimit:  # noqa: N802 (Spark's name)
        if self.options.max_records is None:
            return ReadAllAvailable()
        return ReadMaxRows(self.options.max_records)

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:  # noqa: N802 (Spark's name)
        begin = _flat(start)
        tps = self.topic_partitions()
        earliest, latest = self.bounds(tps)
        self._latest = dict(latest)
        if self._target is not None:
            tps = [tp for tp in tps if tp in self._target]
            latest = {tp: min(latest[tp], self._target[tp]) for tp in tps}
        end = dict(begin)  # partitions gone from the broker keep their offsets
        lags: dict[TP, int] = {}
        for tp in tps:
            if tp not in begin:
                # discovered: recorded at its earliest offset, read from the next batch on, so
                # every batch's range is fixed by its own start and end offsets
                end[tp] = earliest[tp]
                log.info("new Kafka partition %s[%d] from offset %d", tp[0], tp[1], earliest[tp])
                continue
            at = begin[tp]
            if at < earliest[tp] or at > latest[tp]:
                self._data_loss(tp, at, earliest[tp], latest[tp])
                at = max(at, earliest[tp])
            lags[tp] = max(latest[tp] - at, 0)
        if isinstance(limit, ReadMinRows) and sum(lags.values()) < limit.min_rows:
            return _nest(begin)
        if isinstance(limit, ReadMaxRows):
            lags = split_limit(lags, limit.max_rows)
        for tp, n in lags.items():
            end[tp] = max(begin[tp], earliest[tp]) + n if n else begin[tp]
        return _nest(end)

    def _data_loss(self, tp: TP, at: int, earliest: int, latest: int) -> None:
        what = (
            f"{tp[0]}[{tp[1]}]: offset {at} is outside the broker's range [{earliest}, {latest}]"
            " (records deleted by retention, or the topic was recreated)"
        )
        if self.options.fail_on_data_loss:
            raise DataLossError(
                what + "; set failOnDataLoss=false to continue from what the broker still has"
            )
        log.warning("%s; continuing (failOnDataLoss=false)", what)

    def reportLatestOffset(self) -> dict[str, Any] | None:  # noqa: N802 (Spark's name)
        return None if self._latest is None else _nest(self._latest)

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        begin, stop = _flat(start), _flat(end)
        out: list[InputPartition] = []
        for tp in sorted(stop):
            first = begin.get(tp, stop[tp])
            if stop[tp] <= first:
                continue
            step = self.options.max_partition_records or stop[tp] - first
            out += [
                KafkaInputPartition(tp[0], tp[1], lo, min(lo + step, stop[tp]))
                for lo in range(first, stop[tp], step)
            ]
        return out

    def commit(self, end: dict[str, Any]) -> None:
        """Nothing to do: progress lives in Spark's checkpoint and, for the sink, in the
        Iceberg snapshot summaries; no consumer group is used."""

    def stop(self) -> None:
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        self._admin = None

    # ---- executor

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, KafkaInputPartition)
        yield from read_range(self.options, partition)
        workergc.freeze_once()


class ConsumerPool:
    """Idle consumers of this process, by client settings, for the next range read.

    Why: a Python worker runs task after task (Spark reuses it), and a new consumer costs a
    connection and a metadata round trip (~45 ms here) per range; Spark's own Kafka source
    pools its consumers per executor for the same reason. A consumer is only reused after a
    read that ended normally, and is unassigned before it is returned.
    """

    MAX_IDLE = 4  # per settings: as many as a worker has ranges in flight, and then some

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[str, list[Consumer]] = {}

    @staticmethod
    def _key(options: SourceOptions) -> str:
        conf = options.consumer_conf()
        return json.dumps(
            {k: str(v) for k, v in conf.items() if k not in ("group.id", "logger")},
            sort_keys=True,
        )

    def take(self, options: SourceOptions) -> Consumer:
        with self._lock:
            idle = self._idle.get(self._key(options))
            if idle:
                return idle.pop()
        return Consumer(options.consumer_conf())

    def give_back(self, options: SourceOptions, consumer: Consumer, reusable: bool) -> None:
        if reusable:
            try:
                consumer.unassign()
            except KafkaException:
                reusable = False
        if reusable:
            with self._lock:
                idle = self._idle.setdefault(self._key(options), [])
                if len(idle) < self.MAX_IDLE:
                    idle.append(consumer)
                    return
        consumer.close()


CONSUMERS = ConsumerPool()


def read_range(
    options: SourceOptions, part: KafkaInputPartition, batch_size: int = _READ_BATCH
) -> Iterator[pa.RecordBatch]:
    """Every record of [start, end) of one partition, as Kafka-layout record batches.

    Offsets without a record (transaction markers, compaction, aborted transactions under
    read_committed) are skipped: the range ends at the first record at or past ``end``, or
    at the end of the partition once it reaches ``end``.
    """
    consumer = CONSUMERS.take(options)
    finished = False
    try:
        consumer.assign([TopicPartition(part.topic, part.partition, part.start)])
        msgs: list[Any] = []
        next_offset = part.start
        last_progress = time.monotonic()
        while next_offset < part.end:
            # ask for no more than the range still holds: a consume returns once it has that
            # many or its timeout ran out, so asking for more waits out the timeout at the end
            # of every range (offsets without a record only cost one short wait)
            wanted = max(1, min(batch_size, part.end - next_offset))
            polled = consumer.consume(num_messages=wanted, timeout=0.1)
            if not polled:
                if time.monotonic() - last_progress > options.poll_timeout_s:
                    raise KafkaSourceError(
                        f"{part.topic}[{part.partition}]: no records for "
                        f"{options.poll_timeout_s}s while reading offsets [{part.start}, "
                        f"{part.end}) (next: {next_offset})"
                    )
                continue
            reading_from = next_offset  # before an end-of-partition event below moves it
            # list comprehensions, not a loop with branches: this runs once per record
            events = [m for m in polled if m.error() is not None]
            if events:
                polled = [m for m in polled if m.error() is None]
                if _range_ends_here(part, events):
                    next_offset = part.end
            if polled and not _all_of_range(polled, part, reading_from):
                polled = [  # a pooled consumer's leftovers (never seen): keep only this range
                    m
                    for m in polled
                    if (m.topic(), m.partition()) == (part.topic, part.partition)
                    and _int_of(m.offset()) >= reading_from
                ]
            if polled:
                if _int_of(polled[-1].offset()) >= part.end:
                    offsets = [_int_of(m.offset()) for m in polled]
                    polled = polled[: bisect.bisect_left(offsets, part.end)]
                    next_offset = part.end
                if polled:
                    msgs += polled
                    next_offset = max(next_offset, _int_of(polled[-1].offset()) + 1)
                    last_progress = time.monotonic()
            if msgs and (len(msgs) >= batch_size or next_offset >= part.end):
                yield to_record_batch(part.topic, part.partition, msgs)
                msgs = []
        finished = True
    finally:
        CONSUMERS.give_back(options, consumer, finished)


def _all_of_range(polled: Sequence[Any], part: KafkaInputPartition, next_offset: int) -> bool:
    """Cheap check that a consume returned only this range's records: one partition's
    records come in offset order, and anything older would come first."""
    first, last = polled[0], polled[-1]
    here = (part.topic, part.partition)
    return (
        (first.topic(), first.partition()) == here
        and (last.topic(), last.partition()) == here
        and _int_of(first.offset()) >= next_offset
    )


class KafkaRangeGroup(InputPartition):
    """Ranges of several Kafka partitions that one task reads, in this order."""

    def __init__(self, ranges: Sequence[KafkaInputPartition]) -> None:
        super().__init__(tuple(r.value for r in ranges))
        self.ranges = list(ranges)


def pack_ranges(
    ranges: Sequence[KafkaInputPartition], limit: int
) -> list[list[KafkaInputPartition]]:
    """Ranges packed into groups of at most ``limit`` records (a longer range alone), first
    fit, largest first; deterministic, so a replayed batch plans the same tasks.

    Why: with many source partitions a micro-batch's ranges are short (500,000 records over
    16 partitions: 31,250 each), and a task per range pays Spark's per-task cost, a range
    read's set-up and a Parquet file each time; bench_e2e measured 2.4x the ceiling's CPU
    per record at 16 partitions against 1.6x with ranges of 125,000 records."""
    order = sorted(ranges, key=lambda r: (-(r.end - r.start), r.topic, r.partition, r.start))
    groups: list[list[KafkaInputPartition]] = []
    sizes: list[int] = []
    for r in order:
        n = r.end - r.start
        at = next((i for i, size in enumerate(sizes) if size + n <= limit), None)
        if at is None:
            groups.append([r])
            sizes.append(n)
        else:
            groups[at].append(r)
            sizes[at] += n
    return groups


class KafkaRangeReader(KafkaStreamReader):
    """Plans like :class:`KafkaStreamReader`, then packs short ranges into one task
    (:func:`pack_ranges`) where ``maxRecordsPerPartition`` is set; each range is one row."""

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        planned = super().partitions(start, end)
        limit = self.options.max_partition_records
        ranges = [p for p in planned if isinstance(p, KafkaInputPartition)]
        if limit is None or len(ranges) != len(planned):
            return planned
        return [KafkaRangeGroup(group) for group in pack_ranges(ranges, limit)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        if isinstance(partition, KafkaRangeGroup):
            ranges = partition.ranges
        else:
            assert isinstance(partition, KafkaInputPartition)
            ranges = [partition]
        yield pa.RecordBatch.from_pylist(
            [
                {"topic": p.topic, "partition": p.partition, "start": p.start, "end": p.end}
                for p in ranges
            ],
            schema=RANGE_ARROW_SCHEMA,
        )
        workergc.freeze_once()


def read_ranges(options: SourceOptions, ranges: Iterable[pa.RecordBatch]) -> list[pa.RecordBatch]:
    """The records of range rows (``icefloe-kafka-ranges``), as Kafka-layout batches."""
    out: list[pa.RecordBatch] = []
    for batch in ranges:
        for row in batch.to_pylist():
            part = KafkaInputPartition(row["topic"], row["partition"], row["start"], row["end"])
            out += read_range(options, part)
    return out


def _range_ends_here(part: KafkaInputPartition, events: Sequence[Any]) -> bool:
    """Handle the client's non-record events: True when the partition's end was reached at
    or past ``part.end`` (the rest of the range holds no records); data loss and other
    errors raise."""
    ended = False
    for event in events:
        err = event.error()
        if err.code() == KafkaError._PARTITION_EOF:
            # librdkafka drops what an earlier assignment fetched (assign() moves the
            # partition's version on); the partition check guards a pooled consumer anyway
            mine = (event.topic(), event.partition()) == (part.topic, part.partition)
            ended = ended or (mine and _int_of(event.offset()) >= part.end)
        elif err.code() in (KafkaError._AUTO_OFFSET_RESET, KafkaError.OFFSET_OUT_OF_RANGE):
            raise DataLossError(
                f"{part.topic}[{part.partition}]: offsets [{part.start}, {part.end}) are no "
                f"longer on the broker ({err.str()}); set failOnDataLoss=false to continue "
                "from what the broker still has"
            )
        else:
            raise KafkaException(err)
    return ended


# confluent-kafka's timestamp kinds -> Kafka's TimestampType ids (-1: none)
_TS_TYPE = np.full(3, -1, dtype=np.int32)
_TS_TYPE[TIMESTAMP_CREATE_TIME] = 0
_TS_TYPE[TIMESTAMP_LOG_APPEND_TIME] = 1
_HEADERS_TYPE = KAFKA_ARROW_SCHEMA.field("headers").type


def to_record_batch(topic: str, partition: int, msgs: Sequence[Any]) -> pa.RecordBatch:
    """Messages -> one Kafka-layout batch. One pass per column over the client's message
    objects (confluent-kafka hands out one object per record); the rest is vectorised."""
    n = len(msgs)
    stamps = np.array([m.timestamp() for m in msgs], dtype=np.int64).reshape(n, 2)
    ts_type = _TS_TYPE[np.clip(stamps[:, 0], 0, 2)]
    ts_ms = stamps[:, 1]
    no_ts = ts_type < 0
    timestamps = pa.array(ts_ms * 1000, pa.int64(), mask=no_ts if no_ts.any() else None).cast(
        KAFKA_ARROW_SCHEMA.field("timestamp").type
    )
    headers = [m.headers() for m in msgs]
    if any(h is not None for h in headers):
        header_col = pa.array(
            [None if h is None else [{"key": k, "value": v} for k, v in h] for h in headers],
            _HEADERS_TYPE,
        )
    else:
        header_col = pa.nulls(n, _HEADERS_TYPE)
    return pa.RecordBatch.from_arrays(
        [
            pa.array([m.key() for m in msgs], pa.binary()),
            pa.array([m.value() for m in msgs], pa.binary()),
            pa.repeat(pa.scalar(topic, pa.string()), n),
            pa.repeat(pa.scalar(partition, pa.int32()), n),
            pa.array(np.fromiter((m.offset() for m in msgs), np.int64, n)),
            timestamps,
            pa.array(ts_type),
            header_col,
        ],
        schema=KAFKA_ARROW_SCHEMA,
    )


# --------------------------------------------------------------------------- registration


class IcefloeKafkaDataSource(DataSource):
    """``spark.readStream.format("icefloe-kafka")``."""

    source_name = SOURCE_NAME
    row_schema = KAFKA_SCHEMA
    stream_reader_class: type[KafkaStreamReader] = KafkaStreamReader

    @classmethod
    def name(cls) -> str:
        return cls.source_name

    def schema(self) -> StructType:
        return self.row_schema

    def streamReader(self, schema: StructType) -> KafkaStreamReader:  # noqa: N802 (Spark's name)
        return self.stream_reader_class(SourceOptions.parse(self.options))


class IcefloeKafkaRangesDataSource(IcefloeKafkaDataSource):
    """``spark.readStream.format("icefloe-kafka-ranges")``: offset ranges, not records."""

    source_name = RANGES_SOURCE_NAME
    row_schema = RANGE_SCHEMA
    stream_reader_class = KafkaRangeReader


def register_sources(spark: SparkSession) -> None:
    """Make ``icefloe-kafka`` and ``icefloe-kafka-ranges`` available to
    ``spark.readStream.format(...)``."""
    spark.dataSource.register(IcefloeKafkaDataSource)
    spark.dataSource.register(IcefloeKafkaRangesDataSource)
