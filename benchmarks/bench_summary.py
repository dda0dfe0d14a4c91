"""Table metadata growth with many writer ids over many commits, with and without retiring
the watermarks of writers that are gone (``icefloe.retired-writers``).

    python benchmarks/bench_summary.py --writer-ids 2500 --live 256 --commits 100

Drives the real ``IcebergCommitter`` (no channel, no writers: the summary is the committer's
business) on a real SQLite-catalog table created as icefloe creates tables, one file per live
writer per commit, each a hard link of a real Parquet file (``bench_coordinator.Templates``).
Writer ids come and go like restarted streaming queries: commit ``k`` is made by ``--live``
consecutive ids starting at ``k * step``, so ``--writer-ids`` distinct ids are seen over the
run. Runs twice (``live_writers`` given: retiring; None: every watermark stays in every summary)
and reports per run: the last summary's watermark count and size, the newest metadata file's
size, the metadata directory's size and commit wall/CPU p50 of the last 10 commits. Checks with
a pyarrow scan that each table holds exactly one row set per commit.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench_coordinator import TABLE, Templates, dir_size

from icefloe.commit.committer import IcebergCommitter
from icefloe.commit.dedupe import WATERMARKS_KEY
from icefloe.commit.request import PendingFile, TableCommitRequest
from icefloe.ops.maintenance import recommended_properties
from icefloe.testing.fixtures import create_rows_table, make_sqlite_catalog


def run(args: argparse.Namespace, retire: bool, work: Path) -> str:
    catalog = make_sqlite_catalog(work / ("retire" if retire else "keep"))
    table = create_rows_table(catalog, TABLE)
    table.transaction().set_properties(recommended_properties()).commit_transaction()
    templates = Templates(catalog.load_table(TABLE))
    committer = IcebergCommitter(catalog, "bench")
    step = max(1, (args.writer_ids - args.live) // max(1, args.commits - 1))
    uuid_ = str(table.metadata.table_uuid)
    offset = 0
    walls: list[float] = []
    cpus: list[float] = []
    for k in range(args.commits):
        live = [f"query-{(k * step + i) % args.writer_ids:05d}" for i in range(args.live)]
        files = []
        for w in live:
            meta = templates.link(f"s-{w}-{k}.parquet")
            files.append(PendingFile(meta, w, k, "0", offset, uuid_))
            offset += 1
        request = TableCommitRequest(
            TABLE,
            str(uuid.uuid4()),
            tuple(files),
            {"0": offset},
            {},
            1,
            channel_id="bench:1",
            live_writers=frozenset(live) if retire else None,
        )
        wall, cpu = time.perf_counter(), time.process_time()
        committer.commit(request)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    loaded = catalog.load_table(TABLE)
    summary = loaded.current_snapshot().summary.additional_properties  # type: ignore[union-attr]
    marks = summary[WATERMARKS_KEY]
    meta_file = Path(loaded.metadata_location.removeprefix("file://"))
    rows = loaded.scan().to_arrow().num_rows
    assert rows == args.commits * args.live * 10, rows  # ROWS_PER_FILE rows per file
    return (
        f"| {'retiring' if retire else 'keeping all'} | {len(json.loads(marks))} | "
        f"{len(marks) / 1e3:.1f} KB | {meta_file.stat().st_size / 1e6:.2f} MB | "
        f"{dir_size(meta_file.parent) / 1e6:.1f} MB | "
        f"{statistics.median(walls[-10:]) * 1e3:,.0f} ms | "
        f"{statistics.median(cpus[-10:]) * 1e3:,.0f} ms | {os.getloadavg()[0]:.1f} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--writer-ids", type=int, default=2500)
    parser.add_argument("--live", type=int, default=256)
    parser.add_argument("--commits", type=int, default=100)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-summary-"))
    atexit.register(shutil.rmtree, work, True)
    print(
        f"writer ids {args.writer_ids}, live per commit {args.live}, commits {args.commits}, "
        f"files per commit {args.live}"
    )
    print(
        "| summaries | watermarks in the last summary | its size | newest metadata file | "
        "metadata dir | commit wall p50 (last 10) | commit CPU p50 (last 10) | load |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for retire in (True, False):
        print(run(args, retire, work), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
