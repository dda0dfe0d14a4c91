"""End-to-end throughput against the single-process ceiling, on the same data, in one run.

    nox -s bench                       # or: python benchmarks/bench_e2e.py --records 1000000

1. Starts the embedded Kafka-protocol broker (Tansu); the events are JSON (10 fields,
   ~250 bytes), on a topic with P partitions.
2. Ceilings: one process, no Spark, no coordination, confluent-kafka consuming every
   partition in batches of 10,000 messages; nothing is committed.
   * ``pyarrow`` (the ceiling): a consumer per partition, each on a thread, joins each
     batch's values into one buffer; the main thread parses it at once with
     ``pyarrow.json.read_json`` against the table's schema and writes it with
     ``pyarrow.parquet`` (zstd) in files of ``--write`` records: the fastest single-process
     program a pyarrow user would write for consume -> decode -> Parquet (before
     2026-11-27 one consumer did everything in turn, and waited on the broker).
   * ``converter`` (the second column): the records become Kafka-layout Arrow batches (the
     source's own ``to_record_batch``), are decoded and conformed by the sink's converter and
     written by pyiceberg's writer (``write_data_files``), ``--write`` records at a time: the
     pipeline's own per-record work in one process, so a ratio against it hides that work's
     cost.
   With ``--store s3`` the warehouse is a bucket of moto's S3 server (a Python process on the
   same machine, checking every request's signature), for both ceilings and the pipeline;
   with ``--catalog postgres`` the catalog is pyiceberg's SQL catalog on PostgreSQL, so
   ``--cluster N --store s3 --catalog postgres`` shares no local file between the driver and
   the workers (each worker has its own scratch directory).
3. End to end: the real pipeline (icefloe-kafka source -> Spark local -> icefloe sink ->
   backend -> coordinator -> Iceberg commits) into a fresh table; with ``--cluster N`` Spark
   runs on a standalone cluster of N one-core workers started from the PySpark wheel on
   127.0.0.1 (``icefloe_spark.runtime.standalone``), so the tasks run in executors' JVMs and Python
   workers apart from the driver's. It is started and warmed up
   first on W extra records (JVM, Python workers, first commit: start-up is latency, not
   throughput); then the N events (generated beforehand, untimed) are produced while it
   runs. Timed from the start of that production until the table's committed snapshot holds
   every row.

With ``--cdc`` (issue 28) there are no ceilings: the events are Debezium change events
(docs/upsert.md) over ``--keys`` ids, a share ``--deletes`` of them deletes, keyed by id;
the same events go through the pipeline twice, each copy on its own topic, in append mode
(the envelope as columns) and into a keyed table in ``cdc`` mode (``--compact``: with
``compact = true``). Each is warmed up and timed as above, done when the table's snapshot
records the topic's end offsets; the keyed table is then checked against the final state the
events imply with two readers that are not the committer (fastavro and pyarrow over its files
minus their position deletes, and pyiceberg's scan), and the ratio of the two rates printed.

With ``--rate R`` (issue 29's latency figure) there are no ceilings: after the warm-up a
producer process paces R events/s for ``--seconds`` (a burst of whatever is due every 5 ms,
the wall-clock time of each burst kept as its records' produce time) while the pipeline runs
at the configuration's commit and trigger intervals (``--commit-interval``,
``--trigger-interval`` to vary). Once every event is committed, each one's committed time is
the timestamp of the first snapshot that added a data file holding its id, found from the
table's manifests and the added files' rows (pyiceberg and pyarrow, not the committer's own
summaries), which also checks that every event was committed exactly once. Prints the
percentiles of committed - produced, the achieved rate, the pipeline's CPU, whether it kept
up (the latency of the stream's last quarter against its first; the events not yet
committed when the last was produced) and a Markdown row.

The ceilings read exactly the N events the pipeline was timed on, after the pipeline has
stopped and its processes have gone quiet, so they never compete with it for the CPU.

Prints the three rates, the pipeline's rate and CPU per record against each ceiling, and a
Markdown row for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import itertools
import json
import multiprocessing
import os
import platform
import queue
import random
import shutil
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq
import sqlalchemy as sa
from confluent_kafka import Consumer, Message, Producer, TopicPartition
from pyiceberg.catalog import Catalog, load_catalog
from pyiceberg.io import load_file_io
from pyiceberg.io.pyarrow import schema_to_pyarrow
from pyiceberg.manifest import ManifestEntryStatus
from pyiceberg.schema import Schema
from pyiceberg.table.snapshots import ancestors_of
from pyiceberg.types import (
    BooleanType,
    DoubleType,
    IntegerType,
    LongType,
    NestedField,
    StringType,
    StructType,
    TimestamptzType,
)

from icefloe.commit.summary import COMMIT_ID_KEY, SOURCE_OFFSETS_KEY
from icefloe.config import (
    CoordinationConfig,
    PipelineConfig,
    SourceConfig,
    SparkConfig,
    TableConfig,
    config_from_dict,
)
from icefloe.records.converter import RecordConverter, TargetTable
from icefloe.records.datafiles import write_data_files
from icefloe.testing.fixtures import postgres_catalog_database
from icefloe.testing.objectstore import running_s3_store
from icefloe.testing.readers import independent_rows, live_files
from icefloe_kafka.embedded import EmbeddedKafkaBroker
from icefloe_spark.kafka.admin import create_topic, end_offsets, produce
from icefloe_spark.kafka.reading import to_record_batch
from icefloe_spark.pipeline import Pipeline, build_session
from icefloe_spark.runtime import sparklog
from icefloe_spark.runtime.standalone import standalone_cluster

TOPIC = "bench-events"
# messages per consume() call of both ceilings
CONSUME = 10_000
# --cluster: each worker offers 1 core and this much memory, each executor takes one worker;
# the tasks' work is in Python workers outside the executor's heap, so 2 GB is ample, and
# a few workers fit a 24 GB machine
WORKER_MEMORY = "4g"
EXECUTOR_MEMORY = "2g"
# kind under which the master's and workers' own JVMs are counted: the cluster manager, not
# the pipeline (its executors and their Python workers are counted as the pipeline's)
DAEMONS = "cluster daemons"
SCHEMA = Schema(
    NestedField(1, "id", LongType(), required=False),
    NestedField(2, "user_id", LongType(), required=False),
    NestedField(3, "session", StringType(), required=False),
    NestedField(4, "action", StringType(), required=False),
    NestedField(5, "page", StringType(), required=False),
    NestedField(6, "amount", DoubleType(), required=False),
    NestedField(7, "quantity", IntegerType(), required=False),
    NestedField(8, "country", StringType(), required=False),
    NestedField(9, "mobile", BooleanType(), required=False),
    NestedField(10, "ts", TimestamptzType(), required=False),
)


BASE_TS = datetime(2025, 1, 1, tzinfo=UTC).timestamp()
ACTIONS = ("view", "click", "cart", "buy", "search")
COUNTRIES = ("DE", "FR", "US", "JP", "BR", "IN", "NG", "SE")


def event_row(rng: random.Random, key: int, i: int) -> dict[str, Any]:
    """One event of the 10 fields (~250 bytes as JSON): row ``key``, at the ``i``-th ms."""
    return {
        "id": key,
        "user_id": rng.randrange(1_000_000),
        "session": f"{rng.getrandbits(64):016x}",
        "action": rng.choice(ACTIONS),
        "page": f"/products/{rng.randrange(10_000)}/details",
        "amount": round(rng.uniform(0, 500), 2),
        "quantity": rng.randrange(1, 10),
        "country": rng.choice(COUNTRIES),
        "mobile": rng.random() < 0.6,
        "ts": datetime.fromtimestamp(BASE_TS + i / 1000, UTC).isoformat(),
    }


def events(first: int, n: int, tenants: int = 0) -> Iterator[tuple[bytes | None, bytes]]:
    """``n`` events from ``first`` on; with ``tenants`` each also names its table for
    ``[dynamic_tables]`` (``"tenant": "t<id mod tenants>"``, about 15 bytes more)."""
    rng = random.Random(first)
    for i in range(first, first + n):
        row = event_row(rng, i, i)
        if tenants:
            row["tenant"] = f"t{i % tenants}"
        yield None, json.dumps(row).encode()


# --cdc: the keyed table holds the events' rows by id; the append table takes the change
# events as they come (Debezium's envelope: op, before with the key, after with the row)
KEYED_SCHEMA = Schema(
    *(
        NestedField(f.field_id, f.name, f.field_type, required=f.name == "id")
        for f in SCHEMA.fields
    ),
    identifier_field_ids=[1],
)
CHANGE_SCHEMA = Schema(
    NestedField(1, "op", StringType(), required=False),
    NestedField(2, "before", StructType(NestedField(3, "id", LongType(), required=False))),
    NestedField(
        4,
        "after",
        StructType(*(NestedField(f.field_id + 4, f.name, f.field_type) for f in SCHEMA.fields)),
        required=False,
    ),
)


def change_events(n: int, keys: int, deletes: float) -> Iterator[tuple[int, dict[str, Any]]]:
    """``n`` Debezium change events (docs/upsert.md) over ids ``0..keys-1``, as (id, event):
    a share ``deletes`` deletes a random live id (``before`` holds only the key, as with
    PostgreSQL's default replica identity); the others write a new image of a random id,
    ``c`` when it is not live, ``u`` when it is. Deterministic."""
    rng = random.Random(7)
    live: list[int] = []  # live ids, and where each is in the list: O(1) random removal
    where: dict[int, int] = {}
    for i in range(n):
        if live and rng.random() < deletes:
            j = rng.randrange(len(live))
            key, last = live[j], live.pop()
            if last != key:
                live[j], where[last] = last, j
            del where[key]
            yield key, {"op": "d", "before": {"id": key}, "after": None}
            continue
        key = rng.randrange(keys)
        op = "u" if key in where else "c"
        if op == "c":
            where[key] = len(live)
            live.append(key)
        yield key, {"op": op, "before": None, "after": event_row(rng, key, i)}


def final_state(warm: int, feed: Feed) -> dict[int, tuple[str, int]]:
    """id -> (session, user_id) of every live row after the warm-up inserts (ids from
    ``feed.keys`` on) and the feed's changes: ``session`` is random per event, so a stale
    image shows."""
    state = {}
    for _, change in warm_changes(warm, feed.keys):
        state[change["after"]["id"]] = (change["after"]["session"], change["after"]["user_id"])
    for key, change in change_events(feed.n, feed.keys, feed.deletes):
        if change["op"] == "d":
            del state[key]
        else:
            state[key] = (change["after"]["session"], change["after"]["user_id"])
    return state


def warm_changes(n: int, first_key: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """The warm-up: inserts of ids the timed changes never touch."""
    rng = random.Random(first_key)
    for i in range(n):
        row = event_row(rng, first_key + i, -n + i)
        yield row["id"], {"op": "c", "before": None, "after": row}


def make_table(catalog: Catalog, name: str) -> None:
    if not catalog.namespace_exists("bench"):
        catalog.create_namespace("bench")
    catalog.create_table(name, schema=SCHEMA)


def consumed(
    bootstrap: str, starts: dict[int, int], partitions: Sequence[int] | None = None
) -> Iterator[list[Message]]:
    """Every record of the topic (or of ``partitions``) from ``starts`` to its end, as
    confluent-kafka hands them out: one ``consume()`` call's batch at a time (stopping by
    count, so the last call asks for exactly what is left and never waits out its timeout)."""
    ends = end_offsets(bootstrap, TOPIC)
    if partitions is not None:
        ends = {p: e for p, e in ends.items() if p in partitions}
    left = sum(max(end - starts.get(p, 0), 0) for p, end in ends.items())
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "bench-ceiling",
            "enable.auto.commit": False,
            "fetch.max.bytes": 64 * 1024 * 1024,
        }
    )
    consumer.assign([TopicPartition(TOPIC, p, starts.get(p, 0)) for p in ends])
    try:
        while left > 0:
            msgs = [m for m in consumer.consume(min(CONSUME, left), 1.0) if m.error() is None]
            left -= len(msgs)
            yield msgs
    finally:
        consumer.close()


def converter_ceiling(
    bootstrap: str,
    config: PipelineConfig,
    catalog: Catalog,
    table_name: str,
    batch: int,
    starts: dict[int, int],
) -> tuple[float, int]:
    """Consume from ``starts`` to the end, decode with icefloe's own converter, write with
    pyiceberg's writer, in this process; (seconds, records). The second column: what the
    pipeline's own per-record work costs in one process."""
    table = catalog.load_table(table_name)
    converter = RecordConverter.from_config(
        config.source, [TargetTable.of(TableConfig(name=table_name), table)]
    )
    pending: dict[int, list[Any]] = defaultdict(list)
    pending_n = 0
    records = 0

    def flush() -> None:
        nonlocal pending_n, records
        batches = [to_record_batch(TOPIC, p, msgs) for p, msgs in pending.items() if msgs]
        for b in batches:
            for rows in converter.convert(b).values():
                write_data_files(table, rows)
            records += b.num_rows
        pending.clear()
        pending_n = 0

    t0 = time.perf_counter()
    for msgs in consumed(bootstrap, starts):
        for msg in msgs:
            pending[int(msg.partition() or 0)].append(msg)
        pending_n += len(msgs)
        if pending_n >= batch:
            flush()
    flush()
    return time.perf_counter() - t0, records


