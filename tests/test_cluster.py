"""``icefloe run`` against a standalone Spark cluster started from the PySpark wheel itself: one
master and two workers on 127.0.0.1, each worker a JVM of its own with its own Python workers
and its own scratch directory (``SPARK_LOCAL_DIRS``, ``TMPDIR``).

The cluster shares nothing but what a real one shares: the warehouse is a bucket of moto's S3
server (:mod:`icefloe.testing.objectstore`) and the catalog pyiceberg's SqlCatalog on the
machine's real PostgreSQL (``postgres_catalog_properties``), never a local file. The driver
(the ``icefloe run`` subprocess) shares nothing in memory with the executors, so a pipeline
that relied on driver-local objects, sockets or files would lose or duplicate records here.
Rows are counted by pyarrow reading the bucket's files (position deletes applied), against
the ids produced.

The one local path left is Spark's checkpoint, which only the driver writes: on one machine a
local directory is reachable by "every node"; a real cluster whose driver may restart
elsewhere needs HDFS or ``s3a://`` with Hadoop's S3 connector (``hadoop-aws``, not in the
PySpark wheel; docs/spark-runner.md "A checkpoint on S3").
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fastavro
import psutil
import pytest
import tomli_w
from pyiceberg.catalog import Catalog, load_catalog

from icefloe.testing.fixtures import EVENTS_SCHEMA, EVENTS_SPEC
from icefloe.testing.objectstore import S3Store
from icefloe_kafka.embedded import EmbeddedKafkaBroker
from icefloe_spark.kafka.admin import create_topic, produce
from icefloe_spark.runtime.standalone import SCRATCH, StandaloneCluster, standalone_cluster

RUN_S = 300.0
TABLE = "cluster.events"
RECORDS = 60
# the Avro writer schema of the in-driver variant's records (EVENTS_SCHEMA's columns)
AVRO_SCHEMA = {
    "type": "record",
    "name": "Event",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "name", "type": ["null", "string"]},
        {"name": "kind", "type": ["null", "string"]},
    ],
}


@pytest.fixture(scope="module")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneCluster]:
    """A master and two 1-core, 1 GB workers; the fixture errors with the processes' logs
    when they do not come up."""
    with standalone_cluster(
        tmp_path_factory.mktemp("spark-cluster"), workers=2, cores=1, memory="1g"
    ) as cluster:
        yield cluster


@pytest.fixture
def catalog_warehouse(s3_store: S3Store) -> str:
    """The warehouse of this module's catalogs: a bucket of its own on the object store."""
    return s3_store.new_warehouse()


@pytest.fixture
def shared_catalog(
    postgres_catalog_properties: dict[str, str], s3_store: S3Store
) -> dict[str, str]:
    """What every node shares: the SqlCatalog on PostgreSQL, its warehouse in the bucket."""
    return {**postgres_catalog_properties, **s3_store.file_io_properties()}


