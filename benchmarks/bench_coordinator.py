"""The coordinator under many writers and many files: cycle and Iceberg commit time.

    nox -s bench-coordinator -- --backend redis --writers 64 --files 1000 --cycles 20
    # or: python benchmarks/bench_coordinator.py --backend kafka --writers 256 --files 100
    # many tables (dynamic tables): 2 files per table per cycle over 100 tables
    python benchmarks/bench_coordinator.py --writers 16 --tables 100 --files 200 --cycles 10
    # the same tables committed by 4 threads (coordination.commit_parallelism)
    python benchmarks/bench_coordinator.py --writers 16 --tables 100 --files 200 --cycles 5 \
        --commit-parallelism 4
    # ... by 4 committer processes (coordination.commit_processes), the SQL catalog on the
    # machine's PostgreSQL (a catalog name of its own per run), whose commits of different
    # tables run at the same time where SQLite's one write lock serialises them
    python benchmarks/bench_coordinator.py --writers 16 --tables 100 --files 200 --cycles 5 \
        --commit-processes 4 --catalog postgresql+psycopg://postgres@127.0.0.1:5432/test
    # ... by Spark tasks (spark.commit_tasks): one Spark job of 2 tasks per cycle, on a local
    # Spark session of 2 cores started by the benchmark (local[2])
    python benchmarks/bench_coordinator.py --writers 16 --tables 100 --files 200 --cycles 5 \
        --commit-tasks 2

A simulation of a pipeline without Spark, on the real code paths:

* writers: real :class:`~icefloe.coordination.writer.WriterClient` objects (each with its responder
thread)
  on the chosen backend, spread over ``--processes`` child processes;
* coordinator: the real :class:`~icefloe.coordination.coordinator.Coordinator` and committer in this
  process (or ``--commit-processes`` committer processes), committing to a real SQL-catalog
  table, on SQLite or ``--catalog URI`` (``--tables T``: T tables, the cycle's
  files spread over them round-robin, as a stream fanned out by ``[dynamic_tables]``);
* files: every published file is a real Parquet file inside the table location. Each writer
  process writes one small Parquet file through pyiceberg's writer and hard-links it under a
  new name for every file it publishes, so 100,000 files per cycle cost no Parquet writing
  (the committer never opens data files; a reader of the table reads real Parquet).

Per cycle: every writer publishes one batch (``--files`` spread over the writers), the
coordinator reads until all are pending, then runs one commit cycle (StartCommit, every
writer answers, one Iceberg commit). "cycle" is that whole commit cycle; "commit" is the
Iceberg commit alone (from the coordinator's ``before_table_commit`` hook to its
``after_iceberg_commits`` hook); "coordinator CPU" is this process's CPU time over the
whole cycle, also divided by the tables committed (committer processes' CPU not included:
"committers CPU" adds it, read from /proc). Reports p50/p99 of these, the
last-10 / first-10 ratio of the commit time (growth with table history), the metadata
directory's size, and with ``--idle-s`` the CPU the writer processes burn while nothing
happens. At the end it checks that each table holds exactly its published files, and every
row, with a pyarrow scan.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from icefloe.channel import Backend
from icefloe.coordination.coordinator import (
    Coordinator,
    CoordinatorHooks,
    CoordinatorSettings,
    CycleResult,
)
from icefloe.coordination.settings import CatalogSpec
from icefloe.coordination.writer import WriterClient
from icefloe.events import DataFileMeta, SourcePosition
from icefloe.hookspecs import BackendContext
from icefloe.ops.maintenance import expire_snapshots, recommended_properties
from icefloe.plugins.manager import get_plugins
from icefloe.testing.fixtures import create_rows_table, sqlite_catalog_properties, write_rows
from icefloe.testing.harness import drive, lead
from icefloe_kafka.embedded import EmbeddedKafkaBroker

TABLE = "bench.events"


def table_names(count: int) -> list[str]:
    """The benchmark's tables: ``bench.events`` alone, or ``bench.events_00000``... ."""
    return [TABLE] if count == 1 else [f"{TABLE}_{i:05d}" for i in range(count)]


ROWS_PER_FILE = 10


