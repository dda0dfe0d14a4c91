"""Seamless rollback, end to end: Kafka (Tansu) -> Spark -> two Iceberg tables fed by one topic.

Table A is rolled back twice while records keep coming, once with ``icefloe rollback`` and once
with pyiceberg directly (another tool). The pipeline must re-read the rolled-back range for A
only and commit those rows again, exactly once; B must not get a single extra row. Every table
is read with pyiceberg, never with the committer's code.
"""

from __future__ import annotations

import collections
import functools
import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import tomli_w
from pyiceberg.catalog import Catalog, load_catalog

from icefloe.commit.rollback import REPLAY_PREFIX
from icefloe.config import config_from_dict
from icefloe.testing.fixtures import EVENTS_SCHEMA, EVENTS_SPEC, group_snapshots, table_ids
from icefloe_kafka.embedded import EmbeddedKafkaBroker
from icefloe_spark.kafka.admin import end_offsets
from icefloe_spark.pipeline import Pipeline
from tests.test_e2e_spark import (
    FAULT_BACKEND,
    SOURCE_OPTIONS,
    WAIT_S,
    new_topic,
    pipeline_dict,
    produce_json,
    wait_until,
)

A, B = "e2e.rolled", "e2e.bystander"


def keys_of(table: str, upto: int) -> list[int]:
    """The ids routed to ``table`` among 0..upto-1 (kinds a, b to A; c to B)."""
    return [i for i in range(upto) if (i % 3 < 2) == (table == A)]


def assert_each_key_once(catalog: Catalog, table: str, upto: int) -> None:
    """Per-key counts: every routed key exactly once, nothing else."""
    counts = collections.Counter(table_ids(catalog, table))
    expected = keys_of(table, upto)
    missing = [k for k in expected if counts[k] == 0]
    dupes = {k: n for k, n in counts.items() if n > 1}
    extra = set(counts) - set(expected)
    problems = (
        f"{table}: missing {missing[:10]}, duplicated {list(dupes.items())[:10]}, "
        f"unexpected {sorted(extra)[:10]}"
    )
    assert (missing, dupes, extra) == ([], {}, set()), problems


def has_all(catalog: Catalog, table: str, upto: int) -> bool:
    return set(keys_of(table, upto)) <= set(table_ids(catalog, table))


def has_both(catalog: Catalog, upto: int) -> bool:
    return has_all(catalog, A, upto) and has_all(catalog, B, upto)


def head_ancestry(catalog: Catalog, table: str) -> list[int]:
    """The current snapshot and its ancestors, newest first."""
    loaded = catalog.load_table(table)
    out = []
    snap = loaded.current_snapshot()
    while snap is not None:
        out.append(snap.snapshot_id)
        parent = snap.parent_snapshot_id
        snap = None if parent is None else loaded.snapshot_by_id(parent)
    return out


def icefloe_rollback(config_file: Path, table: str, snapshot: int) -> str:
    """`icefloe rollback` as an operator runs it (its own process, no Spark)."""
    proc = subprocess.run(
        [sys.executable, "-m", "icefloe", "rollback", "-c", str(config_file), table, str(snapshot)],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def replay_writers(catalog: Catalog, table: str, group: str) -> set[str]:
    """Replay writer ids any of the table's snapshots of ``group`` recorded."""
    out: set[str] = set()
    for snap in group_snapshots(catalog, table, group):
        assert snap.summary is not None
        marks = json.loads(snap.summary.additional_properties["icefloe.writer-watermarks"])
        out |= {w for w in marks if w.startswith(REPLAY_PREFIX)}
    return out


def test_rolled_back_table_gets_its_rows_again_exactly_once_and_no_other_table_changes(
    spark: Any,
    kafka_broker: EmbeddedKafkaBroker,
    catalog_properties: dict[str, str],
    tmp_path: Path,
) -> None:
    bootstrap = kafka_broker.bootstrap_servers
    topic = new_topic(kafka_broker)
    catalog = load_catalog("e2e", **catalog_properties)
    catalog.create_namespace("e2e")
    for name in (A, B):
        catalog.create_table(name, schema=EVENTS_SCHEMA, partition_spec=EVENTS_SPEC)
    group = f"e2e-rollback-{uuid.uuid4().hex[:10]}"
    data = pipeline_dict(
        group, kafka_broker, topic, catalog_properties, FAULT_BACKEND, tmp_path / "ckpt", 60
    )
    data["tables"] = [
        {"name": A, "route_field": "kind", "route_values": ["a", "b"]},
        {"name": B, "route_field": "kind", "route_values": ["c"]},
    ]
    data["spark"]["rollback_check_interval_s"] = 0.5
    data["source"]["reader_options"] = SOURCE_OPTIONS
    config_file = tmp_path / "pipeline.toml"
    config_file.write_text(tomli_w.dumps(data))
    config = config_from_dict(data)

    with Pipeline(config, spark=spark):
        # three rounds, each committed before the next is produced: at least three snapshots
        # of A to roll back over, whatever the batch sizes and commit timing (one backlog of
        # 300 was sometimes committed in two)
        for upto in (100, 200, 300):
            produce_json(bootstrap, topic, range(upto - 100, upto))
            wait_until(functools.partial(has_both, catalog, upto), WAIT_S, str(upto))
        ours = [s.snapshot_id for s in group_snapshots(catalog, A, group)]
        assert len(ours) >= 3, "want several snapshots to roll back over"
        b_before = [s.snapshot_id for s in group_snapshots(catalog, B, group)]

        # 1. icefloe rollback, to the pipeline's first snapshot of A
        said = icefloe_rollback(config_file, A, ours[0])
        assert "rolled back from snapshot" in said
        assert "re-reads the source" in said
        produce_json(bootstrap, topic, range(300, 450))  # the live stream goes on
        wait_until(lambda: has_all(catalog, A, 450), WAIT_S, "A's rows back after rollback 1")
        assert_each_key_once(catalog, A, 450)

        # 2. another tool: pyiceberg, to the snapshot before the replay's commit
        wait_until(lambda: has_all(catalog, B, 450), WAIT_S, "B's rows up to 450")
        history = head_ancestry(catalog, A)
        target = history[len(history) // 2]
        catalog.load_table(A).manage_snapshots().rollback_to_snapshot(target).commit()
        assert len(table_ids(catalog, A)) < len(keys_of(A, 450))
        produce_json(bootstrap, topic, range(450, 600))
        wait_until(lambda: has_all(catalog, A, 600), WAIT_S, "A's rows back after rollback 2")
        wait_until(lambda: has_all(catalog, B, 600), WAIT_S, "B's rows up to 600")
        ends = {topic: {str(p): o for p, o in end_offsets(bootstrap, topic).items()}}

        def recorded(table: str) -> Any:
            newest = group_snapshots(catalog, table, group)[-1]
            assert newest.summary is not None
            return json.loads(newest.summary.additional_properties["icefloe.source-offsets"])

        wait_until(lambda: recorded(A) == ends == recorded(B), WAIT_S, "the topic's end")

    assert_each_key_once(catalog, A, 600)
    assert_each_key_once(catalog, B, 600)
    assert len(replay_writers(catalog, A, group)) == 2  # one replay per rollback
    # B untouched: no replay batch, its earlier snapshots still its history, rows all live
    assert replay_writers(catalog, B, group) == set()
    b_history = head_ancestry(catalog, B)
    assert all(s in b_history for s in b_before)
    added = sum(
        int(s.summary.additional_properties.get("added-records", "0"))
        for s in group_snapshots(catalog, B, group)
        if s.summary
    )
    assert added == len(keys_of(B, 600))