def _pipeline(
    tmp: Path,
    broker: EmbeddedKafkaBroker,
    topic: str,
    master: str,
    catalog: dict[str, str],
    create_table: bool,
    avro: bool | None = None,
    batch: int = 25,
    per_task: int = 5,
) -> Path:
    """A pipeline TOML for the cluster, on the shared ``catalog``. Without ``create_table``
    the table is left to JSON auto-create, i.e. to a write task on an executor. With it,
    records are Avro (unless ``avro`` is False) whose schema is a file named relative to the
    pipeline file, which the executors (working in their worker's directory) cannot open
    themselves."""
    avro = create_table if avro is None else avro
    cat = load_catalog("cl", **catalog)
    cat.create_namespace("cluster")
    if create_table:
        cat.create_table(TABLE, schema=EVENTS_SCHEMA, partition_spec=EVENTS_SPEC)
        (tmp / "event.avsc").write_text(json.dumps(AVRO_SCHEMA))
    formats: dict[str, Any] = (
        {"format": "avro", "format_options": {"schema_file": "event.avsc"}}
        if avro
        else {"format": "json"}
    )
    config: dict[str, Any] = {
        "name": f"cluster-{uuid.uuid4().hex[:8]}",
        "source": {
            "bootstrap_servers": broker.bootstrap_servers,
            "topics": [topic],
            "max_records_per_batch": batch,  # several batches, so several cycles
            **formats,
            "reader_options": {"probeHighWatermark": "true", "pollTimeoutMs": "20000"},
        },
        "tables": [{"name": TABLE, "auto_create": not create_table}],
        "catalog": {"name": "cl", "properties": catalog},
        "coordination": {
            "backend": "kafka",
            "commit_interval_s": 1.0,
            "commit_timeout_s": 20.0,
            "lease_ttl_s": 5.0,
            "kafka": {
                "bootstrap_servers": broker.bootstrap_servers,
                "control_topic": f"ctl-{uuid.uuid4().hex[:8]}",
            },
        },
        "spark": {
            "master": master,
            "app_name": "icefloe-cluster-test",
            # only the driver writes it; see the module doc for a real cluster's
            "checkpoint_location": str(tmp / "checkpoint"),
            "trigger_interval_s": 0.5,
            # several tasks per batch, so both executors take some: at the default a batch's
            # short ranges are packed into one task, placed on either executor at random
            # (all of a run's four or five on one executor failed the check below in CI)
            "max_records_per_task": per_task,
            "conf": {
                "spark.ui.enabled": "false",
                "spark.driver.host": "127.0.0.1",
                "spark.driver.memory": "1g",
                "spark.executor.memory": "512m",
                "spark.executor.cores": "1",
                "spark.cores.max": "2",
                # schedule only once both executors joined, so both take tasks
                "spark.scheduler.minRegisteredResourcesRatio": "1.0",
                "spark.sql.shuffle.partitions": "2",
            },
        },
    }
    path = tmp / "pipeline.toml"
    path.write_text(tomli_w.dumps(config))
    return path


def _tasks_per_worker(work_dirs: tuple[Path, ...], before: set[Path]) -> dict[Path, int]:
    """Tasks each worker's executors ran for applications started after ``before`` was taken
    (an executor logs each task to ``<work>/<app-id>/<executor-id>/stderr``)."""
    return {
        w: sum(
            f.read_text(errors="replace").count("Running task")
            for f in w.glob("app-*/*/stderr")
            if f.parent.parent not in before
        )
        for w in work_dirs
    }


def _rows(catalog: Catalog) -> int:
    """Rows pyiceberg reads from TABLE (0 before it exists or has a snapshot): to wait on."""
    if not catalog.table_exists(TABLE):
        return 0
    table = catalog.load_table(TABLE)
    return 0 if table.current_snapshot() is None else table.scan().to_arrow().num_rows


def _apps(work_dirs: tuple[Path, ...]) -> set[Path]:
    return {app for w in work_dirs for app in w.glob("app-*")}


def _icefloe(args: list[str], out: Path, cwd: Path) -> subprocess.Popen[bytes]:
    with out.open("wb") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "icefloe", *args],
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            cwd=cwd,
            start_new_session=True,  # its own group: SIGTERM reaches it as under a supervisor
        )


