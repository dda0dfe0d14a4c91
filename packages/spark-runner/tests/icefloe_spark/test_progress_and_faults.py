"""Progress arithmetic and the test-only fault hooks (inert unless switched on)."""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from icefloe.config import config_from_dict
from icefloe.testing.fixtures import (
    KEYED_ROWS_SCHEMA,
    commit_changes,
    make_sqlite_catalog,
    table_ids,
)
from icefloe_spark import faults
from icefloe_spark.cli.progress import Monitor, ProgressLog, QueryProgress, lag, render
from icefloe_spark.sink.publish import PublishStats


def test_lag_counts_what_the_table_has_not_recorded_yet() -> None:
    high = {("t", 0): 100, ("t", 1): 50, ("u", 0): 10}
    low = {("t", 0): 0, ("t", 1): 20, ("u", 0): 0}
    committed = {"t": {0: 90, 1: 50}}
    # t0: 10 behind; t1: caught up; u0: nothing committed, counted from the low watermark
    assert lag(high, committed, low) == 10 + 0 + 10
    assert lag(high, {}, low) == 100 + 30 + 10
    assert lag(high, {"t": {0: 120}}, low) == 0 + 30 + 10  # never negative


def test_query_progress_reads_sparks_report() -> None:
    assert QueryProgress.from_spark(None) == QueryProgress()
    got = QueryProgress.from_spark(
        {"batchId": 4, "numInputRows": 1000, "processedRowsPerSecond": 2500.5}
    )
    assert got == QueryProgress(4, 1000, 2500.5)


def test_on_the_ranges_path_the_batch_records_come_from_the_sink() -> None:
    """Spark's numInputRows counts the ranges there (one row per task), not records."""
    report = {"batchId": 7, "numInputRows": 3, "durationMs": {"triggerExecution": 2000}}
    assert QueryProgress.from_spark(report, records=300) == QueryProgress(7, 300, 150.0)
    assert QueryProgress.from_spark(report).input_rows == 3


def test_exit_after_publish_fires_only_for_its_batch() -> None:
    code = (
        "from icefloe_spark.faults import exit_after_publish\n"
        "exit_after_publish(2)\n"
        "print('survived 2', flush=True)\n"
        "exit_after_publish(3)\n"
        "print('survived 3', flush=True)\n"
    )
    env = {faults.EXIT_AFTER_PUBLISH_ENV: "3"}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**_base_env(), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == faults.EXIT_CODE
    assert proc.stdout.split("\n")[0] == "survived 2"
    assert "survived 3" not in proc.stdout
    off = subprocess.run([sys.executable, "-c", code], env=_base_env(), timeout=60)
    assert off.returncode == 0


def _base_env() -> dict[str, str]:
    import os

    ours = (faults.EXIT_AFTER_PUBLISH_ENV, faults.EXIT_AFTER_COMMIT_ENV)
    return {k: v for k, v in os.environ.items() if k not in ours}