def backend_options(name: str, bootstrap: str | None) -> dict[str, Any]:
    """Options of a private namespace on the machine's servers (or the embedded broker)."""
    tag = uuid.uuid4().hex[:10]
    if name == "redis":
        url = os.environ.get("ICEFLOE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
        return {
            "url": url,
            "key_prefix": f"bench-{tag}",
            "max_block_s": 0.5,
            "warn_no_persistence": False,
        }
    if name == "postgres":
        dsn = os.environ.get("ICEFLOE_TEST_POSTGRES_DSN", "postgresql://127.0.0.1:5432/test")
        return {"dsn": dsn, "schema": f"bench_{tag}"}
    if name == "kafka":
        return {
            "bootstrap_servers": bootstrap,
            "control_topic": f"bench-control-{tag}",
            "partitions": 4,
            "fetch_wait_max_ms": 20,
            "transaction_timeout_ms": 30_000,
        }
    raise SystemExit(f"unknown backend {name!r}: use redis, postgres or kafka")


def open_backend(name: str, options: dict[str, Any], group: str) -> Backend:
    spec = get_plugins().backend(name)
    return spec.factory(
        spec.config_model.model_validate(options), BackendContext(group, lease_ttl_s=15.0)
    )


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    backend: str
    options: dict[str, Any]
    group: str
    catalog: CatalogSpec
    writers: list[tuple[int, str]]  # (index, writer id)
    tables: list[str]


def _local_path(uri: str) -> str:
    return urlsplit(uri).path if uri.startswith("file:") else uri


class Templates:
    """Real Parquet files to hard-link from, a new one before a file system's link limit."""

    LINKS_PER_FILE = 20_000  # ext4 allows 65,000 links to one inode

    def __init__(self, table: Any) -> None:
        self._table = table
        self._lock = threading.Lock()
        self._links = self.LINKS_PER_FILE

    def link(self, name: str) -> DataFileMeta:
        with self._lock:
            if self._links >= self.LINKS_PER_FILE:
                self._meta = write_rows(self._table, range(ROWS_PER_FILE), "template", 0)[0]
                self._path = _local_path(self._meta.path)
                self._links = 0
            self._links += 1
            meta, source = self._meta, self._path
        path = os.path.join(os.path.dirname(source), name)
        os.link(source, path)
        return dataclasses.replace(meta, path=f"file://{path}")


def worker_main(spec: WorkerSpec, commands: Any, replies: Any) -> None:
    """One writer process: its writers publish when told to; replies with CPU seconds used."""
    catalog = spec.catalog.load()
    templates = {name: Templates(catalog.load_table(name)) for name in spec.tables}
    backend = open_backend(spec.backend, spec.options, spec.group)
    clients = [
        (index, WriterClient(backend.writer(wid), spec.group, wid)) for index, wid in spec.writers
    ]
    for _, client in clients:
        client.start()

    def publish(index: int, client: WriterClient, cycle: int, first: int, count: int) -> None:
        metas: dict[str, list[DataFileMeta]] = {}
        for i in range(first, first + count):  # the cycle's i-th file goes to table i % T
            name = spec.tables[i % len(spec.tables)]
            link = templates[name].link(f"bench-{client.writer_id}-{cycle}-{i}.parquet")
            metas.setdefault(name, []).append(link)
        position = SourcePosition("bench", index, cycle + 1, int(time.time() * 1000))
        client.publish(cycle, metas, [position])

    replies.put(("ready", time.process_time()))
    with ThreadPoolExecutor(max_workers=8) as pool:
        while True:
            command = commands.get()
            if command[0] == "stop":
                break
            if command[0] == "cpu":
                replies.put(("cpu", time.process_time()))
                continue
            _, cycle, ranges = command
            jobs = [
                pool.submit(publish, index, client, cycle, first, count)
                for (index, client), (first, count) in zip(clients, ranges, strict=True)
            ]
            for job in jobs:
                job.result()
            replies.put(("published", time.process_time()))
    for _, client in clients:
        client.close()
    backend.close()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="redis", choices=("redis", "postgres", "kafka"))
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--files", type=int, default=100, help="files per cycle, all writers")
    parser.add_argument(
        "--tables", type=int, default=1, help="tables the files are spread over (round-robin)"
    )
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--processes", type=int, default=2, help="writer processes")
    parser.add_argument("--idle-s", type=float, default=0.0, help="measure idle writer CPU")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument(
        "--profile", metavar="PATH", help="write cProfile stats of the commit cycles to PATH"
    )
    parser.add_argument(
        "--plain-table",
        action="store_true",
        help="create the table without icefloe's bounded-metadata properties",
    )
    parser.add_argument(
        "--retain-last",
        type=int,
        default=0,
        help="after every cycle, expire all but the N newest snapshots as `icefloe maintain "
        "--retain-last N` next to the pipeline would (untimed; 0: never)",
    )
    parser.add_argument(
        "--commit-processes",
        type=int,
        default=0,
        help="committer processes (coordination.commit_processes; 0: commit in this process)",
    )
    parser.add_argument(
        "--catalog",
        default="sqlite",
        metavar="URI",
        help="the SQL catalog: sqlite (a file in the work directory) or an SQLAlchemy URI, "
        "e.g. postgresql+psycopg://postgres@127.0.0.1:5432/test (a catalog name per run)",
    )
    parser.add_argument(
        "--commit-tasks",
        type=int,
        default=0,
        help="Spark tasks committing a cycle's tables (spark.commit_tasks), on a local Spark "
        "session of that many cores",
    )
    parser.add_argument(
        "--commit-parallelism",
        type=int,
        default=1,
        help="threads committing a cycle's tables (coordination.commit_parallelism)",
    )
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="bench-coordinator-"))
    catalog_spec = catalog_of(args.catalog, work / "iceberg")
    catalog = catalog_spec.load()
    tables = table_names(args.tables)
    for name in tables:
        table = create_rows_table(catalog, name)
        if not args.plain_table:  # as icefloe creates tables (spark-runner tables.py)
            table.transaction().set_properties(recommended_properties()).commit_transaction()
    broker = (
        EmbeddedKafkaBroker(log_path=work / "broker.log").start()
        if args.backend == "kafka"
        else None
    )
    group = f"bench-{uuid.uuid4().hex[:8]}"
    options = backend_options(args.backend, broker.bootstrap_servers if broker else None)
    ids = [(i, f"w{i:05d}") for i in range(args.writers)]
    ctx = mp.get_context("spawn")
    replies = ctx.Queue()
    workers = []
    for p in range(args.processes):
        commands = ctx.Queue()
        spec = WorkerSpec(
            args.backend, options, group, catalog_spec, ids[p :: args.processes], tables
        )
        proc = ctx.Process(
            target=worker_main,
            args=(spec, commands, replies),
            daemon=True,
            name=f"bench-writer-{p}",
        )
        proc.start()
        workers.append((proc, commands, spec))

    commit_started: list[tuple[float, float]] = []
    commit_times: list[float] = []
    commit_cpu: list[float] = []  # this process's CPU seconds: robust on a shared machine

    first_table = threading.Lock()  # with --commit-parallelism, tables start on threads

    def before(_: str) -> None:
        with first_table:
            if not commit_started:  # the cycle's first table
                commit_started.append((time.perf_counter(), time.process_time()))

    def after(_: CycleResult) -> None:
        if commit_started:
            wall, cpu = commit_started.pop()
            commit_times.append(time.perf_counter() - wall)
            commit_cpu.append(time.process_time() - cpu)

    backend = open_backend(args.backend, options, group)
    spark = spark_committers(args.commit_tasks) if args.commit_tasks else None
    coordinator = Coordinator(
        group,
        backend.coordinator("bench-coordinator"),
        catalog,
        CoordinatorSettings(
            commit_interval_s=3600,
            commit_timeout_s=60,
            writer_timeout_s=3600,
            commit_parallelism=args.commit_parallelism,
            commit_processes=args.commit_processes,
            catalog=catalog_spec,
        ),
        hooks=CoordinatorHooks(before_table_commit=before, after_iceberg_commits=after),
        committers=spark[0] if spark is not None else None,
    )
    profiler = cProfile.Profile(time.process_time) if args.profile else None  # CPU, not waits
    cycle_times: list[float] = []
    cycle_cpu: list[float] = []
    committers_cpu: list[float] = []  # this process and its committer processes
    publish_times: list[float] = []
    idle_cores: float | None = None
    try:
        for _ in workers:
            kind, _cpu = replies.get(timeout=300)
            assert kind == "ready", kind
        lead(coordinator, timeout=120)
        total_files = 0
        for cycle in range(args.cycles):
            started = time.perf_counter()
            for _, commands, spec in workers:
                commands.put(("publish", cycle, [file_range(args, i) for i, _ in spec.writers]))
            for _ in workers:
                replies.get(timeout=600)
            total_files += args.files
            drive(
                coordinator,
                lambda: sum(coordinator.pending_files().values()) >= args.files,
                f"{args.files} pending files",
                timeout=600,
            )
            publish_times.append(time.perf_counter() - started)
            started, cpu_started = time.perf_counter(), time.process_time()
            all_started = committers_cpu_s(cpu_started)
            if profiler is not None:
                profiler.enable()
            result = coordinator.commit_now()
            if profiler is not None:
                profiler.disable()
            cycle_times.append(time.perf_counter() - started)
            cycle_cpu.append(time.process_time() - cpu_started)
            committers_cpu.append(committers_cpu_s(time.process_time()) - all_started)
            if not result.complete or result.failed:
                print(f"cycle {cycle}: complete={result.complete} failed={result.failed}")
            print(
                f"cycle {cycle}: cycle {cycle_times[-1] * 1000:.0f} ms "
                f"({cycle_cpu[-1] * 1000:.0f} ms CPU), "
                f"commit {commit_times[-1] * 1000:.0f} ms ({commit_cpu[-1] * 1000:.0f} ms CPU)"
                if commit_times
                else "",
                flush=True,
            )
            if args.retain_last > 0:
                for name in tables:
                    live = catalog.load_table(name)
                    expire_snapshots(live, older_than_ms=2**62, retain_last=args.retain_last)
        if profiler is not None:
            profiler.dump_stats(args.profile)
        if args.idle_s > 0:
            idle_cores = measure_idle(workers, replies, args.idle_s)
        for i, name in enumerate(tables):  # table i got the cycle's files i, i + T, ...
            per_cycle = len(range(i, args.files, len(tables)))
            check_table(catalog, name, per_cycle * args.cycles)
    finally:
        for _, commands, _ in workers:
            commands.put(("stop",))
        for proc, _, _ in workers:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
        coordinator.close()
        if spark is not None:
            spark[1].stop()
        backend.close()
        if broker is not None:
            broker.stop()
    report(args, cycle_times, cycle_cpu, committers_cpu, commit_times, commit_cpu, work, idle_cores)
    if not args.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 0


