"""`icefloe status` on a healthy pipeline imports only what reading state needs: no pandas,
no `pyarrow.dataset`, no Arrow or numpy at all (issue 24, item 8: status under 1 s). Before,
loading a table made pyiceberg pick `PyArrowFileIO`, whose module imports `pyarrow.dataset`
and with it pandas, and icefloe's committer imported its row-delta writer (numpy, Arrow),
about 0.5 s of CPU per run; then pyiceberg's `FsspecFileIO` imported fsspec, `requests` and
pyiceberg's REST catalog module (~0.08 s) to open local files, and every command imported
prometheus-client and rich (~0.05 s; status serves no metrics and prints plain lines). A
real pipeline: SQLite catalog, Redis backend, the Kafka source on the session's broker, two
committed batches and one published but not committed. Not a timed test: the modules are
the regression; the seconds are in docs/benchmarks.md.

Status asks the servers on threads while its main thread imports pyiceberg; what those
threads run must import no pyiceberg (two threads importing pyiceberg's modules at once can
fail on Python's import locks), which the last test checks in a fresh interpreter."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import tomli_w
from pyiceberg.catalog import Catalog

from icefloe.commit.quarantine import Quarantine
from icefloe.config import PipelineConfig, config_from_dict
from icefloe.ops.status import collect, render_lines
from icefloe.plugins.backends import open_backend
from icefloe.testing.cli import run_icefloe
from icefloe.testing.fixtures import (
    make_sqlite_catalog,
    quarantine_entry,
    sqlite_catalog_properties,
)
from icefloe.testing.harness import RowSource, commit_batches
from icefloe_kafka.embedded import EmbeddedKafkaBroker
from icefloe_spark.kafka.admin import create_topic

TABLE = "db.t"
#: What status must not import: pandas and Arrow's dataset reader (PyArrowFileIO's module),
#: Arrow itself and numpy (the writers' side: row deltas, compaction, data files)
#: and fsspec with requests and pyiceberg's REST catalog (pyiceberg's FsspecFileIO's module),
#: prometheus-client and rich (metrics and the live view of other commands)
HEAVY = (
    "pandas",
    "pyarrow.dataset",
    "pyiceberg.io.pyarrow",
    "pyarrow",
    "numpy",
    "pyiceberg.io.fsspec",
    "fsspec",
    "requests",
    "pyiceberg.catalog.rest",
    "prometheus_client",
    "rich",
)


@dataclasses.dataclass(frozen=True)
class Healthy:
    config: PipelineConfig
    path: Path
    catalog: Catalog


@pytest.fixture
def healthy(tmp_path: Path, kafka_broker: EmbeddedKafkaBroker) -> Healthy:
    topic = f"t-{uuid.uuid4().hex[:10]}"
    create_topic(kafka_broker.bootstrap_servers, topic, 2)
    group = f"status-imports-{uuid.uuid4().hex[:8]}"
    catalog = make_sqlite_catalog(tmp_path / "cat", "c")
    source = RowSource.create(catalog, [TABLE])
    raw = {
        "name": group,
        "source": {"bootstrap_servers": kafka_broker.bootstrap_servers, "topics": [topic]},
        "tables": [{"name": TABLE}],
        "catalog": {
            "name": "c",
            "properties": {"type": "sql", **sqlite_catalog_properties(tmp_path / "cat")},
        },
        "coordination": {"backend": "redis", "redis": {"url": "redis://127.0.0.1:6379"}},
    }
    config = config_from_dict(raw)
    backend = open_backend(config)
    try:  # batch 2 published, not committed: status reads the channel
        commit_batches(backend, catalog, group, source, [0, 1], pending=[2])
    finally:
        backend.close()
    path = tmp_path / "pipeline.toml"
    path.write_text(tomli_w.dumps(raw))
    return Healthy(config, path, catalog)


def test_status_imports_no_pandas_dataset_reader_arrow_or_numpy(healthy: Healthy) -> None:
    out = run_icefloe("status", "--config", str(healthy.path), env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    imported = set(re.findall(r"^import time:.*\|\s*(\S+)$", out.stderr, re.MULTILINE))
    assert "icefloe.ops.status" in imported  # the import report is there
    assert [m for m in HEAVY if m in imported] == []
    # what status says is unchanged: the committed rows, the uncommitted file, the lag
    line = next(x for x in out.stdout.splitlines() if x.startswith(f"  table {TABLE}:"))
    assert "(+10 rows, snapshot" in line, out.stdout
    assert ", 10 rows, lag 0, pending files 1 (" in line, out.stdout
    assert "quarantined files 0" in line, out.stdout


def test_status_counts_quarantined_files_through_its_own_file_io(healthy: Healthy) -> None:
    """The quarantine table is scanned (pyiceberg's Arrow reader over the fsspec FileIO)."""
    table = healthy.catalog.load_table(TABLE)
    path = f"{table.location()}/data/refused.parquet"
    Quarantine(healthy.catalog).add([quarantine_entry(healthy.config.name, TABLE, path)])

    status = collect(healthy.config)

    [t] = status.tables
    assert t.quarantined_files == 1
    assert (t.rows, t.pending_files) == (10, 1)
    assert "quarantined files 1" in "\n".join(render_lines(status))


#: In a fresh interpreter: what status runs on its threads (the backend's answers, the
#: source's watermarks), after importing what the main thread imports before starting them
THREADS_ONLY = """
import sys, tomllib
from icefloe.config import config_from_dict
from icefloe.ops.status import _read_backend
from icefloe.plugins.backends import open_backend
from icefloe_spark.kafka.admin import source_watermarks
config = config_from_dict(tomllib.load(open(sys.argv[1], "rb")))
backend = open_backend(config)
read = _read_backend(backend, config.name)
backend.close()
marks = source_watermarks(config.source, True)
assert read.error is None and read.records and marks is not None, (read, marks)
print(" ".join(sorted(m for m in sys.modules if m.startswith("pyiceberg"))))
"""


def test_what_status_runs_on_its_threads_imports_no_pyiceberg(healthy: Healthy) -> None:
    done = subprocess.run(
        [sys.executable, "-c", THREADS_ONLY, str(healthy.path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == []
