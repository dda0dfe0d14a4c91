"""The scenario registry: each scenario breaks one run in its own way, then lets the run finish.

A scenario is a function of a :class:`Run` registered with :func:`scenario`. Adding one is a
dozen lines: start the pipeline (``run.start_pipeline``), break it (``run.kill`` / an env fault
point / an operator action), record each fault in ``run.faults``, and call ``run.finish()``;
the runner counts the keys. ``needs`` names a feature that is not in every tree yet (probed by
``available``) and ``pending`` marks a scenario that is written but known to fail until the
named fix lands; neither runs by default, both run when named with ``--scenario``.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import pyarrow.parquet as pq
from pyiceberg.schema import Schema
from pyiceberg.table import StaticTable

from icefloe_spark import faults

from .count import Tally
from .harness import LEASE_TTL_S, SCHEMA, SPEC, TABLE, Run, RunError
from .procs import Tree


@dataclass(frozen=True)
class Scenario:
    name: str
    help: str
    run: Callable[[Run], None]
    ci: tuple[str, ...] = ()  # the backends the reduced CI run (`--ci`) runs it on
    needs: str | None = None
    available: Callable[[], bool] = lambda: True
    pending: str | None = None


REGISTRY: dict[str, Scenario] = {}
ALL_BACKENDS = ("kafka", "postgres", "redis")


def scenario(
    name: str,
    *,
    ci: tuple[str, ...] = (),
    needs: str | None = None,
    available: Callable[[], bool] = lambda: True,
    pending: str | None = None,
) -> Callable[[Callable[[Run], None]], Callable[[Run], None]]:
    """Register a scenario; its docstring's first paragraph is its help."""

    def add(fn: Callable[[Run], None]) -> Callable[[Run], None]:
        first = " ".join((fn.__doc__ or "").strip().split("\n\n")[0].split())
        REGISTRY[name] = Scenario(name, first, fn, ci, needs, available, pending)
        return fn

    return add


def has_errors_policy() -> bool:
    """The ``[errors]`` table of issue 10 §1 (branch ``records``) is in this tree."""
    from icefloe.config import PipelineConfig

    return "errors" in PipelineConfig.model_fields


# -- crashes ------------------------------------------------------------------------------


def crash_at(run: Run, env_var: str, low: int, high: int, kind: str) -> None:
    """Run with the fault point ``env_var`` set to a random batch/cycle number in
    ``[low, high]``; once the driver exits there, ``kill -9`` what it left (its JVM)."""
    target = run.rng.randint(low, high)
    tree = run.start_pipeline({env_var: str(target)})
    deadline = time.monotonic() + 600.0
    # the producer may finish before the chosen batch/cycle comes: stop waiting once caught up
    while tree.alive() and time.monotonic() < deadline and not run.caught_up():
        time.sleep(2.0)
    code = run.wait_exit(tree, 10.0)  # caught up by the very commit that fires the fault
    if code == faults.EXIT_CODE:
        run.kill(tree, kind)
        return
    run.notes.append(f"{kind} at {target} did not fire (exit {code}); killed at random instead")
    run.kill(tree, "kill -9 random")


def kill_at_random(run: Run, low: float = 0.0, high: float = 30.0) -> None:
    """Start the pipeline and ``kill -9`` its whole tree a random delay after its query
    started (a batch being read, written, published or committed: wherever it lands)."""
    tree = run.start_pipeline()
    run.wait_query_started(tree)
    if run.wait_exit(tree, run.rng.uniform(low, high)) is not None:
        raise RunError(f"the pipeline exited by itself:\n{run.log_tail()}")
    run.kill(tree, "kill -9 random")


@scenario("kill-random")
def kill_random(run: Run) -> None:
    """kill -9 of the whole `icefloe run` tree at one or two random moments."""
    run.start_producer()
    for _ in range(run.rng.randint(1, 2)):
        kill_at_random(run)
    run.finish()