def test_exit_after_commit_fires_after_the_nth_cycle_that_committed_a_table() -> None:
    """Cycles that committed nothing do not count; the exit comes after the Iceberg commits,
    inside the coordinator's own hook (before it stores the channel position)."""
    code = (
        "from icefloe.commit.request import TableCommitResult\n"
        "from icefloe.coordination.coordinator import CycleResult\n"
        "from icefloe_spark.faults import coordinator_hooks\n"
        "def cycle(snapshot):\n"
        "    r = TableCommitResult('t', 'c', snapshot, 1, 1, 0)\n"
        "    return CycleResult('c', True, None, (r,), {})\n"
        "hook = coordinator_hooks().after_iceberg_commits\n"
        "hook(cycle(1)); print('survived 1', flush=True)\n"
        "hook(cycle(None)); print('survived empty', flush=True)\n"
        "hook(cycle(2)); print('survived 2', flush=True)\n"
    )
    env = {**_base_env(), faults.EXIT_AFTER_COMMIT_ENV: "2"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == faults.EXIT_CODE, proc.stderr
    assert proc.stdout.splitlines() == ["survived 1", "survived empty"]


def test_no_coordinator_hooks_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(faults.EXIT_AFTER_COMMIT_ENV, raising=False)
    monkeypatch.delenv(faults.MARK_COMMITTERS_ENV, raising=False)
    assert faults.coordinator_hooks() is None


def test_committers_mark_themselves_right_before_a_catalog_commit(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The kill-commit-tasks fault scenario finds a committer in a commit by its mark; the
    hook travels to Spark's Python workers, so it must survive pickling."""
    monkeypatch.delenv(faults.EXIT_AFTER_COMMIT_ENV, raising=False)
    monkeypatch.setenv(faults.MARK_COMMITTERS_ENV, str(tmp_path))
    hooks = faults.coordinator_hooks()
    assert hooks is not None
    assert hooks.in_committer is not None
    hook = pickle.loads(pickle.dumps(hooks.in_committer))
    hook("after_commit", "db.t")
    assert list(tmp_path.iterdir()) == []
    hook("before_commit", "db.t")
    assert [p.name for p in tmp_path.iterdir()] == [str(os.getpid())]


def test_fail_task_hits_only_the_first_attempt_of_the_chosen_task(tmp_path: Path) -> None:
    spec = faults.parse_fail_task(
        json.dumps({"batch": 1, "partition": 0, "marker_dir": str(tmp_path)})
    )
    faults.fail_task_if_chosen(spec, 0, 0, 0, ["x"])  # other batch
    faults.fail_task_if_chosen(spec, 1, 1, 0, ["x"])  # other task
    faults.fail_task_if_chosen(spec, 1, 0, 1, ["x"])  # the retry
    assert not list(tmp_path.iterdir())
    with pytest.raises(faults.InjectedFaultError):
        faults.fail_task_if_chosen(spec, 1, 0, 0, ["file:///w/a.parquet"])
    marker = json.loads((tmp_path / "failed-1-0.json").read_text())
    assert marker["files"] == ["file:///w/a.parquet"]
    assert faults.parse_fail_task(None) is None
    with pytest.raises(ValueError, match="marker_dir"):
        faults.parse_fail_task('{"partition": 0}')


def test_source_options_from_the_command_line() -> None:
    from icefloe.errors import ConfigError
    from icefloe_spark.cli.commands import parse_options

    assert parse_options(["probeHighWatermark=true", "kafka.sasl.jaas=a=b"]) == {
        "probeHighWatermark": "true",
        "kafka.sasl.jaas": "a=b",
    }
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_options(["novalue"])


def test_reader_options_from_the_config_are_applied_last() -> None:
    from icefloe.config import config_from_dict
    from icefloe_spark.kafka.options import source_options

    config = config_from_dict(
        {
            "name": "p",
            "source": {
                "topics": ["a", "b"],
                "bootstrap_servers": "h:1",
                "max_records_per_batch": 10,
                "reader_options": {"probeHighWatermark": "true", "maxOffsetsPerTrigger": "5"},
            },
            "tables": [{"name": "db.t"}],
        }
    )
    opts = source_options(config)
    assert opts["subscribe"] == "a,b"
    assert opts["kafka.bootstrap.servers"] == "h:1"
    assert opts["probeHighWatermark"] == "true"
    assert opts["maxOffsetsPerTrigger"] == "5"  # the explicit reader option wins
    assert opts["firstBatchRecords"] == "50000"  # source.first_batch_records' default
    assert "icefloe.catalog.name" not in opts  # catalog properties only for "table"


def test_live_view_shows_bad_record_counts_only_when_there_are_some() -> None:
    def shown(stats: PublishStats) -> str:
        console = Console(width=200, record=True, file=io.StringIO())
        console.print(render("p", QueryProgress(), stats, [], "leader"))
        return console.export_text()

    assert "bad records" not in shown(PublishStats(batches=1, records=10))
    text = shown(PublishStats(batches=2, records=10, skipped=3, dead_lettered=1_500))
    assert "bad records: 3 skipped, 1,500 dead-lettered" in text


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when the block ends


def test_progress_counts_live_rows_of_a_cdc_table(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 24 item 1: the progress log line, its ``rows`` field and the live view count
    records minus deleted rows, not every row of the data files."""
    sqlite_catalog = make_sqlite_catalog(tmp_path)
    sqlite_catalog.create_namespace("db")
    sqlite_catalog.create_table("db.cdc", KEYED_ROWS_SCHEMA)
    config = config_from_dict(
        {
            "name": "p",
            "source": {"bootstrap_servers": f"127.0.0.1:{closed_port()}", "topics": ["t"]},
            "tables": [{"name": "db.cdc"}],
        }
    )
    commit_changes(sqlite_catalog, "p", "db.cdc", upserts=range(10))
    monitor, progress = Monitor(config, sqlite_catalog), ProgressLog("p")
    progress.tables(monitor.tables(), PublishStats())  # the first read logs nothing
    commit_changes(sqlite_catalog, "p", "db.cdc", upserts=[3, 5, 20], batch_seq=1)
    commit_changes(sqlite_catalog, "p", "db.cdc", deletes=[7], batch_seq=2)
    assert len(table_ids(sqlite_catalog, "db.cdc")) == 10  # pyiceberg's scan applies deletes

    with caplog.at_level(logging.INFO, logger="icefloe.progress"):
        tables = monitor.tables()
        progress.tables(tables, PublishStats())
    monitor.close()

    (record,) = [r for r in caplog.records if getattr(r, "event", None) == "table_commit"]
    assert "10 rows (3 deleted)" in record.getMessage(), record.getMessage()
    assert (getattr(record, "rows", None), getattr(record, "deleted_rows", None)) == (10, 3)
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(render("p", QueryProgress(), PublishStats(), tables, "leader"))
    (row,) = [line for line in console.export_text().splitlines() if "db.cdc" in line]
    assert row.split()[1:3] == ["10", "(3"], row


def test_the_live_view_exports_the_lag_per_partition_and_status_does_not(tmp_path: Path) -> None:
    """``icefloe run`` sets the ``icefloe_source_lag`` gauge from the watermarks it read;
    status's monitor (``export_lag=False``) leaves it, and prometheus-client, alone."""
    from icefloe import metrics

    catalog = make_sqlite_catalog(tmp_path)
    catalog.create_namespace("db")
    catalog.create_table("db.lag", KEYED_ROWS_SCHEMA)
    config = config_from_dict(
        {"name": "p", "source": {"topics": ["t"]}, "tables": [{"name": "db.lag"}]}
    )
    commit_changes(catalog, "p", "db.lag", upserts=range(4))
    marks = ({("t", 0): 9, ("t", 1): 3}, {("t", 0): 0, ("t", 1): 0})

    quiet = Monitor(config, catalog, export_lag=False)
    [status] = quiet.tables_at(marks)
    assert metrics.SOURCE_LAG.labels("db.lag", "t", "0")._value.get() == 0.0
    [live] = Monitor(config, catalog).tables_at(marks)

    assert status.lag == live.lag == 12  # no source offsets recorded: counted from the low marks
    assert metrics.SOURCE_LAG.labels("db.lag", "t", "0")._value.get() == 9.0
    assert metrics.SOURCE_LAG.labels("db.lag", "t", "1")._value.get() == 3.0
