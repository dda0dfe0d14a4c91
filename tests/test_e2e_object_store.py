"""The warehouse on an S3-compatible object store, end to end: Kafka (Tansu) -> Spark ->
Iceberg tables whose files live in a bucket of moto's S3 server (signatures checked; see
:mod:`icefloe.testing.objectstore`), with a SQLite catalog.

One pipeline exercises what touches the store: an append table with ``merge_small_files``,
an upsert table (position deletes), dead letters, ``icefloe rollback`` while it runs, then
``icefloe maintain`` (expiry, orphans listed and deleted in the bucket), ``status`` and
``doctor`` as an operator runs them. Rows are counted by pyarrow reading the objects itself
(:meth:`S3Store.read_table`), not by the committer. Quarantine and paging are covered without
Spark in packages/core/tests/icefloe/test_object_store.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import tomli_w
from pyiceberg.catalog import Catalog, load_catalog

from icefloe.config import config_from_dict
from icefloe.errors import ConfigError
from icefloe.testing.fixtures import EVENTS_SCHEMA, EVENTS_SPEC, group_snapshots
from icefloe.testing.objectstore import S3Store
from icefloe_kafka.embedded import EmbeddedKafkaBroker
from icefloe_spark.kafka.admin import produce
from icefloe_spark.pipeline import Pipeline
from tests.test_e2e_rollback import icefloe_rollback
from tests.test_e2e_spark import (
    FAULT_BACKEND,
    SOURCE_OPTIONS,
    WAIT_S,
    new_topic,
    pipeline_dict,
    wait_until,
)
from tests.test_e2e_upsert import ROW_SCHEMA

EVENTS, UPSERTS, DEAD = "e2e.events", "e2e.upserts", "e2e.dead"
KEYS = 30


def records(first: int, n: int) -> list[tuple[bytes, dict[str, Any]]]:
    """Per i: an event for EVENTS (kinds a, b: two partitions of the table), a new version of
    key ``i % KEYS`` for UPSERTS, and every 50th a record whose id is not a number."""
    out: list[tuple[bytes, dict[str, Any]]] = []
    for i in range(first, first + n):
        out.append((str(i).encode(), {"id": i, "name": f"n{i}", "kind": "ab"[i % 2]}))
        out.append((str(i % KEYS).encode(), {"id": i % KEYS, "v": i, "name": f"v{i}", "kind": "u"}))
        if i % 50 == 0:
            out.append((b"bad", {"id": f"x{i}", "kind": "a"}))
    return out


def send(bootstrap: str, topic: str, batch: list[tuple[bytes, dict[str, Any]]]) -> None:
    produce(bootstrap, topic, ((k, json.dumps(v).encode()) for k, v in batch))


def upsert_state(sent: list[tuple[bytes, dict[str, Any]]]) -> dict[int, int]:
    """key -> the last v sent (one key, one Kafka partition: produce order is read order)."""
    return {r["id"]: r["v"] for _, r in sent if r["kind"] == "u"}


def live(store: S3Store, catalog: Catalog) -> tuple[list[int], dict[int, int], int]:
    """(EVENTS' ids, UPSERTS' key -> v, DEAD's row count), read by pyarrow from the bucket."""
    events = store.read_ids(catalog.load_table(EVENTS))
    rows = store.read_table(catalog.load_table(UPSERTS)).to_pylist()
    upserts = {r["id"]: r["v"] for r in rows}
    assert len(upserts) == len(rows), "a key twice in the upsert table"
    return events, upserts, store.read_table(catalog.load_table(DEAD)).num_rows


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``icefloe ARGS`` in its own process, as an operator runs it."""
    return subprocess.run(
        [sys.executable, "-m", "icefloe", *args],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )


def make_tables(props: Mapping[str, str]) -> Catalog:
    """The catalog with EVENTS (partitioned by kind) and UPSERTS (keyed by id) in it."""
    catalog = load_catalog("e2e", **props)
    catalog.create_namespace("e2e")
    catalog.create_table(EVENTS, schema=EVENTS_SCHEMA, partition_spec=EVENTS_SPEC)
    catalog.create_table(UPSERTS, schema=ROW_SCHEMA, properties={"format-version": "2"})
    return catalog


def pipeline_on_the_store(
    broker: EmbeddedKafkaBroker, props: Mapping[str, str], checkpoint: str
) -> dict[str, Any]:
    """A pipeline of its own name reading a new topic into EVENTS, UPSERTS and DEAD."""
    name, topic = f"e2e-s3-{uuid.uuid4().hex[:10]}", new_topic(broker)
    data = pipeline_dict(name, broker, topic, dict(props), FAULT_BACKEND, Path(checkpoint), 120)
    data["spark"]["checkpoint_location"] = checkpoint
    data["spark"]["rollback_check_interval_s"] = 0.5
    data["source"]["reader_options"] = SOURCE_OPTIONS
    data["tables"] = [
        {
            "name": EVENTS,
            "route_field": "kind",
            "route_values": ["a", "b"],
            "merge_small_files": True,
        },
        {
            "name": UPSERTS,
            "route_field": "kind",
            "route_values": ["u"],
            "mode": "upsert",
            "id_columns": ["id"],
        },
    ]
    data["errors"] = {"policy": "dead_letter", "dead_letter_table": DEAD}
    return data


def test_a_pipeline_on_the_object_store_commits_replays_and_is_maintained(
    spark: Any,
    kafka_broker: EmbeddedKafkaBroker,
    s3_store: S3Store,
    s3_catalog_properties: Mapping[str, str],
    tmp_path: Path,
) -> None:
    catalog = make_tables(s3_catalog_properties)
    data = pipeline_on_the_store(kafka_broker, s3_catalog_properties, str(tmp_path / "ckpt"))
    bootstrap, topic, group = (
        kafka_broker.bootstrap_servers,
        data["source"]["topics"][0],
        data["name"],
    )
    config_file = tmp_path / "pipeline.toml"
    config_file.write_text(tomli_w.dumps(data))

    store = s3_store
    sent = records(0, 300)
    send(bootstrap, topic, sent)

    def reached(upto: int) -> bool:
        events, upserts, dead = live(store, catalog)
        bad = sum(1 for _, r in sent if isinstance(r["id"], str))
        return set(range(upto)) <= set(events) and upserts == upsert_state(sent) and dead >= bad

    with Pipeline(config_from_dict(data), spark=spark):
        wait_until(lambda: reached(300), WAIT_S, "the first 300 records in the bucket")
        ours = [s.snapshot_id for s in group_snapshots(catalog, EVENTS, group)]
        assert len(ours) >= 2, "want snapshots to roll back over"
        said = icefloe_rollback(config_file, EVENTS, ours[0])
        assert "re-reads the source" in said
        more = records(300, 150)
        sent += more
        send(bootstrap, topic, more)
        wait_until(lambda: reached(450), WAIT_S, "all 450 records, the rolled-back ones again")

    events, upserts, dead = live(store, catalog)
    assert events == list(range(450)), "each event exactly once after the rollback's replay"
    assert upserts == upsert_state(sent)
    dead_rows = store.read_table(catalog.load_table(DEAD)).to_pylist()
    bad_values = sorted(json.dumps(r) for _, r in sent if isinstance(r["id"], str))
    assert sorted(bytes(r["value"]).decode() for r in dead_rows) == bad_values
    assert any(t.delete_files for t in catalog.load_table(UPSERTS).scan().plan_files())
    # merge_small_files: each cycle added one file per partition (kinds a, b) at most
    table = catalog.load_table(EVENTS)
    bucket = table.location().removeprefix("s3://").split("/", 1)[0]
    added = [
        int(s.summary["added-data-files"] or 0)
        for s in group_snapshots(catalog, EVENTS, group)
        if s.summary
    ]
    assert added
    assert max(added) <= 2, added

    # status and doctor as an operator runs them, against the bucket
    status = cli("status", "-c", str(config_file))
    assert status.returncode == 0, status.stdout + status.stderr
    assert EVENTS in status.stdout
    doctor = cli("doctor", "-c", str(config_file), "--json")
    checks = [json.loads(line) for line in doctor.stdout.splitlines() if line.startswith("{")]
    storage = [c for c in checks if c["check"].startswith("storage")]
    assert storage, doctor.stdout
    assert all(c["status"] == "ok" for c in storage), storage
    wrong = tmp_path / "wrong.toml"
    bad_props = {**s3_catalog_properties, "s3.secret-access-key": "not-the-secret"}
    wrong.write_text(tomli_w.dumps({**data, "catalog": {"name": "e2e", "properties": bad_props}}))
    refused = cli("doctor", "-c", str(wrong), "--json")
    assert refused.returncode == 1
    failed = [json.loads(line) for line in refused.stdout.splitlines() if line.startswith("{")]
    named = [c for c in failed if c["check"].startswith("storage") and c["status"] == "fail"]
    assert named, refused.stdout
    assert all("check catalog property s3.secret-access-key" in c["detail"] for c in named)
    assert "not-the-secret" not in refused.stdout + refused.stderr

    # icefloe maintain: expiry and orphan deletion in the bucket, nothing live touched
    stray = f"{table.location().removeprefix(f's3://{bucket}/')}/data/kind=a/stray.parquet"
    store.client().put_object(Bucket=bucket, Key=stray, Body=b"not referenced")
    maintained = cli(
        "maintain",
        "-c",
        str(config_file),
        "--expire-older-than",
        "0s",
        "--orphans-older-than",
        "0s",
    )
    assert maintained.returncode == 0, maintained.stdout + maintained.stderr
    assert f"{EVENTS}: delete" in maintained.stdout
    assert store.keys(f"s3://{bucket}/{stray}") == []
    assert live(store, catalog) == (events, upserts, dead)


def test_a_checkpoint_scheme_spark_cannot_write_is_refused_before_the_query(
    spark: Any,
    kafka_broker: EmbeddedKafkaBroker,
    s3_store: S3Store,
    s3_catalog_properties: Mapping[str, str],
) -> None:
    """PySpark's wheel has no Hadoop S3 connector: a checkpoint on s3a:// is refused with a
    typed error naming the key, after the driver wrote its incarnation marker there through
    the catalog's FileIO settings (s3a:// is the same object as s3://)."""
    make_tables(s3_catalog_properties)
    bucket = s3_store.new_bucket()
    data = pipeline_on_the_store(kafka_broker, s3_catalog_properties, f"s3a://{bucket}/ckpt")
    with pytest.raises(ConfigError) as refused:
        Pipeline(config_from_dict(data), spark=spark).start()
    assert refused.value.key == "spark.checkpoint_location"
    assert "hadoop-aws" in str(refused.value)
    assert "ckpt/icefloe-incarnation" in s3_store.keys(f"s3://{bucket}/ckpt/")

    data["spark"]["checkpoint_location"] = "nofs://somewhere/ckpt"
    with pytest.raises(ConfigError) as unknown:
        Pipeline(config_from_dict(data), spark=spark)
    assert unknown.value.key == "spark.checkpoint_location"
