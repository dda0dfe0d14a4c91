"""What the runner's commands show on the terminal: the shared console, the live progress
view (progress log lines without a terminal) and the messages around a run. Kept apart from
:mod:`icefloe_spark.cli.commands` so that the demo, which the ``demo`` command imports, shows
progress without importing the commands back."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.live import Live
from rich.text import Text

if TYPE_CHECKING:
    from icefloe_spark.pipeline import Pipeline

# soft_wrap: a line is never broken by rich (off a terminal it would break at 80 columns,
# splitting paths); a terminal wraps what does not fit
console = Console(stderr=True, soft_wrap=True)
# messages of the runner's commands ("stopping ...", Spark's summary): printed, or in
# --log-format json logged as JSON lines like everything else
_say_log = logging.getLogger("icefloe_spark.cli")
_json = False
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
    from icefloe_spark.cli.progress import (
        Monitor,
        ProgressLog,
        PublishRate,
        QueryProgress,
        render,
    )
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
    rate = PublishRate()

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
            published_per_s=rate.update(pipeline.stats.records, time.monotonic()),
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
                    if not live:  # the live view shows it
                        progress_log.tables(tables, pipeline.stats)
                if isinstance(display, Live):
                    display.update(view())
                if until is not None and until():
                    break
    finally:
        monitor.close()
        if live:
            console.print()  # the live view leaves the cursor at the end of its last line


def setup_logging(level: int, fmt: str) -> None:
    """`icefloe run`'s logging: its progress lines say what the committer's and the
    coordinator's per-commit lines would (operations.md), and on a terminal the lines go
    through :data:`console`, so the live view stays whole below them. The JVM's own output
    goes to Spark's log file (:func:`icefloe_spark.runtime.jvm.launch_detached_gateway`), so
    with ``json`` every line on stdout/stderr is JSON."""
    global _json
    from icefloe.cli.logs import configure

    configure(level, fmt, details=False, console=console)
    _json = fmt == "json"


def say(message: str, level: int = logging.INFO, *, outcome: bool = False) -> None:
    """A message of the runner to the operator at ``level`` (shown as the log level allows:
    -q keeps errors only, and the run's ``outcome`` line): one unwrapped line on the console,
    or a JSON log line under --log-format json."""
    if _json:
        _say_log.log(level, message)
    elif not (outcome or logging.getLogger().isEnabledFor(level)):
        return  # -q: warnings and errors only
    elif level >= logging.ERROR:
        console.print(Text.assemble(("error: ", "red"), message), soft_wrap=True)
    else:
        console.print(message, markup=False, highlight=False, soft_wrap=True)


def coordinator_state(pipeline: Pipeline) -> str:
    if pipeline.coordinator is None:
        return "standalone"
    state = "running" if pipeline.coordinator.alive else "stopped"
    if pipeline.coordinator.last_error:
        state += f" (last error: {pipeline.coordinator.last_error})"
    return state


def end_jvm() -> None:
    """End the JVM if it writes class data for later starts, and keep that (once per
    machine and Spark: about 10 s)."""
    from icefloe_spark.runtime import jvm

    if jvm.writes_class_data():
        say("keeping Spark's class data for faster starts (once) ...")
        jvm.end()


def print_error(message: str) -> None:
    say(message, logging.ERROR)