@scenario("kill-after-publish")
def kill_after_publish(run: Run) -> None:
    """kill -9 right after a writer batch was published, before Spark recorded it."""
    run.start_producer()
    crash_at(run, faults.EXIT_AFTER_PUBLISH_ENV, 1, 4, "kill -9 after publish")
    run.finish()


@scenario("kill-after-commit")
def kill_after_commit(run: Run) -> None:
    """kill -9 right after the coordinator's Iceberg commit, before it stored its position."""
    run.start_producer()
    crash_at(run, faults.EXIT_AFTER_COMMIT_ENV, 1, 3, "kill -9 after commit")
    run.finish()


@scenario("crash-mix", ci=ALL_BACKENDS)
def crash_mix(run: Run) -> None:
    """After a publish, after a commit and at a random moment, one after the other."""
    run.start_producer()
    crash_at(run, faults.EXIT_AFTER_PUBLISH_ENV, 1, 3, "kill -9 after publish")
    crash_at(run, faults.EXIT_AFTER_COMMIT_ENV, 1, 2, "kill -9 after commit")
    kill_at_random(run, 0.0, 20.0)
    run.finish()


@scenario("upsert", ci=("redis",))
def upsert(run: Run) -> None:
    """An upsert table keyed by id, every key written twice (the update in a later chunk,
    so it crosses batches and cycles), kill -9 after a publish and after a commit: every key
    once, at its last version, read by pyiceberg and by hand (data minus position deletes)."""
    keyed_table(run)
    run.start_producer()
    crash_at(run, faults.EXIT_AFTER_PUBLISH_ENV, 1, 3, "kill -9 after publish")
    crash_at(run, faults.EXIT_AFTER_COMMIT_ENV, 1, 2, "kill -9 after commit")
    run.finish()


@scenario("upsert-compaction", ci=("redis",))
def upsert_compaction(run: Run) -> None:
    """The upsert table compacted by the coordinator after (nearly) every cycle, kill -9 after
    a commit (before the round) and at random moments (in a round, or between a round and the
    next cycle, wherever they land): every key once, at its last version, read by pyiceberg
    and by hand."""
    keyed_table(
        run, compact=True, compact_delete_ratio=0.001, compact_delete_files=1, compact_small_files=2
    )
    run.start_producer()
    crash_at(run, faults.EXIT_AFTER_COMMIT_ENV, 1, 2, "kill -9 after commit")
    kill_at_random(run, 0.0, 20.0)
    kill_at_random(run, 0.0, 20.0)
    run.finish()
    table = run.catalog().load_table(TABLE)
    rounds = [s for s in table.snapshots() if s.summary and s.summary.operation.value == "replace"]
    if not rounds:
        raise RunError("no compaction round landed: the scenario tested nothing of it")
    run.notes.append(f"{len(rounds)} compaction snapshot(s)")


def keyed_table(run: Run, **options: object) -> None:
    """Recreate the run's table in upsert mode keyed by id (``options``: more table keys)."""
    catalog = run.catalog()
    catalog.drop_table(TABLE)
    keyed = Schema(*SCHEMA.fields, identifier_field_ids=[SCHEMA.find_field("id").field_id])
    catalog.create_table(
        TABLE, schema=keyed, partition_spec=SPEC, properties={"format-version": "2"}
    )
    run.config["tables"] = [{"name": TABLE, "mode": "upsert", "id_columns": ["id"], **options}]
    run.write_config()
    run.keyed = True


# -- committer processes -----------------------------------------------------------------


def busy_committer(tree: Tree, timeout: float) -> psutil.Process | None:
    """The first committer process of ``tree`` seen idle and then using CPU (a screening or
    a commit under way, as far as polling every 20 ms tells), or None within ``timeout``."""
    idle: set[int] = set()
    last: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not tree.alive():
            return None
        for p in tree.committers():
            try:
                times = p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            used = times.user + times.system
            before = last.get(p.pid)
            last[p.pid] = used
            if before is None:
                continue
            if used > before and p.pid in idle:
                return p
            if used == before:
                idle.add(p.pid)  # not starting up, not committing: the next burst is a task
        time.sleep(0.02)
    return None


