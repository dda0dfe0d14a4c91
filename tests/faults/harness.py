"""One fault run: a fresh topic, table, checkpoint and pipeline name on the shared servers, a
producer that keeps producing known keys while the pipeline runs, real ``icefloe run`` process
trees to break, and the final count of every key against the table."""

from __future__ import annotations

import json
import os
import random
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w
from pyiceberg.catalog import Catalog, load_catalog

from icefloe.testing.fixtures import EVENTS_SCHEMA, EVENTS_SPEC
from icefloe_spark.kafka.admin import create_topic, end_offsets, produce

from .count import Tally, Verdict, judge
from .procs import Tree

TABLE = "faults.events"
SCHEMA = EVENTS_SCHEMA
SPEC = EVENTS_SPEC
# Tansu's ListOffsets answers the last batch's base offset + 1: learn partition ends by fetching
SOURCE_OPTIONS = {"probeHighWatermark": "true", "pollTimeoutMs": "10000"}
LEASE_TTL_S = 3.0
POSTGRES_DSN = os.environ.get(
    "ICEFLOE_TEST_POSTGRES_DSN", "host=127.0.0.1 port=5432 user=postgres dbname=test"
)
REDIS_URL = os.environ.get("ICEFLOE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


class RunError(Exception):
    """The run could not do what its scenario asked (not a verdict on exactly-once)."""


@dataclass(frozen=True)
class Settings:
    records: int = 3000
    produce_s: float = 30.0
    catch_up_s: float = 900.0
    workdir: Path = Path(".")
    bootstrap: str = ""


@dataclass
class Run:
    """Everything one run owns; scenarios drive it through the methods below."""

    backend: str
    seed: int
    settings: Settings
    rng: random.Random = field(init=False)
    run_id: str = field(init=False)
    dir: Path = field(init=False)
    topic: str = field(init=False)
    faults: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    bad_values: list[bytes] = field(default_factory=list)
    keyed: bool = False  # the table is in upsert mode: every key written twice, last wins
    dead_lettered: int | None = None
    config: dict[str, Any] = field(init=False)
    trees: list[Tree] = field(default_factory=list)
    _producer: threading.Thread | None = None
    _produce_error: list[BaseException] = field(default_factory=list)
    _extra_tables: list[Tally] = field(default_factory=list)
    # the tables the pipeline writes, each with the ``kind`` routed to it (None: every record)
    routes: dict[str, str | None] = field(default_factory=lambda: {TABLE: None})

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.run_id = f"f{self.seed}-{uuid.uuid4().hex[:6]}"
        self.dir = self.settings.workdir / self.run_id
        self.dir.mkdir(parents=True)
        self.topic = f"faults-{self.run_id}"
        create_topic(self.settings.bootstrap, self.topic, 2)
        warehouse = self.dir / "iceberg"
        warehouse.mkdir()
        self.catalog_properties = {
            "type": "sql",
            "uri": f"sqlite:///{warehouse / 'catalog.db'}",
            "warehouse": f"file://{warehouse / 'warehouse'}",
        }
        self.catalog().create_namespace("faults")
        self.create_table()
        self.config = self._pipeline_dict()
        self.write_config()

    # -- setup ---------------------------------------------------------------------------

    def catalog(self) -> Catalog:
        return load_catalog("faults", **self.catalog_properties)

    def create_table(self, name: str = TABLE) -> None:
        self.catalog().create_table(name, schema=SCHEMA, partition_spec=SPEC)

    def route_by_kind(self) -> None:
        """Route each record by its ``kind`` to a table of its own (the run's table takes
        "a", two more tables "b" and "c"), so every commit cycle holds several tables."""
        self.routes = {TABLE: "a", f"{TABLE}_b": "b", f"{TABLE}_c": "c"}
        for name in list(self.routes)[1:]:
            self.create_table(name)
        self.config["tables"] = [
            {"name": name, "route_field": "kind", "route_values": [kind]}
            for name, kind in self.routes.items()
        ]
        self.write_config()

    def _pipeline_dict(self) -> dict[str, Any]:
        return {
            "name": f"faults-{self.run_id}",
            "source": {
                "bootstrap_servers": self.settings.bootstrap,
                "topics": [self.topic],
                "max_records_per_batch": 250,
            },
            "tables": [{"name": TABLE}],
            "catalog": {"name": "faults", "properties": self.catalog_properties},
            "coordination": {
                "backend": self.backend,
                "commit_interval_s": 1.0,
                "commit_timeout_s": 5.0,
                "lease_ttl_s": LEASE_TTL_S,
                **backend_sections(self.settings.bootstrap),
            },
            "spark": {
                "master": "local[2]",
                "checkpoint_location": str(self.dir / "ckpt"),
                "trigger_interval_s": 0.2,
                "conf": {"spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "2"},
            },
        }

    @property
    def config_file(self) -> Path:
        return self.dir / "pipeline.toml"

    def write_config(self) -> None:
        self.config_file.write_text(tomli_w.dumps(self.config))

    # -- the source ----------------------------------------------------------------------

    def start_producer(self, bad: Callable[[int], bytes | None] | None = None) -> None:
        """Produce keys ``0..records-1`` in small chunks over ``produce_s`` seconds, in the
        background; ``bad(key)`` may replace a key's value by a bad record (kept in
        ``bad_values``; such a key is then not expected in the table)."""
        records, chunks = self.settings.records, 60
        pause = self.settings.produce_s / chunks

        def values(keys: range, version: int = 1) -> list[tuple[bytes | None, bytes]]:
            out: list[tuple[bytes | None, bytes]] = []
            for i in keys:
                value = bad(i) if bad is not None else None
                if value is None:
                    row = {"id": i, "name": expected_name(i, version), "kind": "abc"[i % 3]}
                    value = json.dumps(row).encode()
                else:
                    self.bad_values.append(value)
                out.append((str(i).encode(), value))
            return out

        def loop() -> None:
            try:
                step = -(-records // chunks)
                starts = range(0, records, step)
                for start in starts:
                    batch = values(range(start, min(start + step, records)))
                    if self.keyed and start:  # the previous chunk's keys again, updated
                        batch += values(range(start - step, start), version=2)
                    produce(self.settings.bootstrap, self.topic, batch)
                    time.sleep(pause)
                if self.keyed:
                    last = starts[-1]
                    produce(self.settings.bootstrap, self.topic, values(range(last, records), 2))
            except BaseException as exc:  # reported by wait_produced
                self._produce_error.append(exc)

        self._producer = threading.Thread(target=loop, name="faults-producer", daemon=True)
        self._producer.start()

    def producing(self) -> bool:
        """The producer started and has not finished."""
        return self._producer is not None and self._producer.is_alive()

    def wait_produced(self) -> None:
        if self._producer is not None:
            self._producer.join(self.settings.produce_s * 10 + 60)
            if self._producer.is_alive():
                raise RunError("the producer did not finish")
        if self._produce_error:
            raise RunError(f"producing failed: {self._produce_error[0]}")

    def expected_keys(self) -> set[int]:
        bad = {json_key(v) for v in self.bad_values}
        return set(range(self.settings.records)) - bad

    # -- processes -----------------------------------------------------------------------

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("ICEFLOE_TEST_")}
        return {**base, "PYSPARK_PYTHON": sys.executable, **(extra or {})}

    def start_pipeline(
        self, env: dict[str, str] | None = None, *, no_coordinator: bool = False
    ) -> Tree:
        argv = [sys.executable, "-m", "icefloe", "run", "--config", str(self.config_file), "-q"]
        argv += ["--log-level", "INFO"]
        argv += [a for k, v in SOURCE_OPTIONS.items() for a in ("--source-option", f"{k}={v}")]
        if no_coordinator:
            argv.append("--no-coordinator")
        tree = Tree(argv, self.dir / "driver.log", self.env(env), self.run_id)
        self.trees.append(tree)
        return tree

    def start_coordinator(self, name: str) -> Tree:
        argv = [sys.executable, "-m", "icefloe", "coordinator", "--config", str(self.config_file)]
        tree = Tree([*argv, "--id", name], self.dir / f"{name}.log", self.env(), self.run_id)
        self.trees.append(tree)
        return tree

    def kill(self, tree: Tree, kind: str) -> None:
        """``kill -9`` of the whole tree, counted as a fault of ``kind``."""
        tree.kill()
        self.faults.append(kind)

    def wait_exit(self, tree: Tree, timeout: float) -> int | None:
        """Wait for the tree's root to exit by itself; its code (None: still running)."""
        deadline = time.monotonic() + timeout
        while tree.alive() and time.monotonic() < deadline:
            time.sleep(0.5)
        return tree.proc.poll()

    def kill_all(self) -> None:
        for tree in self.trees:
            tree.kill()

    def log_tail(self, name: str = "driver.log", chars: int = 2000) -> str:
        path = self.dir / name
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    # -- progress ------------------------------------------------------------------------

    def committed_offsets(self) -> dict[str, int] | None:
        """The source offsets recorded by the pipeline's newest snapshot, the furthest of
        its tables' (for waiting only; the verdict never reads them)."""
        found: dict[str, int] | None = None
        catalog = self.catalog()
        for name in self.routes:
            table = catalog.load_table(name)
            for snapshot in reversed(table.snapshots()):
                props = snapshot.summary.additional_properties if snapshot.summary else {}
                if props.get("icefloe.group-id") == self.config["name"]:
                    raw = json.loads(props.get("icefloe.source-offsets", "{}"))
                    offsets = {str(p): int(o) for p, o in raw.get(self.topic, {}).items()}
                    found = found or {}
                    for p, o in offsets.items():
                        found[p] = max(found.get(p, o), o)
                    break
        return found

    def caught_up(self) -> bool:
        """The newest commit read to the topic's end. With several tables that is not
        enough (a table whose commit failed holds its files pending while the others carry
        the end): the tables' record counts must also reach the expected keys."""
        ends = {str(p): o for p, o in end_offsets(self.settings.bootstrap, self.topic).items()}
        if self.committed_offsets() != ends:
            return False
        if len(self.routes) == 1:
            return True
        total = 0
        catalog = self.catalog()
        for name in self.routes:
            snapshot = catalog.load_table(name).current_snapshot()
            if snapshot is not None and snapshot.summary is not None:
                total += int(snapshot.summary.get("total-records") or 0)
        return total >= len(self.expected_keys())

    def wait_for(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise RunError(f"timed out after {timeout:.0f}s waiting for {what}")
            time.sleep(1.0)

    def wait_query_started(self, tree: Tree, timeout: float = 600.0) -> None:
        """Until this tree's driver logged that its streaming query runs."""
        mark = f"pipeline {self.config['name']} started"

        def started() -> bool:
            if not tree.alive():
                raise RunError(f"the pipeline exited early:\n{self.log_tail()}")
            with open(tree.log, "rb") as log:
                log.seek(tree.log_offset)
                return mark.encode() in log.read()

        self.wait_for(started, timeout, "the streaming query to start")

    def wait_first_commit(self, tree: Tree, timeout: float = 600.0) -> None:
        def committed() -> bool:
            if not tree.alive():
                raise RunError(f"the pipeline exited early:\n{self.log_tail()}")
            return self.committed_offsets() is not None

        self.wait_for(committed, timeout, "the first commit")

    def finish(self, *, no_coordinator: bool = False, restarts: int = 3) -> None:
        """Run the pipeline (restarted if it dies) until the table has every produced record's
        offsets, then stop it cleanly."""
        self.wait_produced()
        for attempt in range(restarts + 1):
            tree = self.start_pipeline(no_coordinator=no_coordinator)
            deadline = time.monotonic() + self.settings.catch_up_s
            while time.monotonic() < deadline and tree.alive() and not self.caught_up():
                time.sleep(1.0)
            if tree.alive():
                tree.stop()
                if self.caught_up():
                    return
                raise RunError(f"not caught up after {self.settings.catch_up_s:.0f}s")
            self.notes.append(f"pipeline exited {tree.proc.poll()} while catching up ({attempt})")
            tree.kill()
        raise RunError(f"the pipeline kept dying:\n{self.log_tail()}")

    # -- verdict -------------------------------------------------------------------------

    def add_counted(self, tally: Tally) -> None:
        """Keys read from elsewhere (an old table, quarantine) that count toward the verdict."""
        self._extra_tables.append(tally)

    def verdict(self) -> Verdict:
        tally = Tally()
        catalog = self.catalog()
        for name, kind in self.routes.items():
            table = catalog.load_table(name)
            if self.keyed:
                tally.add_keyed_table(table, name, lambda key: expected_name(key, 2))
            else:
                tally.add_table(table, name, None if kind is None else kind_of(kind))
        for extra in self._extra_tables:
            tally.keys.update(extra.keys)
            tally.scanned_rows += extra.scanned_rows
            tally.problems.extend(extra.problems)
        return judge(tally, self.expected_keys())


def backend_sections(bootstrap: str) -> dict[str, Any]:
    """Every backend's section, so a run can switch ``coordination.backend`` alone."""
    return {
        "kafka": {"bootstrap_servers": bootstrap},
        "postgres": {"dsn": POSTGRES_DSN},
        "redis": {"url": REDIS_URL},
    }


def expected_name(key: int, version: int) -> str:
    """The ``name`` a produced record carries: its key, and on keyed runs its version."""
    return f"n{key}" if version == 1 else f"v{version}-{key}"


def kind_of(kind: str) -> Callable[[int], bool]:
    """Whether a key's record carries ``kind`` (the producer writes ``"abc"[key % 3]``)."""
    return lambda key: "abc"[key % 3] == kind


def json_key(value: bytes) -> int:
    """The key a bad record stood for (bad records carry ``"key": N`` somewhere readable)."""
    match = re.search(rb'"key":\s*(\d+)', value)
    if match is None:
        raise ValueError(f"bad record without a key marker: {value!r}")
    return int(match.group(1))
