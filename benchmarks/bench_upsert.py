"""Upsert row-delta cost: resolving key files into position deletes, and the commit.

    python benchmarks/bench_upsert.py --rows 1000000 --files 10 --updates 100000

Builds a real SQLite-catalog table with ``--files`` data files of ``--rows / --files`` rows
each (ids ascending, so every file holds one id range), then commits one upsert cycle of
``--updates`` changed rows (a data file with the new images plus a key file) through the real
committer, for each key layout:

* ``clustered``: the updated ids are one contiguous range (a recent-rows workload): column
  bounds leave only the files holding that range;
* ``random``: ids drawn uniformly over the table: every file is a candidate.

For each layout it times ``rowdelta.resolve`` with and without pruning (files read, seconds),
and the whole commit (resolve, write position deletes, one Iceberg snapshot). Then it checks
with pyiceberg's scan that the table still holds ``--rows`` rows and every updated id has its
new value, and times that read.

With ``--cycles N`` it instead commits N upsert cycles of ``--updates`` random keys each to
one table and reports the commit times and the scan time before and after them (the table's
final content is checked against the expected version of every id). ``--compact`` runs a
compaction round after every cycle, as the coordinator does for a table with ``compact =
true`` (default thresholds; ``--delete-ratio`` sets ``compact_delete_ratio``), and reports
its times and the files left; when the last cycle's deletes are left for a later round, the
scan is also timed after one more (forced) round. Each scan time is the fastest of
``--scans`` (3) scans; ``--scan-every N`` also times one every N cycles, so the figures
cover what a reader sees between rounds, not only at the end.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.schema import Schema
from pyiceberg.table import Table
from pyiceberg.types import LongType, NestedField, StringType

from icefloe.commit import rowdelta
from icefloe.commit.committer import IcebergCommitter
from icefloe.commit.compaction import Thresholds
from icefloe.commit.request import PendingFile, TableCommitRequest
from icefloe.events import DataFileMeta
from icefloe.ops.maintenance import expire_snapshots, remove_orphan_files
from icefloe.records.datafiles import (
    DataFileBuilder,
    group_write_uuid,
    write_data_files,
    write_key_files,
)
from icefloe.testing.readers import live_files

GROUP = "bench"  # the pipeline (group id) committing
SCHEMA = Schema(
    NestedField(1, "id", LongType(), required=True),
    NestedField(2, "name", StringType(), required=False),
    NestedField(3, "amount", LongType(), required=False),
    identifier_field_ids=[1],
)
ARROW = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False),
        pa.field("name", pa.string()),
        pa.field("amount", pa.int64()),
    ]
)


def rows(ids: np.ndarray, name: str) -> pa.Table:
    return pa.table([pa.array(ids), pa.array([name] * len(ids)), pa.array(ids * 3)], schema=ARROW)


def request(table: Table, metas: list[DataFileMeta], seq: int) -> TableCommitRequest:
    uid = str(table.metadata.table_uuid)
    return TableCommitRequest(
        table=".".join(table.name()),
        commit_id=str(uuid.uuid4()),
        files=tuple(PendingFile(m, "bench", seq, "0", seq, uid) for m in metas),
        positions={"0": seq + 1},
        source_offsets={},
        fencing_token=1,
    )


def run(layout: str, args: argparse.Namespace, root: Path) -> None:
    catalog = SqlCatalog(
        "bench", uri=f"sqlite:///{root}/{layout}.db", warehouse=f"file://{root}/{layout}"
    )
    catalog.create_namespace("db")
    table = catalog.create_table("db.t", schema=SCHEMA)
    committer = IcebergCommitter(catalog, GROUP)
    per_file = args.rows // args.files
    seed: list[DataFileMeta] = []
    for n in range(args.files):
        seed += write_data_files(table, rows(np.arange(n * per_file, (n + 1) * per_file), "v0"))
    committer.commit(request(table, seed, 0))

    began = time.perf_counter()
    before = catalog.load_table("db.t").scan().to_arrow().num_rows
    print(
        f"{layout:9} pyiceberg scan of {before} rows before the upsert: "
        f"{time.perf_counter() - began:6.2f} s"
    )

    rng = np.random.default_rng(7)
    if layout == "clustered":
        start = int(rng.integers(0, args.rows - args.updates))
        updated = np.arange(start, start + args.updates)
    else:
        updated = np.sort(rng.choice(args.rows, size=args.updates, replace=False))
    table = catalog.load_table("db.t")
    metas = write_data_files(table, rows(updated, "v1"))
    (key_file,) = write_key_files(table, pa.table({"id": pa.array(updated)}))
    metas.append(key_file)

    build = DataFileBuilder(table.metadata).build
    data = [build(m) for m in metas[:-1]]
    batch = [rowdelta.Batch(data, [build(key_file)])]
    head = table.current_snapshot()
    assert head is not None
    for prune in (True, False):
        began = time.perf_counter()
        resolution = rowdelta.resolve(table, head.snapshot_id, batch, prune=prune)
        took = time.perf_counter() - began
        assert resolution.deleted_rows == args.updates
        print(
            f"{layout:9} resolve prune={prune!s:5} files read {resolution.files_read:3}"
            f"/{resolution.candidates}: {took:6.2f} s"
        )
    began = time.perf_counter()
    result = committer.commit(request(table, metas, 1))
    commit_s = time.perf_counter() - began
    assert result.snapshot_id is not None
    print(f"{layout:9} commit (resolve + write deletes + snapshot): {commit_s:6.2f} s")

    began = time.perf_counter()
    scanned = catalog.load_table("db.t").scan().to_arrow()
    read_s = time.perf_counter() - began
    assert scanned.num_rows == args.rows, scanned.num_rows
    new = scanned.filter(pc.equal(scanned["name"], "v1"))
    assert sorted(new["id"].to_pylist()) == updated.tolist()
    print(f"{layout:9} pyiceberg scan of {scanned.num_rows} rows after the upsert: {read_s:6.2f} s")


def run_cycles(args: argparse.Namespace, root: Path) -> None:
    catalog = SqlCatalog("bench", uri=f"sqlite:///{root}/cycles.db", warehouse=f"file://{root}/c")
    catalog.create_namespace("db")
    table = catalog.create_table("db.t", schema=SCHEMA)
    committer = IcebergCommitter(catalog, GROUP)
    per_file = args.rows // args.files
    seed: list[DataFileMeta] = []
    for n in range(args.files):
        seed += write_data_files(table, rows(np.arange(n * per_file, (n + 1) * per_file), "v0"))
    committer.commit(request(table, seed, 0))
    before_s = _scan_s(catalog, args)
    compactor = committer.compactor()
    thresholds = Thresholds(delete_ratio=args.delete_ratio, max_file_rows=args.max_file_rows)
    rounds: list[float] = []
    version = np.zeros(args.rows, dtype=np.int64)
    rng = np.random.default_rng(11)
    times: list[float] = []
    most = (0, 0)  # the most live data and delete files seen after a cycle (and its round)
    window = max(1, min(100, args.cycles // 10))  # the goal: first vs last 100
    started = time.perf_counter()
    sampled: list[tuple[float, bool]] = []  # --scan-every: scan / scan before, deletes pending
    for cycle in range(1, args.cycles + 1):
        updated = np.sort(rng.choice(args.rows, size=args.updates, replace=False))
        version[updated] = cycle
        table = catalog.load_table("db.t")
        # named for the pipeline, as its writers name them: the committer deletes the key
        # files it applied only when it can prove it owns them, and lists the others in the
        # applied-files record, which would then grow by one path per cycle
        # (a uuid per write: the same uuid gives the same file names)
        metas = write_data_files(table, rows(updated, f"v{cycle}"), group_write_uuid(GROUP))
        keys = pa.table({"id": pa.array(updated)})
        (key_file,) = write_key_files(table, keys, group_write_uuid(GROUP))
        began = time.perf_counter()
        committer.commit(request(table, [*metas, key_file], cycle))
        times.append(time.perf_counter() - began)
        if args.compact:
            began = time.perf_counter()
            compactor.compact("db.t", thresholds)
            rounds.append(time.perf_counter() - began)
        if args.expire_every and cycle % args.expire_every == 0:
            # what an operator's scheduled `icefloe maintain` does: without it every cycle
            # adds snapshots to the metadata that each later commit reads and writes again
            # and removes the files nothing references any more: a round rewrites the whole
            # table, so 1,000 cycles at 10M rows would otherwise leave ~50 GB behind
            now_ms = int(time.time() * 1000)
            expire_snapshots(catalog.load_table("db.t"), now_ms, retain_last=10)
            remove_orphan_files(catalog.load_table("db.t"), now_ms)
        if args.cycles <= 100 or cycle % 10 == 0:
            data, deletes = live_files(catalog.load_table("db.t"))
            most = (max(most[0], len(data)), max(most[1], len(deletes)))
        if args.scan_every and cycle % args.scan_every == 0:
            # what a reader sees between rounds too, not only at the run's end
            pending = bool(live_files(catalog.load_table("db.t"))[1])
            sampled.append((_scan_s(catalog, args) / before_s, pending))
        if cycle % window == 0:  # a long run reports as it goes (and keeps what it measured)
            print(
                f"cycles {cycle - window + 1}-{cycle}: commit p50 {_p50(times[-window:]):.2f} s"
                + (f", round p50 {_p50(rounds[-window:]):.2f} s" if rounds else "")
                + f", at most {most[0]} / {most[1]} files so far, "
                f"{time.perf_counter() - started:.0f} s since the seed",
                flush=True,
            )
    scanned = catalog.load_table("db.t").scan().to_arrow().sort_by("id")
    assert scanned["id"].to_pylist() == list(range(args.rows))
    assert scanned["name"].to_pylist() == [f"v{v}" for v in version]
    read_s = _scan_s(catalog, args)
    final = catalog.load_table("db.t")
    data, deletes = live_files(final)
    settled = ""
    if args.compact and deletes:
        # the last cycle's deletes wait for the next round (below the thresholds): pyiceberg
        # pays for applying them on every file they hit; the scan right after a round is the
        # other end of the range a reader sees
        compactor.compact("db.t", thresholds, force=True)
        after_round_s = _scan_s(catalog, args)
        settled = (
            f"; after one more round {after_round_s:.2f} s ({after_round_s / before_s:.2f}x), "
            f"{len(live_files(catalog.load_table('db.t'))[0])} data file(s)"
        )
    first, last = _p50(times[:window]), _p50(times[-window:])
    print(
        f"{args.cycles} cycles of {args.updates} random upserts on {args.rows} rows, "
        f"compaction {'on' if args.compact else 'off'}"
        + (f", expiry every {args.expire_every} cycles" if args.expire_every else "")
        + f": commit p50 {_p50(times):.2f} s, max {max(times):.2f} s; p50 of the first "
        f"{window} {first:.2f} s, of the last {window} {last:.2f} s ({last / first:.2f}x); "
        f"pyiceberg scan before {before_s:.2f} s, after {read_s:.2f} s "
        f"({read_s / before_s:.2f}x){settled}; {len(data)} data file(s), {len(deletes)} "
        f"delete file(s) live after the last cycle, at most {most[0]} / {most[1]} during the "
        "run; "
        f"{len(final.metadata.snapshots)} snapshots in {len(final.metadata.metadata_log)} "
        f"metadata versions kept; p50 per {window} cycles: "
        + " ".join(f"{_p50(times[i : i + window]):.2f}" for i in range(0, len(times), window))
        + (
            f"; compaction round p50 {_p50(rounds):.2f} s, max {max(rounds):.2f} s"
            if rounds
            else ""
        )
        + _sampled(sampled)
    )


def _sampled(sampled: list[tuple[float, bool]]) -> str:
    """The scans --scan-every timed, as multiples of the scan before any upsert."""
    if not sampled:
        return ""
    ratios = [r for r, _ in sampled]
    waiting = [r for r, pending in sampled if pending]
    return (
        f"; {len(sampled)} scans during the run: p50 {_p50(ratios):.2f}x, max "
        f"{max(ratios):.2f}x of the scan before; {len(waiting)} with deletes pending"
        + (f" (p50 {_p50(waiting):.2f}x)" if waiting else "")
    )


def _scan_s(catalog: SqlCatalog, args: argparse.Namespace) -> float:
    """The fastest of ``--scans`` full pyiceberg scans of the table: on a shared machine the
    least disturbed one is the closest to the scan's own cost."""
    took = []
    for _ in range(args.scans):
        began = time.perf_counter()
        assert catalog.load_table("db.t").scan().to_arrow().num_rows == args.rows
        took.append(time.perf_counter() - began)
    return min(took)