def arrow_ceiling(
    bootstrap: str, props: dict[str, str], out: str, file_records: int, starts: dict[int, int]
) -> tuple[float, int]:
    """The fastest honest single-process program: a consumer per partition, each on its own
    thread, joins each ``consume()`` batch's values into one buffer; the main thread parses
    each buffer at once with ``pyarrow.json`` (the table's schema given, so nothing is
    inferred) and writes Parquet with ``pyarrow.parquet`` in files of ``file_records`` records
    (zstd, as pyiceberg writes); (seconds, records). No per-record Python beyond taking the
    values out of the client's messages, which confluent-kafka's API requires.

    Why threads: one consumer waits on the broker's fetches (on this machine one consumer
    alone reads at most ~170k records/s, under half a core busy), and librdkafka and pyarrow
    release the GIL while they work, so a reader per partition is what a pyarrow user who
    wants the rate writes (issue 29's sitting: 284-316k records/s, against 140k with one
    consumer doing everything in turn)."""
    # plain strings: pyiceberg's mapping says large_string, which costs more and makes the
    # same Parquet
    schema = pa.schema(
        [
            f.with_type(pa.string()) if f.type == pa.large_string() else f
            for f in schema_to_pyarrow(SCHEMA, include_field_ids=False)
        ]
    )
    parse = pa_json.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    io = load_file_io(props, out)  # the warehouse's store (local disk or S3), as the pipeline's
    buffers: queue.Queue[bytes | BaseException | None] = queue.Queue(16)

    def read(partition: int) -> None:
        try:
            for msgs in consumed(bootstrap, starts, [partition]):
                if msgs:
                    buffers.put(b"\n".join([m.value() or b"null" for m in msgs]))
        except BaseException as exc:  # the main thread re-raises it
            buffers.put(exc)
        buffers.put(None)

    t0 = time.perf_counter()
    readers = [
        threading.Thread(target=read, args=(p,), daemon=True) for p in end_offsets(bootstrap, TOPIC)
    ]
    for t in readers:
        t.start()
    writer: pq.ParquetWriter | None = None
    in_file = files = records = 0
    running = len(readers)
    while running:
        data = buffers.get()
        if data is None:
            running -= 1
            continue
        if isinstance(data, BaseException):
            raise data
        table = pa_json.read_json(pa.BufferReader(data), parse_options=parse)
        if writer is None:
            sink = io.new_output(f"{out}/{files:05d}.parquet").create(overwrite=True)
            writer = pq.ParquetWriter(sink, schema, compression="zstd")
            files += 1
        writer.write_table(table)
        in_file += table.num_rows
        records += table.num_rows
        if in_file >= file_records:
            writer.close()
            sink.close()  # a sink it was given, ParquetWriter leaves open
            writer, in_file = None, 0
    if writer is not None:
        writer.close()
        sink.close()
    return time.perf_counter() - t0, records


