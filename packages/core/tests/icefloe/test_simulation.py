"""Deterministic simulation of the commit path, the way FoundationDB and TigerBeetle test theirs.

The real :class:`~icefloe.coordination.coordinator.Coordinator`,
:class:`~icefloe.commit.committer.IcebergCommitter` and
:class:`~icefloe.coordination.writer.WriterClient` over the in-memory reference channel and a
real SQLite pyiceberg catalog with real Parquet files (on tmpfs), driven by Hypothesis's stateful
testing: every schedule is a random sequence of rules (publishes, re-announcements, stale
events, crashes at the k-th write of a cycle or in a compaction round, zombies, another
engine changing, rewriting or recreating a table (also between a cycle's screening and its
commit), maintenance, a backend swap, ...), and a failing schedule is shrunk to a minimal one.

Nothing waits on a clock: the channel never blocks (one thread drives everything, so a wait
could only time out), cycles ask no writer (partial cycles), retries back off by zero seconds,
and pyiceberg's thread pool runs its work inline, so a schedule does the same I/O in the same
order every time it runs and a crash at "the k-th write" is the same write on replay.

After each schedule the faults stop, a fresh leader gets a bounded number of cycles, and a
reader that is not the committer (pyarrow over the files the snapshots list, position deletes
applied) checks:

* **I1** every record a writer published is in the table exactly once, or in quarantine
  exactly once (nowhere when a rollback without replay removed it or another engine dropped
  its table; a dropped table's copy may stay quarantined beside the rows a batch run again
  committed to the new table, :meth:`World.revived_beside_stale_copy`, or beside that batch
  run again in files written for the dropped table, :meth:`World.rerun_beside_stale_copy`);
* **I2** no file referenced by any snapshot of any ref, or listed in quarantine (until a
  rollback's replay re-commits its records and retires its entry), was deleted;
* **I3** a keyed table equals the model's final state (and a keyed batch is quarantined whole
  or not at all);
* **I4** once faults stop, every pending file commits or is quarantined within
  :data:`SETTLE_CYCLES` cycles: nothing blocks forever.

Run more schedules with ``nox -s simulate -- --schedules N --seed S`` (pytest options of this
module, see ``conftest.py``); a failure names the command that replays it. Open defects the
simulation found are strict xfail tests elsewhere; the few places that step around them are
marked KNOWN here (docs/reliability.md lists them): remove each with its fix.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime as dt
import functools
import itertools
import logging
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field, replace
from decimal import Decimal
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, Phase, reproduce_failure, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    precondition,
    rule,
    run_state_machine_as_test,
)
from pydantic import BaseModel
from pyiceberg.catalog import Catalog, MetastoreCatalog
from pyiceberg.catalog.sql import ICEBERG_TABLE_TYPE, IcebergTables, SqlCatalog
from pyiceberg.exceptions import CommitStateUnknownException, NoSuchTableError
from pyiceberg.io import FileIO
from pyiceberg.io.pyarrow import PyArrowFileIO
from pyiceberg.manifest import DataFileContent, ManifestFile
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.table import StaticTable, Table
from pyiceberg.table.snapshots import ancestors_of
from pyiceberg.transforms import BucketTransform, IdentityTransform, Transform
from pyiceberg.typedef import EMPTY_DICT, Identifier, Properties
from pyiceberg.types import (
    BinaryType,
    DateType,
    DecimalType,
    FixedType,
    IcebergType,
    IntegerType,
    LongType,
    NestedField,
    StringType,
    TimestampType,
    TimestamptzType,
    TimeType,
    UUIDType,
)
from pyiceberg.utils.concurrent import ExecutorFactory
from sqlalchemy import Engine, bindparam, create_engine, select, text

from icefloe.commit import versions
from icefloe.commit.committer import IcebergCommitter
from icefloe.commit.policy import TablePolicies
from icefloe.commit.quarantine import DEFAULT_QUARANTINE_TABLE, Quarantine, QuarantineEntry
from icefloe.commit.request import TableCommitRequest
from icefloe.commit.rollback import REPLAY_BATCH_SEQ
from icefloe.commit.summary import of_group
from icefloe.config import PipelineConfig, config_from_dict
from icefloe.coordination.coordinator import Coordinator, CoordinatorHooks, CoordinatorSettings
from icefloe.coordination.writer import WriterClient
from icefloe.errors import (
    ChannelIdentityError,
    NotLeaderError,
    RollbackNotReplayableError,
    TableMismatchError,
    WriterFencedError,
)
from icefloe.events import DataFileMeta, SourcePosition
from icefloe.hookspecs import BackendContext, BackendSpec, hookimpl
from icefloe.ops.drain import DrainError, drain
from icefloe.ops.maintenance import maintain, recommended_properties
from icefloe.ops.tables import pipeline_tables
from icefloe.plugins import manager as plugins_module
from icefloe.plugins.manager import new_plugins
from icefloe.records.datafiles import (
    group_write_uuid,
    to_meta,
    write_data_files,
    write_key_files,
)
from icefloe.testing.fixtures import ROWS_SCHEMA
from icefloe.testing.harness import SimulatedCrash
from icefloe.testing.memory import MemoryBackend, MemoryServer

pytestmark = pytest.mark.unit

GROUP = "sim"
_Read = TypeVar("_Read")  # what a schedule test reads from its settled machine
ROWS = "db.rows"  # append table, partitioned, small files merged
KEYED = "db.keyed"  # upsert table keyed by ``id`` (of one of the identifier types)
DEAD = "db.dead_letter"  # the dead-letter table: written by writers, not in [[tables]]
SCRATCH = "db.scratch"  # not the pipeline's: files written here are announced as misplaced
APPENDED = (ROWS, DEAD)  # tables whose every published row is counted (I1)
BUCKETS = PartitionSpec(PartitionField(1, 1000, BucketTransform(2), "id_bucket"))
KEYS = 6  # the keyed table's key space: small, so batches touch the same keys
WRITERS = 3  # writer ids w0..w2, each reading its own partition of the source topic
SOURCE = "src"
FOREIGN_KEY = 1000  # the other engine's keys in the keyed table start here
_EPOCH = dt.datetime(2024, 1, 1)
#: identifier field types (every one Iceberg allows but boolean, whose key space is 2) and
#: the value of key ``k`` in each
KEY_TYPES: dict[str, tuple[IcebergType, Callable[[int], Any]]] = {
    "long": (LongType(), lambda k: k),
    "int": (IntegerType(), lambda k: k),
    "string": (StringType(), lambda k: f"k{k}"),
    "uuid": (UUIDType(), lambda k: uuid.UUID(int=k + 1).bytes),
    "date": (DateType(), lambda k: (_EPOCH + dt.timedelta(days=k)).date()),
    "time": (TimeType(), lambda k: dt.time(k // 3600, k // 60 % 60, k % 60)),
    "timestamp": (TimestampType(), lambda k: _EPOCH + dt.timedelta(seconds=k)),
    "timestamptz": (
        TimestamptzType(),
        lambda k: (_EPOCH + dt.timedelta(seconds=k)).replace(tzinfo=dt.UTC),
    ),
    "decimal": (DecimalType(9, 2), lambda k: Decimal(k) / 4),
    "fixed": (FixedType(4), lambda k: k.to_bytes(4, "big")),
    "binary": (BinaryType(), lambda k: k.to_bytes(2, "big")),
}
SETTLE_CYCLES = 5  # I4: cycles a fresh leader gets once faults stop
STEPS = 12  # rules per schedule (Hypothesis may stop a schedule earlier)
CHUNK = 250  # schedules per test item (one Hypothesis run, one seed)
CI_SEED = 23_000  # the default seeds (CI's schedules): CI_SEED, CI_SEED + 1, ... per CHUNK
SMOKE = 20  # schedules run without options (the fast gates); `nox -s simulate` runs 1,000
HERE = Path(__file__)
EVENTS: Counter[str] = Counter()  # what the schedules did (faults that hit, ...), per run


# --------------------------------------------------------------------------- the faults


@dataclass
class Faults:
    """What goes wrong next. Every write and delete of a data or metadata file and every
    mutation of the channel (broadcast, store_position, prune) is one *operation*; a crash
    armed with ``crash_in = k`` kills the coordinator at the k-th operation from then on."""

    crash_in: int | None = None
    fail_deletes: bool = False  # deleting a file fails (tolerated by the committer)
    unknown: str | None = None  # the next catalog commit's outcome is lost: "before"/"after"
    trace: list[str] = field(default_factory=list)

    def op(self, what: str) -> None:
        if self.crash_in is None:
            return
        if self.crash_in == 0:
            self.crash_in = None
            self.trace.append(f"crash at {what}")
            EVENTS[f"crash at {what.split()[0]}"] += 1
            raise SimulatedCrash(what)
        self.crash_in -= 1

    def calm(self) -> None:
        self.crash_in, self.fail_deletes, self.unknown = None, False, None


class FaultyIO(PyArrowFileIO):
    """pyarrow's file IO with the simulation's faults on every write and delete."""

    def __init__(self, faults: Faults, properties: Properties = EMPTY_DICT) -> None:
        super().__init__(properties)
        self.faults = faults

    def new_output(self, location: str) -> Any:
        self.faults.op(f"write {location.rsplit('/', 2)[-2:]}")
        return super().new_output(location)

    def delete(self, location: Any) -> None:
        path = location if isinstance(location, str) else location.location
        self.faults.op(f"delete {path.rsplit('/', 1)[-1]}")
        if self.faults.fail_deletes:
            EVENTS["delete failed"] += 1
            raise OSError(f"simulated: cannot delete {path}")
        super().delete(location)


class CatalogFile:
    """Opens the SQLite catalog file of the schedule that runs now (an engine's ``creator``),
    with the pragmas of a catalog no OS crash ever hits: no fsync (``synchronous = OFF``), the
    rollback journal in memory. Transactions, rollbacks and locking are SQLite's as ever; a
    simulated crash is an exception, never a lost page."""

    def __init__(self) -> None:
        self.path = ""

    def __call__(self) -> sqlite3.Connection:
        connection = sqlite3.connect(self.path, check_same_thread=False)
        connection.execute("PRAGMA synchronous = OFF")
        connection.execute("PRAGMA journal_mode = MEMORY")
        return connection


class CatalogEngines:
    """SQLAlchemy engines lent to schedules, one at a time each: an engine compiles each
    statement once and caches it per engine (most of a fresh engine's cost), so a process's
    schedules share one. Lending it again points it at the new schedule's file and drops its
    pooled connections: only compiled SQL outlives a schedule, never a row."""

    def __init__(self) -> None:
        self.free: list[tuple[Engine, CatalogFile]] = []
        self.lent: dict[int, tuple[Engine, CatalogFile]] = {}

    def lend(self, path: str) -> Engine:
        if self.free:
            engine, opener = self.free.pop()
        else:
            opener = CatalogFile()
            engine = create_engine(f"sqlite:///{path}", creator=opener)
        engine.dispose()
        opener.path = path
        self.lent[id(engine)] = engine, opener
        return engine

    def give_back(self, engine: Engine) -> None:
        engine.dispose()
        lent = self.lent.pop(id(engine), None)
        if lent is not None:
            self.free.append(lent)


ENGINES = CatalogEngines()


class SimCatalog(SqlCatalog):
    """A real SqlCatalog whose tables do their I/O through :class:`FaultyIO` and whose next
    commit may lose its outcome (:class:`CommitStateUnknownException`, landed or not). Its
    engine is lent by :data:`ENGINES` (the catalog file is the schedule's own)."""

    def __init__(self, name: str, faults: Faults, engine: Engine, **properties: str) -> None:
        self.faults = faults
        # SqlCatalog.__init__ but for its create_engine: the engine is given
        MetastoreCatalog.__init__(self, name, **properties)
        self.engine = engine
        self._init_catalog()

    def _load_file_io(
        self, properties: Properties = EMPTY_DICT, location: str | None = None
    ) -> FileIO:
        return FaultyIO(self.faults, {**self.properties, **properties})

    def load_table(self, identifier: str | Identifier) -> Table:
        """SqlCatalog's ``load_table`` with its query built once, in SQLAlchemy Core: the
        same row (same conditions, the ``iceberg_type`` filter of a v1 catalog included), the
        same metadata read, without building an ORM statement, session and entity per call,
        which cost more than the rest of a load (and the simulation loads tables dozens of
        times per schedule). Commits stay SqlCatalog's own compare-and-swap."""
        if self._schema_version != "v1":
            return super().load_table(identifier)
        namespace = Catalog.namespace_to_string(Catalog.namespace_from(identifier))
        name = Catalog.table_name_from(identifier)
        values = {"catalog": self.name, "namespace": namespace, "table": name}
        with self.engine.connect() as connection:
            row = connection.execute(_table_row(), values).first()
        if row is None:
            raise NoSuchTableError(f"Table does not exist: {namespace}.{name}")
        # reads the row's metadata_location, table_namespace and table_name, as of an entity
        return self._convert_orm_to_iceberg(row)  # type: ignore[arg-type]

    def commit_table(self, table: Table, requirements: Any, updates: Any) -> Any:
        plain = super().commit_table
        return self._outcome(lambda: plain(table, requirements, updates))

    def icefloe_commit_known(
        self, table: versions.RetriesOff, requirements: Any, updates: Any
    ) -> Any:
        """The committer's commit on a version it knows (icefloe.commit.versions), which a
        plain SqlCatalog gets: with this catalog's lost outcomes too."""
        return self._outcome(lambda: versions.commit_known(self, table, requirements, updates))

    def _outcome(self, commit: Callable[[], Any]) -> Any:
        unknown, self.faults.unknown = self.faults.unknown, None
        if unknown is not None:
            EVENTS[f"commit outcome lost ({unknown})"] += 1
        if unknown == "before":
            raise CommitStateUnknownException("simulated: the request was lost")
        response = commit()
        if unknown == "after":
            raise CommitStateUnknownException("simulated: the commit landed, its answer was lost")
        return response


@functools.cache
def _table_row() -> Any:
    """SqlCatalog.load_table's query (a v1 catalog: views excluded), built once."""
    return select(
        IcebergTables.table_namespace, IcebergTables.table_name, IcebergTables.metadata_location
    ).where(
        IcebergTables.catalog_name == bindparam("catalog"),
        IcebergTables.table_namespace == bindparam("namespace"),
        IcebergTables.table_name == bindparam("table"),
        (IcebergTables.iceberg_type == ICEBERG_TABLE_TYPE) | IcebergTables.iceberg_type.is_(None),
    )


class SimServer(MemoryServer):
    """The reference channel without waiting (one thread drives the simulation, so a wait
    could only time out), with the channel's mutations as fault points and every published
    batch kept, so a rule can inject it again as a stale event."""

    def __init__(self, faults: Faults) -> None:
        super().__init__()
        self.faults = faults
        self.batches: list[list[bytes]] = []

    def _wait(self, ready: Any, timeout: float) -> None:
        self._cond.wait_for(ready, timeout=0)

    def publish(
        self, group_id: str, writer_id: str, epoch: int, batch_seq: int, events: list[bytes]
    ) -> bool:
        published = super().publish(group_id, writer_id, epoch, batch_seq, events)
        if published:
            self.batches.append(list(events))
        return published

    def broadcast(self, group_id: str, holder: str, token: int, event: bytes) -> bool:
        self.faults.op("broadcast")
        return super().broadcast(group_id, holder, token, event)

    def store_position(
        self, group_id: str, holder: str, token: int, position: dict[str, int]
    ) -> bool:
        self.faults.op("store_position")
        return super().store_position(group_id, holder, token, position)

    def prune(self, group_id: str, before: int) -> int:
        self.faults.op("prune")
        return super().prune(group_id, before)

    def expire_lease(self, group_id: str) -> None:
        """The holder died (or paused): its lease lapses now, as the clock would make it."""
        with self._cond:
            self._group(group_id).expires_at = 0.0
            self._cond.notify_all()


_SERVERS: dict[str, SimServer] = {}  # the channel each simulated pipeline uses now, by name


class SimBackendConfig(BaseModel):
    """``[coordination.sim]``: which simulated channel (a key of ``_SERVERS``)."""

    server: str


def _sim_backend(config: SimBackendConfig, context: BackendContext) -> MemoryBackend:
    return MemoryBackend(_SERVERS[config.server], context.group_id, 3600.0)


class SimBackendPlugin:
    """Backend ``sim``: what the operator's commands (``maintain``) open from the pipeline
    configuration, the simulated channel of the schedule."""

    @hookimpl
    def icefloe_register_backends(self) -> list[BackendSpec]:
        return [BackendSpec("sim", SimBackendConfig, _sim_backend, "simulation", contract=2)]


class _Inline(Executor):
    """pyiceberg's thread pool replaced by the calling thread: the same I/O in the same order
    on every run."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as exc:
            future.set_exception(exc)
        return future


@contextlib.contextmanager
def inline_executor() -> Iterator[None]:
    saved = ExecutorFactory._instance, ExecutorFactory._instance_pid
    ExecutorFactory._instance, ExecutorFactory._instance_pid = _Inline(), os.getpid()
    try:
        yield
    finally:
        ExecutorFactory._instance, ExecutorFactory._instance_pid = saved


@contextlib.contextmanager
def sim_plugins() -> Iterator[None]:
    """The ``sim`` backend in the default plugin manager (commands such as ``maintain`` find
    backends there); the previous manager is restored after: other tests of this worker may
    rely on it."""
    plugins = new_plugins(autoload=False)
    plugins.pm.register(SimBackendPlugin())
    previous = plugins_module._default
    plugins_module.reset_plugins(plugins)
    try:
        yield
    finally:
        plugins_module.reset_plugins(previous)


def create_tables(catalog: Catalog, key_type: str) -> None:
    """A schedule's tables: the append table, the dead-letter table, a table that is not the
    pipeline's and the keyed table, whose key has the type ``key_type``."""
    catalog.create_namespace("db")
    props = recommended_properties()
    catalog.create_table(ROWS, ROWS_SCHEMA, partition_spec=BUCKETS, properties=props)
    catalog.create_table(DEAD, ROWS_SCHEMA, properties=props)
    catalog.create_table(SCRATCH, ROWS_SCHEMA)
    keyed = Schema(
        NestedField(1, "id", KEY_TYPES[key_type][0], required=True),
        NestedField(2, "value", LongType(), required=False),
        identifier_field_ids=[1],
    )
    catalog.create_table(KEYED, keyed, properties=props)


class Templates:
    """A schedule's new tables, copied: creating four tables through pyiceberg costs more
    than a short schedule's rules. Per key type and process, :func:`create_tables` runs once
    into a template directory (its own catalog file and metadata files); a schedule gets a
    copy with the template's path replaced by its own, in the metadata files and in the
    catalog's ``metadata_location`` column, so its tables are as if created in its directory
    (only their uuids recur across schedules, which never meet). The copy is made before the
    first rule, with no fault armed."""

    def __init__(self) -> None:
        self.made: dict[str, Path] = {}

    def copy_into(self, key_type: str, directory: Path, engine: Engine) -> None:
        template = self.made.get(key_type)
        if template is None or not (template / "catalog.db").exists():
            template = self.made[key_type] = self._make(key_type)
        engine.dispose()  # the catalog file is replaced under it: no connection kept
        old, new = str(template), str(directory)

        def copy(source: str, target: str) -> None:
            if source.endswith(".json"):
                Path(target).write_text(Path(source).read_text().replace(old, new))
            else:
                shutil.copyfile(source, target)

        shutil.copytree(template, directory, copy_function=copy, dirs_exist_ok=True)
        with contextlib.closing(sqlite3.connect(directory / "catalog.db")) as db, db:
            db.execute(
                "UPDATE iceberg_tables SET metadata_location = replace(metadata_location, ?, ?)",
                (old, new),
            )

    @staticmethod
    def _make(key_type: str) -> Path:
        template = Path(_scratch_root()) / f"template-{key_type}"
        shutil.rmtree(template, ignore_errors=True)
        template.mkdir()
        # simulate() removes the scratch root; a schedule run rule by rule leaves it
        atexit.register(shutil.rmtree, template, ignore_errors=True)
        engine = ENGINES.lend(f"{template}/catalog.db")
        try:
            properties = {
                "uri": f"sqlite:///{template}/catalog.db",
                "warehouse": f"file://{template}",
            }
            create_tables(SimCatalog("sim", Faults(), engine, **properties), key_type)
        finally:
            ENGINES.give_back(engine)
        return template


TEMPLATES = Templates()


# --------------------------------------------------------------------------- the reader


def local(path: str) -> str:
    return urlsplit(path).path


class Reader:
    """A reader that is not the committer: pyarrow over the files the snapshots' manifests
    list, position deletes applied. It reads each manifest and data file once: Iceberg never
    rewrites a file in place (every write is a new file, named by a uuid), so within one look
    at the tables (the checks after a schedule, with nothing written meanwhile) a file read
    again would give the same rows. Make one per look: it does not notice a file deleted
    after it read it."""

    def __init__(self) -> None:
        self.manifests: dict[str, tuple[list[str], list[str]]] = {}
        self.files: dict[tuple[str, tuple[str, ...]], list[dict[str, Any]]] = {}

    def snapshot_files(self, table: Table, snapshot_id: int) -> tuple[list[str], list[str]]:
        """The data files and position delete files a snapshot references."""
        snapshot = table.metadata.snapshot_by_id(snapshot_id)
        assert snapshot is not None
        data: list[str] = []
        deletes: list[str] = []
        for manifest in snapshot.manifests(table.io):
            listed = self.manifests.get(manifest.manifest_path)
            if listed is None:
                listed = self.manifests[manifest.manifest_path] = self._listed(table, manifest)
            data += listed[0]
            deletes += listed[1]
        return data, deletes

    @staticmethod
    def _listed(table: Table, manifest: ManifestFile) -> tuple[list[str], list[str]]:
        data: list[str] = []
        deletes: list[str] = []
        for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=True):
            f = entry.data_file
            if f.content == DataFileContent.DATA:
                data.append(f.file_path)
            elif f.content == DataFileContent.POSITION_DELETES:
                deletes.append(f.file_path)
            else:
                raise AssertionError(f"unexpected equality delete file {f.file_path}")
        return data, deletes

    def rows(self, path: str, columns: list[str]) -> list[dict[str, Any]]:
        key = (path, tuple(columns))
        rows = self.files.get(key)
        if rows is None:
            rows = self.files[key] = pq.read_table(local(path), columns=columns).to_pylist()
        return rows

    def read_ref(self, table: Table, ref: str, columns: list[str]) -> list[tuple[Any, ...]]:
        """Rows of ``ref``'s head: a reader that shares no code with the committer."""
        head = table.snapshot_by_name(ref)
        if head is None:
            return []
        return self.read_snapshot(table, head.snapshot_id, columns)

    def read_snapshot(
        self, table: Table, snapshot_id: int, columns: list[str]
    ) -> list[tuple[Any, ...]]:
        """Rows of a snapshot of ``table``'s metadata, position deletes applied."""
        data, deletes = self.snapshot_files(table, snapshot_id)
        dead: dict[str, set[int]] = {}
        for path in deletes:
            for r in self.rows(path, ["file_path", "pos"]):
                dead.setdefault(r["file_path"], set()).add(int(r["pos"]))
        out: list[tuple[Any, ...]] = []
        for path in data:
            gone = dead.get(path, set())
            rows = self.rows(path, columns)
            out.extend(tuple(r[c] for c in columns) for i, r in enumerate(rows) if i not in gone)
        return out

    def ids(self, path: str) -> list[int]:
        return [int(r["id"]) for r in self.rows(path, ["id"])]


def snapshot_files(table: Table, snapshot_id: int) -> tuple[list[str], list[str]]:
    """The data files and position delete files a snapshot references (from its manifests)."""
    return Reader().snapshot_files(table, snapshot_id)


def read_ref(table: Table, ref: str, columns: list[str]) -> list[tuple[Any, ...]]:
    """Rows of ``ref``'s head, read with pyarrow from the files its manifests list, position
    deletes applied: a reader that shares no code with the committer."""
    return Reader().read_ref(table, ref, columns)


def history_paths(table: Table, ref: str) -> set[str]:
    """Every file a manifest entry (added, existing or deleted) names in the retained history
    of ``ref``: its head and the parents reachable from it. What a committer walking that
    history can know was once in the branch."""
    metadata = table.metadata
    head = table.snapshot_by_name(ref)
    paths: set[str] = set()
    while head is not None:
        for manifest in head.manifests(table.io):
            for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=False):
                paths.add(entry.data_file.file_path)
        parent = head.parent_snapshot_id
        head = None if parent is None else metadata.snapshot_by_id(parent)
    return paths


def snapshot_ids(table: Table, snapshot_id: int) -> set[int]:
    """The ids a snapshot of ``table`` holds, read by pyiceberg's scan; from the earlier
    metadata file that still holds it when it was expired since (the committer finds a
    rollback's restored snapshot there when an expiry cut the branch's link to it)."""
    source: Table = table
    if table.metadata.snapshot_by_id(snapshot_id) is None:
        for entry in reversed(table.metadata.metadata_log):
            earlier = StaticTable.from_metadata(entry.metadata_file)
            if earlier.metadata.snapshot_by_id(snapshot_id) is not None:
                source = earlier
                break
    rows = source.scan(snapshot_id=snapshot_id).to_arrow()
    return {int(i) for i in rows.column("id").to_pylist()}


def file_ids(path: str) -> list[int]:
    return [int(i) for i in pq.read_table(local(path), columns=["id"])["id"].to_pylist()]


# --------------------------------------------------------------------------- the model


@dataclass
class Batch:
    """One published writer batch, as the model sees it."""

    writer_id: str
    seq: int
    files: dict[str, list[DataFileMeta]]
    rows: dict[str, list[int]] = field(default_factory=dict)  # ids per table of APPENDED
    changes: dict[int, int | None] = field(default_factory=dict)  # KEYED: key -> value / delete
    source: tuple[int, int] | None = None  # the source partition and offset it read
    uuids: dict[str, str] = field(default_factory=dict)  # table -> uuid it was written for

    @property
    def label(self) -> str:
        return f"{self.writer_id}#{self.seq}"


@dataclass(frozen=True)
class Shape:
    """What a writer batch holds: which writer, how many rows (and by how many tasks), dead
    letters, and keyed changes (key -> upsert, or delete)."""

    writer: int
    rows: int
    tasks: int
    dead: int
    changes: dict[int, bool]


SHAPES = st.builds(
    Shape,
    writer=st.integers(0, WRITERS - 1),
    rows=st.integers(0, 5),
    tasks=st.integers(1, 2),
    dead=st.integers(0, 1),
    changes=st.dictionaries(st.integers(0, KEYS - 1), st.booleans(), max_size=3),
)


class InvariantError(AssertionError):
    """An invariant does not hold after a schedule."""


def written(table: Table, data: pa.Table) -> list[DataFileMeta]:
    """Data files as the pipeline's writers write them: named for the pipeline
    (:func:`icefloe.records.datafiles.group_write_uuid`), so merging may delete them."""
    return write_data_files(table, data, group_write_uuid(GROUP))


def arrow_rows(table: Table, columns: dict[str, list[Any]]) -> pa.Table:
    """``columns`` in the table's current schema (columns added since read as null)."""
    schema = table.schema().as_arrow()
    n = len(next(iter(columns.values())))
    arrays = [
        pa.array(columns.get(f.name, [None] * n), f.type)
        if f.name in columns
        else pa.nulls(n, f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(arrays, schema=schema)


@contextlib.contextmanager
def stops_are_violations(what: str) -> Iterator[None]:
    """The coordinator stops (a channel identity error, a drain that cannot finish): once
    faults stop, nothing may block for good (I4)."""
    try:
        yield
    except (ChannelIdentityError, DrainError) as exc:
        raise InvariantError(f"I4: {what}: {type(exc).__name__}: {exc}") from exc


class World(RuleBasedStateMachine):
    """What a schedule runs against: a pipeline (writers, coordinators) on a channel and a
    catalog with faults, the model of what it must hold, and the checks; the rules that move it
    are :class:`CommitPath`'s."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="sim-", dir=_scratch_root()))
        self.faults = Faults()
        self.catalog_properties = {
            "uri": f"sqlite:///{self.dir}/catalog.db",
            "warehouse": f"file://{self.dir}",
        }
        engine = ENGINES.lend(f"{self.dir}/catalog.db")
        self.catalog = SimCatalog("sim", self.faults, engine, **self.catalog_properties)
        self.server = SimServer(self.faults)
        _SERVERS[str(self.dir)] = self.server
        self.backend = MemoryBackend(self.server, GROUP, 3600.0)
        self.plugins = new_plugins(autoload=False)
        self.branch = "main"
        self.key_type = "long"
        self.bound: int | None = None  # max_pending_files of the pipeline's coordinators
        self.compacting: tuple[str, ...] = ()  # tables the pipeline compacts between cycles
        self.compaction_crash: str | None = None  # "during"/"after": the next round dies there
        self.between: Callable[[], None] | None = None  # another engine, after screening
        self.dropped: set[int] = set()  # ids of an append table another engine recreated
        self.incarnations: dict[str, set[str]] = {}  # per table: uuids of the dropped ones
        self.revived: set[int] = set()  # dropped ids a writer's batch run again brought back
        self.reruns: set[str] = set()  # files of the batches writers ran again (published)
        self.replayed: set[tuple[str, int]] = set()  # (writer, batch) a writer published again
        # KNOWN (architecture.md invariant 1's limit): files the pipeline's branch history no
        # longer names after another engine's expiry, and files announced again under a new id
        self.untraceable: dict[str, set[str]] = {}  # by table
        self.reannounced: set[str] = set()
        self.config = self._config()
        self.settings = self._settings()
        self.writers: dict[str, WriterClient] = {}
        self.fenced: list[WriterClient] = []  # older instances of a writer id (zombies)
        self.next_seq: dict[str, int] = {}
        self.leader: Coordinator | None = None
        self.zombies: list[Coordinator] = []
        self.takeover: bool | None = None  # a zombie cycle: does the new leader commit?
        # a zombie cycle whose round runs on committers (processes, Spark tasks): they go on
        # committing, with no lease check, while the new leader screens
        self.remote = False
        self.jobs: dict[str, tuple[Any, int]] = {}  # coordinator id -> its last cycle job, token
        self.names = itertools.count()
        self.ids = itertools.count(1)
        self.values = itertools.count(1)
        self.batches: list[Batch] = []
        self.foreign_live: set[int] = set()  # the other engine's rows in ROWS on main
        self.foreign_ids = itertools.count(-1, -1)
        self.foreign_keys: dict[int, int] = {}  # the other engine's rows in KEYED
        self.rogue: set[int] = set()  # foreign ids a rogue writer announced for the pipeline
        self.protected: set[str] = set()  # quarantined files seen to exist: never deleted
        # the pipeline's quarantine entries as of a metadata file of the quarantine table (a
        # metadata file never changes: while the catalog names the same one, so are they)
        self.quarantine_seen: tuple[str | None, list[QuarantineEntry]] = (None, [])
        self.discarded: set[int] = set()  # ids an accepted rollback (--no-replay) removed
        # per table: ids a rollback to be replayed removed, until the replay is published
        self.awaiting: dict[str, set[int]] = {}
        # per table: ids of the replays published since the last rollback accepted without one
        self.replaying: dict[str, set[int]] = {}
        # (table uuid, snapshot id) -> the ids a snapshot of the pipeline held, read before an
        # expiry or ``maintain`` could delete its manifest list (see :meth:`remember`)
        self.remembered: dict[tuple[str, int], set[int]] = {}

    def _config(self) -> PipelineConfig:
        """The pipeline's configuration, as the operator's commands read it."""
        return config_from_dict(
            {
                "name": GROUP,
                "source": {"topics": ["src"]},
                "tables": [
                    {
                        "name": ROWS,
                        "branch": self.branch,
                        "merge_small_files": True,
                        **self.compaction(ROWS),
                    },
                    {
                        "name": KEYED,
                        "mode": "upsert",
                        "id_columns": ["id"],
                        **self.compaction(KEYED),
                    },
                ],
                "errors": {"policy": "dead_letter", "dead_letter_table": DEAD},
                "catalog": {"name": "sim", "properties": self.catalog_properties},
                "coordination": {"backend": "sim", "sim": {"server": str(self.dir)}},
            }
        )

    def _settings(self) -> CoordinatorSettings:
        """The configuration's commit policies; no clock (retries back off by zero)."""
        return CoordinatorSettings(
            commit_interval_s=1e9,
            commit_timeout_s=1e9,
            writer_timeout_s=1e9,
            stall_after_s=1e9,
            table_retry_base_s=0.0,
            table_retry_max_s=0.0,
            quarantine_after_failures=3,
            max_pending_files=self.bound,
            policies=TablePolicies.from_config(self.config),
            compaction_budget_s=1e9,  # no clock: a round always finishes, the same on replay
        )

    def compaction(self, name: str) -> dict[str, Any]:
        """The ``compact*`` keys of a table the pipeline compacts, thresholds so low that any
        two files or one delete file in a partition start a rewrite."""
        if name not in self.compacting:
            return {}
        return {
            "compact": True,
            "compact_delete_ratio": 0.01,
            "compact_delete_files": 1,
            "compact_small_files": 2,
        }

    # ------------------------------------------------------------------ plumbing

    def name(self, prefix: str) -> str:
        return f"{prefix}{next(self.names)}"

    def key(self, k: int) -> Any:
        return KEY_TYPES[self.key_type][1](k)

    def writer(self, n: int) -> WriterClient:
        writer_id = f"w{n}"
        client = self.writers.get(writer_id)
        if client is None:
            client = self.writers[writer_id] = self.client(writer_id)
        return client

    def client(self, writer_id: str) -> WriterClient:
        """A started writer instance; it never answers StartCommit on its own (cycles ask no
        writer), so its thread adds nothing to the channel."""
        client = WriterClient(
            self.backend.writer(writer_id), GROUP, writer_id, poll_interval_s=3600.0
        )
        client.start()
        return client

    def announce(
        self, files: dict[str, list[DataFileMeta]], prefix: str, uuids: dict[str, str] | None = None
    ) -> None:
        """Files announced once by a writer under a new id (with the uuids of the tables they
        were written for, as icefloe's writers always send them, or none)."""
        client = self.client(self.name(prefix))
        try:
            client.publish(0, files, [], {n: u for n, u in (uuids or {}).items() if n in files})
        finally:
            client.close()

    def coordinator(self, max_pending_files: int | None = None) -> Coordinator:
        name = self.name("c")
        hooks = CoordinatorHooks(
            after_lease_check=self._after_lease_check,
            during_compaction=lambda table: self._compaction_point("during", table),
            after_compaction=lambda table: self._compaction_point("after", table),
        )
        coordinator = Coordinator(
            GROUP,
            self.backend.coordinator(name),
            self.catalog,
            replace(self.settings, max_pending_files=max_pending_files or self.bound),
            coordinator_id=name,
            plugins=self.plugins,
            hooks=hooks,
        )
        cycle = coordinator._cycle
        request = cycle._request

        def remembered(job: Any, table: str, files: Any, token: int) -> TableCommitRequest:
            self.jobs[name] = (job, token)  # what its committers would go on with
            return request(job, table, files, token)

        cycle._request = remembered  # type: ignore[method-assign]
        return coordinator

    def lead(self) -> Coordinator:
        """The leader, after it read everything the channel holds (a new one if none)."""
        with stops_are_violations("the coordinator stopped"):
            if self.leader is None:
                self.server.expire_lease(GROUP)  # whoever held it is dead or paused
                coordinator = self.coordinator()
                coordinator.step(0)
                assert coordinator.is_leader, "a free lease was not taken"
                self.leader = coordinator
            self.read_all(self.leader)
        return self.leader

    @staticmethod
    def read_all(coordinator: Coordinator) -> None:
        end = coordinator.channel.end_position()
        for _ in range(10_000):
            if coordinator.caught_up(end) or coordinator.pending_full():
                return
            if not coordinator.is_leader:
                return
            coordinator.read(0)
        raise AssertionError("the leader could not read to the channel's end")

    def crashed(self) -> None:
        """The leader died where a fault hit it: its object is dropped, its lease lapses."""
        self.leader = None
        self.server.expire_lease(GROUP)
        self.note_quarantine()  # a crash may follow a quarantine write

    def cycle(self, coordinator: Coordinator) -> None:
        try:
            with stops_are_violations("the coordinator stopped"):
                result = coordinator.commit_now(wait_for_writers=False)
        except NotLeaderError:
            self.zombies.append(coordinator)
            if coordinator is self.leader:
                self.leader = None
            return
        EVENTS["cycle"] += 1
        EVENTS["files quarantined"] += sum(result.quarantined.values())
        if result.quarantined:
            self.note_quarantine()

    def metadata_location(self, name: str) -> str | None:
        """The table's current metadata file, as the catalog's row names it (None: no such
        table): one query, no metadata read."""
        namespace, table = name.rsplit(".", 1)
        with self.catalog.engine.connect() as connection:
            found = connection.execute(
                text(
                    "SELECT metadata_location FROM iceberg_tables WHERE catalog_name = :c"
                    " AND table_namespace = :n AND table_name = :t"
                ),
                {"c": self.catalog.name, "n": namespace, "t": table},
            ).scalar()
        return None if found is None else str(found)

    def note_quarantine(self) -> list[QuarantineEntry]:
        """Remember quarantined files that exist now: I2 says they are never deleted. Returns
        the pipeline's quarantine entries."""
        location = self.metadata_location(DEFAULT_QUARANTINE_TABLE)
        if location != self.quarantine_seen[0]:
            self.quarantine_seen = location, Quarantine(self.catalog).list(GROUP)
        entries = self.quarantine_seen[1]
        for e in entries:
            if os.path.exists(local(e.file_path)):
                self.protected.add(e.file_path)
        return entries

    def _compaction_point(self, when: str, table: str) -> None:
        """A compaction round's fault point: the leader dies with the round's new files
        written and its replace snapshot not committed ("during"), or right after it landed."""
        EVENTS[f"compaction {when}"] += 1
        if self.compaction_crash == when:
            self.compaction_crash = None
            raise SimulatedCrash(f"{when} the compaction of {table}")

    def _after_lease_check(self, coordinator_id: str) -> None:
        """A zombie cycle: the leader passed its lease check and pauses; its lease lapses, a
        new leader takes over (and maybe commits) before the old one goes on. Or another
        engine commits right there, between the cycle's screening and its commit."""
        between, self.between = self.between, None
        if between is not None:
            between()
        if self.takeover is None or self.leader is None:
            return
        if coordinator_id != self.leader.coordinator_id:
            return
        commits, self.takeover = self.takeover, None
        EVENTS["zombie leader"] += 1
        zombie, self.leader = self.leader, None
        heir = self.lead()
        if commits:
            if self.remote:
                self.deposed_round_lands_in(heir, zombie)
            self.cycle(heir)

    def deposed_round_lands_in(self, heir: Coordinator, zombie: Coordinator) -> None:
        """The zombie's round runs on committers (processes, Spark tasks) that go on with no
        lease check: right after the heir's screening loads its first table, and before it
        judges the files on that version, they screen and commit every table the zombie
        holds pending, with its token, as a committer's worker does."""
        committer = heir._reader._committer
        judge = committer._screen

        def landed_first(table: str, loaded: Any, files: Any, channel_id: str | None) -> Any:
            committer._screen = judge  # type: ignore[method-assign]
            EVENTS["deposed committers land during screening"] += 1
            job, token = self.jobs[zombie.coordinator_id]
            worker = IcebergCommitter.for_pipeline(self.catalog, self.config)
            pending = {t: tuple(fs) for t, fs in zombie._reader.pending.items() if fs}
            for name, mine in sorted(pending.items()):
                # a deposed committer's failure reaches only its deposed coordinator
                with contextlib.suppress(Exception):
                    screening = worker.screen(name, mine, zombie._reader.channel_id)
                    if screening.refused or not screening.accepted:
                        continue  # its coordinator decides (fenced): nothing committed here
                    worker.commit(zombie._cycle._request(job, name, screening.accepted, token))
            return judge(table, loaded, files, channel_id)

        committer._screen = landed_first  # type: ignore[method-assign]

    def publish(self, client: WriterClient, batch: Batch) -> None:
        """Writer ``w<n>`` reads source partition n; its batch ``seq`` is the record at offset
        ``seq`` there (what a rollback's replay reads again)."""
        batch.source = (int(client.writer_id[1:]), batch.seq)
        positions = [SourcePosition(SOURCE, batch.source[0], batch.seq + 1, None)]
        uuids = {n: str(self.catalog.load_table(n).metadata.table_uuid) for n in batch.files}
        batch.uuids = uuids
        try:
            published = client.publish(batch.seq, batch.files, positions, uuids)
        except WriterFencedError:
            return
        if published:
            self.batches.append(batch)

    def committer(self) -> IcebergCommitter:
        return IcebergCommitter.for_pipeline(self.catalog, self.config)

    def replay(self, name: str) -> None:
        """What the ``icefloe run`` driver's rollback watcher does for a rolled-back table
        (``icefloe_spark.replay``): read the lost source range again (here: the model's
        batches of that range), write the table's rows and publish them as the rollback's
        replay batch, or accept the rollback when the range holds none."""
        committer = self.committer()
        try:
            rollback = committer.rollback(name)
        except RollbackNotReplayableError:
            # the history below the rollback was expired since: the driver stops with this
            # error, whose way out is the operator's `icefloe rollback --no-replay`
            present = {
                int(r[0])
                for r in read_ref(
                    self.catalog.load_table(name), self.committer().branch_of(name), ["id"]
                )
            }
            committer.roll_back(name, None, replay=False)
            self.discarded.update(self.awaiting.pop(name, set()) | self.stale_replay(name, present))
            EVENTS["rollback not replayable, accepted"] += 1
            return
        if rollback is None:
            return
        ranges = rollback.ranges({(SOURCE, p): 0 for p in range(WRITERS)})
        lost = [
            b
            for b in self.batches
            if b.source is not None
            and any(r.partition == b.source[0] and r.start <= b.source[1] < r.end for r in ranges)
        ]
        ids = [i for b in lost for i in b.rows.get(name, ())]
        self.discarded.difference_update(ids)  # a deeper rollback replays an accepted one's too
        # rows of the range that a table another engine dropped had held: the replay reads
        # them again for the table created in its place, as a batch run again does
        # (replayed_batch), so a copy of the dropped table's file may be quarantined beside
        # them (seed 25673). They stay `dropped`: a replay the operator cancels leaves them out
        self.revived |= set(ids) & self.dropped
        self.awaiting.pop(name, None)
        if not ids:
            committer.roll_back(name, None, replay=False, only_if=rollback.writer_id)
            EVENTS["rollback accepted (no rows to replay)"] += 1
            return
        # the replay writes the records of the range's quarantined files again and retires
        # their entries: I2 no longer keeps those files
        replayed = {(b.writer_id, b.seq) for b in lost}
        self.protected.difference_update(
            e.file_path
            for e in Quarantine(self.catalog).list(GROUP, name)
            if (e.writer_id, e.batch_seq) in replayed
        )
        table = self.catalog.load_table(name)
        files = {name: written(table, self.append_rows(table, ids, rollback.writer_id, 0))}
        uuids = {name: str(table.metadata.table_uuid)}
        client = self.client(rollback.writer_id)
        try:
            client.publish(REPLAY_BATCH_SEQ, files, (), uuids)
            EVENTS["rollback replayed"] += 1
        finally:
            client.close()
        # with the uuid the replay named: its files announced again (``reannounce``) name the
        # table they were written for, as every other batch's do (seed 25645)
        self.batches.append(Batch(rollback.writer_id, REPLAY_BATCH_SEQ, files, uuids=uuids))
        self.replaying.setdefault(name, set()).update(ids)

    def stale_replay(self, name: str, present: set[int]) -> set[int]:
        """Rows of replays published but neither committed (``present``: the branch's rows
        before the operator's acceptance) nor quarantined, when a rollback is accepted
        without a replay: the dedupe rule takes a replay batch only for the rollback pending,
        so they stay out by the operator's choice, as the rolled-back rows do."""
        held = {
            i
            for e in Quarantine(self.catalog).list(GROUP, name)
            if os.path.exists(local(e.file_path))
            for i in file_ids(e.file_path)
        }
        return self.replaying.pop(name, set()) - present - held

    def remember(self, names: tuple[str, ...]) -> None:
        """Read and keep the ids every snapshot of the pipeline in these append tables holds,
        before an expiry or ``icefloe maintain`` may take its manifest list away. Why: a
        rollback may restore a pipeline snapshot that only the table's earlier metadata
        files still name, once expired (the committer needs no more than its summary
        there), and the model needs its rows (:meth:`held_by`). Its
        manifest list is gone by then, rightly: ``maintain`` deletes it as an orphan once
        the snapshot was expired (found by the 40-rule search, seed 25306), as Iceberg Java's
        expiry does right away."""
        reader = Reader()
        for name in names:
            table = self.catalog.load_table(name)
            uuid_ = str(table.metadata.table_uuid)
            for snapshot in table.metadata.snapshots:
                key = (uuid_, snapshot.snapshot_id)
                if key not in self.remembered and of_group(snapshot, GROUP):
                    rows = reader.read_snapshot(table, snapshot.snapshot_id, ["id"])
                    self.remembered[key] = {int(r[0]) for r in rows}

    def held_by(self, table: Table, snapshot_id: int) -> set[int]:
        """The ids a snapshot of the pipeline in ``table`` holds: as remembered before it
        could be expired (:meth:`remember`), else read (from an earlier metadata file when it
        was expired since, see :func:`snapshot_ids`)."""
        held = self.remembered.get((str(table.metadata.table_uuid), snapshot_id))
        return snapshot_ids(table, snapshot_id) if held is None else held

    def append_rows(self, table: Table, ids: list[int], writer_id: str, seq: int) -> pa.Table:
        n = len(ids)
        return arrow_rows(table, {"id": ids, "writer": [writer_id] * n, "batch_seq": [seq] * n})

    def write_batch(
        self,
        writer_id: str,
        seq: int,
        rows: dict[str, int],
        changes: dict[int, bool],
        tasks: int = 1,
    ) -> Batch:
        """A new writer batch: ``rows`` new ids per appended table, written by ``tasks`` tasks
        (each its own files, as Spark tasks do), and the ``changes`` (upsert with a new value,
        or delete) of keyed rows."""
        ids = {name: [next(self.ids) for _ in range(n)] for name, n in rows.items() if n}
        values = {k: (next(self.values) if up else None) for k, up in sorted(changes.items())}
        return self.write_content(Batch(writer_id, seq, {}, ids, values), tasks)

    def write_content(self, batch: Batch, tasks: int = 1) -> Batch:
        """Real Parquet files of ``batch``'s rows and changes (a keyed batch: a data file of
        its upserts and a key file of every key it changes)."""
        writer_id, seq = batch.writer_id, batch.seq
        for name, ids in batch.rows.items():
            table = self.catalog.load_table(name)
            batch.files[name] = [
                meta
                for task in range(min(tasks, len(ids)))
                for meta in written(
                    table, self.append_rows(table, ids[task::tasks], writer_id, seq)
                )
            ]
        if batch.changes:
            table = self.catalog.load_table(KEYED)
            upserts = {k: v for k, v in batch.changes.items() if v is not None}
            metas: list[DataFileMeta] = []
            if upserts:
                data = {"id": [self.key(k) for k in upserts], "value": list(upserts.values())}
                metas += written(table, arrow_rows(table, data))
            key_type = table.schema().as_arrow().field("id").type
            keys = pa.table({"id": pa.array([self.key(k) for k in batch.changes], key_type)})
            metas += write_key_files(table, keys)
            batch.files[KEYED] = metas
        return batch

    def next_batch(self, client: WriterClient) -> int:
        seq = self.next_seq.get(client.writer_id, 0)
        self.next_seq[client.writer_id] = seq + 1
        return seq

    def create_tables(self, branch: str, key_type: str, bound: int | None = None) -> None:
        self.branch, self.key_type, self.bound = branch, key_type, bound
        self.config = self._config()
        self.settings = self._settings()
        TEMPLATES.copy_into(key_type, self.dir, self.catalog.engine)

    # ------------------------------------------------------------------ the checks

    def teardown(self) -> None:
        EVENTS["schedules"] += 1
        if sys.exc_info()[0] is not None:  # a rule failed: report that, not what follows
            self.close()
            return
        try:
            self.faults.calm()
            self.settle()
            self.check()
        finally:
            self.close()

    def close(self) -> None:
        for client in [*self.writers.values(), *self.fenced]:
            with contextlib.suppress(Exception):
                client.close()
        _SERVERS.pop(str(self.dir), None)
        ENGINES.give_back(self.catalog.engine)
        shutil.rmtree(self.dir, ignore_errors=True)

    def settle(self) -> None:
        """I4: faults stopped, a fresh leader commits or quarantines every pending file within
        SETTLE_CYCLES cycles (plus one per batch on the channel under a memory bound, which
        makes reading wait for cycles)."""
        self.leader = None
        self.zombies.clear()
        for name in (ROWS, DEAD):
            self.replay(name)  # the driver's watcher runs in the background
        budget = SETTLE_CYCLES + (len(self.server.batches) if self.bound else 0)
        leader = self.lead()

        def settled() -> bool:
            return not leader.pending_files() and leader.caught_up(leader.channel.end_position())

        for _ in range(budget):
            if settled():
                break
            self.cycle(leader)
            assert self.leader is leader, "the settling leader lost its lease"
            self.read_all(leader)
        if not settled():
            raise InvariantError(
                f"I4: files still pending after {budget} fault-free cycles: "
                f"{leader.pending_files()}"
            )
        leader.close()

    def check(self) -> None:
        """I1-I3, each table loaded once and each file read once (:class:`Reader`): nothing
        is written while the checks look."""
        entries = self.note_quarantine()
        reader = Reader()
        tables = {name: self.catalog.load_table(name) for name in (ROWS, KEYED, DEAD)}
        self.check_files(tables, reader)
        for name in APPENDED:
            self.check_rows(name, tables[name], entries, reader)
        self.check_foreign(tables[ROWS], reader)
        self.check_keyed(tables[KEYED], entries, reader)

    def check_files(self, tables: dict[str, Table], reader: Reader) -> None:
        """I2: every file any retained snapshot references exists, and every quarantined file
        seen existing still does."""
        missing: list[str] = []
        for name, table in tables.items():
            for s in table.metadata.snapshots:
                data, deletes = reader.snapshot_files(table, s.snapshot_id)
                gone = [p for p in data + deletes if not os.path.exists(local(p))]
                missing += [f"{name}@{s.snapshot_id}: {p}" for p in gone]
        gone = sorted(p for p in self.protected if not os.path.exists(local(p)))
        missing += [f"quarantined: {p}" for p in gone]
        if missing:
            raise InvariantError(f"I2: {len(missing)} referenced file(s) deleted: {missing[:5]}")

    def check_rows(
        self, name: str, table: Table, entries: list[QuarantineEntry], reader: Reader
    ) -> None:
        """I1: each id published to ``name`` in the table (the pipeline's branch of it) or in
        a quarantined file exactly once (nowhere when a rollback without replay removed it)."""
        ref = self.settings.policies.branch(name) if self.settings.policies else "main"
        got = Counter(int(r[0]) for r in reader.read_ref(table, ref, ["id"]))
        held = Counter(
            i
            for e in entries
            if e.table_name == name and os.path.exists(local(e.file_path))
            for i in reader.ids(e.file_path)
        )
        expected = {i: b.label for b in self.batches for i in b.rows.get(name, ())}
        # KNOWN (invariant 1's limit, docs/reliability.md): rows of a file announced again
        # after another engine's expiry left nothing in the branch history that names it are
        # taken for new: committed again, or quarantined if the table refuses them now
        twice = {
            i
            for p in self.untraceable.get(name, set()) & self.reannounced
            if os.path.exists(local(p))
            for i in reader.ids(p)
        }
        # rows of a dropped table's file that a copy announced again put in quarantine
        # (refused: written for that dropped table), while the writer's batch run again
        # committed them to the table created in its place: see revived_beside_stale_copy;
        # or beside the batch run again in files written for the dropped table: see
        # rerun_beside_stale_copy
        refused = [
            e.file_path
            for e in entries
            if e.table_name == name
            and e.error_type == TableMismatchError.__name__
            and e.table_uuid in self.incarnations.get(name, ())
            and os.path.exists(local(e.file_path))
        ]
        stale = Counter(i for p in refused for i in reader.ids(p))
        rerun = Counter(i for p in refused if p in self.reruns for i in reader.ids(p))
        wrong = {
            i: (label, got[i], held[i])
            for i, label in expected.items()
            if got[i] + held[i] != (0 if i in self.discarded else 1)
            and not (i in self.dropped and (got[i], held[i]) == (0, 1))  # see foreign_recreate
            and not (i in twice and got[i] + held[i] == 2)  # committed or quarantined again
            and not self.revived_beside_stale_copy(i, got[i], held[i], stale[i])
            and not self.rerun_beside_stale_copy(i, got[i], held[i], stale[i], rerun[i])
        }
        unknown = sorted(i for i in got if i > 0 and i not in expected)
        doubled = sorted(i for i, n in got.items() if i < 0 and n > 1 and i not in self.rogue)
        if wrong or unknown or doubled:
            raise InvariantError(
                f"I1: {name}: published rows not exactly once in table or quarantine "
                f"(id: (batch, in table, in quarantine)): {dict(list(wrong.items())[:8])}; "
                f"rows nobody published: {unknown[:8]}; other engine's rows doubled: {doubled[:8]}"
            )

    def revived_beside_stale_copy(self, i: int, got: int, held: int, stale: int) -> bool:
        """Whether row ``i`` is in the table once and in quarantine once only as a copy of
        a dropped table's file: not a defect (seed 24730, docs/reliability.md).

        Another engine dropped the table that had committed the row and created it again;
        the writer's batch run again (the same source records, new files written for the new
        table, on a channel that never saw the batch) committed it to the new table, as a
        source re-read after a recreate does (:meth:`CommitPath.replayed_batch`; or the replay
        of a rollback of the new table whose range reaches back to the row: seed 25673); a copy of
        the old file announced again names the dropped table's uuid and is quarantined with
        ``TableMismatchError``. Nothing the coordinator can read ties that copy to rows a
        dropped table committed (only the dropped table knew; its copy could as well hold
        rows never committed anywhere), so quarantining it is the one choice that loses
        nothing, as for the ``dropped`` rows the check already allows in quarantine.

        It hides no defect: only rows a dropped table held that a batch run again brought
        back (and no rollback without replay removed since) qualify, in the table exactly
        once (a second copy there, committed or added by an operator, is caught), and in
        quarantine exactly once, in a file written for a dropped table's uuid and refused for
        it (a quarantined copy written for the current table, or a second stale copy, is
        caught)."""
        if i not in self.revived or i in self.discarded:
            return False
        return (got, held, stale) == (1, 1, 1)

    def rerun_beside_stale_copy(self, i: int, got: int, held: int, stale: int, rerun: int) -> bool:
        """Whether row ``i`` of a dropped table is in quarantine twice, both copies refused
        for a dropped table's uuid and one of them the writer's batch run again: not a
        defect (seed 25420, docs/reliability.md).

        The batch was committed, a swap, then the writer ran it again in new files written
        for the table that held it, on a channel that never saw it (the dedupe rule would
        have dropped it), and another copy of the row was announced (a copy of the committed
        file under another writer id, or the batch read again); another engine dropped and
        created the table before a cycle read them. Each names the dropped table and is
        refused; nothing left tells the coordinator that the dropped table took their rows,
        or ties the two (another writer id, no source offsets, other files), so each is kept,
        as the one copy ``dropped`` rows already may be.

        It hides no defect: only rows a dropped table held qualify, in no table, in
        quarantine exactly twice, both copies refused for a dropped table's uuid and exactly
        one a batch a writer ran again (two copies of any other kind, or a copy naming the
        current table, are caught, as is a replay of a rollback: its writer is no rerun)."""
        if i not in self.dropped:
            return False
        return (got, held, stale, rerun) == (0, 2, 2, 1)

    def check_foreign(self, table: Table, reader: Reader) -> None:
        """The other engine's rows on ``main`` of the append table: each of its live rows
        exactly once (more only where a rogue writer announced its files)."""
        main = Counter(int(r[0]) for r in reader.read_ref(table, "main", ["id"]))
        lost = sorted(
            i for i in self.foreign_live if main[i] < 1 or (main[i] > 1 and i not in self.rogue)
        )
        if lost:
            raise InvariantError(
                f"I1: the other engine's rows on main not exactly once: {lost[:8]}"
            )

    def check_keyed(self, table: Table, entries: list[QuarantineEntry], reader: Reader) -> None:
        """I3: a keyed batch is quarantined whole or not at all, and the table equals the
        model: the other engine's rows plus every batch not quarantined, in channel order."""
        by_batch: dict[tuple[str, int], set[str]] = {}
        for e in entries:
            if e.table_name == KEYED:
                by_batch.setdefault((e.writer_id, e.batch_seq), set()).add(e.file_path)
        model: dict[int, int] = dict(self.foreign_keys)
        for b in self.batches:
            if not b.changes:
                continue
            paths = {m.path for m in b.files[KEYED]}
            refused = by_batch.get((b.writer_id, b.seq), set())
            if refused and refused != paths:
                raise InvariantError(
                    f"I3: keyed batch {b.label} applied by halves: quarantined "
                    f"{sorted(p.rsplit('/', 1)[-1] for p in refused)} of "
                    f"{sorted(p.rsplit('/', 1)[-1] for p in paths)}"
                )
            if refused:
                continue
            for k, v in b.changes.items():
                if v is None:
                    model.pop(k, None)
                else:
                    model[k] = v
        keys = {_plain(self.key(k)): k for k in [*range(KEYS), *self.foreign_keys]}
        rows = reader.read_ref(table, "main", ["id", "value"])
        copies = Counter(keys.get(_plain(r[0]), -1) for r in rows)
        got = {keys.get(_plain(r[0]), -1): int(r[1]) for r in rows}
        if got != model or any(n > 1 for n in copies.values()):
            diff = {
                k: (model.get(k), got.get(k), copies[k])
                for k in sorted(set(model) | set(got))
                if model.get(k) != got.get(k) or copies[k] > 1
            }
            raise InvariantError(f"I3: keyed table differs (key: (model, table, copies)): {diff}")


class CommitPath(World):
    """One schedule: rules of the pipeline, another engine on the same tables and an
    operator; see the module docstring."""

    # ------------------------------------------------------------------ the pipeline

    @initialize(
        branch=st.sampled_from(["main", "audit"]),
        key_type=st.sampled_from(list(KEY_TYPES)),
        bounded=st.booleans(),
        compact=st.sampled_from([(), (ROWS,), (KEYED,), (ROWS, KEYED)]),
    )
    def configure(
        self, branch: str, key_type: str, bounded: bool, compact: tuple[str, ...]
    ) -> None:
        """The append table commits to ``main`` or to a branch of its own; the keyed table's
        key has one of the identifier types; coordinators hold at most 3 pending files
        (``max_pending_files``: reading waits for a cycle) or no bound; the pipeline compacts
        some of its tables between cycles (thresholds so low that most cycles are followed
        by a round)."""
        self.compacting = compact
        self.create_tables(branch, key_type, 3 if bounded else None)

    @rule(shape=SHAPES)
    def batch(self, shape: Shape) -> None:
        """A writer publishes a batch: appended rows (by one or two tasks), dead-lettered
        records and keyed changes (upserts, deletes). The first rule Hypothesis's ordering
        (fewest arguments, then the name) puts first, which its choices favour."""
        client = self.writer(shape.writer)
        seq = self.next_batch(client)
        counts = {ROWS: shape.rows, DEAD: shape.dead}
        batch = self.write_batch(client.writer_id, seq, counts, shape.changes, shape.tasks)
        self.publish(client, batch)

    @precondition(lambda self: bool(self.batches))
    @rule(pick=st.integers(0, 1 << 16))
    def reannounce(self, pick: int) -> None:
        """An earlier batch's very files announced again under a new writer id (a writer that
        lost its identity, or a forged announcement): no record may land twice."""
        old = self.batches[pick % len(self.batches)]
        self.reannounced.update(m.path for metas in old.files.values() for m in metas)
        # the writer that lost its identity still names the table it wrote for (a file of a
        # dropped table must not land in the one created again under its name)
        self.announce(dict(old.files), "r", old.uuids)

    @precondition(lambda self: bool(self.server.batches))
    @rule(pick=st.integers(0, 1 << 16))
    def stale_events(self, pick: int) -> None:
        """An earlier batch's events appear on the channel again (a backend that cannot
        refuse a replayed publish, e.g. records of an aborted Kafka transaction)."""
        for event in self.server.batches[pick % len(self.server.batches)]:
            self.server.inject(GROUP, event)

    @precondition(lambda self: bool(self.writers))
    @rule(writer=st.integers(0, WRITERS - 1), tasks=st.integers(1, 2))
    def replayed_batch(self, writer: int, tasks: int) -> None:
        """A writer publishes its newest batch again: the same records (Spark replays the same
        offsets after a crash) in new files, under the same batch number. The channel refuses
        it, or (after a swap, a new channel that never saw it) the dedupe rule drops it."""
        client = self.writer(writer)
        seq = self.next_seq.get(client.writer_id, 0) - 1
        original = next(
            (b for b in self.batches if (b.writer_id, b.seq) == (client.writer_id, seq)), None
        )
        if original is None:
            return
        again = Batch(client.writer_id, seq, {}, dict(original.rows), dict(original.changes))
        files = self.write_content(again, tasks).files
        positions = [SourcePosition(SOURCE, int(client.writer_id[1:]), seq + 1, None)]
        # the UUIDs of the tables written for, as every publish of the Spark sink carries
        uuids = {n: str(self.catalog.load_table(n).metadata.table_uuid) for n in files}
        with contextlib.suppress(WriterFencedError):
            if client.publish(seq, files, positions, uuids):
                self.reruns |= {m.path for metas in files.values() for m in metas}
                # rows the batch committed to a table another engine dropped since: only the
                # dropped table knew it took them, the new one commits them again (written
                # for it: nothing refuses them), as a source re-read after a recreate does
                back = {i for ids in original.rows.values() for i in ids} & self.dropped
                self.dropped -= back
                self.discarded -= back
                self.revived |= back  # a copy of the dropped table's file may be quarantined
        self.replayed.add((client.writer_id, seq))

    @precondition(lambda self: bool(self.writers))
    @rule(writer=st.integers(0, WRITERS - 1))
    def restart_writer(self, writer: int) -> None:
        """A new instance of a writer id (a restarted driver) fences the old one, which
        lives on as a zombie."""
        old = self.writers.pop(f"w{writer}", None)
        if old is not None:
            self.fenced.append(old)
        self.writer(writer)

    @precondition(lambda self: bool(self.fenced))
    @rule(pick=st.integers(0, 1 << 16), rows=st.integers(1, 3))
    def zombie_writer_publishes(self, pick: int, rows: int) -> None:
        """A fenced writer instance publishes a batch: refused."""
        client = self.fenced[pick % len(self.fenced)]
        seq = self.next_batch(client)
        self.publish(client, self.write_batch(client.writer_id, seq, {ROWS: rows}, {}))

    @rule(rows=st.integers(1, 3))
    def misplaced_batch(self, rows: int) -> None:
        """A batch whose files lie outside the table's location: quarantined."""
        client = self.writer(0)
        seq = self.next_batch(client)
        ids = [next(self.ids) for _ in range(rows)]
        scratch = self.catalog.load_table(SCRATCH)
        files = written(scratch, self.append_rows(scratch, ids, client.writer_id, seq))
        self.publish(client, Batch(client.writer_id, seq, {ROWS: files}, {ROWS: ids}))

    @rule(
        unknown=st.sampled_from([None, "before", "after"]),
        fail_deletes=st.booleans(),
    )
    def commit_cycle(self, unknown: str | None, fail_deletes: bool) -> None:
        """The leader reads everything and commits; the catalog may lose one commit's outcome,
        deleting merged originals may fail."""
        leader = self.lead()
        self.faults.unknown, self.faults.fail_deletes = unknown, fail_deletes
        try:
            self.cycle(leader)
        finally:
            self.faults.calm()

    @rule(k=st.integers(0, 24), fail_deletes=st.booleans())
    def crash_in_cycle(self, k: int, fail_deletes: bool) -> None:
        """The leader dies at the k-th write, delete or channel mutation of a cycle (if the
        cycle has that many): between any two steps of the commit path."""
        leader = self.lead()
        self.faults.crash_in, self.faults.fail_deletes = k, fail_deletes
        try:
            self.cycle(leader)
        except SimulatedCrash:
            self.crashed()
        finally:
            self.faults.calm()

    @rule(heir_commits=st.booleans(), remote=st.booleans())
    def zombie_cycle(self, heir_commits: bool, remote: bool = False) -> None:
        """The leader pauses right after its lease check, a new leader takes over (and maybe
        commits), then the old one resumes its commit: a zombie. ``remote``: the old leader's
        round runs on committers that go on while the new leader screens."""
        leader = self.lead()
        self.takeover, self.remote = heir_commits, remote
        try:
            self.cycle(leader)
        finally:
            self.takeover, self.remote = None, False
        if leader is not self.leader and leader not in self.zombies:
            self.zombies.append(leader)

    @precondition(lambda self: bool(self.zombies))
    @rule(pick=st.integers(0, 1 << 16))
    def zombie_commits(self, pick: int) -> None:
        """A coordinator that lost its lease runs a cycle anyway: fenced."""
        zombie = self.zombies[pick % len(self.zombies)]
        with contextlib.suppress(NotLeaderError):
            zombie.commit_now(wait_for_writers=False)

    @precondition(lambda self: self.leader is not None)
    @rule(graceful=st.booleans())
    def leader_change(self, graceful: bool) -> None:
        """The leader stops cleanly (releases its lease) or vanishes (its lease lapses) while
        idle; another takes over."""
        assert self.leader is not None
        if graceful:
            self.leader.close()
        self.leader = None
        self.lead()

    # ------------------------------------------------------------------ another engine

    @rule(rows=st.integers(1, 3), keyed=st.booleans())
    def foreign_append(self, rows: int, keyed: bool) -> None:
        """Another engine appends its own rows to ``main``."""
        if keyed:
            table = self.catalog.load_table(KEYED)
            keys = [FOREIGN_KEY + len(self.foreign_keys) + i for i in range(rows)]
            values = [next(self.values) for _ in keys]
            table.append(arrow_rows(table, {"id": [self.key(k) for k in keys], "value": values}))
            self.foreign_keys.update(zip(keys, values, strict=True))
        else:
            table = self.catalog.load_table(ROWS)
            ids = [next(self.foreign_ids) for _ in range(rows)]
            table.append(arrow_rows(table, {"id": ids, "writer": ["x"] * rows}))
            self.foreign_live.update(ids)

    @precondition(lambda self: bool(self.foreign_live))
    @rule(pick=st.integers(0, 1 << 16))
    def foreign_delete(self, pick: int) -> None:
        """Another engine deletes one of its rows (copy-on-write: files leave ``main``'s head
        and stay in older snapshots)."""
        victim = sorted(self.foreign_live)[pick % len(self.foreign_live)]
        self.catalog.load_table(ROWS).delete(f"id = {victim}")
        self.foreign_live.discard(victim)

    @rule(keyed=st.booleans())
    def foreign_repartition(self, keyed: bool) -> None:
        """Another engine changes the partition spec (files in flight have the old one)."""
        table = self.catalog.load_table(KEYED if keyed else ROWS)
        fields = table.spec().fields
        with table.update_spec() as spec:
            if fields:
                spec.remove_field(fields[0].name)
            else:  # pyiceberg 0.12 writes no bucket of a time (identity works there)
                plain = keyed and self.key_type == "time"
                transform: Transform[Any, Any] = (
                    IdentityTransform() if plain else BucketTransform(2)
                )
                spec.add_field("id", transform, self.name("id_b"))

    @rule(keyed=st.booleans())
    def foreign_add_column(self, keyed: bool) -> None:
        """Another engine adds an optional column."""
        table = self.catalog.load_table(KEYED if keyed else ROWS)
        with table.update_schema() as schema:
            schema.add_column(self.name("extra"), StringType())

    @rule(tag=st.booleans())
    def foreign_ref(self, tag: bool) -> None:
        """Another engine tags or branches the current snapshot of ``main``."""
        table = self.catalog.load_table(ROWS)
        head = table.current_snapshot()
        if head is None:
            return
        with table.manage_snapshots() as refs:
            if tag:
                refs.create_tag(head.snapshot_id, self.name("tag"))
            else:
                refs.create_branch(head.snapshot_id, self.name("branch"))

    @rule(keyed=st.booleans(), pick=st.integers(0, 1 << 16))
    def foreign_expire(self, keyed: bool, pick: int) -> None:
        """Another engine expires one snapshot that no ref points at, the pipeline's own
        included: any of them, as expiring by id does, or by age with a tag keeping an older
        one (a gap between a kept snapshot of the pipeline and the head is no rollback)."""
        name = KEYED if keyed else ROWS
        table = self.catalog.load_table(name)
        metadata = table.metadata
        heads = {ref.snapshot_id for ref in metadata.refs.values()}
        old = [s.snapshot_id for s in metadata.snapshots if s.snapshot_id not in heads]
        if old:
            if not keyed:
                self.remember((ROWS,))
            branch = self.committer().branch_of(name)
            before = history_paths(table, branch)
            table.maintenance.expire_snapshots().by_id(old[pick % len(old)]).commit()
            after = history_paths(self.catalog.load_table(name), branch)
            # KNOWN: a file committed and taken off the branch whose removal this expiry made
            # untraceable is committed again if announced again (invariant 1's limit)
            gone = {p for p in before - after if os.path.exists(local(p))}
            self.untraceable.setdefault(name, set()).update(gone)

    @rule(pick=st.integers(0, 1 << 16))
    def rogue_announces_foreign_file(self, pick: int) -> None:
        """A writer under a new id announces a data file of another engine (live on ``main``,
        or kept only by older snapshots): the pipeline does not own it, so must not delete it."""
        table = self.catalog.load_table(ROWS)
        found: dict[str, Any] = {}
        for s in table.metadata.snapshots:
            for manifest in s.manifests(table.io):
                for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=True):
                    f = entry.data_file
                    if f.file_path not in found and all(i < 0 for i in file_ids(f.file_path)):
                        found[f.file_path] = f
        if found:
            # in the order the snapshots, manifests and entries list them: the same on every
            # run (file names hold random uuids, so an order by name was not)
            path = list(found)[pick % len(found)]
            self.rogue.update(file_ids(path))
            self.announce({ROWS: [to_meta(found[path], table.metadata)]}, "rogue")

    # ------------------------------------------------------------------ the operator

    @rule(dead=st.booleans(), pick=st.integers(0, 1 << 16), replay=st.booleans())
    def operator_rolls_back(self, dead: bool, pick: int, replay: bool) -> None:
        """``icefloe rollback`` of an append table to an earlier snapshot of its branch (any:
        the pipeline's, another engine's, the one before the pipeline's first commit): replayed
        by the pipeline, or (``--no-replay``, or when refused as not replayable, as the error
        says) accepted, its rows then out. The other engine's rows after it go too."""
        name = DEAD if dead else ROWS
        committer = self.committer()
        table = self.catalog.load_table(name)
        branch = committer.branch_of(name)
        head = table.snapshot_by_name(branch)
        if head is None:
            return
        older = [s.snapshot_id for s in list(ancestors_of(head, table.metadata))[1:]]
        if not older:
            return
        before = {int(r[0]) for r in read_ref(table, branch, ["id"])}
        try:
            pending = committer.roll_back(name, older[pick % len(older)], replay=replay)
        except RollbackNotReplayableError:
            committer.roll_back(name, None, replay=False)
            replay = False
        else:
            # back to a snapshot above the pipeline's newest (another engine's delete of a
            # rewrite, say): nothing of the pipeline's was rolled back, nothing is replayed;
            # the rows that snapshot lacks were taken out by the other engine
            replay = replay and pending is not None
        after = {int(r[0]) for r in read_ref(self.catalog.load_table(name), branch, ["id"])}
        removed = {i for i in before - after if i > 0}
        # back to a snapshot that held rows a later one took out (another engine's delete, an
        # earlier rollback): they are in the table again, whatever that removal had decided
        self.discarded -= after - before
        if replay and pending is not None and pending.restored_snapshot_id is not None:
            # rows the pipeline's restored snapshot held are not replayed (they were not lost
            # with its snapshots): another engine's snapshot between took them out (the
            # delete of its rewrite, whose append the rollback dropped)
            held = removed & self.held_by(table, pending.restored_snapshot_id)
            self.discarded.update(held)
            removed -= held
        EVENTS["rollback" if replay else "rollback --no-replay"] += 1
        if not replay:
            # a rollback without replay below one whose replay is pending cancels that replay:
            # its rows, after the older snapshot too, are out by the operator's choice
            self.discarded.update(
                removed | self.awaiting.pop(name, set()) | self.stale_replay(name, before)
            )
        else:
            self.awaiting.setdefault(name, set()).update(removed)
        if name == ROWS and branch == "main":
            self.foreign_live &= after

    @rule(dead=st.booleans())
    def driver_replays(self, dead: bool) -> None:
        """The driver notices a rolled-back table and replays its lost range."""
        self.replay(DEAD if dead else ROWS)

    @rule(expire=st.booleans())
    def maintain(self, expire: bool) -> None:
        """``icefloe maintain`` (every table the pipeline commits to) with the orphan age, and
        the snapshot age or none, at zero: expire what the dedupe rule does not need, delete
        every orphan file that no uncommitted batch announces and no quarantine entry names.
        Zero is a minute in the future here, so "older than" holds for every file whatever
        the clock says (nothing is being written meanwhile: one thread drives the schedule)."""
        self.remember((ROWS, DEAD))
        maintain(
            self.config,
            expire_older_than_s=-60.0 if expire else 1e9,
            orphans_older_than_s=-60.0,
        )
        EVENTS["maintain"] += 1

    @rule(bounded=st.booleans())
    def drain_and_swap(self, bounded: bool) -> None:
        """``icefloe drain`` (of every table the pipeline commits to, as the command finds
        them; ``bounded``: under a memory bound of 2 pending files), then the pipeline moves to
        a new channel (a backend swap): writers and coordinators stop first, and the writers go
        on with their batch numbers. The pipeline replayed its rolled-back tables before it
        stopped (a drain while a rollback waits for its replay fails, saying so: the operator
        starts the pipeline again first)."""
        for name in (ROWS, DEAD):
            self.replay(name)
        for client in [*self.writers.values(), *self.fenced]:
            client.close()
        self.writers.clear()
        self.fenced.clear()
        if self.leader is not None:
            self.leader.close()
            self.leader = None
        self.zombies.clear()
        self.server.expire_lease(GROUP)
        drainer = self.coordinator(max_pending_files=2 if bounded else None)
        committer = IcebergCommitter.for_pipeline(self.catalog, self.config)
        try:
            with stops_are_violations("the drain cannot finish"):
                drain(
                    drainer,
                    committer,
                    lambda: pipeline_tables(self.catalog, self.config),  # as `icefloe drain`
                    timeout_s=60.0,
                    quiet_s=0.0,
                )
        finally:
            drainer.close()
        self.note_quarantine()
        self.server = _SERVERS[str(self.dir)] = SimServer(self.faults)
        EVENTS["drain and swap"] += 1
        self.backend = MemoryBackend(self.server, GROUP, 3600.0)

    # ------------------------------------------------------------------ compaction, fast append

    @rule(when=st.sampled_from(["during", "after"]))
    def crash_in_compaction(self, when: str) -> None:
        """The leader commits and dies in the compaction round that follows: its new files
        written and the replace snapshot not committed, or right after the snapshot landed
        (before the next cycle). A cycle with no round is a plain cycle."""
        leader = self.lead()
        self.compaction_crash = when
        try:
            self.cycle(leader)
        except SimulatedCrash:
            EVENTS[f"crash {when} compaction"] += 1
            self.crashed()
        finally:
            self.compaction_crash = None

    @rule(keyed=st.booleans())
    def foreign_rewrite(self, keyed: bool) -> None:
        """Another engine rewrites the table's files on the branch the pipeline commits to:
        an overwrite of every file with the same rows (as its compaction or a copy-on-write
        rewrite would), the pipeline's files among them."""
        name = KEYED if keyed else ROWS
        table = self.catalog.load_table(name)
        branch = self.committer().branch_of(name)
        head = table.snapshot_by_name(branch)
        if head is None:
            return
        table.overwrite(table.scan(snapshot_id=head.snapshot_id).to_arrow(), branch=branch)
        EVENTS["foreign rewrite"] += 1

    @rule(
        what=st.sampled_from(["append", "rewrite", "add_column", "repartition", "recreate"]),
        keyed=st.booleans(),
        shape=SHAPES,
    )
    def foreign_commit_between(self, what: str, keyed: bool, shape: Shape) -> None:
        """A writer batch, then a cycle during which another engine commits right after the
        pipeline screened its files and before its commit (the version screening loaded,
        which the commit may reuse, is then stale): an append, a rewrite, a new column, a
        partition-spec change, or the append table (``keyed``: the dead-letter table) dropped
        and created again."""
        self.batch(shape)
        actions: dict[str, Callable[[], None]] = {
            "append": lambda: self.foreign_append(1, keyed),
            "rewrite": lambda: self.foreign_rewrite(keyed),
            "add_column": lambda: self.foreign_add_column(keyed),
            "repartition": lambda: self.foreign_repartition(keyed),
            "recreate": lambda: self.foreign_recreate(keyed, True),
        }
        leader = self.lead()

        def between() -> None:
            EVENTS[f"foreign {what} between screening and commit"] += 1
            actions[what]()

        self.between = between
        try:
            self.cycle(leader)
        finally:
            self.between = None

    @rule(dead=st.booleans(), partitioned=st.booleans())
    def foreign_recreate(self, dead: bool, partitioned: bool) -> None:
        """Another engine drops an append table and creates it again under the same name (at
        the same location; partitioned or not): the rows it held are gone, the batches still
        pending go to the new table or to quarantine, and no cached version of the old table
        may be used."""
        name = DEAD if dead else ROWS
        table = self.catalog.load_table(name)
        self.incarnations.setdefault(name, set()).add(str(table.metadata.table_uuid))
        branch = self.committer().branch_of(name)
        gone = {i for i in (int(r[0]) for r in read_ref(table, branch, ["id"])) if i > 0}
        self.discarded |= gone
        # a batch committed to the old table whose cycle died before it stored its channel
        # position is read again and refused (its files name the old table's uuid): its rows
        # are then in quarantine, not back in the table. Not a defect: nothing but the dropped
        # table knew it took them. So is a copy, announced again, of a row a rollback without
        # replay took out of the old table (the copy names the old table's uuid).
        # rows a rollback took out for a replay go with the table too: the new table knows no
        # rollback, so none is replayed into it (and a copy announced again is quarantined,
        # as of any row a rollback took out of the old table)
        self.discarded |= self.awaiting.pop(name, set())
        published = {i for b in self.batches for i in b.rows.get(name, ())}
        # rows a batch run again (or a replay) was bringing back into the old table: files
        # written for it are refused by the new one, as the rows it held are (seed 25685: a
        # batch run again after the first of two recreates, quarantined beside a copy of
        # the first table's file). No longer revived: a copy of them committed to the new
        # table is a defect that revived_beside_stale_copy must not excuse
        back = self.revived & published
        self.dropped |= gone | (self.discarded & published) | back
        self.revived -= back
        if name == ROWS:
            self.foreign_live.clear()
        self.catalog.drop_table(name)
        spec = BUCKETS if partitioned else PartitionSpec()
        self.catalog.create_table(
            name, ROWS_SCHEMA, partition_spec=spec, properties=recommended_properties()
        )
        EVENTS["foreign recreate"] += 1


def _plain(value: Any) -> Any:
    """A key as pyarrow reads it back from Parquet, comparable with the value written."""
    if isinstance(value, uuid.UUID):
        return value.bytes
    if isinstance(value, dt.datetime) and value.tzinfo is not None:
        return value.astimezone(dt.UTC).replace(tzinfo=None)
    return value


# --------------------------------------------------------------------------- running


def _scratch_root() -> str:
    root = Path("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    path = root / f"icefloe-sim-{os.getpid()}"
    path.mkdir(exist_ok=True)
    return str(path)


class SimulationError(AssertionError):
    """A schedule broke an invariant; the message holds the minimal schedule and how to
    replay it."""


_BLOB = re.compile(r"@reproduce_failure\('([^']+)', b'([^']+)'\)")


def replay_commands(
    schedules: int, seed_: int, steps: int, blob: str | None, plant: str | None = None
) -> list[str]:
    """The commands that run this failure again: the exact schedule (Hypothesis's blob), and
    the same seeded search. ``nox -s simulate -- ARGS`` runs ``pytest`` on this file with
    ARGS, so each nox command has a pytest twin for a developer's virtualenv."""
    test = HERE.relative_to(HERE.parents[4]).as_posix()
    extra = f" --plant {plant}" if plant else ""
    runs = [f"--schedules {schedules} --seed {seed_} --steps {steps}{extra}"]
    if blob is not None:
        runs.insert(0, f"--replay {blob} --steps {steps}{extra}")
    return [f"{tool} {args}" for args in runs for tool in ("nox -s simulate --", f"pytest {test}")]


def simulate(
    schedules: int,
    seed_: int,
    steps: int = STEPS,
    replay: str | None = None,
    plant: str | None = None,
    shrink: bool = True,
) -> None:
    """Run ``schedules`` seeded schedules (or replay one blob); raise SimulationError with
    the minimal schedule (unless ``shrink`` is off) and the replay commands on the first
    violation. ``plant`` names a deliberately broken machine of :data:`PLANTS` (the
    self-test of this report)."""
    runner: Any = type("Simulation", (PLANTS[plant] if plant else CommitPath,), {})
    if replay is not None:
        version, blob = replay.split(":", 1)
        runner = reproduce_failure(version, blob.encode())(runner)
    else:
        runner = seed(seed_)(runner)
    config = settings(
        max_examples=schedules,
        stateful_step_count=steps,
        deadline=None,
        database=None,
        print_blob=True,
        report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck),
        phases=(Phase.explicit, Phase.generate, *([Phase.shrink] if shrink else [])),
    )
    quiet = logging.getLogger("icefloe")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # thousands of schedules quarantine and retry on purpose
    EVENTS.clear()
    try:
        with inline_executor(), sim_plugins():
            run_state_machine_as_test(runner, settings=config)
    except Exception as exc:
        notes = "\n".join(getattr(exc, "__notes__", []))
        found = _BLOB.search(notes)
        blob_arg = f"{found.group(1)}:{found.group(2)}" if found else replay
        commands = "\n  ".join(replay_commands(schedules, seed_, steps, blob_arg, plant))
        raise SimulationError(
            f"{type(exc).__name__}: {exc}\n{notes}\nreplay with:\n  {commands}"
        ) from exc
    finally:
        quiet.setLevel(level)
        shutil.rmtree(_scratch_root(), ignore_errors=True)


class Sabotaged(World):
    """A machine with a planted bug: something deletes a committed data file. Only for the
    self-test below (``--plant delete-committed-file``)."""

    @initialize()
    def configure(self) -> None:
        self.create_tables("main", "long")

    @rule(rows=st.integers(1, 3))
    def batch(self, rows: int) -> None:
        client = self.writer(0)
        seq = self.next_batch(client)
        self.publish(client, self.write_batch(client.writer_id, seq, {ROWS: rows}, {}))

    @rule()
    def commit_cycle(self) -> None:
        self.cycle(self.lead())

    @rule()
    def sabotage(self) -> None:
        table = self.catalog.load_table(ROWS)
        head = table.snapshot_by_name(self.branch)
        if head is not None:
            data, _ = snapshot_files(table, head.snapshot_id)
            for path in sorted(p for p in data if os.path.exists(local(p)))[:1]:
                os.remove(local(path))


PLANTS: dict[str, type[World]] = {"delete-committed-file": Sabotaged}


def chunks(schedules: int, seed_: int) -> list[tuple[int, int]]:
    """(seed, schedules) per test item: CHUNK schedules each, seeds counting up from
    ``seed_``, so a failing item replays alone with its own seed."""
    n = max(1, -(-schedules // CHUNK))
    return [(seed_ + i, min(CHUNK, schedules - i * CHUNK)) for i in range(n)]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Without options a smoke run (the fast gates); ``--schedules N [--seed S]`` (``nox -s
    simulate``: CI's fixed set) splits N schedules into items of CHUNK; ``--replay`` one."""
    if "schedule_seed" not in metafunc.fixturenames:
        return
    config = metafunc.config
    schedules = config.getoption("schedules", None) or SMOKE
    start = config.getoption("seed", None)
    plan = chunks(schedules, CI_SEED if start is None else start)
    if config.getoption("replay", None):
        plan = [(0, 1)]
    metafunc.parametrize(
        ("schedule_seed", "schedule_count"), plan, ids=[f"seed{s}x{n}" for s, n in plan]
    )


@pytest.mark.timeout(1800)  # a failure shrinks for up to 5 minutes (Hypothesis's limit)
def test_commit_path_simulation(
    request: pytest.FixtureRequest, schedule_seed: int, schedule_count: int
) -> None:
    """Seeded schedules (``--schedules/--seed``) or one (``--replay``): no violation."""
    config = request.config
    try:
        simulate(
            schedule_count,
            schedule_seed,
            config.getoption("steps", None) or STEPS,
            config.getoption("replay", None),
            config.getoption("plant", None),
        )
    except SimulationError as failure:
        pytest.fail(str(failure), pytrace=False)
    print(", ".join(f"{what}: {n}" for what, n in sorted(EVENTS.items())))  # shown with -rP


def test_a_replayed_batch_of_a_quarantined_one_is_in_one_place() -> None:
    """A batch, another engine's partition-spec change, a cycle (the batch's file, of the old
    spec, is quarantined), a drain and swap, the writer publishing the batch again (new files
    of the same records, the same batch number; the new channel never saw it): each record
    must be in the table or in quarantine, not both (I1). Seed 23500 found it; the reader
    ignores a quarantined batch announced again (test_channel_identity.py has the same case)."""
    machine = CommitPath()
    with inline_executor():
        machine.configure(branch="main", key_type="long", bounded=False, compact=())
        machine.batch(Shape(writer=2, rows=1, tasks=1, dead=0, changes={}))
        machine.foreign_repartition(keyed=False)
        machine.commit_cycle(unknown=None, fail_deletes=False)
        machine.drain_and_swap(bounded=False)
        machine.replayed_batch(writer=2, tasks=1)
        machine.teardown()


def test_a_failure_names_commands_that_replay_it(request: pytest.FixtureRequest) -> None:
    """A planted bug is found, the exact replay command (run as a developer would, in a new
    process) fails again with the same invariant and the same schedule, and so does the seeded
    search; the nox commands pass the same arguments to that pytest."""
    if any(request.config.getoption(o, None) for o in ("schedules", "seed", "replay", "plant")):
        pytest.skip("a simulation run (nox -s simulate): this self-test runs without options")
    with pytest.raises(SimulationError) as failed:
        simulate(40, 7, 6, plant="delete-committed-file", shrink=False)  # shrinking takes long
    report = str(failed.value)
    verdict = re.match(r"InvariantError: (I2: \d+ referenced file\(s\) deleted)", report)
    assert verdict is not None, report
    schedule = [line for line in report.splitlines() if line.startswith("state.")]
    assert "state.sabotage()" in schedule
    commands = re.findall(r"^  (\S.*)$", report, re.MULTILINE)
    pytests = [c for c in commands if c.startswith("pytest ")]
    assert [c.split(" -- ", 1)[1] for c in commands if c.startswith("nox ")] == [
        c.split(" ", 2)[2] for c in pytests
    ]
    assert len(pytests) == 2
    assert "--replay" in pytests[0]
    assert "--seed 7" in pytests[1]

    child = subprocess.run(
        [sys.executable, "-m", *pytests[0].split(), "-p", "no:cacheprovider", "-q"],
        cwd=HERE.parents[4],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 1, child.stdout[-2000:]
    assert verdict.group(1) in child.stdout, child.stdout[-2000:]
    lines = [line.strip() for line in child.stdout.splitlines()]
    assert [line for line in lines if line.startswith("state.")] == schedule

    with pytest.raises(SimulationError) as again:
        simulate(40, 7, 6, plant="delete-committed-file", shrink=False)
    assert [line for line in str(again.value).splitlines() if line.startswith("state.")] == (
        schedule
    )


def test_a_replay_after_a_swap_leaves_a_quarantined_record_in_one_place() -> None:
    """Found by the 40-step search (``--schedules 200 --seed 23100 --steps 40``): a batch,
    drain and swap, a batch quarantined (files outside the table's location), another batch,
    drain and swap, a rollback to the first snapshot with replay. The replay writes the
    quarantined batch's record again and commits it; its quarantine entry was retired by the
    rolled-back *channel* range, and channel positions of two channels cannot be compared, so
    none was (I1: the record in the table and in quarantine). Entries now record their batch's
    source offsets, which the replayed source range is compared with."""
    machine = CommitPath()
    with inline_executor():
        machine.configure(branch="main", key_type="long", bounded=False, compact=())
        machine.batch(Shape(writer=0, rows=1, tasks=1, dead=0, changes={}))
        machine.drain_and_swap(bounded=False)
        machine.misplaced_batch(rows=1)
        machine.batch(Shape(writer=1, rows=1, tasks=1, dead=0, changes={}))
        machine.drain_and_swap(bounded=False)
        table = machine.catalog.load_table(ROWS)
        head = table.current_snapshot()
        assert head is not None
        below = len(list(ancestors_of(head, table.metadata))) - 1
        assert below >= 1  # the first batch's snapshot, below the last one's
        machine.operator_rolls_back(dead=False, pick=below - 1, replay=True)  # to the oldest
        machine.teardown()


def test_files_waiting_for_a_replay_under_the_memory_bound_let_the_replay_be_read() -> None:
    """Found by ``--schedules 300 --seed 62000`` (seed 62001): under a bound of 3 pending files,
    a misplaced batch, two batches (the second one's cycle with another engine's append in
    between), a batch announced again, a rollback to the other engine's snapshot with replay.
    The settling leader read four files of the rolled-back table, which wait for the replay,
    and reading waited for them to commit: the replay was never read (I4). They now count
    against the hard cap only (``test_rollback.py`` has the same case)."""
    machine = CommitPath()
    with inline_executor():
        machine.configure(branch="main", key_type="long", bounded=True, compact=())
        machine.misplaced_batch(rows=1)
        machine.batch(Shape(writer=0, rows=0, tasks=1, dead=0, changes={}))
        machine.batch(Shape(writer=0, rows=1, tasks=1, dead=0, changes={0: False}))
        shape = Shape(writer=0, rows=2, tasks=1, dead=0, changes={})
        machine.foreign_commit_between(keyed=False, shape=shape, what="append")
        machine.reannounce(pick=2)
        machine.operator_rolls_back(dead=False, pick=0, replay=True)
        machine.teardown()


def test_files_waiting_for_a_second_rollbacks_replay_beside_the_firsts_let_it_be_read() -> None:
    """Found by ``--schedules 100 --seed 25607 --steps 40``: under a bound of 3 pending files
    the dead-letter table was rolled back with replay, the driver published that replay, and
    before it was committed the table was rolled back again. The settling leader read the first
    replay's file and two new files: a replay writer's file among them made them count as not
    waiting, so they filled the bound and reading stopped before the second replay, the one
    they wait for (I4). A table now waits for its pending rollback's own replay writer."""
    quiet = Shape(writer=0, rows=0, tasks=1, dead=0, changes={})
    dead = Shape(writer=0, rows=0, tasks=1, dead=1, changes={})
    machine = CommitPath()
    with inline_executor():
        machine.configure(branch="main", compact=(), key_type="long", bounded=True)
        machine.foreign_commit_between(keyed=True, shape=dead, what="append")
        machine.batch(shape=quiet)
        machine.batch(shape=quiet)
        machine.batch(shape=quiet)
        machine.batch(shape=Shape(writer=0, rows=0, tasks=2, dead=1, changes={0: True}))
        machine.replayed_batch(tasks=1, writer=0)
        machine.replayed_batch(tasks=1, writer=0)
        machine.batch(shape=quiet)
        machine.batch(shape=quiet)
        machine.driver_replays(dead=False)
        machine.driver_replays(dead=True)
        machine.foreign_commit_between(keyed=False, shape=dead, what="rewrite")
        machine.replayed_batch(tasks=1, writer=0)
        machine.zombie_cycle(heir_commits=True, remote=False)
        machine.driver_replays(dead=False)
        machine.operator_rolls_back(dead=True, pick=0, replay=True)
        machine.batch(shape=quiet)
        machine.foreign_commit_between(keyed=False, shape=dead, what="append")
        machine.batch(shape=quiet)
        machine.batch(shape=quiet)
        machine.driver_replays(dead=True)
        machine.batch(shape=dead)
        machine.replayed_batch(tasks=1, writer=0)
        machine.driver_replays(dead=False)
        machine.operator_rolls_back(dead=False, pick=0, replay=False)
        machine.driver_replays(dead=False)
        machine.operator_rolls_back(dead=True, pick=0, replay=True)
        machine.batch(shape=quiet)


def test_a_drain_under_the_memory_bound_reads_on_to_a_replay_behind_the_bound() -> None:
    """Found by ``--schedules 300 --seed 64000``: under a bound of 3 pending files, a batch
    whose cycle has another engine's append in between, a batch with a dead-letter record and
    a keyed change (3 files), a rollback to the other engine's snapshot (below the pipeline's
    first: "to None") with replay, a drain. The driver published the replay, behind the 3
    files; they fill the bound, so the drain ran a cycle before reading it, the append table
    failed waiting for its replay, and the drain gave up (I4). It now reads on to the replay
    (``test_rollback.py`` has the same case)."""
    machine = CommitPath()
    with inline_executor():
        machine.configure(branch="main", key_type="long", bounded=True, compact=())
        shape = Shape(writer=0, rows=1, tasks=1, dead=0, changes={})
        machine.foreign_commit_between(keyed=False, shape=shape, what="append")
        machine.batch(Shape(writer=0, rows=1, tasks=1, dead=1, changes={0: False}))
        machine.operator_rolls_back(dead=False, pick=0, replay=True)
        machine.drain_and_swap(bounded=False)
        machine.teardown()


def test_maintain_keeps_what_tells_a_rollback_waiting_for_its_replay() -> None:
    """Found by CI's 40-rule set (``--schedules 100 --seed 24000 --steps 40``): a batch whose
    cycle has another engine's append in between, a rollback to that snapshot (below the
    pipeline's only one) with replay, another append, a cycle (waiting for the replay), then
    ``icefloe maintain`` expiring every snapshot it may. It expired the rolled-back snapshot
    and the one rolled back to, so the branch's history began after the pipeline's snapshot:
    taken for another engine's expiry, the replay never came and the batch's row was lost
    (I1). Maintain now keeps, on a branch rolled back below a pipeline's snapshot, the whole
    chain and that snapshot."""
    machine = CommitPath()
    with inline_executor(), sim_plugins():
        machine.configure(branch="main", key_type="long", bounded=False, compact=())
        shape = Shape(writer=0, rows=1, tasks=1, dead=0, changes={})
        machine.foreign_commit_between(keyed=False, shape=shape, what="append")
        machine.operator_rolls_back(dead=False, pick=0, replay=True)
        machine.foreign_append(keyed=False, rows=1)
        machine.commit_cycle(fail_deletes=False, unknown=None)
        machine.maintain(expire=True)
        machine.teardown()


def test_maintain_keeps_the_history_of_a_rollback_whose_snapshot_another_engine_expired() -> None:
    """As above (the same set), but another engine expires the rolled-back snapshot of the
    pipeline first: maintain, finding no snapshot of the pipeline anywhere, expired the one
    rolled back to as well. The property's sequence number tells the branch was rolled back
    below the pipeline's snapshot (its history reaches an older one): maintain keeps it."""
    machine = CommitPath()
    with inline_executor(), sim_plugins():
        machine.configure(branch="main", key_type="long", bounded=False, compact=())
        machine.batch(Shape(writer=0, rows=1, tasks=1, dead=0, changes={}))
        shape = Shape(writer=0, rows=0, tasks=1, dead=0, changes={})
        machine.foreign_commit_between(keyed=False, shape=shape, what="append")
        machine.operator_rolls_back(dead=False, pick=0, replay=True)
        machine.foreign_expire(keyed=False, pick=0)
        machine.foreign_append(keyed=False, rows=1)
        machine.maintain(expire=True)
        machine.teardown()


def test_another_engine_expiring_the_pipelines_only_snapshot_blocks_no_table() -> None:
    """Found by the long run (seed 50030, 12 steps): a delete-only keyed batch committed,
    another engine appends and then expires the pipeline's snapshot (nothing refers to it),
    another batch, a drain. The committer took the missing snapshot for a rollback to
    nothing and waited for a replay that never comes (I4): the expired-gap check looked for
    a data file the kept snapshot added, and a delete-only batch adds none. Now the sequence
    number the table property keeps tells: the branch's line begins after that snapshot."""
    machine = CommitPath()
    with inline_executor():
        machine.configure(branch="main", key_type="long", bounded=False, compact=())
        machine.batch(Shape(writer=0, rows=0, tasks=1, dead=0, changes={0: False}))
        machine.commit_cycle(fail_deletes=False, unknown=None)
        machine.foreign_append(keyed=True, rows=1)
        machine.batch(Shape(writer=0, rows=0, tasks=1, dead=0, changes={0: False}))
        machine.foreign_expire(keyed=True, pick=0)
        machine.drain_and_swap(bounded=False)
        machine.teardown()


def test_another_engine_expiring_its_rewrites_delete_is_no_rollback() -> None:
    """Found by the 40-step search (``--schedules 150 --seed 61200 --steps 40``): a batch, a
    cycle, another engine's branch on that snapshot, its rewrite of ``main`` (a ``delete``,
    then an ``append``), then its expiry of the ``delete``. pyiceberg's expiry clears the
    ``append``'s parent id, and that snapshot holds just the files it added: it looks like a
    root, the history seems whole, and the pipeline's snapshot (kept by the branch) seems
    rolled back; the replay committed its rows a second time (I1). The sequence number kept
    with the pipeline's snapshot tells the history begins after it: no rollback."""
    machine = CommitPath()
    with inline_executor():
        machine.configure(branch="main", key_type="long", bounded=False, compact=())
        machine.batch(Shape(writer=0, rows=2, tasks=1, dead=0, changes={}))
        machine.commit_cycle(fail_deletes=False, unknown=None)
        machine.foreign_ref(tag=False)
        machine.foreign_rewrite(keyed=False)
        machine.foreign_expire(keyed=False, pick=0)
        machine.batch(Shape(writer=0, rows=1, tasks=1, dead=0, changes={}))
        machine.teardown()


def test_another_engine_expiring_its_rewrites_delete_alone_blocks_nothing() -> None:
    """Found by the 40-rule set (``--schedules 100 --seed 24100 --steps 40``): an upsert
    committed to the keyed table, another engine's rewrite of it (a ``delete`` of every file,
    then an ``append`` of the same rows), and its expiry of that ``delete`` alone (the
    pipeline's snapshot stays), then a batch deleting the key. Nothing in the table's current
    metadata links the head to the pipeline's snapshot: pyiceberg's expiry clears the
    ``append``'s parent, the pipeline's data file was rewritten, and the snapshot still
    exists, so it could be a rollback onto another line; the committer refused the table for
    good (``RollbackNotReplayableError``, I4: ``{'db.keyed': 1}`` pending). The metadata
    files the metadata log names still hold the expired ``delete`` and its parent: the walk
    goes on there and finds the pipeline's snapshot."""
    machine = CommitPath()
    with inline_executor():
        machine.configure(branch="main", key_type="long", bounded=False, compact=())
        shape = Shape(writer=0, rows=0, tasks=1, dead=0, changes={0: True})
        machine.foreign_commit_between(keyed=False, shape=shape, what="append")
        machine.foreign_rewrite(keyed=True)
        machine.foreign_expire(keyed=True, pick=1)
        machine.batch(Shape(writer=0, rows=0, tasks=1, dead=0, changes={0: False}))
        machine.teardown()


def _committed_then_rewritten(machine: CommitPath) -> None:
    """The start of the schedules below: a batch of five rows (and keyed changes) committed
    to the partitioned append table, then another engine's rewrite of it."""
    machine.configure(branch="main", key_type="long", bounded=True, compact=())
    machine.batch(Shape(writer=0, rows=5, tasks=2, dead=0, changes={0: True, 1: False}))
    machine.commit_cycle(fail_deletes=False, unknown="before")
    machine.foreign_rewrite(keyed=False)


def test_a_rollback_back_onto_rows_an_earlier_one_took_out_brings_them_back() -> None:
    """A defect of the model found by the 40-rule set (``--schedules 100 --seed 24000
    --steps 40``): a batch committed, another engine's rewrite, a rollback to the rewrite's
    ``delete`` (above the pipeline's snapshot: nothing to replay, the rows out), then a
    rollback to the pipeline's snapshot, which holds them: they are in the table again,
    once. The model had kept them as taken out by the first rollback."""
    machine = CommitPath()
    with inline_executor():
        _committed_then_rewritten(machine)
        machine.operator_rolls_back(dead=False, pick=0, replay=True)
        machine.operator_rolls_back(dead=False, pick=0, replay=True)
        machine.teardown()


def test_a_rollback_onto_a_rewrite_whose_link_an_expiry_cut_replays_nothing_it_holds() -> None:
    """Found by the 40-rule set (``--schedules 100 --seed 24000 --steps 40``, shrunk by hand):
    a batch committed, another engine's rewrite of the append table, its expiry of the
    rewrite's ``delete`` (pyiceberg clears the ``append``'s parent: nothing in the current
    metadata links it to the pipeline's snapshot), a batch of files announced again and
    committed by a drain, then a rollback to the rewrite's ``append``. The committer took the
    restored snapshot for one without any commit of the pipeline and replayed the source from
    its start: the rows the rewrite holds came twice (I1). The earlier metadata files link the
    ``append`` to the pipeline's snapshot, whose positions the replay now starts from."""
    machine = CommitPath()
    with inline_executor():
        _committed_then_rewritten(machine)
        machine.foreign_expire(keyed=False, pick=1)
        machine.reannounce(pick=0)
        machine.drain_and_swap(bounded=True)
        machine.operator_rolls_back(dead=False, pick=0, replay=True)
        shape = Shape(writer=2, rows=2, tasks=2, dead=0, changes={0: True, 4: False, 5: False})
        machine.foreign_commit_between(keyed=False, shape=shape, what="add_column")
        machine.teardown()


def test_a_keyed_batch_whose_key_file_was_applied_is_not_committed_again() -> None:
    """Found by the 40-rule set (``--schedules 100 --seed 24000 --steps 40``, shrunk by hand):
    an upsert committed to the keyed table, another engine's rewrite of it, a second upsert,
    ``icefloe maintain`` (expiring every snapshot it may and deleting the orphans: the first
    batch's data file and key file among them), then the first batch announced again under
    another writer id. Its key file was held as applied (the list keeps it until the next
    commit notices it is gone) and dropped, while its data file, which nothing held any
    longer and whose existence nothing checks, was committed: a snapshot naming a deleted
    file (I2). A keyed batch whose key file the table holds as applied is now dropped whole."""
    machine = CommitPath()
    with inline_executor(), sim_plugins():
        machine.configure(branch="main", key_type="long", bounded=True, compact=())
        shape = Shape(writer=0, rows=0, tasks=2, dead=0, changes={0: True})
        machine.foreign_commit_between(keyed=False, shape=shape, what="recreate")
        machine.batch(Shape(writer=0, rows=0, tasks=1, dead=0, changes={0: True, 1: True, 2: True}))
        machine.foreign_rewrite(keyed=True)
        machine.crash_in_compaction(when="during")
        machine.maintain(expire=True)
        machine.reannounce(pick=0)
        machine.teardown()


def test_a_copy_of_a_row_awaiting_a_replay_when_its_table_was_dropped_may_be_quarantined() -> None:
    """A defect of the model found by the 40-rule set (``--schedules 100 --seed 24000 --steps
    40``, shrunk by hand): rows a rollback took out for a replay, then the table dropped and
    created again, then the batch announced again: its copy names the old table and is
    quarantined, as a copy of any row a rollback took out of the dropped table is. The model
    counted rows awaiting the replay as taken out only after it listed those allowed there."""
    machine = CommitPath()
    with inline_executor():
        machine.configure(branch="main", key_type="long", bounded=True, compact=())
        machine.batch(Shape(writer=2, rows=4, tasks=2, dead=0, changes={3: True}))
        machine.crash_in_compaction(when="after")
        machine.foreign_recreate(dead=False, partitioned=True)
        rewrite = Shape(writer=1, rows=5, tasks=1, dead=1, changes={})
        machine.foreign_commit_between(keyed=False, shape=rewrite, what="rewrite")
        append = Shape(writer=0, rows=1, tasks=2, dead=1, changes={})
        machine.foreign_commit_between(keyed=False, shape=append, what="append")
        machine.operator_rolls_back(dead=False, pick=17011, replay=True)
        machine.misplaced_batch(rows=1)
        machine.foreign_recreate(dead=False, partitioned=False)
        machine.reannounce(pick=2586)
        machine.teardown()


def test_a_rollback_whose_restored_snapshot_only_earlier_metadata_holds() -> None:
    """Found by the 40-rule set (``--schedules 100 --seed 24300 --steps 40``, shrunk by hand):
    a batch whose cycle has another engine's rewrite in between, another rewrite, the
    pipeline's snapshot and the rewrite's ``delete`` expired, a batch, then a rollback with
    replay. The restored state is the pipeline's snapshot the earlier metadata files link the
    head to, expired in the current metadata; the model read that snapshot's rows with a scan
    of the current table and failed (``Snapshot not found``). It reads them from the earlier
    metadata file that holds the snapshot."""
    machine = CommitPath()
    with inline_executor():
        machine.configure(branch="main", key_type="long", bounded=False, compact=())
        first = Shape(writer=0, rows=5, tasks=1, dead=0, changes={})
        machine.foreign_commit_between(keyed=False, shape=first, what="rewrite")
        machine.foreign_rewrite(keyed=False)
        machine.foreign_expire(keyed=False, pick=0)
        machine.foreign_expire(keyed=False, pick=0)
        second = Shape(writer=0, rows=1, tasks=1, dead=0, changes={})
        machine.foreign_commit_between(keyed=False, shape=second, what="append")
        machine.operator_rolls_back(dead=False, pick=0, replay=True)
        machine.teardown()


def test_the_model_tells_untraceable_files_apart_by_table() -> None:
    """A defect of this session's model allowance for invariant 1's limit, found by the
    40-rule set (``--schedules 100 --seed 24600 --steps 40``, shrunk by hand): an expiry of
    the keyed table listed its files as untraceable, and the append table's check then read
    their time-typed keys as ids (``TypeError``). Untraceable files are kept per table."""
    machine = CommitPath()
    with inline_executor():
        machine.configure(branch="main", key_type="time", bounded=False, compact=())
        keyed = Shape(writer=0, rows=0, tasks=1, dead=0, changes={0: False, 1: False, 2: True})
        machine.foreign_commit_between(keyed=False, shape=keyed, what="append")
        machine.foreign_rewrite(keyed=True)
        machine.foreign_expire(keyed=True, pick=34001)
        machine.reannounce(pick=201)
        machine.teardown()


def test_a_refused_replay_leaves_a_quarantined_record_in_one_place() -> None:
    """Found by the 40-rule search (``--schedules 250 --seed 24700 --steps 40``, shrunk by
    hand from 30 rules): a batch quarantined (its file outside the table's location), a batch
    committed with another engine's append between its screening and its commit, a rollback to
    that engine's snapshot with replay, the driver's replay (the quarantined batch's record
    among the range's), a partition-spec change. The replay's files, of the old spec, are
    refused whole and quarantined, the rollback accepted; the first entry stayed, so the
    record was in quarantine twice (I1), and recovering both with ``add_files`` adds it
    twice. The entries of the range's quarantined files are now retired before the refused
    replay is, as before a replay's commit."""
    machine = CommitPath()
    with inline_executor(), sim_plugins():
        machine.configure(branch="main", key_type="long", bounded=False, compact=())
        machine.misplaced_batch(rows=1)
        shape = Shape(writer=0, rows=4, tasks=1, dead=0, changes={})
        machine.foreign_commit_between(keyed=False, shape=shape, what="append")
        machine.operator_rolls_back(dead=False, pick=0, replay=True)
        machine.driver_replays(dead=False)
        machine.foreign_repartition(keyed=False)
        machine.teardown()


def test_a_replay_into_a_table_recreated_under_the_leader_is_committed_or_quarantined() -> None:
    """Found by the 40-rule search (``--schedules 250 --seed 25002 --steps 40``, shrunk by
    hand from eight rules): a batch, drain and swap, a leader of the new channel commits
    (reading what the table holds), another engine drops the table and creates it again, the
    writer publishes its first batch again (the new channel never saw it), and the same leader
    reads it. The leader skipped it as held by the dropped table: its row in neither the new
    table nor quarantine (I1). A file written for another table UUID than the held state was
    read from now makes the leader read that state again."""
    machine = CommitPath()
    with inline_executor(), sim_plugins():
        machine.configure(branch="main", key_type="long", bounded=False, compact=())
        machine.batch(shape=Shape(writer=1, rows=1, tasks=1, dead=0, changes={}))
        machine.drain_and_swap(bounded=False)
        machine.batch(shape=Shape(writer=0, rows=1, tasks=1, dead=0, changes={}))
        machine.commit_cycle(unknown=None, fail_deletes=False)
        machine.foreign_recreate(dead=False, partitioned=False)
        machine.replayed_batch(tasks=1, writer=1)
        machine.commit_cycle(unknown=None, fail_deletes=False)
        machine.teardown()


def test_a_deposed_leaders_quarantine_entry_is_fenced_out() -> None:
    """Found by the 40-rule search (``--seed 25004 --steps 40``, shrunk by greedy step
    removal): a keyed batch, a partition-spec change, a zombie cycle: the deposed leader
    resumed after its heir had recovered and quarantined the batch (old spec); the spec
    changed back and the heir, whose pending files and quarantine view predated that entry,
    committed it. The batch was in the table and in quarantine (I3), and recovering the entry
    with ``add_files`` doubles it. A leader now raises a fence in the quarantine table before
    it reads anything, and quarantine writes carry the writer's token: the zombie's is
    refused (it ends its leadership), as a table commit is."""
    machine = CommitPath()
    with inline_executor(), sim_plugins():
        machine.configure(branch="main", key_type="long", bounded=False, compact=())
        machine.batch(shape=Shape(writer=2, rows=0, tasks=2, dead=1, changes={}))
        keyed = Shape(writer=0, rows=0, tasks=2, dead=1, changes={1: False, 0: False, 2: True})
        machine.batch(shape=keyed)
        machine.foreign_repartition(keyed=True)
        machine.zombie_cycle(heir_commits=False)
        machine.foreign_repartition(keyed=True)
        machine.zombie_cycle(heir_commits=False)
        machine.teardown()


def test_a_replay_made_for_a_dropped_tables_rollback_is_not_quarantined_beside_a_copy() -> None:
    """Found by the 40-rule set (``--schedules 250 --seed 24000 --steps 40``, once the zombie
    rule drew whether the old leader's round runs on committers; shrunk by Hypothesis): a
    batch committed to the table's own branch, a rollback with replay, the driver's replay
    published, the batch's file announced again under another writer id, another engine
    drops the table and creates it again. Both files name the dropped table and were
    quarantined: the row in quarantine twice (I1), and recovering both entries adds it twice.
    A replay made for no rollback the table waits for is dropped by the commit; screening now
    holds it too instead of refusing it."""
    machine = CommitPath()
    with inline_executor(), sim_plugins():
        machine.configure(branch="audit", key_type="long", bounded=False, compact=())
        machine.batch(shape=Shape(writer=0, rows=1, tasks=1, dead=0, changes={}))
        machine.commit_cycle(unknown=None, fail_deletes=False)
        machine.operator_rolls_back(dead=False, pick=0, replay=True)
        machine.driver_replays(dead=False)
        machine.reannounce(pick=0)
        machine.foreign_recreate(dead=False, partitioned=False)
        machine.batch(shape=Shape(writer=0, rows=0, tasks=1, dead=0, changes={}))
        machine.teardown()


def test_a_file_announced_again_after_a_compaction_crash_and_maintain_is_not_committed_again() -> (
    None
):
    """Found by the 40-rule search (``--schedules 250 --seed 24700 --steps 40``, once the
    refused-replay defect above was fixed; shrunk by greedy step removal from 17 rules): a
    batch of one row, a cycle with another engine's append between its screening and its
    commit (a compaction round follows), a batch of three rows, a cycle whose compaction round
    dies with its new files written, the first batch's file announced again under a new
    writer id, ``icefloe maintain`` with expiry. The settling cycles committed the file again:
    its row was in the table twice (I1). The crash is incidental: any commit of the pipeline
    above the compaction's ``replace`` let ``maintain`` expire it; the commit now lists what the
    ``replace`` took off (docs/reliability.md)."""
    machine = CommitPath()
    with inline_executor(), sim_plugins():
        machine.configure(branch="main", key_type="long", bounded=False, compact=(ROWS, KEYED))
        machine.batch(Shape(writer=0, rows=1, tasks=1, dead=0, changes={}))
        empty = Shape(writer=0, rows=0, tasks=1, dead=0, changes={})
        machine.foreign_commit_between(keyed=False, shape=empty, what="append")
        machine.batch(Shape(writer=0, rows=3, tasks=1, dead=0, changes={}))
        machine.crash_in_compaction(when="during")
        machine.reannounce(pick=0)
        machine.maintain(expire=True)
        machine.teardown()


def test_a_replay_commits_after_another_engine_expired_the_restored_snapshot() -> None:
    """Found by the 40-rule search (``--schedules 250 --seed 24704 --steps 40``, shrunk by
    greedy step removal from 34 rules): a rollback of the append table to another engine's
    snapshot (the ``delete`` of its rewrite) restored the pipeline's snapshot below it; the
    driver published the replay; another engine then expired that restored snapshot. The
    committer refused the pending rollback as not replayable (the branch's history stopped
    above it), so the replay never committed and the operator's way out, accepting the
    rollback, lost its row. The earlier metadata files still link the head to the restored
    snapshot: the same rollback is found and the replay commits. (The model also counted the
    rows of a published replay wrongly when a rollback is accepted: they now stay out.)"""
    machine = CommitPath()
    with inline_executor(), sim_plugins():
        machine.configure(branch="main", key_type="long", bounded=True, compact=())
        machine.foreign_append(keyed=False, rows=2)
        changes = {0: False, 1: False, 2: True}
        machine.batch(Shape(writer=0, rows=0, tasks=1, dead=1, changes=changes))
        one = Shape(writer=0, rows=1, tasks=1, dead=0, changes={})
        machine.foreign_commit_between(keyed=True, shape=one, what="append")
        machine.foreign_ref(tag=False)
        machine.drain_and_swap(bounded=True)
        machine.foreign_append(keyed=False, rows=3)
        machine.foreign_rewrite(keyed=False)
        two = Shape(writer=0, rows=1, tasks=2, dead=0, changes={})
        machine.foreign_commit_between(keyed=True, shape=two, what="append")
        machine.operator_rolls_back(dead=False, pick=131, replay=True)
        machine.driver_replays(dead=False)
        machine.foreign_expire(keyed=False, pick=0)
        machine.teardown()


def test_a_rollback_restoring_a_snapshot_whose_manifest_list_maintain_deleted() -> None:
    """Found by the 40-rule search (``--schedules 500 --seed 25306 --steps 40``; shrunk by
    greedy step removal from 23 rules): a batch committed, another engine appends and then
    expires the pipeline's snapshot, ``icefloe maintain`` (orphans only) deletes that
    snapshot's manifest list (rightly: the current metadata no longer names it), a batch
    committed, a rollback with replay to the other engine's append. The committer found the
    restored snapshot in an earlier metadata file and needed only its summary; the model read
    its rows there and failed with ``FileNotFoundError`` for the manifest list. A defect of
    the model: it now remembers the rows of the pipeline's snapshots before an expiry or
    ``maintain`` (:meth:`World.remember`)."""
    machine = CommitPath()
    with inline_executor(), sim_plugins():
        machine.configure(branch="main", key_type="long", bounded=False, compact=())
        machine.batch(Shape(writer=0, rows=2, tasks=1, dead=0, changes={}))
        machine.commit_cycle(unknown=None, fail_deletes=False)
        machine.foreign_append(keyed=False, rows=1)
        machine.foreign_expire(keyed=False, pick=0)
        machine.maintain(expire=False)
        machine.batch(Shape(writer=0, rows=4, tasks=1, dead=0, changes={}))
        machine.commit_cycle(unknown=None, fail_deletes=False)
        machine.operator_rolls_back(dead=False, pick=0, replay=True)
        machine.teardown()


@pytest.mark.parametrize("repartition", [False, True])
def test_a_file_whose_compaction_another_engine_expired_is_held_by_the_manifest_left(
    repartition: bool,
) -> None:
    """Found by the 40-rule search (``--schedules 100 --seed 25414 --steps 40``, I1
    ``{2: ('w0#1', 1, 1)}``; shrunk by greedy step removal and by hand): a batch committed,
    the pipeline's compaction rewriting its file with another engine's (a ``replace``),
    that engine's rewrite of the table (a ``delete``, then an ``append``), its expiry of the
    ``replace`` by id, (a partition-spec change,) the batch's file announced again. The
    ``delete`` still lists the manifest the ``replace`` wrote, whose DELETED entries name the
    file, but the dedupe rule read only the manifests a snapshot wrote itself: the file was
    committed again (``{1: ('w0#0', 2, 0)}``) or, under the new spec, quarantined beside the
    rewritten row (``{1: ('w0#0', 1, 1)}``). ``LiveFiles.held`` now also reads the manifests
    an expired ancestor wrote that the walk's oldest snapshot lists."""
    machine = CommitPath()
    with inline_executor(), sim_plugins():
        machine.configure(branch="main", key_type="long", bounded=False, compact=(ROWS,))
        machine.foreign_append(keyed=False, rows=2)
        machine.batch(Shape(writer=0, rows=1, tasks=1, dead=0, changes={}))
        machine.commit_cycle(unknown=None, fail_deletes=False)
        machine.foreign_rewrite(keyed=False)
        machine.foreign_expire(keyed=False, pick=2)  # the compaction's replace
        if repartition:
            machine.foreign_repartition(keyed=False)
        machine.reannounce(pick=0)
        machine.teardown()


def test_a_retired_quarantined_file_announced_again_stays_out() -> None:
    """Found by the 40-rule search (``--schedules 250 --seed 24700 --steps 40``, after the
    compaction fix above; shrunk by greedy step removal to twelve rules): batches quarantined
    (their files outside the table's location), a rollback with replay, the driver's replay,
    which reads the quarantined batches' records again and retires their entries when it
    commits, then one of those quarantined files announced again under a new writer id. The
    entry was deleted, so nothing knew the file: it was quarantined a second time while the
    replay had committed its records (I1: in the table and in quarantine). A retired entry is
    now kept as a tombstone (``icefloe.commit.quarantine.RETIRED``): the coordinator still
    knows the path, the operator's list leaves it out."""
    machine = CommitPath()
    with inline_executor(), sim_plugins():
        machine.configure(branch="main", key_type="long", bounded=False, compact=(ROWS, KEYED))
        machine.misplaced_batch(rows=3)
        changes = {0: False, 1: True}
        machine.batch(Shape(writer=0, rows=5, tasks=1, dead=0, changes=changes))
        machine.crash_in_compaction(when="during")
        machine.misplaced_batch(rows=2)
        shape = Shape(writer=0, rows=4, tasks=2, dead=0, changes={0: False, 3: False, 4: False})
        machine.foreign_commit_between(keyed=True, shape=shape, what="append")
        machine.misplaced_batch(rows=2)
        machine.operator_rolls_back(dead=False, pick=5907, replay=True)
        later = Shape(writer=0, rows=4, tasks=2, dead=0, changes={4: False, 2: False, 3: False})
        machine.batch(later)
        machine.zombie_cycle(heir_commits=False)
        machine.driver_replays(dead=False)
        machine.reannounce(pick=13883)
        machine.commit_cycle(fail_deletes=False, unknown="after")
        machine.teardown()


def _batch_run_again_into_a_recreated_table(machine: CommitPath) -> None:
    """Seed 24730's schedule up to its settling cycles: batch ``w2#0`` committed (one of its
    two files merged with ``w0#0``'s row and deleted), a drain and swap, ``w2#0``'s files
    announced again under a new writer id (``r2``) with the table's uuid, another engine
    dropping the table and creating it again, the Spark batch ``w2#0`` run again in new
    files written for the new table."""
    empty = Shape(writer=0, rows=0, tasks=1, dead=0, changes={})
    machine.configure(branch="main", key_type="long", bounded=False, compact=())
    machine.batch(Shape(writer=0, rows=1, tasks=1, dead=0, changes={}))
    machine.batch(empty)
    machine.batch(empty)
    shape = Shape(writer=2, rows=5, tasks=1, dead=0, changes={})
    machine.foreign_commit_between(keyed=False, shape=shape, what="append")
    for _ in range(4):
        machine.batch(empty)
    machine.crash_in_compaction(when="during")
    machine.drain_and_swap(bounded=False)
    machine.misplaced_batch(rows=1)
    machine.reannounce(pick=18966)
    machine.batch(empty)
    machine.foreign_recreate(dead=False, partitioned=False)
    machine.replayed_batch(tasks=1, writer=2)
    machine.batch(empty)


def test_a_batch_run_again_into_a_recreated_table_leaves_the_dropped_tables_copy_quarantined() -> (
    None
):
    """Found by the 40-rule search (``--schedules 250 --seed 24730 --steps 40``, shrunk by
    Hypothesis to these rules); a defect of the model, not of the product. The rows of batch
    ``w2#0`` end in the new table once (the batch run again, written for it) and in quarantine
    once: the copy ``r2`` announced of the file the dropped table had committed, refused with
    ``TableMismatchError``. Only the dropped table knew it took those rows, so the coordinator
    cannot tell that copy from a file of the dropped table never committed (whose rows
    quarantine must keep); the model now accepts exactly this (``revived_beside_stale_copy``,
    whose docstring says why it hides no defect; the two tests below plant defects it must
    still catch)."""
    machine = CommitPath()
    with inline_executor(), sim_plugins():
        _batch_run_again_into_a_recreated_table(machine)
        machine.teardown()


def _quarantined_copy_named_for_the_new_table(machine: CommitPath) -> None:
    """A planted defect: the quarantined copy names the table it was refused from."""
    table = machine.catalog.load_table(ROWS)
    quarantine = Quarantine(machine.catalog)
    for e in quarantine.list(GROUP, ROWS):
        if e.writer_id.startswith("r"):
            quarantine.drop(GROUP, ROWS, e.file_path)
            quarantine.add([replace(e, table_uuid=str(table.metadata.table_uuid))])


def _quarantined_copy_added_to_the_table(machine: CommitPath) -> None:
    """A planted defect: the quarantined copy (that still exists) is committed to the new
    table beside the batch run again, as an operator's ``add_files`` would."""
    paths = [
        e.file_path
        for e in Quarantine(machine.catalog).list(GROUP, ROWS)
        if e.writer_id.startswith("r") and os.path.exists(local(e.file_path))
    ]
    machine.catalog.load_table(ROWS).add_files(paths, check_duplicate_files=False)


def _planted_breaks_i1(
    schedule: Callable[[CommitPath], None], plant: Callable[[CommitPath], None]
) -> None:
    """Run ``schedule``, settle, plant a defect and check that I1 catches it."""
    machine = CommitPath()
    with inline_executor(), sim_plugins():
        schedule(machine)
        machine.faults.calm()
        machine.settle()
        plant(machine)
        try:
            with pytest.raises(InvariantError, match=r"I1: db\.rows"):
                machine.check()
        finally:
            machine.close()


@pytest.mark.parametrize(
    "plant", [_quarantined_copy_named_for_the_new_table, _quarantined_copy_added_to_the_table]
)
def test_the_models_allowance_for_a_dropped_tables_copy_still_catches(
    plant: Callable[[CommitPath], None],
) -> None:
    """The allowance above accepts a row in the table once beside one quarantined copy
    written for a dropped table, nothing wider: the same schedule with that copy naming the
    current table, or with it committed too, breaks I1."""
    _planted_breaks_i1(_batch_run_again_into_a_recreated_table, plant)


def _batch_run_again_before_its_table_was_dropped(machine: CommitPath) -> None:
    """Seed 25420's schedule (40 rules, shrunk by greedy step removal) up to its settling
    cycles: batch ``w1#0`` committed by the drain before a swap, the Spark batch ``w1#0`` run
    again in new files written for the table that holds it, on the new channel, ``w1#0``'s
    files announced again under a new writer id (``r3``), another engine dropping the table
    and creating it again before a cycle read either."""
    machine.configure(branch="main", key_type="long", bounded=False, compact=(ROWS,))
    keyed = Shape(writer=0, rows=0, tasks=2, dead=1, changes={0: True})
    machine.foreign_commit_between(keyed=True, shape=keyed, what="append")
    machine.batch(Shape(writer=1, rows=2, tasks=2, dead=0, changes={}))
    machine.batch(Shape(writer=0, rows=0, tasks=2, dead=0, changes={0: True, 1: False, 2: True}))
    machine.drain_and_swap(bounded=True)
    keyed = Shape(writer=0, rows=0, tasks=2, dead=0, changes={0: False, 1: True, 2: False})
    machine.foreign_commit_between(keyed=True, shape=keyed, what="append")
    machine.replayed_batch(tasks=1, writer=1)
    machine.batch(Shape(writer=0, rows=0, tasks=2, dead=0, changes={}))
    machine.reannounce(pick=65536)
    machine.foreign_recreate(dead=False, partitioned=True)


def test_a_batch_run_again_before_its_table_was_dropped_is_quarantined_beside_a_copy() -> None:
    """Found by the 40-rule search (``--schedules 100 --seed 25420 --steps 40``); a defect of
    the model, not of the product. The rows of ``w1#0`` are in no table (the dropped one held
    them) and in quarantine twice: the batch run again and ``r3``'s copy, both written for the
    dropped table and refused with ``TableMismatchError``. Nothing left ties either to the
    dropped table's rows or to each other, so the coordinator keeps both; the model now
    accepts exactly this (``rerun_beside_stale_copy``)."""
    machine = CommitPath()
    with inline_executor(), sim_plugins():
        _batch_run_again_before_its_table_was_dropped(machine)
        machine.teardown()


def _two_stale_copies_neither_run_again(machine: CommitPath) -> None:
    """A planted defect: the two refused copies are of a kind the coordinator can tie (as a
    replay made for no rollback of the table is, ``IcebergCommitter._stale_replays``)."""
    machine.reruns.clear()


@pytest.mark.parametrize(
    "plant", [_quarantined_copy_named_for_the_new_table, _two_stale_copies_neither_run_again]
)
def test_the_models_allowance_for_a_rerun_beside_a_copy_still_catches(
    plant: Callable[[CommitPath], None],
) -> None:
    """The allowance above accepts two stale copies of a dropped table's row, one of them a
    batch run again, nothing wider: the copy naming the current table, or two copies neither
    of which a writer ran again, break I1."""
    _planted_breaks_i1(_batch_run_again_before_its_table_was_dropped, plant)


def _checked_then(
    schedule: Callable[[CommitPath], None], read: Callable[[CommitPath], _Read]
) -> _Read:
    """Run ``schedule``, settle and check every invariant as a teardown does; what
    ``read`` finds in the settled machine (its quarantine, its tables) before it closes."""
    machine = CommitPath()
    with inline_executor(), sim_plugins():
        schedule(machine)
        machine.faults.calm()
        machine.settle()
        try:
            machine.check()
            return read(machine)
        finally:
            machine.close()


def _replay_announced_again_after_a_recreate(machine: CommitPath) -> None:
    """Seed 25645's schedule (40 rules, shrunk by Hypothesis): batch ``w0#0`` committed on
    branch ``audit``, rolled back with replay, the replay committed by a drain, another engine
    dropping the table and creating it again, the replay's files announced again under a new
    writer id."""
    empty = Shape(writer=0, rows=0, tasks=1, dead=0, changes={})
    machine.configure(branch="audit", compact=(), bounded=False, key_type="long")
    machine.batch(Shape(writer=0, rows=1, tasks=1, dead=0, changes={}))
    machine.crash_in_compaction(when="during")
    machine.crash_in_compaction(when="during")
    machine.drain_and_swap(bounded=False)
    machine.batch(empty)
    machine.operator_rolls_back(dead=False, pick=0, replay=True)
    machine.drain_and_swap(bounded=False)
    machine.batch(empty)
    machine.foreign_recreate(dead=False, partitioned=False)
    machine.batch(empty)
    machine.reannounce(pick=467)
    machine.batch(empty)


def test_a_replays_files_announced_again_after_a_recreate_stay_out_of_the_new_table() -> None:
    """Found by the 40-rule search (``--schedules 50 --seed 25645 --steps 40``); a defect of
    the model, not of the product. The model kept a rollback's replay batch without the uuid
    of the table it was written for, which the replay's publish carries, so ``reannounce``
    forged a copy of its files with no uuid: a file that names no table is committed to the
    table of that name (a third-party writer's may name none), here the one another engine
    created again, and row 1 landed there (``{1: ('w0#0', 1, 0)}``). With the uuid the copy
    is refused with ``TableMismatchError`` and quarantined, as any dropped table's file."""
    refused = _checked_then(
        _replay_announced_again_after_a_recreate,
        lambda machine: [
            (e.writer_id[0], e.error_type, file_ids(e.file_path))
            for e in Quarantine(machine.catalog).list(GROUP, ROWS)
        ],
    )
    assert refused == [("r", "TableMismatchError", [1])]


def _replay_reaching_back_before_a_recreate(machine: CommitPath) -> None:
    """Seed 25673's schedule (38 rules, shrunk by greedy step removal to these nine): batch
    ``w0#0`` (ids 1-5, two tasks) committed to the append table on branch ``audit``; another
    engine dropping and creating that table between a cycle's screening and its commit;
    keyed cycles; a batch committed to the new table; the operator rolling the new table back
    below the pipeline's first commit there, with replay; ``w0#0``'s files announced again
    under a new writer id (written for the dropped table)."""
    machine.configure(branch="audit", key_type="long", bounded=False, compact=())
    append = Shape(writer=0, rows=5, tasks=2, dead=0, changes={})
    machine.foreign_commit_between(keyed=False, shape=append, what="append")
    one = Shape(writer=0, rows=1, tasks=1, dead=0, changes={})
    machine.foreign_commit_between(keyed=False, shape=one, what="recreate")
    empty = Shape(writer=0, rows=0, tasks=1, dead=0, changes={})
    machine.foreign_commit_between(keyed=True, shape=empty, what="append")
    delete = Shape(writer=0, rows=0, tasks=2, dead=0, changes={0: False})
    machine.foreign_commit_between(keyed=True, shape=delete, what="append")
    two = Shape(writer=0, rows=2, tasks=2, dead=1, changes={})
    machine.foreign_commit_between(keyed=True, shape=two, what="repartition")
    machine.operator_rolls_back(dead=False, pick=175, replay=True)
    more = Shape(writer=2, rows=2, tasks=2, dead=1, changes={0: False, 5: False})
    machine.foreign_commit_between(keyed=True, shape=more, what="add_column")
    machine.reannounce(pick=1158)


def test_a_replay_reaching_back_before_a_recreate_leaves_the_dropped_tables_copy_quarantined() -> (
    None
):
    """Found by the 40-rule search (``--schedules 50 --seed 25673 --steps 40``); a defect of
    the model, not of the product. The new table's rollback goes back below the pipeline's
    first commit there, so its replay reads the source from the start again and writes
    ``w0#0``'s rows for the new table, as a source re-read after a recreate does. A copy of
    ``w0#0``'s files, announced under a new writer id and with no source offsets, names the
    dropped table: refused with ``TableMismatchError`` and quarantined. Nothing ties that
    copy to the replay (the replay retires the entries of its range's batches, found by
    their source offsets), so ids 3 and 5 were in the table and in quarantine once each,
    which the model allowed for a batch run again but not for a replay
    (``{3: ('w0#0', 1, 1), 5: ('w0#0', 1, 1)}``). It now allows both
    (``revived_beside_stale_copy``)."""

    def read(machine: CommitPath) -> tuple[list[int], list[int]]:
        copies = sorted(
            i
            for e in Quarantine(machine.catalog).list(GROUP, ROWS)
            if e.writer_id.startswith("r") and e.error_type == "TableMismatchError"
            if os.path.exists(local(e.file_path))  # a copy of a file that still exists
            for i in file_ids(e.file_path)
        )
        held = read_ref(machine.catalog.load_table(ROWS), "audit", ["id"])
        return copies, sorted(int(r[0]) for r in held)

    copies, held = _checked_then(_replay_reaching_back_before_a_recreate, read)
    assert copies == [3, 5]
    assert [held.count(i) for i in range(1, 6)] == [1] * 5  # w0#0's rows, by the replay


def _batch_run_again_between_two_recreates(machine: CommitPath) -> None:
    """Seed 25685's schedule (40 rules, shrunk by greedy step removal to these eight): batch
    ``w1#0`` (ids 1, 2) committed in a cycle that dies, another engine dropping the table and
    creating it again, ``w1#0``'s files announced again under a new writer id (``r1``), a
    drain and swap, the Spark batch ``w1#0`` run again in files written for the second
    table, and that table dropped and created again before a cycle read them."""
    machine.configure(branch="main", key_type="long", bounded=False, compact=())
    machine.batch(Shape(writer=1, rows=2, tasks=2, dead=1, changes={0: True}))
    machine.crash_in_cycle(fail_deletes=True, k=19)
    machine.foreign_recreate(dead=False, partitioned=False)
    machine.reannounce(pick=0)
    machine.drain_and_swap(bounded=False)
    machine.replayed_batch(tasks=1, writer=1)
    machine.foreign_recreate(dead=False, partitioned=False)


def test_a_batch_run_again_for_a_table_dropped_before_it_landed_is_quarantined_beside_a_copy() -> (
    None
):
    """Found by the 40-rule search (``--schedules 50 --seed 25685 --steps 40``); a defect of
    the model, not of the product. ``r1``'s copy names the first table, the batch run again
    names the second: both are refused with ``TableMismatchError`` and quarantined, so ids 1
    and 2 are in no table and in quarantine twice, as for seed 25420. The model allows that
    for rows a dropped table held (``rerun_beside_stale_copy``), but the batch run again had
    taken them out of ``dropped`` (it was bringing them back), and the second recreate did
    not put them back: ``{1: ('w1#0', 0, 2), 2: ('w1#0', 0, 2)}``. A recreate now drops the
    rows a batch run again was bringing back into the old table."""

    def read(machine: CommitPath) -> tuple[list[tuple[str, tuple[int, ...]]], list[Any]]:
        refused = sorted(
            (e.writer_id, tuple(file_ids(e.file_path)))
            for e in Quarantine(machine.catalog).list(GROUP, ROWS)
            if e.error_type == "TableMismatchError" and os.path.exists(local(e.file_path))
        )
        return refused, read_ref(machine.catalog.load_table(ROWS), "main", ["id"])

    refused, held = _checked_then(_batch_run_again_between_two_recreates, read)
    assert refused == [("r1", (1,)), ("r1", (2,)), ("w1", (1, 2))]
    assert [r for r in held if int(r[0]) > 0] == []
