"""Kafka (a real Tansu broker) -> Spark (local) -> Iceberg (SqlCatalog): exactly once, with each
coordination backend, through a driver crash at the dangerous moment and a failed task.

Every test counts the table's rows against the records produced: each id exactly once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import tomli_w
from pyiceberg.catalog import Catalog, load_catalog
from pyiceberg.schema import Schema
from pyiceberg.table.name_mapping import MappedField, NameMapping
from pyiceberg.types import LongType, NestedField, StringType

from icefloe.config import config_from_dict
from icefloe.errors import WriterRegressionError
from icefloe.plugins.backends import open_backend
from icefloe.plugins.manager import get_plugins
from icefloe.testing.fixtures import (
    EVENTS_SCHEMA,
    EVENTS_SPEC,
    assert_exactly_once,
    data_file_ids,
    group_snapshots,
)
from icefloe_kafka.embedded import EmbeddedKafkaBroker
from icefloe_spark import faults
from icefloe_spark.kafka.admin import create_topic, end_offsets, produce
from icefloe_spark.pipeline import CoordinatorThread, Pipeline
from icefloe_spark.sink.datasource import derive_writer_id
from icefloe_spark.sink.publish import PublishStats

TABLE = "e2e.events"
SCHEMA = EVENTS_SCHEMA
SPEC = EVENTS_SPEC
# Tansu's ListOffsets answers the last batch's base offset + 1: learn partition ends by fetching
SOURCE_OPTIONS = {"probeHighWatermark": "true", "pollTimeoutMs": "10000"}
WAIT_S = float(os.environ.get("ICEFLOE_TEST_WAIT_S", "180"))  # more on a loaded machine
BACKENDS = ("kafka", "postgres", "redis")
FAULT_BACKEND = os.environ.get("ICEFLOE_TEST_FAULT_BACKEND", "kafka")  # the default backend
POSTGRES_DSN = os.environ.get(
    "ICEFLOE_TEST_POSTGRES_DSN", "host=127.0.0.1 port=5432 user=postgres dbname=test"
)
REDIS_URL = os.environ.get("ICEFLOE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``predicate`` until true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.5)


def require_server(host: str, port: int, what: str) -> None:
    """Fail (never skip) when a server the test needs is not listening."""
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError as exc:
        pytest.fail(f"{what} is not reachable on {host}:{port} ({exc}); start it")


def backend_section(backend: str, broker: EmbeddedKafkaBroker) -> dict[str, Any]:
    """The ``[coordination.<backend>]`` section for a real server of that backend."""
    if backend == "kafka":
        return {"bootstrap_servers": broker.bootstrap_servers}
    if backend == "postgres":
        require_server("127.0.0.1", 5432, "PostgreSQL")
        return {"dsn": POSTGRES_DSN}
    require_server("127.0.0.1", 6379, "Redis")
    return {"url": REDIS_URL}


def produce_json(bootstrap: str, topic: str, ids: range) -> None:
    """One JSON record per id, keyed by id so they spread over the partitions."""
    produce(
        bootstrap,
        topic,
        (
            (str(i).encode(), json.dumps({"id": i, "name": f"n{i}", "kind": "abc"[i % 3]}).encode())
            for i in ids
        ),
    )


def new_topic(broker: EmbeddedKafkaBroker, partitions: int = 2) -> str:
    topic = f"t-{uuid.uuid4().hex[:10]}"
    create_topic(broker.bootstrap_servers, topic, partitions)
    return topic


def pipeline_dict(
    name: str,
    broker: EmbeddedKafkaBroker,
    topic: str,
    catalog_properties: dict[str, str],
    backend: str,
    checkpoint: Path,
    batch: int = 250,
) -> dict[str, Any]:
    return {
        "name": name,
        "source": {
            "bootstrap_servers": broker.bootstrap_servers,
            "topics": [topic],
            "max_records_per_batch": batch,
        },
        "tables": [{"name": TABLE}],
        "catalog": {"name": "e2e", "properties": catalog_properties},
        "coordination": {
            "backend": backend,
            "commit_interval_s": 1.0,
            "commit_timeout_s": 5.0,
            "lease_ttl_s": 3.0,
            backend: backend_section(backend, broker),
        },
        "spark": {
            "master": "local[2]",
            "checkpoint_location": str(checkpoint),
            "trigger_interval_s": 0.2,
            "conf": {"spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "2"},
        },
    }


def make_table(catalog_properties: dict[str, str]) -> Catalog:
    catalog = load_catalog("e2e", **catalog_properties)
    catalog.create_namespace("e2e")
    catalog.create_table(TABLE, schema=SCHEMA, partition_spec=SPEC)
    return catalog


def committed_rows(catalog: Catalog) -> int:
    snap = catalog.load_table(TABLE).current_snapshot()
    return 0 if snap is None or snap.summary is None else int(snap.summary["total-records"] or 0)


def committed_paths(catalog: Catalog) -> list[str]:
    return [t.file.file_path for t in catalog.load_table(TABLE).scan().plan_files()]


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_record_lands_exactly_once(
    backend: str,
    spark: Any,
    kafka_broker: EmbeddedKafkaBroker,
    catalog_properties: dict[str, str],
    tmp_path: Path,
) -> None:
    bootstrap = kafka_broker.bootstrap_servers
    topic = new_topic(kafka_broker)
    catalog = make_table(catalog_properties)
    name = f"e2e-{backend}-{uuid.uuid4().hex[:10]}"
    config = config_from_dict(
        pipeline_dict(name, kafka_broker, topic, catalog_properties, backend, tmp_path / "ckpt")
    )
    produce_json(bootstrap, topic, range(600))
    with Pipeline(config, spark=spark, source_extra_options=SOURCE_OPTIONS) as pipeline:
        wait_until(lambda: committed_rows(catalog) >= 600, WAIT_S, "the first 600 rows")
        produce_json(bootstrap, topic, range(600, 1000))  # while the query runs
        wait_until(lambda: committed_rows(catalog) >= 1000, WAIT_S, "all 1000 rows")
        assert pipeline.stats.batches >= 4  # 250 records per batch at most
        assert pipeline.stats.records == 1000
    assert_exactly_once(catalog, TABLE, range(1000))
    snapshots = group_snapshots(catalog, TABLE, name)
    assert snapshots, "no snapshot carries the pipeline's group id"
    assert snapshots[-1].summary is not None
    recorded = json.loads(snapshots[-1].summary.additional_properties["icefloe.source-offsets"])
    ends = end_offsets(bootstrap, topic)
    assert recorded == {topic: {str(p): o for p, o in ends.items()}}
    assert len(set(committed_paths(catalog))) == len(committed_paths(catalog))


@pytest.mark.parametrize("data_path", ["ranges", "records"])
def test_each_data_path_commits_every_record_once_with_partitions_split_over_tasks(
    data_path: str,
    spark: Any,
    kafka_broker: EmbeddedKafkaBroker,
    catalog_properties: dict[str, str],
    tmp_path: Path,
) -> None:
    """``ranges`` (the default): the source's rows are offset ranges, one per task, and the
    sink's tasks read the records; a partition's range longer than max_records_per_task is
    split over several tasks. ``records``: Spark moves the records themselves."""
    bootstrap = kafka_broker.bootstrap_servers
    topic = new_topic(kafka_broker, partitions=1)
    catalog = make_table(catalog_properties)
    name = f"e2e-path-{uuid.uuid4().hex[:10]}"
    data = pipeline_dict(name, kafka_broker, topic, catalog_properties, "kafka", tmp_path / "c")
    data["spark"].update({"data_path": data_path, "max_records_per_task": 40})
    produce_json(bootstrap, topic, range(300))
    with Pipeline(config_from_dict(data), spark=spark, source_extra_options=SOURCE_OPTIONS) as p:
        wait_until(lambda: committed_rows(catalog) >= 300, WAIT_S, "all 300 rows")
        assert p.query is not None
        progress = [r for r in p.query.recentProgress if r["numInputRows"]]
        assert p.stats.records == 300
    input_rows: int = sum(r["numInputRows"] for r in progress)
    if data_path == "ranges":  # ranges of at most 40 offsets: no record crossed the JVM
        assert input_rows == sum(-(-n // 40) for n in batch_sizes(progress))
    else:
        assert input_rows == 300
    assert_exactly_once(catalog, TABLE, range(300))


def test_commit_tasks_commit_on_the_executors_every_record_once(
    spark: Any,
    kafka_broker: EmbeddedKafkaBroker,
    catalog_properties: dict[str, str],
    tmp_path: Path,
) -> None:
    """``spark.commit_tasks``: the driver's coordinator commits each cycle as a Spark job
    (the job group of the pipeline's committers), every record once."""
    bootstrap = kafka_broker.bootstrap_servers
    topic = new_topic(kafka_broker)
    catalog = make_table(catalog_properties)
    name = f"e2e-tasks-{uuid.uuid4().hex[:10]}"
    data = pipeline_dict(name, kafka_broker, topic, catalog_properties, "kafka", tmp_path / "c")
    data["spark"]["commit_tasks"] = 2
    produce_json(bootstrap, topic, range(300))
    with Pipeline(config_from_dict(data), spark=spark, source_extra_options=SOURCE_OPTIONS) as p:
        wait_until(lambda: committed_rows(catalog) >= 300, WAIT_S, "all 300 rows")
        (committers,) = p.spark_committers
    jobs = spark.sparkContext.statusTracker().getJobIdsForGroup(committers.job_group)
    assert len(jobs) > len(group_snapshots(catalog, TABLE, name)) >= 1  # and a warm-up
    assert_exactly_once(catalog, TABLE, range(300))


def batch_sizes(progress: Sequence[Mapping[str, Any]]) -> list[int]:
    """Offsets each batch spanned (its one partition's end minus start)."""
    out = []
    for report in progress:
        (source,) = report["sources"]
        start, end = (
            (json.loads(x) if isinstance(x, str) else x) or {}  # none: the topic's beginning
            for x in (source["startOffset"], source["endOffset"])
        )
        out += [
            int(o) - int(start.get(t, {}).get(p, 0))
            for t, parts in end.items()
            for p, o in parts.items()
        ]
    return out


def test_a_backlog_is_read_in_batches_that_start_small_and_grow_to_the_maximum(
    spark: Any,
    kafka_broker: EmbeddedKafkaBroker,
    catalog_properties: dict[str, str],
    tmp_path: Path,
) -> None:
    """``source.first_batch_records``: on a backlog the first micro-batch is small (so the
    first commit comes early), each next one as large as ``max_records_per_batch`` allows;
    every record is still committed once. Batch sizes come from Spark's own progress
    reports, the rows from the table's Parquet files read by pyarrow."""
    bootstrap = kafka_broker.bootstrap_servers
    topic = new_topic(kafka_broker)
    catalog = make_table(catalog_properties)
    name = f"e2e-ramp-{uuid.uuid4().hex[:10]}"
    data = pipeline_dict(
        name, kafka_broker, topic, catalog_properties, "kafka", tmp_path / "c", batch=100
    )
    data["source"]["first_batch_records"] = 25
    produce_json(bootstrap, topic, range(300))  # the backlog, before the start
    with Pipeline(config_from_dict(data), spark=spark, source_extra_options=SOURCE_OPTIONS) as p:
        wait_until(lambda: committed_rows(catalog) >= 300, WAIT_S, "all 300 rows")
        assert p.query is not None
        progress = [r for r in p.query.recentProgress if r["numInputRows"]]
    # 25, then at most 100 (the maximum), the rest last
    assert [sum(batch_sizes([r])) for r in progress] == [25, 100, 100, 75]
    paths = [path.removeprefix("file://") for path in committed_paths(catalog)]
    ids = sorted(pq.read_table(paths, columns=["id"], partitioning=None)["id"].to_pylist())
    assert ids == list(range(300))


def test_fresh_checkpoint_at_the_same_place_resumes_from_the_table_and_loses_nothing(
    spark: Any,
    kafka_broker: EmbeddedKafkaBroker,
    catalog_properties: dict[str, str],
    tmp_path: Path,
) -> None:
    """A checkpoint deleted and started afresh restarts Spark's batch ids at 0. Resuming from
    the offsets recorded in the table must commit the new records, not drop them as replays
    of the old checkpoint's batches (the writer id changes with the checkpoint)."""
    bootstrap = kafka_broker.bootstrap_servers
    topic = new_topic(kafka_broker)
    catalog = make_table(catalog_properties)
    name = f"e2e-reset-{uuid.uuid4().hex[:10]}"
    checkpoint = tmp_path / "ckpt"
    data = pipeline_dict(name, kafka_broker, topic, catalog_properties, "kafka", checkpoint)
    data["source"]["starting_offsets"] = "table"
    config = config_from_dict(data)
    produce_json(bootstrap, topic, range(300))
    with Pipeline(config, spark=spark, source_extra_options=SOURCE_OPTIONS) as first:
        wait_until(lambda: committed_rows(catalog) >= 300, WAIT_S, "the first 300 rows")
        first_writer = first.writer_id
    shutil.rmtree(checkpoint)
    produce_json(bootstrap, topic, range(300, 500))
    with Pipeline(config, spark=spark, source_extra_options=SOURCE_OPTIONS) as second:
        assert second.writer_id != first_writer
        wait_until(lambda: committed_rows(catalog) >= 500, WAIT_S, "the 200 rows after the reset")
    assert_exactly_once(catalog, TABLE, range(500))


def test_table_on_its_own_branch_with_merged_small_files_resumes_from_that_branch(
    spark: Any,
    kafka_broker: EmbeddedKafkaBroker,
    catalog_properties: dict[str, str],
    tmp_path: Path,
) -> None:
    """``tables.branch`` and ``merge_small_files`` through ``icefloe run``'s pipeline: ranges
    split over many tasks each write a file per partition, the coordinator commits one file per
    partition per cycle to branch ``audit`` (main untouched), and a fresh checkpoint with
    ``starting_offsets = "table"`` resumes from the offsets on that branch."""
    bootstrap = kafka_broker.bootstrap_servers
    topic = new_topic(kafka_broker, partitions=1)
    catalog = make_table(catalog_properties)
    name = f"e2e-branch-{uuid.uuid4().hex[:10]}"
    checkpoint = tmp_path / "ckpt"
    data = pipeline_dict(name, kafka_broker, topic, catalog_properties, "kafka", checkpoint)
    data["tables"] = [{"name": TABLE, "branch": "audit", "merge_small_files": True}]
    data["source"]["starting_offsets"] = "table"
    data["spark"]["max_records_per_task"] = 40
    config = config_from_dict(data)

    def on_audit() -> int:
        head = catalog.load_table(TABLE).snapshot_by_name("audit")
        summary = None if head is None else head.summary
        return 0 if summary is None else int(summary["total-records"] or 0)

    produce_json(bootstrap, topic, range(300))
    with Pipeline(config, spark=spark, source_extra_options=SOURCE_OPTIONS):
        wait_until(lambda: on_audit() >= 300, WAIT_S, "the first 300 rows on branch audit")
    shutil.rmtree(checkpoint)
    produce_json(bootstrap, topic, range(300, 500))
    with Pipeline(config, spark=spark, source_extra_options=SOURCE_OPTIONS):
        wait_until(lambda: on_audit() >= 500, WAIT_S, "the 200 rows after the reset")
    assert_exactly_once(catalog, TABLE, range(500), branch="audit")
    assert catalog.load_table(TABLE).current_snapshot() is None  # main untouched
    snapshots = group_snapshots(catalog, TABLE, name)
    added = [int(s.summary["added-data-files"] or 0) for s in snapshots if s.summary]
    assert added
    assert max(added) <= 3, added  # one file per partition (kind a, b, c) and cycle


def test_failed_task_attempt_commits_no_file_and_no_duplicate(
    spark: Any,
    kafka_broker: EmbeddedKafkaBroker,
    catalog_properties: dict[str, str],
    tmp_path: Path,
) -> None:
    """The first attempt of input partition 0 of every batch writes its files, then fails;
    Spark retries it (``local[2,2]`` allows two attempts)."""
    bootstrap = kafka_broker.bootstrap_servers
    topic = new_topic(kafka_broker)
    catalog = make_table(catalog_properties)
    markers = tmp_path / "faults"
    config = config_from_dict(
        pipeline_dict(
            f"e2e-taskfail-{uuid.uuid4().hex[:10]}",
            kafka_broker,
            topic,
            catalog_properties,
            FAULT_BACKEND,
            tmp_path / "ckpt",
            batch=200,
        )
    )
    fault = {faults.FAIL_TASK_OPTION: json.dumps({"partition": 0, "marker_dir": str(markers)})}
    produce_json(bootstrap, topic, range(400))
    with Pipeline(
        config, spark=spark, source_extra_options=SOURCE_OPTIONS, sink_extra_options=fault
    ):
        wait_until(lambda: committed_rows(catalog) >= 400, WAIT_S, "all 400 rows")
    failed = [json.loads(p.read_text()) for p in sorted(markers.glob("failed-*.json"))]
    assert failed, "the fault never fired"
    failed_files = {f for m in failed for f in m["files"]}
    assert failed_files, "the failed attempts wrote no file, so the test proves nothing"
    assert all(m["attempt"] == 0 for m in failed)
    paths = committed_paths(catalog)
    assert not failed_files & set(paths), "a file of a failed attempt was committed"
    assert len(set(paths)) == len(paths)
    for f in failed_files:  # the failed attempt cleaned up after itself
        assert not Path(f.removeprefix("file://")).exists()
    assert_exactly_once(catalog, TABLE, range(400))


@contextlib.contextmanager
def driver(config_file: Path, log: Path, env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """``icefloe run`` as its own process group (its JVM and Python workers with it)."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "icefloe", "run", "--config", str(config_file), "--quiet"),
                *(a for k, v in SOURCE_OPTIONS.items() for a in ("--source-option", f"{k}={v}")),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # a JVM left behind by the dead driver


def crash_after_publishing_batch_1(
    config_file: Path, log: Path, ckpt: Path, timeout: float, batch: int = 1
) -> None:
    """Run ``icefloe run`` until it exits right after publishing ``batch`` (default 1),
    before Spark recorded that batch in the checkpoint."""
    env = {
        **os.environ,
        "PYSPARK_PYTHON": sys.executable,
        faults.EXIT_AFTER_PUBLISH_ENV: str(batch),
    }
    with driver(config_file, log, env) as first:
        code = first.wait(timeout)
    assert code == faults.EXIT_CODE, f"driver exited {code}; log:\n{log.read_text()[-3000:]}"
    assert (ckpt / "offsets" / str(batch)).exists(), f"Spark never planned batch {batch}"
    assert not (ckpt / "commits" / str(batch)).exists(), (
        f"Spark recorded batch {batch}: the crash came late"
    )


def run_driver_until(
    config_file: Path, log: Path, done: Callable[[], bool], timeout: float, what: str
) -> None:
    """Run ``icefloe run`` until ``done()``, then stop it with SIGTERM: it must exit 0."""
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
    with driver(config_file, log, env) as proc:
        wait_until(lambda: done() or proc.poll() is not None, timeout, what)
        assert proc.poll() is None, f"the driver died; log:\n{log.read_text()[-3000:]}"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, "the driver did not stop cleanly on SIGTERM"


def test_driver_killed_after_publish_before_spark_recorded_the_batch(
    kafka_broker: EmbeddedKafkaBroker, catalog_properties: dict[str, str], tmp_path: Path
) -> None:
    """Batch 1 is published, then the driver dies before Spark writes ``commits/1``. The
    restarted driver re-runs batch 1 from the checkpoint and publishes it again (new files,
    same key): the table must hold every record once."""
    bootstrap = kafka_broker.bootstrap_servers
    topic = new_topic(kafka_broker)
    catalog = make_table(catalog_properties)
    ckpt = tmp_path / "ckpt"
    data = pipeline_dict(
        f"e2e-crash-{uuid.uuid4().hex[:10]}",
        kafka_broker,
        topic,
        catalog_properties,
        FAULT_BACKEND,
        ckpt,
        batch=200,
    )
    config_file = tmp_path / "pipeline.toml"
    config_file.write_text(tomli_w.dumps(data))
    produce_json(bootstrap, topic, range(1000))
    log = tmp_path / "driver.log"
    crash_after_publishing_batch_1(config_file, log, ckpt, WAIT_S)
    assert committed_rows(catalog) <= 400
    run_driver_until(
        config_file, log, lambda: committed_rows(catalog) >= 1000, WAIT_S, "all 1000 rows"
    )
    assert (ckpt / "commits" / "1").exists()
    assert_exactly_once(catalog, TABLE, range(1000))
    paths = committed_paths(catalog)
    assert len(set(paths)) == len(paths)


def kafka_crash_scene(
    prefix: str, broker: EmbeddedKafkaBroker, catalog_properties: dict[str, str], tmp: Path
) -> tuple[str, Catalog, Path, dict[str, Any]]:
    """A topic, the events table and a Kafka-coordinated pipeline of 200-record batches (the
    set-up of the tests that kill the driver after a publish): topic, catalog, checkpoint
    and the pipeline's settings."""
    topic = new_topic(broker)
    catalog = make_table(catalog_properties)
    ckpt = tmp / "ckpt"
    name = f"{prefix}-{uuid.uuid4().hex[:10]}"
    data = pipeline_dict(name, broker, topic, catalog_properties, "kafka", ckpt, batch=200)
    return topic, catalog, ckpt, data


def test_a_batch_run_again_with_another_route_is_committed_once_as_first_published(
    kafka_broker: EmbeddedKafkaBroker, catalog_properties: dict[str, str], tmp_path: Path
) -> None:
    """Batch 1 is published with kind "a" routed to one table, the driver dies before Spark
    records it, and the operator moves kind "a" to another table before the restart. Spark
    runs batch 1 again. On Kafka, which cannot tell a batch it already holds, the coordinator
    dropped the second copy for the first table and committed it for the other: batch 1's "a"
    records were in both. A batch is committed once, as first published. Counted with pyarrow
    over each table's data files."""
    moved = "e2e.moved"
    topic, catalog, ckpt, data = kafka_crash_scene(
        "e2e-reroute", kafka_broker, catalog_properties, tmp_path
    )
    catalog.create_table(moved, schema=SCHEMA, partition_spec=SPEC)

    def routes(first: list[str], second: list[str]) -> None:
        data["tables"] = [
            {"name": TABLE, "route_field": "kind", "route_values": first},
            {"name": moved, "route_field": "kind", "route_values": second},
        ]
        config_file.write_text(tomli_w.dumps(data))

    def ids() -> list[int]:
        return sorted(
            data_file_ids(catalog.load_table(TABLE)) + data_file_ids(catalog.load_table(moved))
        )

    config_file = tmp_path / "pipeline.toml"
    routes(["a", "b", "c"], ["z"])
    produce_json(kafka_broker.bootstrap_servers, topic, range(1000))
    log = tmp_path / "driver.log"
    crash_after_publishing_batch_1(config_file, log, ckpt, WAIT_S)
    routes(["b", "c"], ["a"])
    run_driver_until(config_file, log, lambda: len(ids()) >= 1000, WAIT_S, "1000 rows")
    got = ids()
    dupes = sorted({i for i in got if got.count(i) > 1})
    assert got == list(range(1000)), f"{len(got)} rows for 1000; duplicated {dupes[:10]}"


def test_run_once_after_a_crash_after_its_last_publish_exits_with_every_row(
    kafka_broker: EmbeddedKafkaBroker, catalog_properties: dict[str, str], tmp_path: Path
) -> None:
    """The driver dies right after publishing batch 1, the source's last, before Spark
    recorded it; `icefloe run --once` then runs batch 1 again, which the first run published
    (and which it therefore does not publish again). It must still see that batch committed
    and exit 0 as soon as it is, every row once."""
    topic, catalog, ckpt, data = kafka_crash_scene(
        "e2e-once", kafka_broker, catalog_properties, tmp_path
    )
    config_file = tmp_path / "pipeline.toml"
    config_file.write_text(tomli_w.dumps(data))
    produce_json(kafka_broker.bootstrap_servers, topic, range(400))
    log = tmp_path / "driver.log"
    crash_after_publishing_batch_1(config_file, log, ckpt, WAIT_S)
    options = [a for k, v in SOURCE_OPTIONS.items() for a in ("--source-option", f"{k}={v}")]
    once = subprocess.run(
        [sys.executable, "-m", "icefloe", "run", "--config", str(config_file), "--once", *options],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        env={**os.environ, "PYSPARK_PYTHON": sys.executable},
    )
    output = once.stdout + once.stderr
    assert once.returncode == 0, output[-8000:]
    # not by its grace period, which ends a run whose batches did not all commit in time
    assert "not every published batch was committed" not in output, output[-8000:]
    assert_exactly_once(catalog, TABLE, range(400))


def writer_watermark(catalog: Catalog, group_id: str, writer_id: str) -> int | None:
    """The highest batch of ``writer_id`` the table's newest snapshot of the group records."""
    snapshots = group_snapshots(catalog, TABLE, group_id)
    if not snapshots:
        return None
    assert snapshots[-1].summary is not None
    marks = json.loads(snapshots[-1].summary.additional_properties["icefloe.writer-watermarks"])
    return marks.get(writer_id)


def test_lost_checkpoint_starts_after_batches_published_but_not_committed(
    spark: Any,
    kafka_broker: EmbeddedKafkaBroker,
    catalog_properties: dict[str, str],
    tmp_path: Path,
) -> None:
    """The documented recovery from a lost checkpoint (new checkpoint, starting_offsets =
    "table") while batch 1 sits on the channel, published and not committed: the new writer
    (a new id) must start after it, not from the table's offsets, and the old batch must still
    be committed. The restart commits through a standalone coordinator started only once the
    new query has planned its first batch (an in-driver one may win the race and hide the
    defect). Every key once."""
    bootstrap = kafka_broker.bootstrap_servers
    topic = new_topic(kafka_broker)
    catalog = make_table(catalog_properties)
    ckpt = tmp_path / "ckpt"
    name = f"e2e-lost-{uuid.uuid4().hex[:10]}"
    data = pipeline_dict(
        name, kafka_broker, topic, catalog_properties, FAULT_BACKEND, ckpt, batch=200
    )
    config_file = tmp_path / "pipeline.toml"
    config_file.write_text(tomli_w.dumps(data))
    produce_json(bootstrap, topic, range(1000))
    crash_after_publishing_batch_1(config_file, tmp_path / "driver.log", ckpt, WAIT_S)
    old_writer = derive_writer_id(name, str(ckpt))
    assert (writer_watermark(catalog, name, old_writer) or 0) < 1, "batch 1 got committed"
    shutil.rmtree(ckpt)  # the checkpoint is lost
    data["source"]["starting_offsets"] = "table"
    config = config_from_dict(data)
    with Pipeline(
        config, spark=spark, coordinator=False, source_extra_options=SOURCE_OPTIONS
    ) as second:
        assert second.writer_id != old_writer
        wait_until((ckpt / "offsets" / "0").exists, WAIT_S, "the new query's first batch")
        backend = open_backend(config)
        standalone = CoordinatorThread(config, backend, catalog, get_plugins()).start()
        try:
            wait_until(
                lambda: (
                    committed_rows(catalog) >= 1000
                    and writer_watermark(catalog, name, old_writer) == 1
                ),
                WAIT_S,
                "all 1000 rows and the old writer's batch 1",
            )
        finally:
            standalone.stop()
            backend.close()
    assert_exactly_once(catalog, TABLE, range(1000))


def test_explicit_writer_id_with_a_fresh_checkpoint_is_refused_not_dropped(
    spark: Any,
    kafka_broker: EmbeddedKafkaBroker,
    catalog_properties: dict[str, str],
    tmp_path: Path,
) -> None:
    """An explicit writer id keeps its name across a fresh checkpoint, but Spark's batch ids
    restart at 0, below what the table holds for that writer: the start is refused with the
    fix named (before, the new batches were dropped as replays). The fix it names works."""
    bootstrap = kafka_broker.bootstrap_servers
    topic = new_topic(kafka_broker)
    catalog = make_table(catalog_properties)
    name = f"e2e-wid-{uuid.uuid4().hex[:10]}"
    data = pipeline_dict(name, kafka_broker, topic, catalog_properties, "kafka", tmp_path / "a")
    produce_json(bootstrap, topic, range(300))
    with Pipeline(
        config_from_dict(data), spark=spark, writer_id="orders", source_extra_options=SOURCE_OPTIONS
    ):
        wait_until(lambda: committed_rows(catalog) >= 300, WAIT_S, "the first 300 rows")
    assert (writer_watermark(catalog, name, "orders") or 0) >= 1  # batch 0 alone proves less
    produce_json(bootstrap, topic, range(300, 500))
    data["source"]["starting_offsets"] = "table"
    data["spark"]["checkpoint_location"] = str(tmp_path / "b")  # fresh
    fresh = Pipeline(
        config_from_dict(data), spark=spark, writer_id="orders", source_extra_options=SOURCE_OPTIONS
    )
    with pytest.raises(WriterRegressionError, match="another writer id") as refused:
        fresh.start()
    assert "'orders'" in str(refused.value)
    assert str(tmp_path / "b") in str(refused.value)
    assert committed_rows(catalog) == 300
    assert not (tmp_path / "b" / "offsets").exists(), "the refused query planned a batch"
    # the fix the message names: a new writer id (derived from the checkpoint), from the table
    with Pipeline(config_from_dict(data), spark=spark, source_extra_options=SOURCE_OPTIONS):
        wait_until(lambda: committed_rows(catalog) >= 500, WAIT_S, "the 200 new rows")
    assert_exactly_once(catalog, TABLE, range(500))


def test_demo_command_checks_its_own_table(tmp_path: Path) -> None:
    """The README's first command, as a user runs it (small): exit 0 and an exact match."""
    proc = subprocess.run(
        [sys.executable, "-m", "icefloe", "demo", "--dir", str(tmp_path), "--records", "3000"],
        capture_output=True,
        text=True,
        timeout=WAIT_S + 120,
        env={**os.environ, "PYSPARK_PYTHON": sys.executable},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "exactly once" in out
    catalog = load_catalog("demo", **{"type": "sql", "uri": f"sqlite:///{tmp_path / 'catalog.db'}"})
    assert_exactly_once(catalog, "demo.events", range(3000))


def test_hand_wired_sink_publishes_from_the_commit_worker(
    spark: Any,
    kafka_broker: EmbeddedKafkaBroker,
    catalog_properties: dict[str, str],
    tmp_path: Path,
) -> None:
    """``writeStream.format("icefloe")`` without a Pipeline: the commit worker opens its own
    writer client; a coordinator runs beside it."""
    from icefloe.plugins.backends import open_backend
    from icefloe.plugins.manager import get_plugins
    from icefloe_spark.kafka.options import source_options
    from icefloe_spark.pipeline import CoordinatorThread, register

    topic = new_topic(kafka_broker)
    catalog = make_table(catalog_properties)
    ckpt = tmp_path / "ckpt"
    name = f"e2e-wired-{uuid.uuid4().hex[:10]}"
    config = config_from_dict(
        pipeline_dict(name, kafka_broker, topic, catalog_properties, FAULT_BACKEND, ckpt)
    )
    produce_json(kafka_broker.bootstrap_servers, topic, range(300))
    backend = open_backend(config)
    coordinator = CoordinatorThread(config, backend, catalog, get_plugins()).start()
    register(spark)
    query = (
        spark.readStream.format("icefloe-kafka")
        .options(**source_options(config), **SOURCE_OPTIONS)
        .load()
        .writeStream.format("icefloe")
        .option("config", config.model_dump_json())
        .option("checkpointLocation", str(ckpt))
        .trigger(processingTime="0.2 seconds")
        .start()
    )
    try:
        wait_until(lambda: committed_rows(catalog) >= 300, WAIT_S, "all 300 rows")
    finally:
        query.stop()
        coordinator.stop()
        backend.close()
    assert_exactly_once(catalog, TABLE, range(300))


# --------------------------------------------------------------------------- bad records

DEAD = "e2e.bad_records"
ROUTED_TABLE = {"name": TABLE, "route_field": "kind", "route_values": ["a", "b", "c"]}
BAD_KINDS: list[tuple[bytes, str]] = [
    (b'{"id": 7, "name": ', "decode"),  # malformed JSON
    (b'{"id": "abc", "name": "x", "kind": "a"}', "conform"),  # wrong type for a long column
    (b'{"id": null, "name": "x", "kind": "b"}', "conform"),  # null in a required field
    (b'{"name": "x", "kind": "c"}', "conform"),  # required field missing
    (b'{"id": 123456, "kind": "zzz"}', "route"),  # a value no table lists
    (b'{"id": 123457}', "route"),  # no route field
]


def produce_with_bad(
    bootstrap: str, topic: str, good: int, every: int = 23, first_kind: int = 0
) -> dict[tuple[int, int], str]:
    """Good JSON records ``0..good-1`` over two partitions with a bad one (cycling through
    :data:`BAD_KINDS`) after every ``every``-th; returns ``{(partition, offset): error type}``
    of the bad ones, from the broker's delivery reports."""
    from confluent_kafka import Producer

    values: list[tuple[bytes, str | None]] = []
    for i in range(good):
        values.append((json.dumps({"id": i, "name": f"n{i}", "kind": "abc"[i % 3]}).encode(), None))
        if i % every == every - 1:
            values.append(BAD_KINDS[(first_kind + i // every) % len(BAD_KINDS)])
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    bad: dict[tuple[int, int], str] = {}
    failures: list[Any] = []

    def report(kind: str | None) -> Callable[[Any, Any], None]:
        def done(err: Any, msg: Any) -> None:
            if err is not None:
                failures.append(err)
            elif kind is not None:
                bad[(msg.partition(), msg.offset())] = kind

        return done

    for n, (value, kind) in enumerate(values):
        producer.produce(topic, value=value, partition=n % 2, on_delivery=report(kind))
        producer.poll(0)
    assert producer.flush(30) == 0
    assert not failures, failures
    assert len(bad) == sum(1 for _, k in values if k is not None)
    return bad


@dataclasses.dataclass
class BadRecordsRun:
    """A topic of good records with bad ones mixed in, its table and a pipeline config."""

    topic: str
    catalog: Catalog
    name: str
    data: dict[str, Any]
    bad: dict[tuple[int, int], str]  # (partition, offset) -> error type


def bad_records_run(
    broker: EmbeddedKafkaBroker,
    catalog_properties: dict[str, str],
    tmp_path: Path,
    policy: str,
    good: int,
    batch: int = 100,
    **mix: int,
) -> BadRecordsRun:
    topic = new_topic(broker)
    catalog = make_table(catalog_properties)
    name = f"e2e-{policy}-{uuid.uuid4().hex[:10]}"
    ckpt = tmp_path / "ckpt"
    data = pipeline_dict(name, broker, topic, catalog_properties, FAULT_BACKEND, ckpt, batch)
    data["tables"] = [ROUTED_TABLE]
    data["errors"] = {"policy": policy}
    if policy == "dead_letter":
        data["errors"]["dead_letter_table"] = DEAD
    bad = produce_with_bad(broker.bootstrap_servers, topic, good, **mix)
    return BadRecordsRun(topic, catalog, name, data, bad)


def run_until_good_and_bad(
    spark: Any, run: BadRecordsRun, good: int, set_aside: Callable[[Pipeline], int], how: str
) -> PublishStats:
    """Run ``run``'s pipeline until its ``good`` records are committed and ``set_aside`` counts
    every bad one; return the pipeline's final stats."""
    with Pipeline(
        config_from_dict(run.data), spark=spark, source_extra_options=SOURCE_OPTIONS
    ) as p:
        wait_until(
            lambda: committed_rows(run.catalog) >= good and set_aside(p) >= len(run.bad),
            2 * WAIT_S,  # first batches are slow on a loaded machine
            f"the {good} good records and every bad one {how}",
        )
        return p.stats


def dead_letter_rows(catalog: Catalog) -> list[dict[str, Any]]:
    """The dead-letter table as a reader other than the committer sees it (pyiceberg scan)."""
    return catalog.load_table(DEAD).scan().to_arrow().to_pylist()


def table_records(catalog: Catalog, name: str) -> int:
    snap = catalog.load_table(name).current_snapshot()
    return 0 if snap is None or snap.summary is None else int(snap.summary["total-records"] or 0)


def assert_dead_letters_exact(
    catalog: Catalog, topic: str, bad: dict[tuple[int, int], str], name: str
) -> None:
    rows = dead_letter_rows(catalog)
    got = [(r["partition"], r["offset"]) for r in rows]
    assert len(got) == len(set(got)), "a bad record was dead-lettered twice"
    assert set(got) == set(bad), f"missing {set(bad) - set(got)}, unexpected {set(got) - set(bad)}"
    assert {(r["partition"], r["offset"]): r["error_type"] for r in rows} == bad
    assert {(r["pipeline"], r["topic"]) for r in rows} == {(name, topic)}
    assert all(f"[{r['partition']}]@{r['offset']}" in r["error_message"] for r in rows)
    assert all(r["value"] for r in rows)  # the raw bytes are kept


def test_policy_fail_stops_naming_the_bad_record_and_the_fix(
    spark: Any,
    kafka_broker: EmbeddedKafkaBroker,
    catalog_properties: dict[str, str],
    tmp_path: Path,
) -> None:
    # one bad record: "abc" for a long column
    run = bad_records_run(
        kafka_broker, catalog_properties, tmp_path, "fail", 60, every=40, first_kind=1
    )
    catalog, topic, bad = run.catalog, run.topic, run.bad
    ((partition, offset),) = bad
    with Pipeline(
        config_from_dict(run.data), spark=spark, source_extra_options=SOURCE_OPTIONS
    ) as p:
        query = p.query
        assert query is not None
        wait_until(lambda: not query.isActive, WAIT_S, "the query to stop on the bad record")
        message = str(query.exception())
    assert f"{topic}[{partition}]@{offset} field 'id'" in message, message[-2000:]
    assert "RecordDecodeError" in message or "RecordConformError" in message
    assert "[errors] policy" in message
    assert committed_rows(catalog) < 60  # the batch with the bad record was not committed


def test_policy_skip_commits_exactly_the_good_records_and_counts_the_bad(
    spark: Any,
    kafka_broker: EmbeddedKafkaBroker,
    catalog_properties: dict[str, str],
    tmp_path: Path,
) -> None:
    run = bad_records_run(kafka_broker, catalog_properties, tmp_path, "skip", 400)
    stats = run_until_good_and_bad(spark, run, 400, lambda p: p.stats.skipped, "skipped")
    assert stats.batches >= 3  # bad records in several batches
    assert stats.skipped == len(run.bad)
    assert stats.dead_lettered == 0
    assert_exactly_once(run.catalog, TABLE, range(400))


def test_policy_dead_letter_commits_the_good_records_and_exactly_the_bad_ones_aside(
    spark: Any,
    kafka_broker: EmbeddedKafkaBroker,
    catalog_properties: dict[str, str],
    tmp_path: Path,
) -> None:
    run = bad_records_run(kafka_broker, catalog_properties, tmp_path, "dead_letter", 400)
    stats = run_until_good_and_bad(
        spark, run, 400, lambda _: table_records(run.catalog, DEAD), "dead-lettered"
    )
    assert stats.dead_lettered == len(run.bad)
    assert stats.skipped == 0
    assert_exactly_once(run.catalog, TABLE, range(400))
    assert_dead_letters_exact(run.catalog, run.topic, run.bad, run.name)


def test_dead_letters_survive_a_driver_crash_after_publish_without_duplicates(
    kafka_broker: EmbeddedKafkaBroker, catalog_properties: dict[str, str], tmp_path: Path
) -> None:
    """Batch 1 (with bad records) is published, then the driver dies before Spark records it.
    The restarted driver re-runs batch 1 and writes its dead-letter rows again: the replay must
    not commit them a second time, and nothing may be lost."""
    run = bad_records_run(
        kafka_broker, catalog_properties, tmp_path, "dead_letter", 800, batch=200, every=19
    )
    catalog, bad = run.catalog, run.bad
    config_file = tmp_path / "pipeline.toml"
    config_file.write_text(tomli_w.dumps(run.data))
    log = tmp_path / "driver.log"
    crash_after_publishing_batch_1(config_file, log, tmp_path / "ckpt", 2 * WAIT_S)
    run_driver_until(
        config_file,
        log,
        lambda: committed_rows(catalog) >= 800 and table_records(catalog, DEAD) >= len(bad),
        2 * WAIT_S,  # a fresh JVM on a busy machine
        "every record after the restart",
    )
    assert_exactly_once(catalog, TABLE, range(800))
    assert_dead_letters_exact(catalog, run.topic, bad, run.name)
    dead = catalog.load_table(DEAD)
    committed = {t.file.file_path for t in dead.scan().plan_files()}
    on_disk = {
        "file://" + str(p) for p in Path(dead.location().removeprefix("file://")).rglob("*.parquet")
    }
    assert committed < on_disk, "batch 1's dead letters were not written twice: no replay tested"


# --------------------------------------------------------------------------- backend swap


def icefloe_drain(config_file: Path, log: Path) -> None:
    """`icefloe drain` as an operator runs it (no JVM): it must exit 0."""
    with open(log, "ab") as out:
        proc = subprocess.run(
            [sys.executable, "-m", "icefloe", "drain", "--config", str(config_file)],
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=WAIT_S * 2,
        )
    assert proc.returncode == 0, f"icefloe drain exited {proc.returncode}:\n{log.read_text()}"


def table_ids(catalog: Catalog) -> list[int]:
    """Every id in the table, as pyiceberg reads it (not the committer's code)."""
    ids: list[int] = (
        catalog.load_table(TABLE).scan(selected_fields=("id",)).to_arrow()["id"].to_pylist()
    )
    return ids


def test_backend_swap_kafka_postgres_redis_by_the_documented_procedure(
    spark: Any,
    kafka_broker: EmbeddedKafkaBroker,
    catalog_properties: dict[str, str],
    tmp_path: Path,
) -> None:
    """docs/operations.md, "Swapping the backend", on a pipeline that leaves a published,
    uncommitted batch on the old channel at every move (the driver dies right after a
    publish): kafka -> postgres -> redis, records produced throughout. A move to redis
    without draining postgres first is refused (`ChannelChangedError`, the table unchanged);
    drained afterwards, nothing is lost. Every key is counted with pyiceberg."""
    from icefloe.errors import ChannelChangedError

    bootstrap = kafka_broker.bootstrap_servers
    topic = new_topic(kafka_broker)
    catalog = make_table(catalog_properties)
    ckpt = tmp_path / "ckpt"
    name = f"e2e-swap-{uuid.uuid4().hex[:10]}"
    config_file = tmp_path / "pipeline.toml"
    log = tmp_path / "swap.log"

    def use(backend: str) -> dict[str, Any]:
        data = pipeline_dict(name, kafka_broker, topic, catalog_properties, backend, ckpt, 200)
        config_file.write_text(tomli_w.dumps(data))
        return data

    # kafka: batch 1 published, the driver dies before it is committed (and before Spark
    # recorded it): stranded on the Kafka channel
    use("kafka")
    produce_json(bootstrap, topic, range(600))
    crash_after_publishing_batch_1(config_file, log, ckpt, 3 * WAIT_S)  # a fresh JVM
    icefloe_drain(config_file, log)
    after_kafka = table_ids(catalog)
    assert len(after_kafka) >= 400, "the drain did not commit the stranded batch 1"

    # postgres: Spark replays batch 1 (dropped by the writer watermark), goes on, and dies
    # right after publishing batch 3
    use("postgres")
    produce_json(bootstrap, topic, range(600, 1000))
    crash_after_publishing_batch_1(config_file, log, ckpt, 3 * WAIT_S, batch=3)
    before_refusal = sorted(table_ids(catalog))

    # redis without draining postgres: refused, nothing committed
    redis = config_from_dict(use("redis"))
    produce_json(bootstrap, topic, range(1000, 1200))
    with Pipeline(redis, spark=spark, source_extra_options=SOURCE_OPTIONS) as refused:
        thread = refused.coordinator
        assert thread is not None
        wait_until(lambda: thread.fatal is not None, WAIT_S, "the refusal")
        assert isinstance(thread.fatal, ChannelChangedError), thread.fatal
        assert "icefloe drain" in str(thread.fatal)
    assert sorted(table_ids(catalog)) == before_refusal

    # the documented way: drain postgres, then redis
    use("postgres")
    icefloe_drain(config_file, log)
    with Pipeline(redis, spark=spark, source_extra_options=SOURCE_OPTIONS):
        produce_json(bootstrap, topic, range(1200, 1400))  # while it runs
        wait_until(lambda: committed_rows(catalog) >= 1400, WAIT_S, "all 1400 rows")
    assert_exactly_once(catalog, TABLE, range(1400))
    paths = committed_paths(catalog)
    assert len(set(paths)) == len(paths)
    channels = {
        s.summary.additional_properties.get("icefloe.channel-id", "")
        for s in group_snapshots(catalog, TABLE, name)
        if s.summary
    }
    assert {c.split(":")[0] for c in channels} == {"kafka", "postgres", "redis"}, channels


def table_rows(catalog: Catalog, name: str) -> list[dict[str, Any]]:
    """A table's rows as pyiceberg's scan reads them (none while it does not exist)."""
    if not catalog.table_exists(name):
        return []
    return catalog.load_table(name).scan().to_arrow().to_pylist()


def test_json_dynamic_tables_are_created_and_evolved_exactly_once(
    spark: Any,
    kafka_broker: EmbeddedKafkaBroker,
    catalog_properties: dict[str, str],
    tmp_path: Path,
) -> None:
    """JSON records name their tables; the tables do not exist, are created from the records
    and evolve while the query runs (a new nested field, a required column made optional);
    records no table can take and values that cannot fit are dead-lettered, exactly."""
    bootstrap = kafka_broker.bootstrap_servers
    topic = new_topic(kafka_broker)
    catalog = load_catalog("e2e", **catalog_properties)
    name = f"e2e-schema-{uuid.uuid4().hex[:10]}"
    data = pipeline_dict(name, kafka_broker, topic, catalog_properties, "kafka", tmp_path / "c")
    del data["tables"]
    data["dynamic_tables"] = {
        "route_field": "type",
        "namespace": "dyn",
        "auto_create": True,
        "evolve_schema": True,
        "id_columns": ["id"],
    }
    data["errors"] = {"policy": "dead_letter", "dead_letter_table": DEAD}
    config = config_from_dict(data)

    def record(i: int, **extra: Any) -> tuple[bytes, bytes]:
        body = {"id": i, "type": "Click" if i % 2 else "view", "n": i * 10, **extra}
        return str(i).encode(), json.dumps(body).encode()

    bad = {
        b'{"id": 900001, "n": 1}': "route",  # names no table
        b'{"id": 900002, "type": "two words"}': "route",  # not a table name
    }
    produce(bootstrap, topic, [record(i) for i in range(200)] + [(None, v) for v in bad])
    with Pipeline(config, spark=spark, source_extra_options=SOURCE_OPTIONS) as pipeline:
        wait_until(
            lambda: (
                len(table_rows(catalog, "dyn.click")) + len(table_rows(catalog, "dyn.view")) >= 200
            ),
            WAIT_S,
            "the first 200 rows in two created tables",
        )
        late_bad = b'{"id": 900003, "type": "view", "n": "lots"}'  # a string for a long
        bad[late_bad] = "conform"
        later = [record(i, meta={"src": f"s{i}"}) for i in range(200, 300)]
        later += [
            (str(i).encode(), json.dumps({"id": i, "type": "view"}).encode())
            for i in range(300, 310)
        ]
        produce(bootstrap, topic, [*later, (None, late_bad)])
        wait_until(
            lambda: (
                len(table_rows(catalog, "dyn.click")) + len(table_rows(catalog, "dyn.view")) >= 310
                and len(table_rows(catalog, DEAD)) >= len(bad)
            ),
            WAIT_S,
            "every later row and every bad record",
        )
        assert pipeline.stats.dead_lettered == len(bad)
    assert_exactly_once(catalog, "dyn.click", range(1, 300, 2))
    assert_exactly_once(catalog, "dyn.view", [*range(0, 300, 2), *range(300, 310)])
    for table in ("dyn.click", "dyn.view"):
        schema = catalog.load_table(table).schema()
        assert schema.identifier_field_names() == {"id"}
        assert schema.find_field("meta.src").field_type == StringType()
        rows = {r["id"]: r for r in table_rows(catalog, table)}
        assert all(rows[i]["meta"] is None for i in rows if i < 200)  # written before the change
        assert all(rows[i]["meta"] == {"src": f"s{i}"} for i in rows if 200 <= i < 300)
        assert all(rows[i]["n"] == i * 10 for i in rows if i < 300)
    views = {r["id"]: r for r in table_rows(catalog, "dyn.view")}
    assert all(views[i]["n"] is None and views[i]["meta"] is None for i in range(300, 310))
    dead = table_rows(catalog, DEAD)
    assert {bytes(r["value"]): r["error_type"] for r in dead} == bad
    assert len(dead) == len(bad)


def test_lost_checkpoint_of_a_dynamic_tables_pipeline_resumes_from_those_tables(
    spark: Any,
    kafka_broker: EmbeddedKafkaBroker,
    catalog_properties: dict[str, str],
    tmp_path: Path,
) -> None:
    """The documented recovery from a lost checkpoint (a new one, ``starting_offsets =
    "table"``) on a pipeline with ``[dynamic_tables]`` only: the start reads the offsets its
    dynamic tables record. Before, it read only ``[[tables]]`` and the dead-letter table, so
    the new query read the topic from its start again and every row came twice."""
    bootstrap = kafka_broker.bootstrap_servers
    topic = new_topic(kafka_broker)
    catalog = load_catalog("e2e", **catalog_properties)
    name = f"e2e-dynck-{uuid.uuid4().hex[:10]}"
    namespace = f"dy{uuid.uuid4().hex[:8]}"
    checkpoint = tmp_path / "ckpt"
    data = pipeline_dict(name, kafka_broker, topic, catalog_properties, "kafka", checkpoint)
    del data["tables"]
    data["dynamic_tables"] = {"route_field": "type", "namespace": namespace, "auto_create": True}
    data["source"]["starting_offsets"] = "table"
    config = config_from_dict(data)

    def records(ids: range) -> list[tuple[bytes, bytes]]:
        kinds = ("a", "b")
        return [
            (str(i).encode(), json.dumps({"id": i, "type": kinds[i % 2]}).encode()) for i in ids
        ]

    def rows_in_both() -> int:
        return sum(len(table_rows(catalog, f"{namespace}.{k}")) for k in ("a", "b"))

    produce(bootstrap, topic, records(range(300)))
    with Pipeline(config, spark=spark, source_extra_options=SOURCE_OPTIONS) as first:
        wait_until(lambda: rows_in_both() >= 300, WAIT_S, "the first 300 rows")
        first_writer = first.writer_id
    shutil.rmtree(checkpoint)
    produce(bootstrap, topic, records(range(300, 500)))
    with Pipeline(config, spark=spark, source_extra_options=SOURCE_OPTIONS) as second:
        assert second.writer_id != first_writer
        wait_until(lambda: rows_in_both() >= 500, WAIT_S, "the 200 rows after the reset")
        time.sleep(5)  # a re-read of the topic's start would land within a cycle or two
    assert_exactly_once(catalog, f"{namespace}.a", range(0, 500, 2))
    assert_exactly_once(catalog, f"{namespace}.b", range(1, 500, 2))


def test_regex_routes_rename_map_and_name_mapping_end_to_end(
    spark: Any,
    kafka_broker: EmbeddedKafkaBroker,
    catalog_properties: dict[str, str],
    tmp_path: Path,
) -> None:
    """Static routes by regular expression, a per-table rename map and the table's own
    ``schema.name-mapping.default``, through a running pipeline: every record lands once in
    the table its kind matches, its fields in the columns the maps name."""
    bootstrap = kafka_broker.bootstrap_servers
    topic = new_topic(kafka_broker)
    catalog = load_catalog("e2e", **catalog_properties)
    catalog.create_namespace("fan")
    columns = Schema(
        NestedField(1, "id", LongType(), required=False),
        NestedField(2, "user_name", StringType(), required=False),
        NestedField(3, "kind", StringType(), required=False),
    )
    aliases = NameMapping(
        [
            MappedField(field_id=1, names=["id"]),  # type: ignore[call-arg]  # by name
            MappedField(field_id=2, names=["user_name", "userName"]),  # type: ignore[call-arg]
            MappedField(field_id=3, names=["kind"]),  # type: ignore[call-arg]
        ]
    )
    catalog.create_table(
        "fan.orders",
        schema=columns,
        properties={"schema.name-mapping.default": aliases.model_dump_json()},
    )
    catalog.create_table("fan.other", schema=columns)
    name = f"e2e-fan-{uuid.uuid4().hex[:10]}"
    data = pipeline_dict(name, kafka_broker, topic, catalog_properties, "kafka", tmp_path / "c")
    data["tables"] = [
        {"name": "fan.orders", "route_field": "kind", "route_regex": "order[.-].*"},
        {
            "name": "fan.other",
            "route_field": "kind",
            "route_values": ["misc"],
            "rename": {"uid": "id", "who": "user_name"},
        },
    ]
    kinds = ("order.new", "order-paid", "misc")
    records = []
    for i in range(240):
        kind = kinds[i % 3]
        body = (
            {"uid": i, "who": f"u{i}", "kind": kind}
            if kind == "misc"
            else {"id": i, "userName": f"u{i}", "kind": kind}
        )
        records.append((str(i).encode(), json.dumps(body).encode()))
    produce(bootstrap, topic, records)
    with Pipeline(config_from_dict(data), spark=spark, source_extra_options=SOURCE_OPTIONS):
        wait_until(
            lambda: (
                len(table_rows(catalog, "fan.orders")) + len(table_rows(catalog, "fan.other"))
                >= 240
            ),
            WAIT_S,
            "all 240 rows in the two tables",
        )
    orders = [i for i in range(240) if i % 3 != 2]
    assert_exactly_once(catalog, "fan.orders", orders)
    assert_exactly_once(catalog, "fan.other", range(2, 240, 3))
    for table in ("fan.orders", "fan.other"):
        rows = table_rows(catalog, table)
        assert all(r["user_name"] == f"u{r['id']}" for r in rows), table
        assert catalog.load_table(table).schema().column_names == ["id", "user_name", "kind"]