def cpu_seconds(
    exclude: set[int], detail: bool = False, daemons: frozenset[int] = frozenset()
) -> dict[str, float]:
    """CPU seconds (user + system) this process and every live descendant used so far, by
    kind of process (driver, jvm, python: Spark's Python workers and planners; ``daemons``,
    a standalone cluster's master and workers, apart; with ``detail`` one entry per
    process), exited children included through their parents' accounts; ``exclude``
    (broker, producer) left out. CPU time, unlike wall time, hardly depends on what else the
    machine runs."""
    me = psutil.Process()
    mine = me.cpu_times()
    out = {"driver": mine.user + mine.system}  # not its reaped children: the producer is one
    for proc in me.children(recursive=True):
        if proc.pid in exclude:
            continue
        with contextlib.suppress(psutil.NoSuchProcess):
            t = proc.cpu_times()
            kind = DAEMONS if proc.pid in daemons else "jvm" if "java" in proc.name() else "python"
            if detail:
                kind = f"{kind} {proc.pid} {' '.join(proc.cmdline()[-1:])}"
            out[kind] = out.get(kind, 0.0) + t.user + t.system + t.children_user + t.children_system
    return out


def settle(exclude: set[int], timeout_s: float = 30.0) -> float:
    """Wait until this process and its children (but ``exclude``) use under a twentieth of a
    core, at most ``timeout_s``; the seconds waited. After the query stops, Spark's JVM and
    Python workers wind down for a while: a ceiling measured beside them would pay for it, and
    the ceiling measured first more than the other."""
    t0 = time.monotonic()
    last = sum(cpu_seconds(exclude).values())
    while time.monotonic() - t0 < timeout_s:
        time.sleep(0.5)
        now = sum(cpu_seconds(exclude).values())
        if now - last < 0.025:
            break
        last = now
    return time.monotonic() - t0


def cpu_used(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(v - before.get(k, 0.0), 1) for k, v in after.items()}


@dataclass(frozen=True)
class Feed:
    """The timed records of a run, as the producer process makes them again (picklable: the
    child is spawned): ``n`` events from ``first`` on, or (``keys`` > 0) the first ``n``
    change events of :func:`change_events` over ``keys`` keys."""

    topic: str
    first: int
    n: int
    keys: int = 0
    deletes: float = 0.0
    tenants: int = 0

    def records(self) -> Iterator[tuple[bytes | None, bytes]]:
        if not self.keys:
            return events(self.first, self.n, self.tenants)
        return (
            (str(key).encode(), json.dumps(change).encode())
            for key, change in change_events(self.n, self.keys, self.deletes)
        )


def produce_when_told(bootstrap: str, feed: Feed, ready: Any, go: Any, spent: Any = None) -> None:
    """In a child process: make the events, say so, produce them on ``go``. The producer's
    CPU then stays out of the pipeline's account; ``spent`` (a shared array of two) gets the
    seconds and CPU seconds the producing took, since it shares the cores with the
    pipeline while the ceilings read a topic already full."""
    made = list(feed.records())
    ready.set()
    go.wait()
    t0, c0 = time.perf_counter(), time.process_time()
    produce(bootstrap, feed.topic, made)
    if spent is not None:
        spent[0], spent[1] = time.perf_counter() - t0, time.process_time() - c0


def process_cpu(pid: int) -> float:
    """CPU seconds ``pid`` and its children used so far (0 when it is gone)."""
    try:
        proc = psutil.Process(pid)
        times = [proc.cpu_times(), *(c.cpu_times() for c in proc.children(recursive=True))]
        return float(sum(t.user + t.system for t in times))
    except psutil.NoSuchProcess:
        return 0.0


def committed_rows(catalog: Catalog, names: Sequence[str]) -> int:
    total = 0
    for name in names:
        snap = catalog.load_table(name).current_snapshot()
        total += (
            0 if snap is None or snap.summary is None else int(snap.summary["total-records"] or 0)
        )
    return total


def snapshot_count(catalog: Catalog, names: Sequence[str]) -> int:
    return sum(len(catalog.load_table(name).snapshots()) for name in names)


def target_tables(n: int) -> list[dict[str, Any]]:
    """The pipeline's ``[[tables]]``: one table, or ``n`` up to :data:`ROUTED_MAX` routed by
    the last digit of the event id, so each takes a tenth (or so) of the events; none for
    more (those go through ``[dynamic_tables]``: :func:`dynamic_tables`)."""
    if n == 1:
        return [{"name": "bench.e2e"}]
    if n > ROUTED_MAX:
        return []
    if n < 1:
        raise SystemExit("--tables: at least 1")
    digits = [[d for d in range(10) if d % n == k] for k in range(n)]
    return [
        {
            "name": f"bench.e2e_{k}",
            "route_field": "id",
            "route_regex": f"[0-9]*[{''.join(map(str, ds))}]",
        }
        for k, ds in enumerate(digits)
    ]


# --tables above this: [dynamic_tables] by the events' "tenant" field, as a stream fanned out
# to a table per tenant is configured (a regex per table would cost a pass per table)
ROUTED_MAX = 10


def _total_records(catalog: Catalog, location: str) -> int:
    """The current snapshot's ``total-records`` from a metadata file, parsed as plain JSON:
    pyiceberg's model of the whole metadata costs several times more, and this runs in the
    driver's process, whose CPU the benchmark counts as the pipeline's."""
    with load_file_io(catalog.properties, location).new_input(location).open() as f:
        meta = json.load(f)
    current = meta.get("current-snapshot-id")
    for snap in meta.get("snapshots", []):
        if snap["snapshot-id"] == current:
            return int(snap.get("summary", {}).get("total-records") or 0)
    return 0


