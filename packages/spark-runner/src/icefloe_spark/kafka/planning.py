"""The driver's side of the ``icefloe-kafka`` source: what the broker holds, where each
micro-batch ends, and the ranges ([start, end) of one partition) its tasks read.

Offsets are Spark offsets, ``{"topic": {"partition": next offset}}``, checkpointed by Spark.
A micro-batch's ranges follow from its start and end offsets alone, so a replayed batch reads
exactly the same records (the exactly-once sink relies on it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa
from confluent_kafka import Consumer, KafkaError, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec  # type: ignore[attr-defined]
from pyspark.sql.datasource import InputPartition
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    ReadMinRows,
)
from pyspark.sql.types import IntegerType, LongType, StringType, StructField, StructType

from icefloe.errors import IcefloeError
from icefloe_spark.kafka.options import EARLIEST, LATEST, Offsets, SourceOptions, parse_offsets_json

log = logging.getLogger("icefloe_spark.source")

# the rows of ``icefloe-kafka-ranges``: one range a row
RANGE_SCHEMA = StructType(
    [
        StructField("topic", StringType()),
        StructField("partition", IntegerType()),
        StructField("start", LongType()),
        StructField("end", LongType()),
    ]
)
RANGE_ARROW_SCHEMA: pa.Schema = to_arrow_schema(RANGE_SCHEMA, timezone="UTC")

TP = tuple[str, int]


class KafkaSourceError(IcefloeError):
    """The source cannot deliver the records a micro-batch asked for."""


class DataLossError(KafkaSourceError):
    """Records between the last processed offset and the broker's earliest offset are gone."""


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


def int_of(value: int | None) -> int:
    """Offsets and partitions of consumed messages are always set (typed as optional)."""
    if value is None:
        raise KafkaSourceError("the Kafka client returned a message without offset/partition")
    return value


def flat_offsets(offsets: Mapping[str, Mapping[str, int]]) -> dict[TP, int]:
    """Spark's offsets (JSON-shaped, partitions as text) by (topic, partition), to compute on."""
    return {(t, int(p)): int(o) for t, parts in offsets.items() for p, o in parts.items()}


def nest_offsets(flat: Mapping[TP, int]) -> Offsets:
    """The inverse of :func:`flat_offsets`, in a stable order: what Spark checkpoints."""
    out: Offsets = {}
    for (t, p), o in sorted(flat.items()):
        out.setdefault(t, {})[str(p)] = o
    return out


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


class KafkaOffsetPlanner:
    """The driver's half of Spark's stream reader, under Spark's method names: offsets from
    the broker, each micro-batch's end and its input partitions. The reader classes of
    :mod:`icefloe_spark.kafka.source` add what the tasks run; replay uses it alone."""

    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        self._admin: AdminClient | None = None
        self._probe: Consumer | None = None
        self._latest: dict[TP, int] | None = None
        self._target: dict[TP, int] | None = None  # Trigger.AvailableNow's end
        self._listed: dict[TP, int] = {}  # the last ListOffsets answer (auto probing)
        self._settled: dict[TP, int] = {}  # the ends bounds() last returned (auto probing)
        self._planned = 0  # non-empty micro-batches this run planned (the ramp's step)

    def __getstate__(self) -> dict[str, Any]:
        return {"options": self.options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.options = state["options"]
        self._admin, self._probe, self._latest, self._target = None, None, None, None
        self._listed, self._settled = {}, {}
        self._planned = 0

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
                    tp = (str(msg.topic()), int_of(msg.partition()))
                    err = msg.error()
                    if err is None:
                        result[tp] = max(result[tp], int_of(msg.offset()) + 1)
                    elif err.code() == KafkaError._PARTITION_EOF:
                        result[tp] = max(result[tp], int_of(msg.offset()))
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
                given = self._offsets_at(flat_offsets(self.options.starting_timestamps), latest)
            else:
                given = flat_offsets(parse_offsets_json(start))
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
        return nest_offsets(chosen)

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
        begin = flat_offsets(start)
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
            return nest_offsets(begin)
        cap = self._ramp_limit(limit.max_rows if isinstance(limit, ReadMaxRows) else None)
        if cap is not None:
            lags = split_limit(lags, cap)
        for tp, n in lags.items():
            end[tp] = max(begin[tp], earliest[tp]) + n if n else begin[tp]
        if any(lags.values()):
            self._planned += 1
        return nest_offsets(end)

    def _ramp_limit(self, max_rows: int | None) -> int | None:
        """The records this micro-batch may read: ``max_rows``, or for this run's first
        non-empty batch at most ``firstBatchRecords`` (the ramp). Why a small first batch: a
        run that starts on a backlog would otherwise commit nothing until a whole batch of the
        largest size was read and written (27 s to the first commit on 2 million records at
        500,000 a batch). Why full size at once after it: the coordinator commits once per
        interval whatever the batch sizes, and every further small batch costs its fixed
        share (planning, the JVM's round, the sink's commit runner), so doubling from the
        first size made a 2-million-record catch-up's data path 7-9 s longer
        (docs/benchmarks.md, first commit on a backlog). Spark checkpoints each batch's end
        offsets, so a replayed batch keeps its size whatever the ramp says."""
        first = self.options.first_batch_records
        if first is None or self._planned:
            return max_rows
        return first if max_rows is None else min(first, max_rows)

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
        return None if self._latest is None else nest_offsets(self._latest)

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        begin, stop = flat_offsets(start), flat_offsets(end)
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