def spark_committers(tasks: int) -> tuple[Callable[[Any], Any], Any]:
    """A local Spark session of ``tasks`` cores and the committers factory that commits on
    it (``spark.commit_tasks``, as ``icefloe run`` builds them); imported here only, so the
    other runs need no Spark."""
    from icefloe_spark.committers import SparkCommitters
    from icefloe_spark.runtime import jvm

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    session = jvm.session(
        {
            "spark.master": f"local[{tasks}]",
            "spark.app.name": "bench-coordinator",
            "spark.ui.enabled": "false",
            "spark.scheduler.mode": "FAIR",
            "spark.ui.showConsoleProgress": "false",
        }
    )
    session.sparkContext.setLogLevel("ERROR")
    return (lambda spec: SparkCommitters(lambda: session, tasks, spec)), session


def catalog_of(uri: str, path: Path) -> CatalogSpec:
    """The run's catalog: SQLite in ``path``, or the SQL database at ``uri`` under a catalog
    name of its own (its rows apart from every other run's), its warehouse in ``path``."""
    if uri == "sqlite":
        return CatalogSpec("icefloe_test", sqlite_catalog_properties(path))
    path.mkdir(parents=True, exist_ok=True)
    props = {"type": "sql", "uri": uri, "warehouse": f"file://{path / 'warehouse'}"}
    return CatalogSpec(f"bench_{uuid.uuid4().hex[:10]}", props)