def table_names(n: int) -> list[str]:
    """Every table the run writes: the routed ones, or the dynamic ``bench.t<k>``."""
    if n > ROUTED_MAX:
        return [f"bench.t{k}" for k in range(n)]
    return [t["name"] for t in target_tables(n)]


class CommittedRows:
    """The rows committed to many tables, cheaply enough to poll: the SQL catalog's
    metadata locations in one query, and a table's ``total-records`` read again only when
    its location changed. Why not ``load_table`` per table: at 1,000 tables each poll would
    load 1,000 tables, competing with the pipeline for the CPU it is measured on. Reads
    pyiceberg's SQL catalog table (``iceberg_tables``) directly: a benchmark's shortcut."""

    def __init__(self, catalog: Catalog, names: Sequence[str]) -> None:
        self._catalog = catalog
        self._names = {tuple(n.rsplit(".", 1)) for n in names}
        self._rows: dict[str, int] = {}  # metadata location -> total-records

    def __call__(self) -> int:
        query = sa.text(
            "SELECT table_namespace, table_name, metadata_location FROM iceberg_tables "
            "WHERE catalog_name = :name"
        )
        engine = self._catalog.engine  # type: ignore[attr-defined]
        with engine.connect() as conn:
            rows = conn.execute(query, {"name": self._catalog.name}).all()
        total = 0
        for namespace, table, location in rows:
            if (namespace, table) not in self._names or location is None:
                continue
            if location not in self._rows:
                self._rows[location] = _total_records(self._catalog, location)
            total += self._rows[location]
        return total


def committed_offsets(catalog: Catalog, name: str) -> int:
    """How many source records the table's newest pipeline snapshot says were committed: the
    sum of its ``icefloe.source-offsets`` (next offset per partition; the topics are produced
    without transactions, so offsets are dense from 0). A keyed table's row count says nothing
    of how many change events it took in; compaction snapshots carry no offsets."""
    table = catalog.load_table(name)
    for snap in ancestors_of(table.current_snapshot(), table.metadata):
        offsets = None if snap.summary is None else snap.summary[SOURCE_OFFSETS_KEY]
        if offsets is not None:
            return sum(sum(parts.values()) for parts in json.loads(offsets).values())
    return 0


@contextlib.contextmanager
def warmed_up(
    config: PipelineConfig,
    catalog: Catalog,
    table_names: Sequence[str],
    warmup: int,
    timeout_s: float,
    by_offsets: bool = False,
) -> Iterator[tuple[Pipeline, Callable[[int], None]]]:
    """The pipeline started and warmed up on ``warmup`` records, with a ``wait_for(n)`` that
    returns once the tables' committed rows (``by_offsets``: the one table's committed source
    offsets) reach ``n``; stopped, with its Spark session, when the context ends."""
    spark = build_session(config)
    spark.sparkContext.setLogLevel("ERROR")
    pipeline = Pipeline(config, spark=spark)
    pipeline.start()

    many = len(table_names) > ROUTED_MAX
    counter = CommittedRows(catalog, table_names) if many else None

    def committed() -> int:
        if by_offsets:
            return sum(committed_offsets(catalog, name) for name in table_names)
        if counter is not None:
            return counter()
        return committed_rows(catalog, table_names)

    def wait_for(rows: int) -> None:
        deadline = time.monotonic() + timeout_s
        while committed() < rows:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{committed()} of {rows} records")
            if pipeline.query is not None and not pipeline.query.isActive:
                raise RuntimeError(f"query failed: {pipeline.query.exception()}")
            time.sleep(0.5 if many else 0.05)

    try:
        wait_for(warmup)
        yield pipeline, wait_for
    finally:
        pipeline.stop()
        spark.stop()
        if pipeline.spark_log is not None:  # its directory under /tmp, kept only on errors
            for line in sparklog.finish(pipeline.spark_log)[0]:
                print(line, flush=True)


def end_to_end(
    bootstrap: str,
    config: PipelineConfig,
    catalog: Catalog,
    table_names: Sequence[str],
    warmup: int,
    feed: Feed,
    timeout_s: float,
    broker_pid: int,
    cpu_detail: bool = False,
    daemons: frozenset[int] = frozenset(),
    by_offsets: bool = False,
) -> tuple[float, float, int, int]:
    """Warm the pipeline up on ``warmup`` records, then time the ``feed`` records;
    (seconds, CPU seconds of the pipeline's processes, Spark batches, snapshots) of the timed
    part. ``daemons``: a standalone cluster's master and workers, whose CPU is reported but
    not counted as the pipeline's. Done when the tables' committed rows (``by_offsets``: the
    one table's committed source offsets) reach the records produced."""
    with warmed_up(config, catalog, table_names, warmup, timeout_s, by_offsets) as (
        pipeline,
        wait_for,
    ):
        batches0 = pipeline.stats.batches
        snaps0 = snapshot_count(catalog, table_names)
        # generated before the clock starts, in another process: making JSON in Python is
        # the harness's work (about 8 s of one core per million events), not the pipeline's
        spawn = multiprocessing.get_context("spawn")
        ready, go = spawn.Event(), spawn.Event()
        spent = spawn.Array("d", 2)
        producer = spawn.Process(target=produce_when_told, args=(bootstrap, feed, ready, go, spent))
        producer.start()
        ready.wait()
        skip = {broker_pid, producer.pid or -1}
        broker0 = process_cpu(broker_pid)
        cpu0, t0 = cpu_seconds(skip, cpu_detail, daemons), time.perf_counter()
        go.set()
        wait_for(warmup + feed.n)
        seconds = time.perf_counter() - t0
        by_kind = cpu_used(cpu0, cpu_seconds(skip, cpu_detail, daemons))
        broker = process_cpu(broker_pid) - broker0
        cpu = sum(v for k, v in by_kind.items() if not k.startswith(DAEMONS))
        print(f"CPU by kind : {by_kind}", flush=True)
        producer.join()
        print(
            f"beside it   : the producer took {spent[0]:.1f} s and {spent[1]:.1f} CPU s to "
            f"produce the {feed.n:,} events; the broker used {broker:.1f} CPU s in the timed "
            f"part; with the pipeline's {cpu:.1f}, {(cpu + spent[1] + broker) / seconds:.2f} "
            "cores busy on average",
            flush=True,
        )
        batches = pipeline.stats.batches - batches0
        assert pipeline.query is not None
        report_batches(pipeline.query.recentProgress[-batches:])
    snapshots = snapshot_count(catalog, table_names) - snaps0
    return seconds, cpu, batches, snapshots


# --rate: the paced producer hands the client whatever is due every BURST_S seconds
BURST_S = 0.005


