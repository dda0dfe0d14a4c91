"""Output off a terminal (a file, a pipe, a journal): whole lines, numbers as they were."""

from __future__ import annotations

import io
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from icefloe_spark.cli import console as console_module
from icefloe_spark.runtime import sparklog


@pytest.fixture
def root_logger() -> Iterator[logging.Logger]:
    """The root logger, its level put back afterwards (setLevel clears the loggers' caches)."""
    root = logging.getLogger()
    old = root.level
    yield root
    root.setLevel(old)


def test_messages_off_a_terminal_are_not_wrapped(
    monkeypatch: pytest.MonkeyPatch, root_logger: logging.Logger
) -> None:
    out = io.StringIO()
    monkeypatch.setattr(console_module.console, "file", out)
    root_logger.setLevel(logging.INFO)
    assert not console_module.console.is_terminal
    path = "/tmp/icefloe-a-pipeline-with-a-long-name-spark-5eadv277/and/a/deep/directory/spark.log"
    console_module.say(f"Spark logged 4 warning(s) and 0 error(s); see {path}")
    console_module.print_error(f"the streaming query failed: see {path} and fix it")
    lines = out.getvalue().splitlines()
    assert lines == [
        f"Spark logged 4 warning(s) and 0 error(s); see {path}",
        f"error: the streaming query failed: see {path} and fix it",
    ]


def test_spark_log_summary_keeps_the_numbers(tmp_path: Path) -> None:
    """Repeats of a message with other numbers count as one; the line shows the newest as
    Spark wrote it, not `ddNbaNb-...`."""
    cancel = "WARN SparkContext: Failed to cancel job group {}. Cannot find active jobs for it."
    host = (
        "WARN Utils: Your hostname, vm, resolves to a loopback address: 127.0.1.1; "
        "using 10.0.2.15 instead (on interface eth0)"
    )
    log = tmp_path / "spark.log"
    lines = [cancel.format("dd1ba2b-17"), cancel.format("dd3ba4b-18"), host]
    log.write_text("".join(f"26/11/26-10:00:0{i} {line}\n" for i, line in enumerate(lines)))
    assert sparklog.summarize(log) == [
        f"Spark logged 3 warning(s) and 0 error(s); see {log}",
        f"  2 x {cancel.format('dd3ba4b-18')}",
        f"  1 x {host}",
    ]


def test_a_run_leaves_no_spark_log_directory_unless_it_failed_or_spark_logged_errors() -> None:
    def spark_log(*lines: str) -> Path:
        options = sparklog.java_options({}, "leftovers", logging.INFO)  # what a run makes
        log = sparklog.log_file_of(options)
        assert log is not None
        assert log.parent.name.startswith("icefloe-leftovers-spark-")
        log.write_text("".join(f"26/11/26-10:00:00 {line}\n" for line in lines))
        return log

    warned = spark_log("WARN Utils: Set SPARK_LOCAL_IP if you need to bind to another address")
    lines, kept = sparklog.finish(warned)
    assert not kept
    assert not warned.parent.exists()
    assert lines[0] == "Spark logged 1 warning(s) and 0 error(s)"  # no path that is gone
    failed = spark_log("WARN Utils: x")
    assert sparklog.finish(failed, keep=True)[1]
    errors = spark_log("ERROR Executor: boom")
    lines, kept = sparklog.finish(errors)
    assert kept
    assert lines[0] == f"Spark logged 0 warning(s) and 1 error(s); see {errors}"
    for log in (failed, errors):
        assert log.exists()
        shutil.rmtree(log.parent)


def test_quiet_shows_errors_only(
    monkeypatch: pytest.MonkeyPatch, root_logger: logging.Logger
) -> None:
    """-q: no `stopping ...`, no Spark summary; the error and the outcome still."""
    out = io.StringIO()
    monkeypatch.setattr(console_module.console, "file", out)
    root_logger.setLevel(logging.WARNING)  # what -q sets
    console_module.say("stopping ...")
    console_module.say("Spark logged 4 warning(s) and 0 error(s)")
    console_module.print_error("the streaming query failed")
    console_module.say("stopped cleanly", outcome=True)  # how the run ended: always said
    assert out.getvalue() == "error: the streaming query failed\nstopped cleanly\n"


def test_a_failure_line_has_one_fix() -> None:
    """The error's own fix when it names one (`policy = "fail"`), else the general one."""
    from icefloe_spark.cli.commands import failure_message

    trace = (
        "org.apache.spark.SparkException: Job aborted.\n"
        "  icefloe.errors.RecordConversionError: record t[0]@5 field 'id': not a number. "
        'Fix: correct the record, or set [errors] policy = "dead_letter"\n'
        "\tat org.apache.spark.sql.execution...\n"
    )
    message, _ = failure_message(trace)
    assert message.count("Fix:") == 1, message
    assert message.startswith("the streaming query failed: RecordConversionError: record t[0]@5")
    assert "resumes from its checkpoint" in message
    plain, _ = failure_message("java.lang.OutOfMemoryError: Java heap space")
    assert plain.count("Fix:") == 1, plain


def test_the_cdc_demo_says_how_to_keep_its_own_directory(tmp_path: Path) -> None:
    from rich.console import Console

    from icefloe_spark.cli.demo import where_things_are
    from icefloe_spark.cli.demo_cdc import Changes

    out = io.StringIO()
    where_things_are(tmp_path, False, Console(file=out, width=300), command=Changes(5).command)
    assert "run `icefloe demo --cdc --keep` to keep" in out.getvalue()
