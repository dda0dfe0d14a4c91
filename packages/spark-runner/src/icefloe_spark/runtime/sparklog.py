"""Spark's (log4j) output: into a file unless debugging, summarised when the run ends.

Streamed to the terminal, Spark's log buries icefloe's own lines (a ``ProcessingTimeExecutor:
Current batch is falling behind`` warning every second while idle, hundreds of lines of Java
trace for one bad record). So by default log4j writes warnings and errors to a file, and the
runner prints how many there were and the most frequent ones; ``-v`` streams everything.
"""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

_LOG4J_PROPERTY = "-Dlog4j2.configurationFile="
_LINE = re.compile(r"^\S+ (?P<level>WARN|ERROR) (?P<logger>[^:]+): (?P<message>.*)$")


def log4j_properties(log_file: Path | None, level: str) -> str:
    """A log4j2 configuration: everything at ``level`` to the file, or to stderr when no file
    is given."""
    lines = [
        "# written by icefloe: Spark's log for one run",
        f"rootLogger.level = {level}",
        "appender.out.layout.type = PatternLayout",
        "appender.out.layout.pattern = %d{yy/MM/dd-HH:mm:ss} %p %c{1}: %m%n%ex",
        "appender.out.name = out",
        "rootLogger.appenderRef.out.ref = out",
    ]
    if log_file is None:
        lines += ["appender.out.type = Console", "appender.out.target = SYSTEM_ERR"]
    else:
        lines += ["appender.out.type = File", f"appender.out.fileName = {log_file}"]
    return "\n".join(lines) + "\n"


def java_options(conf: Mapping[str, str], name: str, log_level: int) -> dict[str, str]:
    """The driver's Java options with our log4j configuration, unless the user chose one."""
    key = "spark.driver.extraJavaOptions"
    current = conf.get(key, "")
    if _LOG4J_PROPERTY in current:
        return {}
    directory = Path(tempfile.mkdtemp(prefix=f"icefloe-{name}-spark-"))
    debugging = log_level <= logging.DEBUG
    log_file = None if debugging else directory / "spark.log"
    props = directory / "log4j2.properties"
    props.write_text(log4j_properties(log_file, "info" if debugging else "warn"))
    if log_file is not None:
        logging.getLogger("icefloe_spark.sparklog").info("Spark's warnings go to %s", log_file)
    return {key: f"{current} {_LOG4J_PROPERTY}{props}".strip()}


def log_file_of(conf: Mapping[str, str]) -> Path | None:
    """The file the Spark log goes to under ``java_options``' configuration, if any."""
    options = conf.get("spark.driver.extraJavaOptions", "")
    if _LOG4J_PROPERTY not in options:
        return None
    props = Path(options.split(_LOG4J_PROPERTY, 1)[1].split()[0])
    candidate = props.with_name("spark.log")
    return candidate if props.name == "log4j2.properties" else None


def _read(log_file: Path) -> tuple[Counter[str], Counter[str], dict[str, str]]:
    """Counts per level, counts per kind of message (numbers aside) and each kind's newest
    line as Spark wrote it."""
    levels: Counter[str] = Counter()
    messages: Counter[str] = Counter()
    newest: dict[str, str] = {}
    if not log_file.exists():
        return levels, messages, newest
    with log_file.open(errors="replace") as f:
        for line in f:
            m = _LINE.match(line.rstrip("\n"))
            if m is None:
                continue
            levels[m["level"]] += 1
            text = f"{m['level']} {m['logger']}: {m['message']}"
            # numbers vary between repeats of one message (durations, batch ids): count those
            # as one kind, and show the newest with its numbers
            kind = re.sub(r"[0-9]+", "N", text)
            messages[kind] += 1
            newest[kind] = text
    return levels, messages, newest


def summarize(log_file: Path, top: int = 3, *, kept: bool = True) -> list[str]:
    """One line with the counts (and where the file is, when ``kept``), then the ``top``
    most frequent warnings/errors."""
    levels, messages, newest = _read(log_file)
    if not levels:
        return []
    where = f"; see {log_file}" if kept else ""
    out = [f"Spark logged {levels['WARN']} warning(s) and {levels['ERROR']} error(s){where}"]
    for kind, count in messages.most_common(top):
        out.append(f"  {count} x {newest[kind][:300]}")
    return out


def finish(log_file: Path, keep: bool = False) -> tuple[list[str], bool]:
    """At the end of a run: the summary, and whether the log was kept. The run's log
    directory (``<tmp>/icefloe-<name>-spark-*``) is removed, so runs leave nothing behind,
    unless ``keep`` (the run failed) or Spark logged errors; the summary names the file only
    when it stays."""
    keep = keep or _read(log_file)[0]["ERROR"] > 0
    lines = summarize(log_file, kept=keep)
    if not keep and log_file.parent.name.startswith("icefloe-"):
        shutil.rmtree(log_file.parent, ignore_errors=True)
    return lines, keep