def committers_cpu_s(own: float) -> float:
    """CPU seconds of this process (``own``) and of its live descendants that are not
    writers (the committer processes; with ``--commit-tasks`` Spark's JVM and its Python
    workers), read from /proc (0 for them elsewhere)."""
    writers = {c.pid for c in mp.active_children() if c.name.startswith("bench-writer")}
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}  # pid -> (parent, CPU seconds)
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in stats.items():
        children.setdefault(parent, []).append(pid)
    total, todo = own, [c for c in children.get(os.getpid(), []) if c not in writers]
    while todo:
        pid = todo.pop()
        total += stats[pid][1]
        todo += children.get(pid, [])
    return total


def measure_idle(workers: list[Any], replies: Any, seconds: float) -> float:
    """CPU cores the writer processes use while no batch is published and no cycle runs."""

    def cpu() -> float:
        for _, commands, _ in workers:
            commands.put(("cpu",))
        return float(sum(replies.get(timeout=60)[1] for _ in workers))

    before, started = cpu(), time.perf_counter()
    time.sleep(seconds)
    return (cpu() - before) / (time.perf_counter() - started)


def file_range(args: argparse.Namespace, index: int) -> tuple[int, int]:
    """Writer ``index``'s share of a cycle's files: the first file's number, and how many."""
    base, extra = divmod(args.files, args.writers)
    return index * base + min(index, extra), base + (1 if index < extra else 0)


