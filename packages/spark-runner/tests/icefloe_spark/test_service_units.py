"""Pure logic of running as a service: signal handling, Spark log summaries, failure
explanations, reader option checks (the real process tree is in test_service.py)."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import pytest

from icefloe.errors import ConfigError
from icefloe_spark.cli.commands import explain_failure
from icefloe_spark.kafka.options import check_reader_options
from icefloe_spark.runtime import sparklog
from icefloe_spark.runtime.signals import StopSignals


def test_first_signal_stops_second_forces() -> None:
    stop = threading.Event()
    forced: list[int] = []
    signals = StopSignals(stop, force=forced.append)
    signals.handler(signal.SIGTERM, None)
    assert stop.is_set()
    assert forced == []
    signals.handler(signal.SIGINT, None)
    assert forced == [signal.SIGINT]


def test_misspelt_reader_option_is_refused_with_a_suggestion() -> None:
    with pytest.raises(ConfigError) as info:
        check_reader_options({"probeHighWaterMark": "true"}, "source.reader_options")
    assert info.value.key == "source.reader_options"
    assert "did you mean 'probeHighWatermark'?" in str(info.value)
    check_reader_options(
        {"probeHighWatermark": "true", "failOnDataLoss": "false", "kafka.x": "1"}, "x"
    )


def test_failure_explanation_puts_the_icefloe_error_first() -> None:
    trace = "\n".join(
        [
            "[STREAM_FAILED] Query [id = 1] terminated with exception: Job aborted",
            "org.apache.spark.SparkException: Job aborted due to stage failure",
            *[f"\tat org.apache.spark.Some.method{i}(Some.scala:{i})" for i in range(300)],
            "pyspark.errors.exceptions.base.PySparkRuntimeError: worker failed",
            "Traceback (most recent call last):",
            '  File "x.py", line 1, in <module>',
            "icefloe.errors.RecordConversionError: record t[0]@5 field 'id': not a number",
            *[f"\tat java.Thread.run{i}(Thread.java:{i})" for i in range(200)],
        ]
    )
    first, fix, full = explain_failure(trace)
    assert first == "RecordConversionError: record t[0]@5 field 'id': not a number"
    assert "-v" in fix
    assert full == trace


def test_spark_log_summary_counts_and_groups(tmp_path: Path) -> None:
    log = tmp_path / "spark.log"
    lines = [
        f"25/11/23-19:00:{i:02d} WARN ProcessingTimeExecutor: Current batch is falling behind. "
        f"The trigger interval is 500 milliseconds, but spent {600 + i} milliseconds"
        for i in range(40)
    ]
    lines.append("25/11/23-19:01:00 ERROR Executor: Exception in task 0.0")
    lines.append("\tat org.apache.Foo.bar(Foo.java:1)")
    log.write_text("\n".join(lines) + "\n")
    summary = sparklog.summarize(log)
    assert summary[0].startswith("Spark logged 40 warning(s) and 1 error(s)")
    assert summary[1].startswith("  40 x WARN ProcessingTimeExecutor: Current batch is falling")
    assert len(summary) == 3


def test_spark_log_goes_to_a_file_unless_debugging() -> None:
    import logging

    opts = sparklog.java_options({}, "p", logging.INFO)
    props = Path(opts["spark.driver.extraJavaOptions"].split("=", 1)[1])
    assert "appender.out.type = File" in props.read_text()
    assert sparklog.log_file_of(opts) == props.with_name("spark.log")
    debug = sparklog.java_options({}, "p", logging.DEBUG)
    text = Path(debug["spark.driver.extraJavaOptions"].split("=", 1)[1]).read_text()
    assert "appender.out.type = Console" in text
    mine = {"spark.driver.extraJavaOptions": "-Dlog4j2.configurationFile=/etc/x.properties"}
    assert sparklog.java_options(mine, "p", logging.INFO) == {}  # the user's choice stays


def test_kept_demo_prints_where_things_are_and_a_snippet_that_reads_the_table(
    tmp_path: Path,
) -> None:
    import io
    import subprocess
    import sys

    import pyarrow as pa
    from pyiceberg.catalog import load_catalog
    from rich.console import Console

    from icefloe_spark.cli.demo import catalog_properties, create_table, where_things_are

    table = create_table(load_catalog("demo", **catalog_properties(tmp_path)))
    rows = pa.table(
        {
            "id": pa.array([1, 2], pa.int64()),
            "user": pa.array(["a", "b"]),
            "action": pa.array(["view", "buy"]),
            "amount": pa.array([None, 2.5], pa.float64()),
            "ts": pa.array([0, 1], pa.timestamp("us", "UTC")),
        }
    )
    table.append(rows)
    out = io.StringIO()
    where_things_are(tmp_path, True, Console(file=out, width=300))
    text = out.getvalue()
    assert str(tmp_path / "catalog.db") in text
    assert str(tmp_path / "pipeline.toml") in text
    lines = text.splitlines()
    start = lines.index("read the table with pyiceberg:") + 1
    snippet = lines[start : start + 3]
    run = subprocess.run(
        [sys.executable, "-c", "\n".join(snippet)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert "view" in run.stdout
    assert "buy" in run.stdout
    removed = io.StringIO()
    where_things_are(tmp_path, False, Console(file=removed, width=300))
    assert "--keep" in removed.getvalue()