def _p50(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--files", type=int, default=10)
    parser.add_argument("--updates", type=int, default=100_000)
    parser.add_argument("--layout", choices=["clustered", "random", "both"], default="both")
    parser.add_argument("--cycles", type=int, default=0, help="run N upsert cycles instead")
    parser.add_argument("--compact", action="store_true", help="with --cycles: compact too")
    parser.add_argument(
        "--delete-ratio",
        type=float,
        default=Thresholds().delete_ratio,
        help="with --compact: compact_delete_ratio (default: the table key's)",
    )
    parser.add_argument(
        "--max-file-rows",
        type=int,
        default=Thresholds().max_file_rows,
        help="with --compact: rows per compacted file at most (a huge value: no cap)",
    )
    parser.add_argument(
        "--scans", type=int, default=3, help="with --cycles: the fastest of N scans is timed"
    )
    parser.add_argument(
        "--scan-every",
        type=int,
        default=0,
        help="with --cycles: also time a scan every N cycles (after the cycle and its round)",
    )
    parser.add_argument(
        "--expire-every",
        type=int,
        default=0,
        help="with --cycles: expire snapshots (keep 10) every N cycles, as a scheduled "
        "`icefloe maintain` would",
    )
    args = parser.parse_args()
    print(f"{platform.processor() or platform.machine()}, Python {platform.python_version()}")
    layouts = ["clustered", "random"] if args.layout == "both" else [args.layout]
    with tempfile.TemporaryDirectory() as tmp:
        if args.cycles:
            run_cycles(args, Path(tmp))
            return
        for layout in layouts:
            run(layout, args, Path(tmp))


if __name__ == "__main__":
    main()