def kill_committer(run: Run, tree: Tree) -> None:
    """``kill -9`` of one committer process: at random in the middle of a commit, or at a
    random moment (mostly between cycles); the pipeline must carry on without it."""
    # a killed committer is replaced when its tables' next task comes: wait for one
    deadline = time.monotonic() + 60.0
    while not (committers := tree.committers()):
        if time.monotonic() > deadline or not tree.alive():
            raise RunError(f"no committer process under the driver:\n{run.log_tail()}")
        time.sleep(0.2)
    victim: psutil.Process | None = None
    kind = "kill -9 committer at random"
    if run.rng.random() < 0.5:
        victim = busy_committer(tree, 10.0)
        kind = "kill -9 committer in a commit"
    if victim is None:
        victim = run.rng.choice(sorted(committers, key=lambda p: p.pid))
        kind = "kill -9 committer at random"
    kill_member(run, tree, victim, kind, "committer")


def kill_member(run: Run, tree: Tree, victim: psutil.Process, kind: str, what: str) -> None:
    """``kill -9`` of ``victim`` (a ``what`` of ``tree``), counted as a fault of ``kind``;
    the pipeline must live on without it."""
    try:
        victim.kill()
    except psutil.NoSuchProcess:
        run.notes.append(f"{what} {victim.pid} was gone before its kill")
        return
    run.faults.append(kind)
    time.sleep(0.5)
    if not tree.alive():
        raise RunError(f"the pipeline died with its {what}:\n{run.log_tail()}")


KILL_COMMITTERS_PRODUCE_S = 40.0


@scenario("kill-committers", ci=("redis",))
def kill_committers(run: Run) -> None:
    """Records routed to three tables, committed by two committer processes
    (`commit_processes = 2`): kill -9 of a committer several times (in a commit or at a
    random moment), then of the whole tree in a commit; every key once in its table."""
    run.route_by_kind()
    run.config["coordination"]["commit_processes"] = 2
    run.write_config()
    # records must still flow while the committers die, or no commit is there to interrupt
    kill_committers_then_tree(
        run,
        {},
        lambda tree: kill_committer(run, tree),
        lambda tree: busy_committer(tree, 10.0) is not None,
    )
    replaced = run.log_tail(chars=10_000_000).count("died; it is replaced")
    run.notes.append(f"{replaced} committer replacement(s) logged")


def kill_committers_then_tree(
    run: Run,
    env: dict[str, str],
    kill_one: Callable[[Tree], None],
    committing: Callable[[Tree], bool],
) -> None:
    """Start the pipeline (``env`` added), produce for at least 40 s (so the kills meet
    commits), ``kill_one`` 3-5 times a random 0.2-2 s apart, then kill -9 the whole tree (in
    a commit when ``committing`` saw one start) and count every key."""
    produce_s = max(run.settings.produce_s, KILL_COMMITTERS_PRODUCE_S)
    run.settings = dataclasses.replace(run.settings, produce_s=produce_s)
    tree = run.start_pipeline(env)
    run.wait_query_started(tree)
    run.start_producer()
    run.wait_first_commit(tree)
    for _ in range(run.rng.randint(3, 5)):
        time.sleep(run.rng.uniform(0.2, 2.0))
        kill_one(tree)
    in_commit = committing(tree)
    if not tree.alive():
        raise RunError(f"the pipeline exited by itself:\n{run.log_tail()}")
    run.kill(tree, "kill -9 tree in a commit" if in_commit else "kill -9 random")
    if not run.producing():
        run.notes.append("the producer had finished before the last kill")
    run.finish()


# -- commit tasks on Spark executors -------------------------------------------------------


