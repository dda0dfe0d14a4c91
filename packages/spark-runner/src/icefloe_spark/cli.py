"""``icefloe run`` and ``icefloe demo``, added to core's CLI through the ``icefloe_cli`` hook."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.live import Live

from icefloe.config import load_config
from icefloe.errors import ConfigError

if TYPE_CHECKING:
    from icefloe_spark.pipeline import Pipeline

console = Console(stderr=True)
REFRESH_S = 1.0
TABLE_REFRESH_S = 2.0


@contextmanager
def stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """SIGINT and SIGTERM set ``stop`` (a clean shutdown) instead of killing the driver."""
    previous: dict[signal.Signals, Any] = {}

    def handler(signum: int, frame: FrameType | None) -> None:
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def watch(
    pipeline: Pipeline,
    stop: threading.Event,
    *,
    live: bool = True,
    until: Callable[[], bool] | None = None,
) -> None:
    """Show progress until ``stop`` is set, the query ends, or ``until()`` turns true."""
    from icefloe_spark.progress import Monitor, QueryProgress, render

    assert pipeline.query is not None
    assert pipeline.catalog is not None
    reader = {**pipeline.config.source.reader_options, **pipeline.source_extra_options}
    probe = reader.get("probeHighWatermark", "").lower() == "true"
    monitor = Monitor(pipeline.config, pipeline.catalog, probe_end=probe)
    tables = monitor.tables()
    last_tables = 0.0

    def view() -> Any:
        assert pipeline.query is not None
        coordinator = "standalone"
        if pipeline.coordinator is not None:
            coordinator = "running" if pipeline.coordinator.alive else "stopped"
            if pipeline.coordinator.last_error:
                coordinator += f" (last error: {pipeline.coordinator.last_error})"
        return render(
            pipeline.config.name,
            QueryProgress.from_spark(pipeline.query.lastProgress),
            pipeline.stats,
            tables,
            coordinator,
        )

    display: AbstractContextManager[Any] = (
        Live(view(), console=console, refresh_per_second=2) if live else nullcontext()
    )
    try:
        with display:
            while not stop.wait(REFRESH_S):
                if not pipeline.query.isActive:
                    break
                now = time.monotonic()
                if now - last_tables >= TABLE_REFRESH_S:
                    tables = monitor.tables()
                    last_tables = now
                if isinstance(display, Live):
                    display.update(view())
                if until is not None and until():
                    break
    finally:
        monitor.close()
        if live:
            console.print()  # the live view leaves the cursor at the end of its last line


def parse_options(pairs: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` strings to a dict (the value may contain ``=``)."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError("--source-option", "must look like KEY=VALUE", "e.g. a=b", pair)
        out[key.strip()] = value
    return out


def parse_log_level(name: str) -> int:
    """``--log-level``'s value as a ``logging`` level."""
    level = logging.getLevelName(name.upper())
    if not isinstance(level, int):
        raise ConfigError("--log-level", "is not a log level", "use DEBUG, INFO or WARNING", name)
    return level


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
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No live progress view.")] = False,
    source_option: Annotated[
        list[str] | None,
        typer.Option(
            "--source-option",
            help="Extra reader option of the icefloe-kafka source, KEY=VALUE (repeatable), "
            "e.g. probeHighWatermark=true.",
        ),
    ] = None,
    log_level: Annotated[
        str,
        typer.Option(
            "--log-level",
            help="Python log level of the driver: INFO shows each commit cycle (e.g. when "
            "the output goes to a file with --quiet).",
        ),
    ] = "WARNING",
) -> None:
    """Run the pipeline's streaming query until SIGINT/SIGTERM, with live progress."""
    from icefloe_spark.pipeline import Pipeline

    logging.basicConfig(
        level=parse_log_level(log_level), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    cfg = load_config(config)
    stop = threading.Event()
    with stop_on_signals(stop):
        pipeline = Pipeline(
            cfg,
            coordinator=not no_coordinator,
            checkpoint=checkpoint,
            source_extra_options=parse_options(source_option or []),
        )
        pipeline.start()
        pipeline.spark.sparkContext.setLogLevel("WARN")
        failure = None
        try:
            watch(pipeline, stop, live=not quiet)
        finally:
            query = pipeline.query
            if query is not None and not query.isActive:
                failure = query.exception()
            console.print("stopping ...")
            pipeline.stop()
    if failure is not None:
        console.print(f"[red]error:[/red] the streaming query failed: {failure}")
        raise typer.Exit(1)
    console.print("stopped cleanly")


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
) -> None:
    """Kafka -> Spark -> Iceberg on this machine: an embedded broker, an SQLite catalog, sample
    events; checks that the table holds every event exactly once."""
    from icefloe_spark.demo import run_demo

    ok = run_demo(directory, records=records, partitions=partitions, timeout_s=timeout)
    if not ok:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add ``run`` and ``demo`` to the ``icefloe`` command."""
    app.command("run")(run)
    app.command("demo")(demo)
