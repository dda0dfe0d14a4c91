"""Small files per commit with and without ``merge_small_files`` (the coordinator merging a
cycle's small files per partition before the commit).

    python benchmarks/bench_merge.py --tasks 8 --partitions 16 --records 25000 --cycles 5

Each cycle imitates a Spark micro-batch on the ``ranges`` path: ``--tasks`` write tasks each
write ``--records`` of ``bench_e2e``'s events (10 fields, ~250 bytes as JSON) into a table
partitioned by ``bucket(--partitions, user_id)``, with pyiceberg's writer as the sink does, so
a cycle announces tasks x partitions files. The real ``IcebergCommitter`` commits them to a
SQLite-catalog table (created as icefloe creates tables), once without and once with merging
(target ``--target-mb``). Reports per run: files and mean file size per commit (from the
snapshot summaries), the commit's wall and CPU time p50 (merging included), the files in the
table at the end and the wall time of a full pyiceberg scan of it. Checks that every row is in
the table exactly once.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.json as pajson
from bench_e2e import SCHEMA, events
from pyiceberg.io.pyarrow import schema_to_pyarrow
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.transforms import BucketTransform

from icefloe.commit.committer import IcebergCommitter
from icefloe.commit.policy import TablePolicies, TablePolicy
from icefloe.commit.request import PendingFile, TableCommitRequest
from icefloe.ops.maintenance import recommended_properties
from icefloe.records.datafiles import group_write_uuid, write_data_files
from icefloe.testing.fixtures import make_sqlite_catalog

TABLE = "bench.events"


def task_data(first_id: int, n: int) -> pa.Table:
    """What one write task converts: ``bench_e2e``'s events, parsed by Arrow's JSON reader."""
    data = b"\n".join(value for _, value in events(first_id, n))
    options = pajson.ParseOptions(explicit_schema=schema_to_pyarrow(SCHEMA))
    return pajson.read_json(io.BytesIO(data), parse_options=options)


def run(args: argparse.Namespace, merge: bool, work: Path) -> str:
    catalog = make_sqlite_catalog(work / ("merge" if merge else "plain"))
    catalog.create_namespace("bench")
    # bucket(partitions, user_id): every task's random users touch every partition
    spec = PartitionSpec(PartitionField(2, 1000, BucketTransform(args.partitions), "user_bucket"))
    table = catalog.create_table(
        TABLE, schema=SCHEMA, partition_spec=spec, properties=recommended_properties()
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
            data = task_data(next_id, args.records)
            next_id += args.records
            for meta in write_data_files(table, data, group_write_uuid("bench")):
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