def committing_worker(tree: Tree, marks: Path, timeout: float) -> psutil.Process | None:
    """A Spark Python worker of ``tree`` that marked itself just now (right before a catalog
    commit: ``faults.MARK_COMMITTERS_ENV``), polled every 10 ms; None within ``timeout``."""
    seen = {f.name: f.stat().st_mtime_ns for f in marks.iterdir()}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and tree.alive():
        for f in marks.iterdir():
            try:
                stamp = f.stat().st_mtime_ns
            except FileNotFoundError:
                continue
            if stamp > seen.get(f.name, 0):
                seen[f.name] = stamp
                workers = {p.pid: p for p in tree.python_workers()}
                if int(f.name) in workers:
                    return workers[int(f.name)]
        time.sleep(0.01)
    return None


def kill_commit_task(run: Run, tree: Tree, marks: Path) -> None:
    """``kill -9`` of the Python worker of a Spark commit task: right as it starts a catalog
    commit, or at random a worker that committed before (mostly idle between cycles)."""
    victim: psutil.Process | None = None
    kind = "kill -9 commit task's worker at random"
    if run.rng.random() < 0.5:
        victim = committing_worker(tree, marks, 15.0)
        kind = "kill -9 commit task's worker in a commit"
    if victim is None:
        workers = {p.pid: p for p in tree.python_workers()}
        known = sorted(int(f.name) for f in marks.iterdir() if int(f.name) in workers)
        if not known:
            run.notes.append("no commit task's worker alive to kill")
            return
        victim = workers[run.rng.choice(known)]
        kind = "kill -9 commit task's worker at random"
    kill_member(run, tree, victim, kind, "commit task's Python worker")


@scenario("kill-commit-tasks")
def kill_commit_tasks(run: Run) -> None:
    """Records routed to three tables, committed by Spark tasks (`spark.commit_tasks = 2`),
    in a session that retries a failed task (`local[2,4]`, as a cluster does) or not
    (`local[2]`, the job fails), chosen at random: kill -9 of a commit task's Python worker
    several times (as it starts a catalog commit, or at random), then of the whole tree in a
    commit; every key once in its table."""
    run.route_by_kind()
    retries = run.rng.random() < 0.5
    run.config["spark"]["commit_tasks"] = 2
    run.config["spark"]["master"] = "local[2,4]" if retries else "local[2]"
    run.write_config()
    run.notes.append("Spark retries tasks" if retries else "Spark retries no task")
    marks = run.dir / "committers"
    marks.mkdir()
    kill_committers_then_tree(
        run,
        {faults.MARK_COMMITTERS_ENV: str(marks)},
        lambda tree: kill_commit_task(run, tree, marks),
        lambda tree: committing_worker(tree, marks, 15.0) is not None,
    )
    jobs = run.log_tail(chars=10_000_000).count("Spark commit job of")
    run.notes.append(f"{jobs} failed Spark commit job(s) logged")


# -- leadership ---------------------------------------------------------------------------


def leader(coordinators: dict[str, Tree], run: Run) -> str | None:
    """The coordinator that took the lease last (highest fencing token in its log)."""
    best: tuple[int, str] | None = None
    for name in coordinators:
        for line in run.log_tail(f"{name}.log", 200_000).splitlines():
            if ": leading pipeline " in line and "fencing token " in line:
                token = int(line.rsplit("fencing token ", 1)[1].split()[0])
                best = max(best, (token, name)) if best else (token, name)
    return best[1] if best else None


@scenario("paused-leader")
def paused_leader(run: Run) -> None:
    """SIGSTOP the leading standalone coordinator past its lease, then SIGCONT it (twice)."""
    coordinators = {n: run.start_coordinator(n) for n in ("coord-a", "coord-b")}
    run.start_producer()
    driver = run.start_pipeline(no_coordinator=True)
    run.wait_first_commit(driver)
    for _ in range(2):
        name = leader(coordinators, run)
        if name is None:
            raise RunError("no coordinator leads")
        coordinators[name].pause()
        time.sleep(LEASE_TTL_S * 2 + run.rng.uniform(0.5, 3.0))
        coordinators[name].resume()
        run.faults.append("paused leader")
        time.sleep(run.rng.uniform(2.0, 6.0))
    driver.stop()
    run.finish(no_coordinator=True)
    for tree in coordinators.values():
        tree.stop()