def check_table(catalog: Any, name: str, files: int) -> None:
    """The table holds exactly the published files and their rows (pyarrow scan)."""
    table = catalog.load_table(name)
    snapshot = table.current_snapshot()
    summary = snapshot.summary if snapshot else None
    got = int(summary["total-data-files"]) if summary else 0
    rows = table.scan(selected_fields=("id",)).to_arrow().num_rows
    if got != files or rows != files * ROWS_PER_FILE:
        raise SystemExit(f"{name} holds {got} files / {rows} rows, expected {files} files")


def report(
    args: argparse.Namespace,
    cycles: list[float],
    cycles_cpu: list[float],
    committers_cpu: list[float],
    commits: list[float],
    cpu: list[float],
    work: Path,
    idle_cores: float | None,
) -> None:
    def ms(v: float) -> str:
        return f"{v * 1000:,.0f} ms"

    n = min(10, len(commits) // 2) or 1

    def growth(values: list[float]) -> float:
        return statistics.mean(values[-n:]) / statistics.mean(values[:n]) if values else 0.0

    def median_growth(values: list[float]) -> float:
        # one slow cycle (a manifest merge, a load spike of a shared machine) dominates the
        # mean of ten; the median shows whether the typical commit grew with history
        return statistics.median(values[-n:]) / statistics.median(values[:n]) if values else 0.0

    meta = sum(dir_size(p) for p in (work / "iceberg" / "warehouse").rglob("metadata"))
    load = os.getloadavg()[0]
    print()
    print(
        f"backend={args.backend} writers={args.writers} files/cycle={args.files} "
        f"tables={args.tables} commit_parallelism={args.commit_parallelism} "
        f"commit_processes={args.commit_processes} commit_tasks={args.commit_tasks} "
        f"catalog={args.catalog.split('://')[0]} "
        f"cycles={args.cycles} processes={args.processes} plain_table={args.plain_table} "
        f"retain_last={args.retain_last} "
        f"cpus={os.cpu_count()} python={platform.python_version()} load(1m)={load:.1f}"
    )
    print(
        f"cycle p50 {ms(percentile(cycles, 0.5))}, p99 {ms(percentile(cycles, 0.99))}, "
        f"max {ms(max(cycles, default=0.0))}"
    )
    cpu50 = percentile(cycles_cpu, 0.5)
    print(
        f"coordinator CPU per cycle p50 {ms(cpu50)}, p99 {ms(percentile(cycles_cpu, 0.99))}; "
        f"per table {cpu50 / args.tables * 1000:.1f} ms"
    )
    if args.commit_processes or args.commit_tasks:
        all50 = percentile(committers_cpu, 0.5)
        who = (
            f"{args.commit_processes} committer processes"
            if args.commit_processes
            else f"Spark's JVM and Python workers, {args.commit_tasks} tasks"
        )
        print(
            f"committers CPU per cycle (coordinator + {who}) p50 {ms(all50)}; "
            f"per table {all50 / args.tables * 1000:.1f} ms"
        )
    print(f"commit p50 {ms(percentile(commits, 0.5))}, p99 {ms(percentile(commits, 0.99))}")
    print(f"commit CPU p50 {ms(percentile(cpu, 0.5))}, p99 {ms(percentile(cpu, 0.99))}")
    print(
        f"last-{n} / first-{n}: commit {growth(commits):.2f}, commit CPU {growth(cpu):.2f}; "
        f"metadata dir {meta / 1e6:.1f} MB"
    )
    print(
        f"last-{n} / first-{n} medians: commit {median_growth(commits):.2f}, "
        f"commit CPU {median_growth(cpu):.2f}"
    )
    if idle_cores is not None:
        print(f"idle writers: {idle_cores:.2f} cores")
    date = datetime.now(UTC).strftime("%Y-%m-%d")
    print(
        f"| {date} | {args.backend} | {args.writers} | {args.files:,} | {args.cycles} | "
        f"{ms(percentile(cycles, 0.5))} | {ms(percentile(cycles, 0.99))} | "
        f"{ms(percentile(commits, 0.5))} | {ms(percentile(cpu, 0.5))} | "
        f"{growth(commits):.2f} / {growth(cpu):.2f} | "
        f"{'' if idle_cores is None else f'{idle_cores:.2f}'} | {load:.1f} |"
    )


if __name__ == "__main__":
    sys.exit(main())