@pytest.mark.parametrize(
    "coordinator",
    ["in-driver", "standalone"],
)
def test_run_on_a_standalone_cluster_commits_every_record_once(
    tmp_path: Path,
    kafka_broker: EmbeddedKafkaBroker,
    spark_cluster: StandaloneCluster,
    s3_store: S3Store,
    shared_catalog: dict[str, str],
    coordinator: str,
) -> None:
    """Four partitions, records produced before and while the query runs on two executors in
    other JVMs; every process stops cleanly on SIGTERM once pyiceberg sees every id.

    ``in-driver``: Avro records (their schema in a file beside the pipeline file) into a
    pre-created partitioned table, committed by the driver's coordinator thread.
    ``standalone``: ``icefloe run --no-coordinator`` next to ``icefloe coordinator``, and the
    table auto-created from JSON by a task on an executor."""
    topic = f"t-{uuid.uuid4().hex[:10]}"
    create_topic(kafka_broker.bootstrap_servers, topic, 4)

    standalone = coordinator == "standalone"
    parsed = fastavro.parse_schema(AVRO_SCHEMA)

    def encode(record: dict[str, Any]) -> bytes:
        if standalone:
            return json.dumps(record).encode()
        out = io.BytesIO()
        fastavro.schemaless_writer(out, parsed, record)
        return out.getvalue()

    def send(ids: range) -> None:
        produce(
            kafka_broker.bootstrap_servers,
            topic,
            (
                (str(i).encode(), encode({"id": i, "name": f"n{i}", "kind": "abc"[i % 3]}))
                for i in ids
            ),
        )

    half = RECORDS // 2
    send(range(half))
    config = _pipeline(
        tmp_path,
        kafka_broker,
        topic,
        spark_cluster.master_url,
        shared_catalog,
        create_table=not standalone,
    )
    apps_before = _apps(spark_cluster.worker_dirs)
    procs: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
    run_args = ["run", "--config", str(config), "--quiet"]
    if standalone:
        out = tmp_path / "coordinator.log"
        procs["coordinator"] = (
            _icefloe(["coordinator", "--config", str(config)], out, tmp_path),
            out,
        )
        run_args.append("--no-coordinator")
    out = tmp_path / "run.log"
    procs["run"] = (_icefloe(run_args, out, tmp_path), out)
    catalog = load_catalog("cl", **shared_catalog)

    def logs() -> str:
        return "\n".join(f"--- {name}\n{log.read_text()}" for name, (_, log) in procs.items())

    def wait_rows(n: int) -> None:
        deadline = time.monotonic() + RUN_S
        while _rows(catalog) < n:
            exited = {name: p.returncode for name, (p, _) in procs.items() if p.poll() is not None}
            if exited:
                pytest.fail(f"exited early {exited}:\n{logs()}")
            if time.monotonic() > deadline:
                pytest.fail(f"{_rows(catalog)} of {n} rows after {RUN_S:.0f}s:\n{logs()}")
            time.sleep(1.0)

    try:
        wait_rows(half)
        send(range(half, RECORDS))
        wait_rows(RECORDS)
        for proc, _ in procs.values():
            os.killpg(proc.pid, signal.SIGTERM)
        for name, (proc, _) in procs.items():
            rc = proc.wait(RUN_S)
            assert rc == 0, f"{name} exited {rc}:\n{logs()}"
        assert "stopped cleanly" in (tmp_path / "run.log").read_text(), logs()
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(60)
    assert s3_store.read_ids(catalog.load_table(TABLE)) == list(range(RECORDS))
    # the tasks really ran on the cluster: each worker's executor ran some of them
    ran = _tasks_per_worker(spark_cluster.worker_dirs, apps_before)
    assert all(ran.values()), f"a worker ran no task for this run: {ran}"


KILL_RECORDS = 2000
_RUNNING = re.compile(r"Running task (\S+) in stage (\S+) \(TID (\d+)\)")
_FINISHED = re.compile(r"Finished task \S+ in stage \S+ \(TID (\d+)\)")


def _executors(cluster: StandaloneCluster, app: str) -> list[psutil.Process]:
    """The executor JVMs of application ``app``: children of the workers' JVMs."""
    found = []
    for pid in cluster.pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in psutil.Process(pid).children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    cmd = " ".join(child.cmdline())
                    if "CoarseGrainedExecutorBackend" in cmd and app in cmd:
                        found.append(child)
    return found


def _running(stderr: Path) -> set[tuple[str, str]]:
    """(task index, stage) of the tasks an executor logged as started and not (yet) as
    finished, from ``Running task 3.0 in stage 7.0 (TID 31)`` (task 3, attempt 0)."""
    text = stderr.read_text(errors="replace")
    done = set(_FINISHED.findall(text))
    found = _RUNNING.findall(text)
    return {(task.split(".")[0], stage) for task, stage, tid in found if tid not in done}