def produce_paced(
    bootstrap: str, feed: Feed, rate: float, ready: Any, go: Any, produced: Any, out: Any
) -> None:
    """In a child process: make the events, say so, and on ``go`` produce them at ``rate``
    records/s in small bursts (every :data:`BURST_S`, whatever is due by then), counting them
    in ``produced``. Each burst's wall-clock time, taken just before its records are handed
    to the client, is their produce time; ``[(first index, count, time)]`` and the delivery
    failures go to ``out``. A burst, not a record, is timed: per-record clock reads would cost
    more than the produce calls."""
    made = [value for _, value in feed.records()]
    failures: list[str] = []

    def report(err: Any, _msg: Any) -> None:
        if err is not None:
            failures.append(str(err))

    # the client's defaults (linger.ms 5) but for what the other producers here set
    client = Producer({"bootstrap.servers": bootstrap, "acks": "all", "compression.type": "lz4"})
    bursts: list[tuple[int, int, float]] = []
    sent = 0
    ready.set()
    go.wait()
    t0 = time.time()
    while sent < len(made):
        now = time.time()
        due = min(len(made), int((now - t0) * rate) + 1)
        if due > sent:
            bursts.append((sent, due - sent, now))
            for value in made[sent:due]:
                while True:
                    try:
                        client.produce(feed.topic, value=value, on_delivery=report)
                        break
                    except BufferError:  # the local queue is full: let deliveries drain
                        client.poll(0.01)
            sent = due
            produced.value = sent
        client.poll(0)
        time.sleep(max(0.0, max(t0 + sent / rate, now + BURST_S) - time.time()))
    left = client.flush(60)
    if left:
        failures.append(f"{left} records undelivered")
    out.put((bursts, failures))


def first_commits(catalog: Catalog, name: str, first: int, n: int) -> tuple[Any, int]:
    """When each of the events ``first .. first + n - 1`` was committed: the timestamp (s) of
    the first snapshot that added a data file holding its ``id``, read from the table's
    metadata and the added files' rows (pyiceberg's manifest reader and pyarrow, not the
    committer's summaries: the figure is then independent of the code it measures); NaN for
    an event no snapshot holds. Also how many extra copies of events append snapshots added
    (exactly once: 0)."""
    table = catalog.load_table(name)
    committed = np.full(n, np.nan)
    copies = np.zeros(n, dtype=np.int64)
    for snap in sorted(table.snapshots(), key=lambda s: s.sequence_number or 0):
        appended = snap.summary is not None and snap.summary.operation.value == "append"
        for manifest in snap.manifests(table.io):
            for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=True):
                if (
                    entry.status != ManifestEntryStatus.ADDED
                    or entry.snapshot_id != snap.snapshot_id
                ):
                    continue
                with table.io.new_input(entry.data_file.file_path).open() as f:
                    ids = pq.read_table(f, columns=["id"]).column("id").to_numpy() - first
                ids = ids[(ids >= 0) & (ids < n)]
                fresh = ids[np.isnan(committed[ids])]
                committed[fresh] = snap.timestamp_ms / 1000
                if appended:
                    np.add.at(copies, ids, 1)
    return committed, int(np.maximum(copies - 1, 0).sum())


