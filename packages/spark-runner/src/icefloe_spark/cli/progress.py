"""Live progress of a running pipeline: Spark's rates, what the driver published, what the
tables hold and how far behind the source they are.

Commit state is read from the tables (the snapshot summary the committer writes), not from the
coordinator, so the view is the same when a standalone coordinator commits.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rich.console import Group
from rich.table import Table as RichTable
from rich.text import Text

from icefloe.commit.summary import describe_rows
from icefloe_spark.cli.monitor import Monitor as Monitor
from icefloe_spark.cli.monitor import TableProgress as TableProgress
from icefloe_spark.cli.monitor import lag as lag
from icefloe_spark.cli.monitor import lag_by_partition as lag_by_partition
from icefloe_spark.sink.publish import PublishStats

log = logging.getLogger("icefloe_spark.progress")


@dataclass(frozen=True)
class QueryProgress:
    """The fields of Spark's last progress report that matter here."""

    batch_id: int | None = None
    input_rows: int = 0
    rows_per_s: float = 0.0

    @classmethod
    def from_spark(
        cls, progress: Mapping[str, Any] | None, records: int | None = None
    ) -> QueryProgress:
        """``records``: the batch's records when Spark's ``numInputRows`` does not count
        them (on the ``ranges`` data path it counts offset ranges, one per task)."""
        if not progress:
            return cls()
        if records is None:
            return cls(
                batch_id=progress.get("batchId"),
                input_rows=int(progress.get("numInputRows") or 0),
                rows_per_s=float(progress.get("processedRowsPerSecond") or 0.0),
            )
        seconds = float((progress.get("durationMs") or {}).get("triggerExecution") or 0) / 1000
        return cls(
            batch_id=progress.get("batchId"),
            input_rows=records,
            rows_per_s=records / seconds if seconds > 0 else 0.0,
        )


def _ago(ms: int | None, now: float) -> str:
    if ms is None:
        return "never"
    return f"{max(0.0, now - ms / 1000):.0f}s ago"


def _rows(t: TableProgress) -> str:
    """The live view's rows column: live rows, the deleted ones apart (``10 (3 deleted)``)."""
    if t.records is None:
        return "-"
    return describe_rows(t.records, t.deleted, t.exact).replace(" rows", "", 1)


def _bad_records(stats: PublishStats) -> Text:
    """Bad records set aside by the [errors] policy, in a colour that asks for a look."""
    if not (stats.skipped or stats.dead_lettered):
        return Text("")
    return Text(
        f"\nbad records: {stats.skipped:,} skipped, {stats.dead_lettered:,} dead-lettered",
        style="yellow",
    )


class PublishRate:
    """Records published per second over the last ``window_s`` seconds: what the live view
    shows. Spark's rate of a batch divides that batch's records by its duration, so an idle
    batch that reports the previous batch's records shows a six-figure rate while nothing
    moves, and a batch that waited shows a fraction of the real one."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()

    def update(self, records: int, now: float) -> float:
        """The rate, given the records published so far at ``now`` (monotonic seconds)."""
        self._samples.append((now, records))
        while len(self._samples) > 1 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()
        then, before = self._samples[0]
        return (records - before) / (now - then) if now > then else 0.0


def render(
    name: str,
    query: QueryProgress,
    stats: PublishStats,
    tables: list[TableProgress],
    coordinator: str,
    published_per_s: float = 0.0,
) -> Group:
    """The live view of ``icefloe run``; ``published_per_s`` from :class:`PublishRate`."""
    now = time.time()
    head = Text.assemble(
        ("icefloe ", "bold cyan"),
        (name, "bold"),
        f"  batch {query.batch_id if query.batch_id is not None else '-'}",
        f"  {published_per_s:,.0f} records/s",
        f"  coordinator: {coordinator}\n",
        f"published {stats.batches} batches, {stats.records:,} records, {stats.files} files",
        f" ({stats.duplicates} replays ignored)" if stats.duplicates else "",
        _bad_records(stats),
    )
    grid = RichTable(box=None, pad_edge=False)
    for col in ("table", "rows", "snapshot", "last commit", "lag"):
        grid.add_column(col, justify="left" if col == "table" else "right")
    for t in tables:
        grid.add_row(
            t.name,
            _rows(t),
            "-" if t.snapshot_id is None else str(t.snapshot_id),
            _ago(t.committed_at_ms, now),
            "?" if t.lag is None else f"{t.lag:,}",
        )
    return Group(head, grid)


class ProgressLog:
    """Progress as log lines, for runs without a terminal: one line per table commit (a new
    snapshot) and a summary every ``every_s`` seconds. Fields go to ``extra`` so
    ``--log-format json`` makes them JSON keys."""

    def __init__(self, name: str, every_s: float = 60.0, logger: logging.Logger | None = None):
        self.name = name
        self.every_s = every_s
        self.log = logger or logging.getLogger("icefloe.progress")
        self._snapshots: dict[str, int | None] = {}
        self._next_summary = time.monotonic() + every_s
        self._first = True

    def tables(self, tables: list[TableProgress], stats: PublishStats) -> None:
        for t in tables:
            before = self._snapshots.get(t.name)
            self._snapshots[t.name] = t.snapshot_id
            if self._first or t.snapshot_id is None or t.snapshot_id == before:
                continue
            self.log.info(
                "table %s committed: snapshot %s, %s, lag %s",
                t.name,
                t.snapshot_id,
                "- rows" if t.records is None else describe_rows(t.records, t.deleted, t.exact),
                "?" if t.lag is None else t.lag,
                extra={
                    "event": "table_commit",
                    "pipeline": self.name,
                    "table": t.name,
                    "snapshot_id": t.snapshot_id,
                    "rows": t.records,
                    "deleted_rows": t.deleted,
                    "rows_exact": t.exact,
                    "lag": t.lag,
                },
            )
        self._first = False
        now = time.monotonic()
        if now >= self._next_summary:
            self._next_summary = now + self.every_s
            self.summary(tables, stats)

    def summary(self, tables: list[TableProgress], stats: PublishStats) -> None:
        lags = [t.lag for t in tables if t.lag is not None]
        total_lag = sum(lags) if lags else None
        self.log.info(
            "progress: %d records in %d files published (%d batches), lag %s, "
            "dead-lettered %d, skipped %d",
            stats.records,
            stats.files,
            stats.batches,
            "?" if total_lag is None else total_lag,
            stats.dead_lettered,
            stats.skipped,
            extra={
                "event": "progress",
                "pipeline": self.name,
                "records": stats.records,
                "files": stats.files,
                "batches": stats.batches,
                "lag": total_lag,
                "dead_lettered": stats.dead_lettered,
                "skipped": stats.skipped,
            },
        )