def _retried(app_dirs: set[Path], tasks: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """Those of ``tasks`` some executor of the application ran again (a later attempt)."""
    again = {
        (task.split(".")[0], stage)
        for app in app_dirs
        for stderr in app.glob("*/stderr")
        for task, stage, _ in _RUNNING.findall(stderr.read_text(errors="replace"))
        if not task.endswith(".0")
    }
    return tasks & again


def _kill_an_executor_mid_task(
    cluster: StandaloneCluster, apps_before: set[Path], deadline: float
) -> tuple[str, set[tuple[str, str]]]:
    """SIGKILL the process tree (JVM, Python daemon and workers) of the first executor of the
    new application caught running a task; returns its log directory and those tasks."""
    while time.monotonic() < deadline:
        for app_dir in _apps(cluster.worker_dirs) - apps_before:
            for stderr in app_dir.glob("*/stderr"):
                tids = _running(stderr)
                if not tids:
                    continue
                executor_id, app = stderr.parent.name, app_dir.name
                for proc in _executors(cluster, app):
                    if f"--executor-id {executor_id} " in " ".join(proc.cmdline()) + " ":
                        tree = [proc, *proc.children(recursive=True)]
                        for p in tree:
                            with contextlib.suppress(psutil.NoSuchProcess):
                                p.kill()
                        psutil.wait_procs(tree, timeout=30)
                        return str(stderr.parent), tids
        time.sleep(0.01)
    pytest.fail("no executor of the run was caught running a task")


def test_a_cluster_sharing_only_the_store_survives_an_executor_killed_mid_batch(
    tmp_path: Path,
    kafka_broker: EmbeddedKafkaBroker,
    spark_cluster: StandaloneCluster,
    s3_store: S3Store,
    shared_catalog: dict[str, str],
) -> None:
    """kill -9 of one executor's process tree while it runs a task: the tasks it had are
    retried elsewhere (or by the executor the worker starts instead) and every record ends in
    the bucket exactly once; the workers' scratch stayed in their own directories."""
    topic = f"t-{uuid.uuid4().hex[:10]}"
    create_topic(kafka_broker.bootstrap_servers, topic, 4)
    produce(
        kafka_broker.bootstrap_servers,
        topic,
        (
            (str(i).encode(), json.dumps({"id": i, "name": f"n{i}", "kind": "abc"[i % 3]}).encode())
            for i in range(KILL_RECORDS)
        ),
    )
    # JSON into a pre-created table; 8 tasks a batch, so each executor has some to lose
    where = (kafka_broker, topic, spark_cluster.master_url, shared_catalog)
    batch, per_task = KILL_RECORDS // 5, KILL_RECORDS // 40
    config = _pipeline(tmp_path, *where, True, False, batch, per_task)
    apps_before = _apps(spark_cluster.worker_dirs)
    out = tmp_path / "run.log"
    started = time.monotonic()
    run = _icefloe(["run", "--config", str(config), "--quiet"], out, tmp_path)
    catalog = load_catalog("cl", **shared_catalog)
    try:
        killed, tids = _kill_an_executor_mid_task(
            spark_cluster, apps_before, time.monotonic() + RUN_S
        )
        deadline = time.monotonic() + RUN_S
        while _rows(catalog) < KILL_RECORDS:
            assert run.poll() is None, f"exited {run.returncode}:\n{out.read_text()}"
            assert time.monotonic() < deadline, f"not every row after {RUN_S}s\n{out.read_text()}"
            time.sleep(1.0)
        os.killpg(run.pid, signal.SIGTERM)
        assert run.wait(RUN_S) == 0, out.read_text()
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(60)
    print(f"killed {killed} running tasks {tids}; took {time.monotonic() - started:.0f}s")
    # the kill hit a task: Spark ran it again, and its first attempt's files stayed out
    assert _retried(_apps(spark_cluster.worker_dirs) - apps_before, tids) == tids, killed
    ids = s3_store.read_ids(catalog.load_table(TABLE))
    assert ids == list(range(KILL_RECORDS)), f"killed {killed} running tasks {tids}"
    # each worker's executors kept their scratch (block manager, Python) in its own directory
    for work in spark_cluster.worker_dirs:
        assert any((work / SCRATCH).iterdir()), f"{work / SCRATCH} unused"