# -- operator actions ---------------------------------------------------------------------


def last_metadata(location: str, table_uuid: str) -> str:
    """The newest metadata file of the table with ``table_uuid`` under ``location`` (read
    after the drop, so a commit that raced the drop is not missed)."""
    best: tuple[int, str] | None = None
    for path in Path(location.removeprefix("file://"), "metadata").glob("*.metadata.json"):
        meta = json.loads(path.read_text())
        if meta.get("table-uuid") == table_uuid:
            stamp = (int(meta.get("last-sequence-number", 0)), str(path))
            best = max(best, stamp) if best else stamp
    if best is None:
        raise RunError(f"no metadata of table {table_uuid} under {location}")
    return f"file://{best[1]}"


def quarantined_tally(run: Run, table_uuid: str) -> Tally:
    """Keys of the files the coordinator quarantined for the dropped table incarnation, read
    from the quarantine table and the files themselves with pyiceberg and pyarrow."""
    tally = Tally()
    catalog = run.catalog()
    if not catalog.table_exists(QUARANTINE_TABLE):
        return tally
    rows = catalog.load_table(QUARANTINE_TABLE).scan().to_arrow().to_pylist()
    for row in rows:
        if row["group_id"] != run.config["name"] or row["table_name"] != TABLE:
            continue
        if row.get("table_uuid") not in (None, table_uuid):
            tally.problems.append(f"quarantined {row['file_path']} of another table incarnation")
        ids = pq.read_table(row["file_path"].removeprefix("file://"), columns=["id"])["id"]
        if len(ids) != row["record_count"]:
            tally.problems.append(
                f"quarantine says {row['record_count']} rows, file has {len(ids)}"
            )
        tally.keys.update(int(i) for i in ids.to_pylist())
        tally.scanned_rows += len(ids)
    run.notes.append(f"{tally.scanned_rows} records in quarantined files")
    return tally


@scenario("drop-recreate-table")
def drop_recreate_table(run: Run) -> None:
    """Drop and recreate the target table while batches are in flight; every key must be in
    the dropped table, the new one or a quarantined file, exactly once."""
    run.start_producer()
    tree = run.start_pipeline()
    run.wait_first_commit(tree)
    time.sleep(run.rng.uniform(1.0, 8.0))
    catalog = run.catalog()
    old = catalog.load_table(TABLE)
    old_uuid = str(old.metadata.table_uuid)
    catalog.drop_table(TABLE)
    run.create_table()
    run.faults.append("dropped and recreated table")
    dropped = Tally()
    dropped.add_table(StaticTable.from_metadata(last_metadata(old.location(), old_uuid)), "old")
    run.add_counted(dropped)
    time.sleep(run.rng.uniform(5.0, 20.0))  # batches in flight meet the new table
    tree.stop()
    run.finish()
    run.add_counted(quarantined_tally(run, old_uuid))


@scenario("checkpoint-loss")
def checkpoint_loss(run: Run) -> None:
    """kill -9 after a publish, delete the Spark checkpoint, restart from the table (the new
    writer must start after the batches still on the channel)."""
    run.start_producer()
    crash_at(run, faults.EXIT_AFTER_PUBLISH_ENV, 1, 4, "kill -9 after publish")
    shutil.rmtree(run.dir / "ckpt", ignore_errors=True)
    run.config["source"]["starting_offsets"] = "table"
    run.write_config()
    run.faults.append("checkpoint lost")
    run.finish()


NEXT_BACKEND = {"kafka": "postgres", "postgres": "redis", "redis": "kafka"}


@scenario("backend-swap")
def backend_swap(run: Run) -> None:
    """kill -9 after a publish (a batch left on the old channel), `icefloe drain` the old
    backend, switch `coordination.backend` to the next one, restart (the documented swap)."""
    run.start_producer()
    crash_at(run, faults.EXIT_AFTER_PUBLISH_ENV, 1, 4, "kill -9 after publish")
    argv = [sys.executable, "-m", "icefloe", "drain", "--config", str(run.config_file)]
    drain = Tree(argv, run.dir / "drain.log", run.env(), run.run_id)
    run.trees.append(drain)
    code = run.wait_exit(drain, 600.0)
    if code != 0:
        raise RunError(f"icefloe drain exited {code}:\n{run.log_tail('drain.log')}")
    run.config["coordination"]["backend"] = NEXT_BACKEND[run.backend]
    run.write_config()
    run.faults.append("backend swap")
    run.finish()


