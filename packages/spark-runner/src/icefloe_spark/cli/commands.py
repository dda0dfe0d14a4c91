"""``icefloe run`` and ``icefloe demo``, added to core's CLI through the ``icefloe_cli`` hook."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.live import Live
from rich.text import Text

from icefloe.cli.logs import LogFormatOption, LogLevelOption, VerboseOption, resolve_level
from icefloe.cli.logs import configure as configure_logging
from icefloe.config import load_config
from icefloe.errors import ConfigError
from icefloe.metrics import MetricsPortOption, start_metrics
from icefloe_spark.runtime import sparklog
from icefloe_spark.runtime.signals import stop_on_signals

if TYPE_CHECKING:
    from icefloe_spark.pipeline import Pipeline

log = logging.getLogger("icefloe_spark.cli")
console = Console(stderr=True)
REFRESH_S = 1.0
TABLE_REFRESH_S = 2.0
TICK_S = 0.2


def watch(
    pipeline: Pipeline,
    stop: threading.Event,
    *,
    live: bool = True,
    until: Callable[[], bool] | None = None,
    past_end: bool = False,
) -> None:
    """Show progress until ``stop`` is set, the query ends (unless ``past_end``: then only
    ``until`` ends it), or ``until()`` turns true.

    The live view refreshes in place, so it only runs on a terminal; without one (systemd,
    containers, files) progress is logged: a line per table commit and one a minute.
    """
    from icefloe_spark.cli.progress import Monitor, ProgressLog, QueryProgress, render
    from icefloe_spark.kafka.options import probe_mode

    assert pipeline.query is not None
    assert pipeline.catalog is not None
    reader = {**pipeline.config.source.reader_options, **pipeline.source_extra_options}
    monitor = Monitor(pipeline.config, pipeline.catalog, probe_end=probe_mode(reader) != "false")
    tables = monitor.tables()
    progress_log = ProgressLog(pipeline.config.name)
    progress_log.tables(tables, pipeline.stats)
    last_tables = last_view = 0.0
    # a commit of this writer's batches is reported as soon as the writer hears of it (its
    # CommitComplete), not at the next poll of the tables
    seen_committed = pipeline.publisher.committed_through if pipeline.publisher else None
    live = live and console.is_terminal

    def view() -> Any:
        assert pipeline.query is not None
        return render(
            pipeline.config.name,
            QueryProgress.from_spark(
                pipeline.query.lastProgress,
                pipeline.stats.last_batch_records if pipeline.reads_ranges else None,
            ),
            pipeline.stats,
            tables,
            coordinator_state(pipeline),
        )

    display: AbstractContextManager[Any] = (
        Live(view(), console=console, refresh_per_second=2) if live else nullcontext()
    )
    try:
        with display:
            while not stop.wait(TICK_S):
                committed = pipeline.publisher.committed_through if pipeline.publisher else None
                now = time.monotonic()
                if committed == seen_committed and now - last_view < REFRESH_S:
                    continue
                last_view = now
                if not pipeline.query.isActive and not past_end:
                    break
                if pipeline.coordinator is not None and pipeline.coordinator.fatal is not None:
                    break  # nothing would be committed any more: stop (run exits with it)
                if committed != seen_committed or now - last_tables >= TABLE_REFRESH_S:
                    seen_committed = committed
                    tables = monitor.tables()
                    last_tables = now
                    progress_log.tables(tables, pipeline.stats)
                if isinstance(display, Live):
                    display.update(view())
                if until is not None and until():
                    break
    finally:
        monitor.close()
        if live:
            console.print()  # the live view leaves the cursor at the end of its last line


def coordinator_state(pipeline: Pipeline) -> str:
    if pipeline.coordinator is None:
        return "standalone"
    state = "running" if pipeline.coordinator.alive else "stopped"
    if pipeline.coordinator.last_error:
        state += f" (last error: {pipeline.coordinator.last_error})"
    return state


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
    level = resolve_level(log_level, verbose, quiet)
    configure_logging(level, log_format)
    cfg = load_config(config)
    extra = parse_options(source_option or [])
    from icefloe_spark.kafka.options import check_reader_options

    check_reader_options(extra, "--source-option")
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
        finally:
            if pipeline.coordinator is not None:
                fatal = pipeline.coordinator.fatal
            console.print("stopping ...")
            pipeline.stop()
            end_jvm()
            if pipeline.spark_log is not None:
                for line in sparklog.summarize(pipeline.spark_log):
                    console.print(line, markup=False, highlight=False)
    if fatal is not None:
        raise fatal  # icefloe's CLI prints it ("error: ...", naming the recovery), exit 2
    if failure is not None:
        first, fix, trace = explain_failure(str(failure))
        _error(f"the streaming query failed: {first}. Fix: {fix}")
        if level <= logging.DEBUG:
            console.print(trace, markup=False, highlight=False)
        raise typer.Exit(1)
    console.print("stopped cleanly")


def end_jvm() -> None:
    """End the JVM if it writes class data for later starts, and keep that (once per
    machine and Spark: about 10 s)."""
    from icefloe_spark.runtime import jvm

    if jvm.writes_class_data():
        console.print("keeping Spark's class data for faster starts (once) ...")
        jvm.end()


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


def _error(message: str) -> None:
    console.print(Text.assemble(("error: ", "red"), message), soft_wrap=True)


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
