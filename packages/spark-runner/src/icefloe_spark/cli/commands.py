"""``icefloe run`` and ``icefloe demo``, added to core's CLI through the ``icefloe_cli`` hook."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from icefloe.cli.logs import LogFormatOption, LogLevelOption, VerboseOption, resolve_level
from icefloe.cli.logs import configure as configure_logging
from icefloe.config import load_config
from icefloe.errors import ConfigError
from icefloe.options import MetricsPortOption
from icefloe_spark.runtime import sparklog
from icefloe_spark.runtime.signals import stop_on_signals

if TYPE_CHECKING:
    from icefloe_spark.pipeline import Pipeline

log = logging.getLogger("icefloe_spark.cli")


def parse_options(pairs: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` strings to a dict (the value may contain ``=``)."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError("--source-option", "must look like KEY=VALUE", "e.g. a=b", pair)
        out[key.strip()] = value
    return out


def run(
    config: Annotated[Path, typer.Option("--config", "-c", help="Pipeline TOML file.")],
    no_coordinator: Annotated[
        bool,
        typer.Option(
            "--no-coordinator",
            help="Do not run a coordinator in this driver (a standalone `icefloe coordinator` "
            "commits).",
        ),
    ] = False,
    checkpoint: Annotated[
        str | None,
        typer.Option("--checkpoint", help="Spark checkpoint location (overrides the config)."),
    ] = None,
    once: Annotated[
        bool,
        typer.Option(
            "--once",
            help="Catch up and exit: read what the source holds now (Spark's available-now "
            "trigger), wait until it is committed, stop.",
        ),
    ] = False,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="No live view; log warnings and errors only.")
    ] = False,
    verbose: VerboseOption = False,
    log_level: LogLevelOption = None,
    log_format: LogFormatOption = "text",
    metrics_port: MetricsPortOption = None,
    source_option: Annotated[
        list[str] | None,
        typer.Option(
            "--source-option",
            help="Extra reader option of the icefloe-kafka source, KEY=VALUE (repeatable), "
            "e.g. pollTimeoutMs=60000.",
        ),
    ] = None,
) -> None:
    """Run the pipeline's streaming query until SIGINT/SIGTERM (or, with --once, until it has
    caught up), with live progress on a terminal and progress log lines otherwise."""
    # rich (the live view) and prometheus-client load only when run runs
    from icefloe.metrics import start_metrics
    from icefloe_spark.cli.console import end_jvm, print_error, say, setup_logging, watch

    level = resolve_level(log_level, verbose, quiet)
    setup_logging(level, log_format)
    cfg = load_config(config)
    extra = parse_options(source_option or [])
    from icefloe_spark.kafka.options import check_reader_options

    check_reader_options(extra, "--source-option")
    # a backend that is not installed or misconfigured fails now, not once the JVM is up
    from icefloe.plugins.backends import backend_config

    backend_config(cfg)
    # the JVM is the longest step before the first batch: launch it before importing the rest
    from icefloe_spark.runtime import jvm

    jvm.launch_early(cfg, level)
    from icefloe_spark.pipeline import Pipeline

    stop = threading.Event()
    with stop_on_signals(stop) as signals:
        start_metrics(metrics_port)
        pipeline = Pipeline(
            cfg,
            coordinator=not no_coordinator,
            checkpoint=checkpoint,
            source_extra_options=extra,
            once=once,
            log_level=level,
        )
        failure = None
        fatal: Exception | None = None
        try:
            pipeline.start()
            signals.install()  # PySpark's context may have taken SIGINT over
            watch(
                pipeline,
                stop,
                live=not quiet and log_format == "text",
                until=caught_up(pipeline) if once else None,
                past_end=once,
            )
            query = pipeline.query
            if query is not None and not query.isActive:
                failure = query.exception()
            if failure is not None:  # first: what failed and the fix, before the shutdown
                message, trace = failure_message(str(failure))
                print_error(message)
                if level <= logging.DEBUG:
                    say(trace)
        finally:
            if pipeline.coordinator is not None:
                fatal = pipeline.coordinator.fatal
            say("stopping ...")
            pipeline.stop()
            end_jvm()
            if pipeline.spark_log is not None:
                failed = failure is not None or fatal is not None
                for line in sparklog.finish(pipeline.spark_log, keep=failed)[0]:
                    say(line)
    if fatal is not None:
        raise fatal  # icefloe's CLI prints it ("error: ...", naming the recovery), exit 2
    if failure is not None:
        raise typer.Exit(1)
    say("stopped cleanly", outcome=True)


def caught_up(pipeline: Pipeline) -> Callable[[], bool]:
    """For ``--once``: true once the query ended and what it published is committed (or
    the commit did not come within a cycle and a timeout, which is logged)."""
    coordination = pipeline.config.coordination
    grace_s = coordination.commit_interval_s + coordination.commit_timeout_s + 60.0
    ended_at: list[float] = []

    def check() -> bool:
        query = pipeline.query
        if query is None or query.isActive:
            return False
        if query.exception() is not None or pipeline.all_committed():
            return True
        if not ended_at:
            ended_at.append(time.monotonic())
        if time.monotonic() - ended_at[0] > grace_s:
            log.warning("not every published batch was committed before exiting")
            return True
        return False

    return check


def failure_message(text: str) -> tuple[str, str]:
    """The one line that says why the streaming query failed and what to do, with one fix
    (the error's own when it names one), and the whole trace."""
    first, fix, trace = explain_failure(text)
    if ". Fix: " in first:
        return f"the streaming query failed: {first}; {RESTART}", trace
    return f"the streaming query failed: {first}. Fix: {fix}", trace


RESTART = "restart after that: the query resumes from its checkpoint (-v shows Spark's trace)"


def explain_failure(text: str) -> tuple[str, str, str]:
    """(what failed, what to do, the whole trace) from a StreamingQueryException's text.

    The Python error that caused it sits deep in Java's trace; icefloe's own errors name the
    record or key, so that line goes first.
    """
    import icefloe.errors as errors

    known = [
        name
        for name in dir(errors)
        if isinstance(getattr(errors, name), type)
        and issubclass(getattr(errors, name), BaseException)
    ]
    pattern = re.compile(r"(?:^|[\s.])(" + "|".join(known) + r"): (.+)$", re.M)
    found = pattern.findall(text)
    if found:
        name, message = found[-1]
        first = f"{name}: {message.strip()}"
    else:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        first = lines[0] if lines else "unknown error"
    fix = (
        "correct the record or configuration it names and restart: the query resumes from "
        "its checkpoint; run with -v for Spark's full trace"
    )
    return first[:500], fix, text


def demo(
    directory: Annotated[
        Path | None,
        typer.Option("--dir", help="Keep the catalog, warehouse and checkpoint here."),
    ] = None,
    records: Annotated[
        int, typer.Option("--records", "-n", min=1, help="Events to produce.")
    ] = 20_000,
    partitions: Annotated[int, typer.Option("--partitions", min=1, help="Topic partitions.")] = 4,
    timeout: Annotated[
        float, typer.Option("--timeout", help="Give up after this many seconds.")
    ] = 180.0,
    keep: Annotated[
        bool,
        typer.Option("--keep", help="Keep the temporary directory (catalog, table, config)."),
    ] = False,
    cdc: Annotated[
        bool,
        typer.Option(
            "--cdc",
            help="A Debezium-style change stream (creates, updates, deletes) into a keyed "
            "table in cdc mode, checked against the final state.",
        ),
    ] = False,
    verbose: VerboseOption = False,
    log_level: LogLevelOption = None,
) -> None:
    """Kafka -> Spark -> Iceberg on this machine: an embedded broker, an SQLite catalog, sample
    events; checks that the table holds every event exactly once (with --cdc: each key's final
    row, after updates and deletes)."""
    from icefloe_spark.cli.demo import run_demo
    from icefloe_spark.cli.demo_cdc import Changes

    level = resolve_level(log_level, verbose, quiet=log_level is None and not verbose)
    configure_logging(level)
    ok = run_demo(
        directory,
        records=records,
        partitions=partitions,
        timeout_s=timeout,
        keep=keep,
        scenario=Changes(records) if cdc else None,
    )
    if not ok:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add ``run`` and ``demo`` to the ``icefloe`` command."""
    app.command("run")(run)
    app.command("demo")(demo)
