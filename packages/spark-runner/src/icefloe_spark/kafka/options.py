"""The options of the ``icefloe-kafka`` source (:mod:`icefloe_spark.kafka.source`), checked
at query start on the driver and carried, parsed, to planning and the tasks.

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
* ``firstBatchRecords``: the first micro-batch of this run reads at most this many records,
  each next one twice as many as the one before, up to ``maxOffsetsPerTrigger`` (or without
  bound when that is unset): on a backlog the first commit comes after a small batch, not
  the largest. Unset: no ramp.
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
"""

from __future__ import annotations

import difflib
import json
import re
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, cast, get_args

from confluent_kafka import IsolationLevel

from icefloe.config import matching_topics
from icefloe.errors import ConfigError
from icefloe_spark.kafka.admin import CLIENT_LOG

if TYPE_CHECKING:
    from icefloe.config import PipelineConfig

EARLIEST, LATEST = -2, -1  # Spark's markers in JSON starting offsets
Offsets = dict[str, dict[str, int]]  # topic -> partition (as text, JSON keys) -> next offset


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
    first_batch_records: int | None = None  # firstBatchRecords: the ramp's first limit
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
            parse_offsets_json(starting)  # validate now, at query start
        stamps_raw = opts.get("startingoffsetsbytimestamp")
        stamps: Offsets = {}
        if stamps_raw:  # takes precedence over startingOffsets, as in Spark's Kafka source
            stamps = parse_offsets_json(stamps_raw, "startingOffsetsByTimestamp")
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
            first_batch_records=_int(opts, "firstBatchRecords", None),
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
            "logger": CLIENT_LOG,
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
    "firstBatchRecords",
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


def parse_offsets_json(text: str, option: str = "startingOffsets") -> Offsets:
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
    if src.first_batch_records is not None:
        opts["firstBatchRecords"] = str(src.first_batch_records)
    check_reader_options(src.reader_options, "source.reader_options")
    opts.update(src.reader_options)
    return opts