def run_latency(
    args: argparse.Namespace,
    root: Path,
    props: dict[str, str],
    bootstrap: str,
    catalog: Catalog,
    broker_pid: int,
) -> None:
    """``--rate``: after the usual warm-up, a producer process paces ``--rate`` events/s for
    ``--seconds`` while the pipeline runs (by default at the configuration's commit and
    trigger intervals); once all are committed, each event's latency is its first commit's
    snapshot timestamp minus its produce time (:func:`first_commits`). Prints the latency's
    percentiles, the achieved rate, the pipeline's CPU, whether it kept up, and a Markdown
    row for docs/benchmarks.md."""
    create_topic(bootstrap, TOPIC, args.partitions)
    produce(bootstrap, TOPIC, events(0, args.warmup))
    name = "bench.latency"
    make_table(catalog, name)
    n = round(args.rate * args.seconds)
    feed = Feed(TOPIC, args.warmup, n)
    with spark_for(args, root) as spark:
        config = pipeline_config(args, bootstrap, props, spark, TOPIC, [{"name": name}], root)
        with warmed_up(config, catalog, [name], args.warmup, args.timeout) as (pipeline, wait_for):
            batches0 = pipeline.stats.batches
            snaps0 = snapshot_count(catalog, [name])
            spawn = multiprocessing.get_context("spawn")
            ready, go, out = spawn.Event(), spawn.Event(), spawn.Queue()
            produced = spawn.Value("q", 0)
            producer = spawn.Process(
                target=produce_paced,
                args=(bootstrap, feed, args.rate, ready, go, produced, out),
            )
            producer.start()
            ready.wait()
            skip = {broker_pid, producer.pid or -1}
            cpu0, t0 = cpu_seconds(skip, args.cpu_detail, spark.daemons), time.time()
            go.set()
            while produced.value < n:  # the committed lag, sampled while the stream runs
                if not producer.is_alive():
                    raise RuntimeError(f"the producer died after {produced.value} records")
                time.sleep(0.2)
            lag = n + args.warmup - committed_rows(catalog, [name])
            bursts, failures = out.get(timeout=120)
            producer.join()
            if failures:
                raise RuntimeError(f"{len(failures)} produce failures: {failures[:3]}")
            wait_for(args.warmup + n)
            wall = time.time() - t0
            by_kind = cpu_used(cpu0, cpu_seconds(skip, args.cpu_detail, spark.daemons))
            batches = pipeline.stats.batches - batches0
        snaps = snapshot_count(catalog, [name]) - snaps0
    produced_at = np.repeat([b[2] for b in bursts], [b[1] for b in bursts])
    last = bursts[-1][2]
    drained = t0 + wall - last
    committed, copies = first_commits(catalog, name, args.warmup, n)
    if np.isnan(committed).any() or copies:
        raise SystemExit(
            f"{int(np.isnan(committed).sum())} events never committed, {copies} extra copies"
        )
    latency = committed - produced_at
    p50, p90, p99, top = np.percentile(latency, [50, 90, 99, 100])
    quarter = max(n // 4, 1)
    early, late = np.median(latency[:quarter]), np.median(latency[-quarter:])
    interval = config.coordination.commit_interval_s
    trigger = config.spark.trigger_interval_s
    kept_up = late <= early + interval / 2
    achieved = n / max(last - bursts[0][2], 1e-9)
    cpu = sum(v for k, v in by_kind.items() if not k.startswith(DAEMONS))
    load = os.getloadavg()
    print(f"CPU by kind : {by_kind}", flush=True)
    print(
        f"stream      : {n:,} events asked at {args.rate:,.0f}/s over {args.seconds:g} s, "
        f"produced at {achieved:,.0f}/s in {len(bursts):,} bursts; commit interval "
        f"{interval:g} s, trigger {trigger:g} s; {batches} Spark batches, {snaps} snapshots\n"
        f"latency     : produce -> committed p50 {p50:.2f} s, p90 {p90:.2f} s, p99 {p99:.2f} s, "
        f"max {top:.2f} s (every event committed once)\n"
        f"kept up     : {'yes' if kept_up else 'NO'} - p50 of the first quarter {early:.2f} s, "
        f"of the last {late:.2f} s; {lag:,} events ({lag / args.rate:.1f} s of the stream) "
        f"not yet committed when the last was produced, all committed {drained:.1f} s after\n"
        f"CPU         : {cpu:.1f} s over {wall:.1f} s = {cpu / wall:.2f} cores, "
        f"{cpu / n * 1e5:.2f} s per 100k events (broker and producer not counted); "
        f"load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}",
        flush=True,
    )
    cmd = "python benchmarks/bench_e2e.py " + " ".join(sys.argv[1:])
    print("\nMarkdown row for docs/benchmarks.md:")
    print(
        f"| {datetime.now(UTC):%Y-%m-%d} | `{cmd.strip()}` | {args.rate:,.0f} / {achieved:,.0f} | "
        f"{n:,} | {interval:g} s, {trigger:g} s | {p50:.2f} | {p90:.2f} | {p99:.2f} | {top:.2f} | "
        f"{'yes' if kept_up else 'no'}: {lag:,} at the end, drained in {drained:.1f} s | "
        f"{cpu / wall:.2f} cores, {cpu / n * 1e5:.2f} s / 100k | "
        f"{os.cpu_count()} cores, load {load[0]:.1f}, {platform.python_version()} |"
    )


def report_cycles(catalog: Catalog, names: Sequence[str]) -> None:
    """How long each commit cycle took to commit its tables, from the tables' own snapshots
    (each records the cycle's commit id; the span is its first table's commit to its last)
    and how far apart the cycles started: whether many tables keep the commit interval."""
    stamps: dict[str, list[int]] = defaultdict(list)
    for name in names:
        for snap in catalog.load_table(name).snapshots():
            cid = (snap.summary.additional_properties if snap.summary else {}).get(COMMIT_ID_KEY)
            if cid:
                stamps[cid].append(snap.timestamp_ms)
    cycles = sorted((min(t), max(t), len(t)) for t in stamps.values())
    spans = sorted((hi - lo) / 1000 for lo, hi, _ in cycles)
    gaps = sorted((b[0] - a[0]) / 1000 for a, b in itertools.pairwise(cycles))
    tables = sorted(n for _, _, n in cycles)
    if not cycles:
        return
    print(
        f"cycles      : {len(cycles)}, tables per cycle median {tables[len(tables) // 2]} "
        f"(max {tables[-1]}); first to last table commit of a cycle p50 "
        f"{spans[len(spans) // 2]:.1f} s, max {spans[-1]:.1f} s; cycle starts apart p50 "
        f"{gaps[len(gaps) // 2] if gaps else float('nan'):.1f} s, max "
        f"{gaps[-1] if gaps else float('nan'):.1f} s",
        flush=True,
    )


def report_batches(progress: Sequence[Any]) -> None:
    """Where a micro-batch's time goes, from Spark's own progress reports (medians)."""
    timed = [p for p in progress if p.get("numInputRows")]
    if not timed:
        return

    def median(key: str) -> float:
        values = sorted(float(p["durationMs"].get(key, 0)) for p in timed)
        return values[len(values) // 2]

    rows = sorted(int(p["numInputRows"]) for p in timed)[len(timed) // 2]
    print(
        f"per batch   : median {rows:,} rows; latestOffset {median('latestOffset'):.0f} ms, "
        f"addBatch (read + write + commit) {median('addBatch'):.0f} ms, "
        f"whole trigger {median('triggerExecution'):.0f} ms",
        flush=True,
    )


def run_cdc(
    args: argparse.Namespace,
    root: Path,
    props: dict[str, str],
    bootstrap: str,
    catalog: Catalog,
    broker_pid: int,
) -> None:
    """``--cdc``: the same change events, each copy on its own topic, through the pipeline
    in append mode and through the keyed one (``mode = "cdc"``), one after the other, each
    warmed up and timed as :func:`end_to_end` does; ``--rounds`` times, every other round in
    the other order (``--first`` says which opens), since a pipeline inherits the driver's
    JVM, JIT-compiled, from the one before. Then each keyed table is checked against the
    final state with readers that are not the committer, and both rates (records over the
    rounds' summed seconds) and their ratio are reported.

    Why append is the yardstick: the same events, source and Spark; append mode writes every
    event (its envelope as columns), cdc mode the last image per key and batch, plus the
    coordinator's key resolution and position deletes."""
    catalog.create_namespace("bench")
    modes = ["append", "cdc"] if args.first == "append" else ["cdc", "append"]
    seconds: dict[str, float] = dict.fromkeys(modes, 0.0)
    cpus: dict[str, float] = dict.fromkeys(modes, 0.0)
    keyed_tables: list[str] = []
    for r in range(args.rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            name = f"bench.{mode}_{r}"
            if mode == "cdc":
                keyed_tables.append(name)
                catalog.create_table(name, schema=KEYED_SCHEMA, properties={"format-version": "2"})
                target = {
                    "name": name,
                    "mode": "cdc",
                    "id_columns": ["id"],
                    "compact": args.compact,
                }
            else:
                catalog.create_table(name, schema=CHANGE_SCHEMA)
                target = {"name": name}
            topic = f"bench-{mode}-{r}"
            create_topic(bootstrap, topic, args.partitions)
            warm = warm_changes(args.warmup, args.keys)
            produce(bootstrap, topic, ((str(k).encode(), json.dumps(c).encode()) for k, c in warm))
            feed = Feed(topic, args.warmup, args.records, args.keys, args.deletes)
            waited = settle({broker_pid})  # the previous pipeline's processes wind down first
            work = root / f"{mode}-{r}"
            with spark_for(args, work) as spark:
                config = pipeline_config(args, bootstrap, props, spark, topic, [target], work)
                s, cpu, batches, snaps = end_to_end(
                    bootstrap,
                    config,
                    catalog,
                    [name],
                    args.warmup,
                    feed,
                    args.timeout,
                    broker_pid,
                    args.cpu_detail,
                    spark.daemons,
                    by_offsets=True,
                )
            seconds[mode] += s
            cpus[mode] += cpu
            print(
                f"round {r + 1}, {mode:6}: {args.records:,} change events in {s:.1f}s = "
                f"{args.records / s:,.0f} events/s ({batches} Spark batches, {snaps} snapshots), "
                f"{cpu:.1f} CPU s (after waiting {waited:.1f} s for quiet)",
                flush=True,
            )
            if mode == "append":
                appended = committed_rows(catalog, [name])
                if appended != args.warmup + args.records:
                    raise SystemExit(f"{name}: {appended} rows, not {args.warmup + args.records}")
    want = final_state(args.warmup, Feed("", 0, args.records, args.keys, args.deletes))
    files = [check_keyed(catalog, name, want) for name in keyed_tables]
    a_rate, c_rate = (args.rounds * args.records / seconds[m] for m in ("append", "cdc"))
    ratio = c_rate / a_rate
    cpu_ratio = cpus["cdc"] / cpus["append"]
    left = ", ".join(f"{d} / {x}" for d, x in files)
    print(
        f"cdc/append over {args.rounds} round(s): {ratio:.2f} of the append rate, "
        f"{cpu_ratio:.2f}x its CPU; keyed tables checked: {len(want):,} live rows each, in "
        f"{left} data / delete files"
    )
    load = os.getloadavg()[0]
    cmd = "python benchmarks/bench_e2e.py " + " ".join(sys.argv[1:])
    print("\nMarkdown row for docs/benchmarks.md:")
    print(
        f"| {datetime.now(UTC):%Y-%m-%d} | `{cmd.strip()}` | {args.records:,} | {args.keys:,} | "
        f"{args.deletes:.0%} | {args.partitions} | {a_rate:,.0f} | {c_rate:,.0f} | "
        f"**{ratio:.2f}** | {cpu_ratio:.2f} | {len(want):,} rows in {left} files | "
        f"{os.cpu_count()} cores, load {load:.1f}, {platform.python_version()} |"
    )


def check_keyed(catalog: Catalog, name: str, want: dict[int, tuple[str, int]]) -> tuple[int, int]:
    """The keyed table must hold exactly ``want`` (id -> (session, user_id)), read twice:
    fastavro and pyarrow over its files minus their position deletes, and pyiceberg's scan;
    its live data and delete files."""
    columns = ("id", "session", "user_id")
    table = catalog.load_table(name)
    by_hand = independent_rows(table, columns)
    scanned = table.scan(selected_fields=columns).to_arrow().to_pylist()
    for reader, got in (("files minus deletes", by_hand), ("pyiceberg scan", scanned)):
        rows = [tuple(r[c] for c in columns) if isinstance(r, dict) else r for r in got]
        state = {r[0]: (r[1], r[2]) for r in rows}
        if len(state) != len(rows) or state != want:
            missing, extra = want.keys() - state.keys(), state.keys() - want.keys()
            stale = sum(1 for k in want.keys() & state.keys() if want[k] != state[k])
            raise SystemExit(
                f"{name} ({reader}): {len(rows) - len(state)} duplicate, {len(missing)} "
                f"missing, {len(extra)} extra, {stale} stale rows"
            )
    data, deletes = live_files(table)
    return len(data), len(deletes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--records", type=int, default=500_000)
    ap.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed records first (default: 500,000, 20,000 with --cdc). A warm-up of one\n"
        "task started only two of local[2]'s four Python workers (a ranges-path task holds\n"
        "one for the source's read and one for the sink's write), so the timed part paid the\n"
        "other two's start-up (imports, catalog) that a running pipeline pays once: 500,000\n"
        "records are four tasks, two at a time",
    )
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument(
        "--tables",
        type=int,
        default=1,
        help=f"target tables: up to {ROUTED_MAX} routed by the id's last digit, more through "
        "[dynamic_tables] by a tenant field the events then carry",
    )
    ap.add_argument(
        "--commit-processes",
        type=int,
        default=0,
        help="coordination.commit_processes (0: the coordinator's process commits)",
    )
    ap.add_argument(
        "--batch",
        type=int,
        default=SourceConfig.model_fields["max_records_per_batch"].default,
        help="source.max_records_per_batch of the pipeline (default: the configuration's)",
    )
    ap.add_argument(
        "--task-records",
        type=int,
        default=SparkConfig.model_fields["max_records_per_task"].default,
        help="spark.max_records_per_task of the pipeline (default: the configuration's)",
    )
    ap.add_argument(
        "--first-batch",
        type=int,
        default=None,
        help="source.first_batch_records (default: none, no ramp: the warm-up is one batch, "
        "so a ramp would still be shrinking the timed part's first batches; "
        "benchmarks/bench_startup.py --backlog measures it)",
    )
    ap.add_argument("--write", type=int, default=100_000, help="records per ceiling write")
    ap.add_argument(
        "--cdc",
        action="store_true",
        help="Debezium change events (--keys ids, --deletes of them deletes) through the "
        "pipeline in append mode and in cdc mode, one after the other; no ceilings",
    )
    ap.add_argument("--keys", type=int, default=100_000, help="--cdc: distinct ids")
    ap.add_argument("--deletes", type=float, default=0.3, help="--cdc: share of deletes")
    ap.add_argument("--compact", action="store_true", help="--cdc: compact = true on the table")
    ap.add_argument(
        "--rounds", type=int, default=2, help="--cdc: rounds of both runs, order alternating"
    )
    ap.add_argument(
        "--first",
        default="append",
        choices=("append", "cdc"),
        help="--cdc: the pipeline run first (a run reuses the driver's JVM warmed by the last)",
    )
    ap.add_argument("--backend", default="kafka")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--master", default="local[2]")
    where.add_argument(
        "--cluster",
        type=int,
        default=0,
        metavar="N",
        help="run Spark on a standalone cluster of N 1-core workers started here",
    )
    ap.add_argument("--data-path", default="ranges", choices=("ranges", "records"))
    ap.add_argument(
        "--commit-interval",
        type=float,
        default=None,
        help="coordination.commit_interval_s (default: 2; with --rate the configuration's)",
    )
    ap.add_argument(
        "--interval-from",
        default="start",
        choices=("start", "end"),
        help="coordination.commit_interval_from (default: start)",
    )
    ap.add_argument(
        "--trigger-interval",
        type=float,
        default=None,
        help="spark.trigger_interval_s (default: 0, back to back; with --rate the configuration's)",
    )
    ap.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="latency instead of throughput: produce this many events/s, paced, for "
        "--seconds while the pipeline runs, and report produce -> committed percentiles",
    )
    ap.add_argument("--seconds", type=float, default=60.0, help="--rate: how long to produce")
    ap.add_argument("--cpu-detail", action="store_true", help="CPU seconds per process")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--dir", type=Path, default=None, help="work directory (default: a temp dir)")
    ap.add_argument(
        "--store",
        default="file",
        choices=("file", "s3"),
        help="the warehouse: local disk, or a bucket of moto's S3 server (started here)",
    )
    ap.add_argument(
        "--catalog",
        default="sqlite",
        choices=("sqlite", "postgres"),
        help="the Iceberg catalog: an SQLite file in the work directory, or pyiceberg's SQL "
        "catalog in a new database of the machine's PostgreSQL (ICEFLOE_TEST_POSTGRES_DSN), "
        "which with --store s3 is all a --cluster shares besides the broker",
    )
    args = ap.parse_args()
    if args.warmup is None:
        args.warmup = 20_000 if args.cdc else 500_000
    # a throughput run keeps the pipeline busy; a latency run measures what a user's
    # defaults give
    if args.commit_interval is None:
        args.commit_interval = (
            CoordinationConfig.model_fields["commit_interval_s"].default if args.rate else 2.0
        )
    if args.trigger_interval is None:
        args.trigger_interval = (
            SparkConfig.model_fields["trigger_interval_s"].default if args.rate else 0.0
        )
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

    root = args.dir or Path(tempfile.mkdtemp(prefix="icefloe-bench-"))
    if args.dir is None:  # a run of 2 million records leaves ~1 GB: not kept unless asked
        atexit.register(shutil.rmtree, root, True)
    root.mkdir(parents=True, exist_ok=True)
    props = {
        "type": "sql",
        "uri": f"sqlite:///{root / 'catalog.db'}",
        "warehouse": f"file://{root / 'warehouse'}",
    }
    with contextlib.ExitStack() as services:
        if args.store == "s3":  # every data and metadata file goes over HTTP to the store
            store = services.enter_context(running_s3_store())
            props.update(store.warehouse_properties(store.new_warehouse()))
        if args.catalog == "postgres":  # dropped, connections and all, when the run ends
            props["uri"] = services.enter_context(postgres_catalog_database())
        run(args, root, props)


@dataclass(frozen=True)
class Spark:
    """Where the pipelines' Spark runs: its master, the conf a standalone cluster needs, and
    the cluster daemons' process ids (their CPU is not the pipeline's)."""

    master: str
    conf: dict[str, str]
    daemons: frozenset[int]


@contextlib.contextmanager
def spark_for(args: argparse.Namespace, root: Path) -> Iterator[Spark]:
    """``--master``, or a standalone cluster of ``--cluster`` workers living as long as the
    context (the ceilings run after it is gone)."""
    if not args.cluster:
        yield Spark(args.master, {}, frozenset())
        return
    with standalone_cluster(
        root / "spark-cluster", workers=args.cluster, cores=1, memory=WORKER_MEMORY
    ) as cluster:
        yield Spark(
            cluster.master_url,
            {
                "spark.driver.host": "127.0.0.1",
                "spark.executor.cores": "1",
                "spark.executor.memory": EXECUTOR_MEMORY,
                "spark.cores.max": str(args.cluster),
                # schedule once every executor joined, so all of them take tasks
                "spark.scheduler.minRegisteredResourcesRatio": "1.0",
            },
            frozenset(cluster.pids),
        )


def pipeline_config(
    args: argparse.Namespace,
    bootstrap: str,
    props: dict[str, str],
    spark: Spark,
    topic: str,
    targets: list[dict[str, Any]],
    work: Path,
) -> PipelineConfig:
    """The pipeline's configuration: ``topic`` into ``targets``, its Spark checkpoint in
    ``work``, everything else from the command line."""
    backend_section: dict[str, Any] = {}
    if args.backend == "kafka":
        backend_section = {"bootstrap_servers": bootstrap}
    elif args.backend == "postgres":  # the machine's server, as the tests use it
        dsn = "host=127.0.0.1 port=5432 user=postgres dbname=test"
        backend_section = {"dsn": os.environ.get("ICEFLOE_POSTGRES_DSN", dsn)}
    return config_from_dict(
        {
            "name": f"bench-{work.name}-{int(time.time())}",
            "source": {
                "bootstrap_servers": bootstrap,
                "topics": [topic],
                "max_records_per_batch": args.batch,
                "first_batch_records": args.first_batch,
            },
            "tables": targets,
            **(
                {"dynamic_tables": {"route_field": "tenant", "namespace": "bench"}}
                if args.tables > ROUTED_MAX
                else {}
            ),
            "catalog": {"name": "bench", "properties": props},
            "coordination": {
                "backend": args.backend,
                "commit_interval_s": args.commit_interval,
                "commit_interval_from": args.interval_from,
                "commit_processes": args.commit_processes,
                args.backend: backend_section,
            },
            "spark": {
                "master": spark.master,
                "checkpoint_location": str(work / "checkpoint"),
                "trigger_interval_s": args.trigger_interval,
                "data_path": args.data_path,
                "max_records_per_task": args.task_records,
                "conf": {"spark.ui.enabled": "false", **spark.conf},
            },
        }
    )


def run(args: argparse.Namespace, root: Path, props: dict[str, str]) -> None:
    """The broker, the pipeline and the ceiling on the warehouse of ``props``."""
    with EmbeddedKafkaBroker(log_path=root / "broker.log") as broker:
        bootstrap = broker.bootstrap_servers
        assert broker.proc is not None
        catalog = load_catalog("bench", **props)
        if args.cdc:
            run_cdc(args, root, props, bootstrap, catalog, broker.proc.pid)
            return
        if args.rate:
            run_latency(args, root, props, bootstrap, catalog, broker.proc.pid)
            return
        tenants = args.tables if args.tables > ROUTED_MAX else 0
        create_topic(bootstrap, TOPIC, args.partitions)
        produce(bootstrap, TOPIC, events(0, args.warmup, tenants))
        warm_ends = end_offsets(bootstrap, TOPIC)
        make_table(catalog, "bench.ceiling")
        targets = target_tables(args.tables)
        names = table_names(args.tables)
        for name in names:
            make_table(catalog, name)
        with spark_for(args, root) as spark:
            config = pipeline_config(args, bootstrap, props, spark, TOPIC, targets, root)
            e_s, e_cpu, batches, snaps = end_to_end(
                bootstrap,
                config,
                catalog,
                names,
                args.warmup,
                Feed(TOPIC, args.warmup, args.records, tenants=tenants),
                args.timeout,
                broker.proc.pid,
                args.cpu_detail,
                spark.daemons,
            )
        e_rate = args.records / e_s
        print(
            f"end to end  : {args.records:,} records in {e_s:.1f}s = {e_rate:,.0f} records/s "
            f"({batches} Spark batches, {snaps} snapshots), {e_cpu:.1f} CPU s",
            flush=True,
        )
        if tenants:
            report_cycles(catalog, names)
        ceilings: dict[str, Callable[[], tuple[float, int]]] = {
            "pyarrow": lambda: arrow_ceiling(
                bootstrap, props, f"{props['warehouse']}/ceiling-parquet", args.write, warm_ends
            ),
            "converter": lambda: converter_ceiling(
                bootstrap, config, catalog, "bench.ceiling", args.write, warm_ends
            ),
        }
        rates: dict[str, float] = {}
        cpus: dict[str, float] = {}
        for name, run in ceilings.items():
            waited = settle({broker.proc.pid})
            cpu0 = time.process_time()  # every thread of this process: pyarrow's too
            c_s, c_n = run()
            cpus[name] = time.process_time() - cpu0
            assert c_n == args.records, f"{name} ceiling read {c_n} of {args.records} records"
            rates[name] = c_n / c_s
            print(
                f"ceiling, {name:9}: {c_n:,} records in {c_s:.1f}s = {rates[name]:,.0f} "
                f"records/s, {cpus[name]:.1f} CPU s (after waiting {waited:.1f} s for the "
                "pipeline's processes to go quiet)"
            )
        for name in ceilings:
            print(
                f"against {name:9}: the pipeline at {e_rate / rates[name]:.0%} of its rate, "
                f"{e_cpu / cpus[name]:.2f}x its CPU time per record "
                "(broker and producer not counted)"
            )
        load = os.getloadavg()[0]
        cmd = "python benchmarks/bench_e2e.py " + " ".join(sys.argv[1:])
        on = f", standalone cluster of {args.cluster} x 1 core" if args.cluster else ""
        on += ", warehouse in moto's S3" if args.store == "s3" else ""
        on += ", catalog on PostgreSQL" if args.catalog == "postgres" else ""
        print("\nMarkdown row for docs/benchmarks.md:")
        print(
            f"| {datetime.now(UTC):%Y-%m-%d} | `{cmd.strip()}` | {args.records:,} | "
            f"{args.partitions} | {args.backend}, {args.data_path}, {args.tables} table(s){on} | "
            f"{rates['pyarrow']:,.0f} | {rates['converter']:,.0f} | {e_rate:,.0f} | "
            f"{e_rate / rates['pyarrow']:.0%} | {e_rate / rates['converter']:.0%} | "
            f"{e_cpu / cpus['pyarrow']:.2f} | {e_cpu / cpus['converter']:.2f} | "
            f"{os.cpu_count()} cores, load {load:.1f}, {platform.python_version()} |"
        )


if __name__ == "__main__":
    main()
