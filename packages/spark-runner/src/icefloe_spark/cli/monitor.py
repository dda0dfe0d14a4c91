"""What the tables hold and how far behind the source they are: the live view's data, and
the lag of ``icefloe status`` (through the plugin's source-lag hook).

Commit state is read from the tables (the snapshot summary the committer writes), not from the
coordinator, so the view is the same when a standalone coordinator commits. A module apart
from :mod:`.progress` so that status imports neither rich nor prometheus-client.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from confluent_kafka import Consumer, KafkaException
from pyiceberg.catalog import Catalog

from icefloe.commit.committer import IcebergCommitter
from icefloe.commit.summary import RowCounts
from icefloe.config import PipelineConfig
from icefloe_spark.kafka.admin import Watermarks, source_consumer, watermarks

log = logging.getLogger("icefloe_spark.progress")


@dataclass(frozen=True)
class TableProgress:
    """One target table as the committer left it."""

    name: str
    snapshot_id: int | None
    committed_at_ms: int | None
    records: int | None  # live rows of the current snapshot: records minus deleted rows
    lag: int | None  # source records not yet committed to this table (None: unknown)
    deleted: int | None = None  # rows of its data files that position deletes remove
    exact: bool = True  # False with equality deletes: ``records`` is then an upper bound


def lag(
    high_watermarks: Mapping[tuple[str, int], int],
    committed: Mapping[str, Mapping[int, int]],
    low_watermarks: Mapping[tuple[str, int], int],
) -> int:
    """Records between what the table's source offsets record and each partition's end."""
    return sum(lag_by_partition(high_watermarks, committed, low_watermarks).values())


def lag_by_partition(
    high_watermarks: Mapping[tuple[str, int], int],
    committed: Mapping[str, Mapping[int, int]],
    low_watermarks: Mapping[tuple[str, int], int],
) -> dict[tuple[str, int], int]:
    """:func:`lag` per source partition (the metrics export it so)."""
    out: dict[tuple[str, int], int] = {}
    for (topic, partition), high in high_watermarks.items():
        start = committed.get(topic, {}).get(partition, low_watermarks.get((topic, partition), 0))
        out[(topic, partition)] = max(0, high - start)
    return out


class Monitor:
    """Reads table state and source watermarks; cheap enough to call every couple of seconds."""

    def __init__(
        self,
        config: PipelineConfig,
        catalog: Catalog,
        probe_end: bool = False,
        export_lag: bool = True,
    ) -> None:
        self.config = config
        self.probe_end = probe_end  # read partition ends by fetching (see kafkautil.end_offsets)
        self.export_lag = export_lag  # set the icefloe_source_lag gauge
        self.catalog = catalog
        self.committer = IcebergCommitter.for_pipeline(catalog, config)
        self._consumer: Consumer | None = None

    def _watermarks(self) -> Watermarks | None:
        try:
            if self._consumer is None:
                self._consumer = source_consumer(self.config.source)
            return watermarks(self._consumer, self.config.source, self.probe_end)
        except (KafkaException, TimeoutError):
            log.debug("watermarks unavailable", exc_info=True)
            return None

    def tables(self) -> list[TableProgress]:
        return self.tables_at(self._watermarks())

    def tables_at(self, marks: Watermarks | None) -> list[TableProgress]:
        """The tables' state, their lag against ``marks`` (None: lag unknown)."""
        out = []
        for t in self.config.tables:
            try:
                state = self.committer.state(t.name)
                table = self.catalog.load_table(t.name)
            except Exception:
                log.debug("state of %s unavailable", t.name, exc_info=True)
                out.append(TableProgress(t.name, None, None, None, None))
                continue
            snap = table.snapshot_by_id(state.snapshot_id) if state else None
            counts = None
            if snap is not None and snap.summary is not None:
                counts = RowCounts.of(snap.summary.additional_properties)
            behind = None
            if marks is not None:
                parts = lag_by_partition(marks[0], state.source_offsets if state else {}, marks[1])
                behind = sum(parts.values())
                if self.export_lag:
                    _export_lag(t.name, parts)
            out.append(
                TableProgress(
                    t.name,
                    state.snapshot_id if state else None,
                    snap.timestamp_ms if snap else None,
                    None if counts is None else counts.live,
                    behind,
                    None if counts is None else counts.deleted,
                    counts is None or counts.exact,
                )
            )
        return out

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None


def _export_lag(table: str, parts: Mapping[tuple[str, int], int]) -> None:
    """The lag per source partition as the ``icefloe_source_lag`` gauge (prometheus-client
    loads here, in the process that serves the metrics)."""
    from icefloe import metrics

    for (topic, partition), n in parts.items():
        metrics.SOURCE_LAG.labels(table, topic, str(partition)).set(n)
