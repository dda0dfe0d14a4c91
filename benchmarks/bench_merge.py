"""Small files per commit with and without ``merge_small_files`` (the coordinator merging a
cycle's small files per partition before the commit).

    python benchmarks/bench_merge.py --tasks 8 --partitions 16 --records 25000 --cycles 5

Each cycle imitates a Spark micro-batch on the ``ranges`` path: ``--tasks`` write tasks each
write ``--records`` events (10 fields, ~250 bytes as JSON) spread over ``--partitions`` values
of the table's identity partition column, with pyiceberg's writer as the sink does, so a cycle
announces tasks x partitions files. The real ``IcebergCommitter`` commits them to a
SQLite-catalog table (created as icefloe creates tables), once without and once with merging
(target ``--target-mb``). Reports per run: files and mean file size per commit (from the
snapshot summaries), the commit's wall and CPU time p50 (merging included), the files in the
table at the end and the wall time of a full pyiceberg scan of it. Checks that every row is in
the table exactly once.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pyarrow as pa
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.transforms import IdentityTransform
from pyiceberg.types import (
    BooleanType,
    DoubleType,
    IntegerType,
    LongType,
    NestedField,
    StringType,
    TimestamptzType,
)

from icefloe.committer import IcebergCommitter, PendingFile, TableCommitRequest
from icefloe.datafiles import write_data_files
from icefloe.maintenance import recommended_properties
from icefloe.policy import TablePolicies, TablePolicy
from icefloe.testing.fixtures import make_sqlite_catalog

TABLE = "bench.events"
SCHEMA = Schema(
    NestedField(1, "id", LongType(), required=False),
    NestedField(2, "region", StringType(), required=False),
    NestedField(3, "user", StringType(), required=False),
    NestedField(4, "session", StringType(), required=False),
    NestedField(5, "page", StringType(), required=False),
    NestedField(6, "amount", DoubleType(), required=False),
    NestedField(7, "count", IntegerType(), required=False),
    NestedField(8, "flag", BooleanType(), required=False),
    NestedField(9, "ts", TimestamptzType(), required=False),
    NestedField(10, "note", StringType(), required=False),
)
SPEC = PartitionSpec(PartitionField(2, 1000, IdentityTransform(), "region"))
T0 = dt.datetime(2026, 11, 25, tzinfo=dt.UTC)


def events(first_id: int, n: int, partitions: int) -> pa.Table:
    """``n`` events with ids from ``first_id``, spread evenly over ``partitions`` regions."""
    ids = list(range(first_id, first_id + n))
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "region": [f"region-{i % partitions:03d}" for i in ids],
            "user": [f"user-{i % 9973:05d}" for i in ids],
            "session": [uuid.UUID(int=i * 2654435761).hex for i in ids],
            "page": [f"/shop/item/{i % 5003}" for i in ids],
            "amount": pa.array([i * 0.37 % 1000 for i in ids], pa.float64()),
            "count": pa.array([i % 100 for i in ids], pa.int32()),
            "flag": [i % 3 == 0 for i in ids],
            "ts": pa.array(
                [T0 + dt.timedelta(milliseconds=i) for i in ids], pa.timestamp("us", "UTC")
            ),
            "note": [f"event number {i} from the benchmark" for i in ids],
        }
    )


def run(args: argparse.Namespace, merge: bool, work: Path) -> str:
    catalog = make_sqlite_catalog(work / ("merge" if merge else "plain"))
    catalog.create_namespace("bench")
    table = catalog.create_table(
        TABLE, schema=SCHEMA, partition_spec=SPEC, properties=recommended_properties()
    )
    policy = TablePolicy(merge_small_files=merge, target_file_size_bytes=args.target_mb << 20)
    committer = IcebergCommitter(catalog, "bench", policies=TablePolicies(policy))
    uuid_ = str(table.metadata.table_uuid)
    next_id, offset = 0, 0
    walls: list[float] = []
    cpus: list[float] = []
    announced: list[int] = []
    for cycle in range(args.cycles):
        files: list[PendingFile] = []
        for task in range(args.tasks):  # a Spark task: its own file per partition it touches
            data = events(next_id, args.records, args.partitions)
            next_id += args.records
            for meta in write_data_files(table, data):
                files.append(PendingFile(meta, f"task-{task}", cycle, "0", offset, uuid_))
                offset += 1
        announced.append(len(files))
        request = TableCommitRequest(TABLE, str(uuid.uuid4()), tuple(files), {"0": offset}, {}, 1)
        wall, cpu = time.perf_counter(), time.process_time()
        committer.commit(request)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    loaded = catalog.load_table(TABLE)
    summaries = [s.summary for s in loaded.snapshots() if s.summary is not None]
    added = [int(s["added-data-files"] or 0) for s in summaries]
    size = sum(int(s["added-files-size"] or 0) for s in summaries)
    started = time.perf_counter()
    scanned = loaded.scan().to_arrow()
    scan_s = time.perf_counter() - started
    assert scanned.num_rows == next_id, (scanned.num_rows, next_id)
    assert len(set(scanned["id"].to_pylist())) == next_id, "a row is in the table twice"
    live = len(list(loaded.scan().plan_files()))
    return (
        f"| {'merged' if merge else 'as written'} | {statistics.mean(announced):,.0f} | "
        f"{statistics.mean(added):,.0f} | {size / sum(added) / 1e3:,.1f} KB | "
        f"{statistics.median(walls) * 1e3:,.0f} ms | {statistics.median(cpus) * 1e3:,.0f} ms | "
        f"{live:,} | {scan_s:.2f} s | {os.getloadavg()[0]:.1f} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=8, help="write tasks per cycle")
    parser.add_argument("--partitions", type=int, default=16, help="partitions each touches")
    parser.add_argument("--records", type=int, default=25_000, help="records per task")
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--target-mb", type=int, default=128, help="target_file_size_bytes")
    args = parser.parse_args()
    print(
        "| files | announced per commit | added per commit | mean file size | commit p50 wall "
        "| commit p50 CPU | files in table | full scan | load |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="icefloe-bench-merge-") as tmp:
        for merge in (False, True):
            print(run(args, merge, Path(tmp)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