# -- bad records (issue 10 §1: `[errors]` policy) ------------------------------------------

DEAD_LETTER_TABLE = "faults.dead_letters"
QUARANTINE_TABLE = "icefloe.quarantine"  # where the coordinator quarantines by default


def bad_record_maker(run: Run, share: int = 150) -> Callable[[int], bytes | None]:
    """About one key in ``share`` becomes a bad record: a wrong type or broken JSON. Each
    carries its key as ``"key": N`` so the verdict knows which keys must not land."""
    chosen = {k for k in range(run.settings.records) if run.rng.randrange(share) == 0}
    chosen.add(run.rng.randrange(run.settings.records))  # at least one

    def bad(key: int) -> bytes | None:
        if key not in chosen:
            return None
        if key % 2:
            return json.dumps({"id": f"bad{key}", "key": key, "kind": "a"}).encode()
        return f'{{"key": {key}, "id": {key}, "name": '.encode()  # truncated JSON

    return bad


def with_errors(run: Run, policy: str) -> None:
    errors: dict[str, str] = {"policy": policy}
    if policy == "dead_letter":
        errors["dead_letter_table"] = DEAD_LETTER_TABLE
    run.config["errors"] = errors
    run.write_config()


def check_dead_letters(run: Run) -> None:
    """The dead-letter table holds exactly the bad records, each once (by raw value)."""
    table = run.catalog().load_table(DEAD_LETTER_TABLE)
    names = [f.name for f in table.schema().fields]
    column = next((n for n in ("raw_value", "value") if n in names), None)
    if column is None:
        raise RunError(f"dead-letter table has no raw value column: {names}")
    raw = table.scan(selected_fields=(column,)).to_arrow()[column].to_pylist()
    got = sorted(v if isinstance(v, bytes) else str(v).encode() for v in raw)
    want = sorted(run.bad_values)
    run.dead_lettered = len(got)
    if got != want:
        raise RunError(f"dead letters: {len(got)} rows, expected exactly the {len(want)} bad ones")


@scenario("bad-records-skip", needs="records", available=has_errors_policy)
def bad_records_skip(run: Run) -> None:
    """`[errors] policy = "skip"` with bad records, and a kill -9 after a commit."""
    with_errors(run, "skip")
    run.start_producer(bad_record_maker(run))
    crash_at(run, faults.EXIT_AFTER_COMMIT_ENV, 1, 3, "kill -9 after commit")
    run.finish()


@scenario("bad-records-dead-letter", needs="records", available=has_errors_policy)
def bad_records_dead_letter(run: Run) -> None:
    """`policy = "dead_letter"`: a kill -9 after a commit; dead letters exactly once."""
    with_errors(run, "dead_letter")
    run.start_producer(bad_record_maker(run))
    crash_at(run, faults.EXIT_AFTER_COMMIT_ENV, 1, 3, "kill -9 after commit")
    run.finish()
    check_dead_letters(run)


@scenario("bad-records-fail", needs="records", available=has_errors_policy)
def bad_records_fail(run: Run) -> None:
    """`policy = "fail"` stops the run at the bad record; switching to "skip" gets past it
    without losing or repeating what was already accepted."""
    with_errors(run, "fail")
    run.start_producer(bad_record_maker(run))
    tree = run.start_pipeline()
    code = run.wait_exit(tree, run.settings.produce_s * 4 + 240)
    if code in (None, 0):
        raise RunError(f"policy fail: the pipeline did not stop on a bad record (exit {code})")
    tree.kill()
    run.faults.append("stopped on a bad record")
    with_errors(run, "skip")
    run.finish()
