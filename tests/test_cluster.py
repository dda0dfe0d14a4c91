"""``icefloe run`` against a standalone Spark cluster started from the PySpark wheel itself: one
master and two workers on 127.0.0.1, each worker a JVM of its own with its own Python workers.

The driver (the ``icefloe run`` subprocess) shares nothing in memory with the executors, so a
pipeline that relied on driver-local objects, sockets or files would lose or duplicate records
here; the table is counted with pyiceberg against the ids produced.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fastavro
import pytest
import tomli_w
from pyiceberg.catalog import load_catalog

from icefloe.testing.fixtures import EVENTS_SCHEMA, EVENTS_SPEC, assert_exactly_once
from icefloe_kafka.embedded import EmbeddedKafkaBroker
from icefloe_spark.kafka.admin import create_topic, produce
from icefloe_spark.runtime.standalone import StandaloneCluster, standalone_cluster

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


def _pipeline(
    tmp: Path, broker: EmbeddedKafkaBroker, topic: str, master: str, create_table: bool
) -> tuple[Path, dict[str, str]]:
    """A pipeline TOML for the cluster. The SQLite catalog and the warehouse are plain paths
    every executor can open because they run on this machine; a real cluster needs shared
    storage and a shared catalog instead (docs/spark-runner.md). Without ``create_table`` the
    table is left to JSON auto-create, i.e. to a write task on an executor. With it, records
    are Avro whose schema is a file named relative to the pipeline file, which the executors
    (working in their worker's directory) cannot open themselves."""
    catalog = {
        "type": "sql",
        "uri": f"sqlite:///{tmp / 'catalog.db'}",
        "warehouse": f"file://{tmp / 'warehouse'}",
    }
    cat = load_catalog("cl", **catalog)
    cat.create_namespace("cluster")
    if create_table:
        cat.create_table(TABLE, schema=EVENTS_SCHEMA, partition_spec=EVENTS_SPEC)
        (tmp / "event.avsc").write_text(json.dumps(AVRO_SCHEMA))
    formats: dict[str, Any] = (
        {"format": "avro", "format_options": {"schema_file": "event.avsc"}}
        if create_table
        else {"format": "json"}
    )
    config: dict[str, Any] = {
        "name": f"cluster-{uuid.uuid4().hex[:8]}",
        "source": {
            "bootstrap_servers": broker.bootstrap_servers,
            "topics": [topic],
            "max_records_per_batch": 25,  # several batches, so several cycles
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
            "checkpoint_location": str(tmp / "checkpoint"),
            "trigger_interval_s": 0.5,
            # several tasks per batch, so both executors take some: at the default a batch's
            # short ranges are packed into one task, placed on either executor at random
            # (all of a run's four or five on one executor failed the check below in CI)
            "max_records_per_task": 5,
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
    return path, catalog


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
    config, catalog_props = _pipeline(
        tmp_path, kafka_broker, topic, spark_cluster.master_url, create_table=not standalone
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
    catalog = load_catalog("cl", **catalog_props)

    def logs() -> str:
        return "\n".join(f"--- {name}\n{log.read_text()}" for name, (_, log) in procs.items())

    def rows() -> int:
        if not catalog.table_exists(TABLE):
            return 0
        table = catalog.load_table(TABLE)
        return 0 if table.current_snapshot() is None else table.scan().to_arrow().num_rows

    def wait_rows(n: int) -> None:
        deadline = time.monotonic() + RUN_S
        while rows() < n:
            exited = {name: p.returncode for name, (p, _) in procs.items() if p.poll() is not None}
            if exited:
                pytest.fail(f"exited early {exited}:\n{logs()}")
            if time.monotonic() > deadline:
                pytest.fail(f"{rows()} of {n} rows after {RUN_S:.0f}s:\n{logs()}")
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
    assert_exactly_once(catalog, TABLE, list(range(RECORDS)))
    # the tasks really ran on the cluster: each worker's executor ran some of them
    ran = _tasks_per_worker(spark_cluster.worker_dirs, apps_before)
    assert all(ran.values()), f"a worker ran no task for this run: {ran}"
