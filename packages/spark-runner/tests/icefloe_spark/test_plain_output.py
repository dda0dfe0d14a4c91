"""Output off a terminal (a file, a pipe, a journal): whole lines, numbers as they were."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from icefloe_spark.cli import console as console_module
from icefloe_spark.runtime import sparklog


def test_messages_off_a_terminal_are_not_wrapped(monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    monkeypatch.setattr(console_module.console, "file", out)
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
