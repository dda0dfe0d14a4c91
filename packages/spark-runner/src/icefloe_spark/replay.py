"""Replaying a rolled-back table, in the driver (the rules are in :mod:`icefloe.commit.rollback`).

The driver checks every table the pipeline commits to (``[[tables]]``, the dead-letter table,
the ``[dynamic_tables]`` tables it committed to: :func:`icefloe.ops.tables.pipeline_tables`)
every ``spark.rollback_check_interval_s``. For a table rolled back below what the pipeline
committed, it reads the lost source range again with the ``ranges`` path's own reader
(:func:`icefloe_spark.kafka.reading.read_range`), converts and routes the records as a write task
does but keeps only that table's rows (:func:`icefloe_spark.sink.task.write_task` with ``only``;
for the dead-letter table, the range's bad records), and publishes the files as one writer
batch under the rollback's replay writer id. The coordinator then commits them, with the table's
waiting live files, in one snapshot.

Why in the driver and not as a Spark job: a replay is rare and bounded (the rolled-back
snapshots' range of one table), and the driver already holds the catalog and the backend;
the records never leave this process.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

import pyarrow as pa
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import NoSuchTableError
from pyiceberg.expressions import EqualTo, Reference

from icefloe.channel import Backend
from icefloe.commit.committer import IcebergCommitter
from icefloe.commit.rollback import REPLAY_BATCH_SEQ, ReplayRange, Rollback, keyed_refusal
from icefloe.commit.versions import current_location
from icefloe.config import ErrorsConfig, PipelineConfig
from icefloe.coordination.writer import WriterClient
from icefloe.errors import RecordConversionError, RollbackNotReplayableError, TableMissingError
from icefloe.events import DataFileMeta
from icefloe.hookspecs import TableCommitted, hookimpl
from icefloe.ops.tables import change_options, pipeline_tables
from icefloe_spark.kafka.options import EARLIEST, SourceOptions, parse_offsets_json
from icefloe_spark.kafka.planning import KafkaInputPartition, KafkaOffsetPlanner, flat_offsets
from icefloe_spark.kafka.reading import read_range
from icefloe_spark.sink.tables import TableResolver
from icefloe_spark.sink.task import write_task

log = logging.getLogger(__name__)


def beginnings(options: SourceOptions, rollback: Rollback) -> dict[tuple[str, int], int]:
    """Where the pipeline began reading the partitions the restored snapshot does not record:
    the broker's earliest offset under ``startingOffsets`` earliest, or the explicit offsets
    given; unknown (absent) for latest, table and timestamps."""
    missing = [
        (topic, p)
        for topic, parts in rollback.to_offsets.items()
        for p in parts
        if p not in rollback.from_offsets.get(topic, {})
    ]
    start = options.starting_offsets
    if not missing or start in ("latest", "table", "timestamp"):
        return {}
    reader = KafkaOffsetPlanner(options)
    try:
        earliest, _ = reader.bounds(missing)
    finally:
        reader.stop()
    if start == "earliest":
        return earliest
    given = flat_offsets(parse_offsets_json(start))
    out: dict[tuple[str, int], int] = {}
    for tp in missing:
        offset = given.get(tp, EARLIEST)
        if offset == EARLIEST:
            out[tp] = earliest[tp]
        elif offset >= 0:
            out[tp] = offset
    return out


def replay(
    config: PipelineConfig,
    catalog: Catalog,
    backend: Backend,
    rollback: Rollback,
    reader_options: Mapping[str, str],
) -> int:
    """Read the rolled-back range again, write that table's rows and publish them as the
    rollback's replay batch; returns the records written. A rollback whose range holds no row
    of the table is accepted instead (nothing to publish). Raises RollbackNotReplayableError
    for a keyed table or an unknown start."""
    table = rollback.table
    changes = change_options(config, table)
    if changes is not None and changes.keyed:
        raise keyed_refusal(table, changes.mode)
    # the dead-letter table's rows are the range's bad records; every other table's are good
    # ones, its bad records set aside the first time (skipped now, not dead-lettered again)
    dead_letters = table == config.errors.dead_letter_table
    errors = config.errors if dead_letters else ErrorsConfig(policy="skip")
    options = SourceOptions.parse(reader_options)
    pieces = _pieces(rollback.ranges(beginnings(options, rollback)), config)
    set_aside = set() if dead_letters else dead_lettered(catalog, config, table, pieces)
    resolver = TableResolver(catalog, config)
    files: list[DataFileMeta] = []
    uuids: dict[str, str] = {}
    unplaced: list[RecordConversionError] = []
    records = 0
    for piece in pieces:
        part = KafkaInputPartition(piece.topic, piece.partition, piece.start, piece.end)
        batches = list(read_range(options, part))
        if not batches:
            continue
        data = _without(pa.Table.from_batches(batches), set_aside)
        tables, converter = resolver.prepare(data)
        out = write_task(
            data,
            tables,
            converter,
            errors=errors,
            pipeline=config.name,
            only=table,
        )
        files += out.files.get(table, ())
        unplaced += () if dead_letters else out.unplaced
        uuids.update(out.table_uuids)
        records += sum(f.record_count for f in out.files.get(table, ()))
    if unplaced:
        _report_unplaced(rollback, unplaced, skipping=config.errors.policy == "skip")
    if not files:
        log.info("rollback of %s: the rolled-back range holds none of its rows", table)
        IcebergCommitter.for_pipeline(catalog, config).roll_back(
            table, None, replay=False, only_if=rollback.writer_id
        )
        return 0
    client = WriterClient(backend.writer(rollback.writer_id), config.name, rollback.writer_id)
    client.start()
    try:
        added = client.publish(REPLAY_BATCH_SEQ, {table: files}, (), uuids)
    finally:
        client.close()
    log.warning(
        "table %s was rolled back from snapshot %s to %s: replayed %d records of %s (%s)",
        table,
        rollback.lost_snapshot_id,
        rollback.restored_snapshot_id,
        records,
        [(r.topic, r.partition, r.start, r.end) for r in pieces],
        "published" if added else "published before",
    )
    return records


def _report_unplaced(
    rollback: Rollback, unplaced: list[RecordConversionError], skipping: bool
) -> None:
    """Say loudly which records the replay left out because they fail today (a route or the
    schema changed since the table took them). Why: their rows went with the rolled-back
    snapshots, the replay writes only the table's rows, and nothing else names them. Under
    ``errors.policy = "skip"`` a record that failed the first time too is among them (nothing
    recorded it), so that is a warning; under ``fail`` or ``dead_letter`` each was written
    somewhere the first time."""
    table, restored = rollback.table, rollback.restored_snapshot_id
    log.log(
        logging.WARNING if skipping else logging.ERROR,
        "rollback of %s: %d record(s) of the replayed range were not replayed: today they fail "
        "to route or convert for %s, and the dead-letter table does not hold them. Those the "
        "table held before the rollback are in no table now%s. First: %s. Fix: correct the "
        "routes or the table schema, then roll %s back%s again to replay the range once more",
        table,
        len(unplaced),
        table,
        " (under errors.policy = skip, those skipped the first time were in none before)"
        if skipping
        else "",
        "; ".join(str(e) for e in unplaced[:3]),
        table,
        "" if restored is None else f" to snapshot {restored}",
    )


def dead_lettered(
    catalog: Catalog, config: PipelineConfig, table: str, pieces: list[ReplayRange]
) -> set[tuple[str, int, int]]:
    """Source positions in ``pieces`` of the records the dead-letter table holds for this
    pipeline and ``table`` (or for no table: a record that failed to decode or route).

    Why: the replay converts and routes with today's configuration and schemas. A record set
    aside the first time that converts now (a route added for it, a column widened) would be
    in the dead-letter table and, replayed, in the table too. What was set aside stays so."""
    name = config.errors.dead_letter_table
    if name is None or not pieces:
        return set()
    # pyiceberg 0.12's expression classes declare a pydantic __init__ that mypy mis-reads
    mine = EqualTo(Reference("pipeline"), config.name)  # type: ignore[call-arg,arg-type]
    try:
        scan = catalog.load_table(name).scan(
            row_filter=mine, selected_fields=("topic", "partition", "offset", "target_table")
        )
    except NoSuchTableError:
        return set()
    ranges: dict[tuple[str, int], list[ReplayRange]] = {}
    for p in pieces:
        ranges.setdefault((p.topic, p.partition), []).append(p)
    return {
        (r["topic"], r["partition"], r["offset"])
        for r in scan.to_arrow().to_pylist()
        if r["target_table"] in (None, table)
        and any(
            p.start <= r["offset"] < p.end for p in ranges.get((r["topic"], r["partition"]), ())
        )
    }


def _without(data: pa.Table, positions: set[tuple[str, int, int]]) -> pa.Table:
    """``data`` (Spark's Kafka layout) without the records at ``positions``."""
    if not positions or data.num_rows == 0:
        return data
    keep = [
        (t, p, o) not in positions
        for t, p, o in zip(
            data["topic"].to_pylist(),
            data["partition"].to_pylist(),
            data["offset"].to_pylist(),
            strict=True,
        )
    ]
    return data.filter(pa.array(keep, pa.bool_()))


def _pieces(ranges: list[ReplayRange], config: PipelineConfig) -> list[ReplayRange]:
    """``ranges`` cut into pieces of at most ``spark.max_records_per_task`` offsets, so the
    driver holds one piece's records at a time."""
    step = config.spark.max_records_per_task
    out: list[ReplayRange] = []
    for r in ranges:
        size = step or r.end - r.start
        out += [
            ReplayRange(r.topic, r.partition, lo, min(lo + size, r.end))
            for lo in range(r.start, r.end, size)
        ]
    return out


class RollbackWatcher:
    """Checks the pipeline's tables for rollbacks and replays them, from a daemon thread.

    Each rollback is replayed once per process (its replay batch is keyed by the rollback, so
    another driver or a restart replaying it too adds nothing); a refused one is logged once.
    """

    def __init__(
        self,
        config: PipelineConfig,
        catalog: Catalog,
        backend: Backend,
        reader_options: Mapping[str, str],
    ) -> None:
        self.config = config
        self.catalog = catalog
        self.backend = backend
        self.reader_options = dict(reader_options)
        self.replayed: set[str] = set()  # replay writer ids published by this process
        self._refused: set[str] = set()
        # kept across checks: the committer reuses a table's version while the catalog still
        # names it, and dynamic tables found once are not loaded again to find them
        self._committer: IcebergCommitter | None = None
        self._committed: set[str] = set()
        # per table, the version this process's coordinator committed last, in which no
        # rollback waits (the commit checked): not loaded again while the catalog names it
        self._settled: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="icefloe-rollback", daemon=True)

    def start(self) -> RollbackWatcher:
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    @hookimpl
    def icefloe_after_table_commit(self, event: TableCommitted) -> None:
        """Registered as a plugin where the coordinator runs in this process: its commits tell
        which versions need no check. Why: at 1,000 tables every cycle changes every table,
        and loading each again for the check was most of the watcher's CPU in the driver."""
        if event.group_id == self.config.name and event.metadata_location is not None:
            self._settled[event.table] = event.metadata_location

    def _run(self) -> None:
        while not self._stop.wait(self.config.spark.rollback_check_interval_s):
            try:
                self.check()
            except Exception:
                log.exception("checking the tables for rollbacks failed; retrying")

    def check(self) -> list[Rollback]:
        """Replay every rollback not replayed yet, of every table the pipeline commits to (its
        dead-letter table and ``[dynamic_tables]`` tables too: a rolled-back table nobody
        replays holds its new files back for good); returns those replayed now."""
        if self._committer is None:
            self._committer = IcebergCommitter.for_pipeline(self.catalog, self.config)
        committer = self._committer
        done: list[Rollback] = []
        for name in pipeline_tables(self.catalog, self.config, known=self._committed):
            if self._stop.is_set():
                continue
            settled = self._settled.get(name)
            if settled is not None and current_location(self.catalog, name) == settled:
                continue  # the version our coordinator's commit made: no rollback waits
            try:
                rollback = committer.rollback(name)
                if rollback is None or rollback.writer_id in self.replayed:
                    continue
                replay(self.config, self.catalog, self.backend, rollback, self.reader_options)
            except TableMissingError:
                # dropped since it was listed: nothing to replay. Asked here rather than by
                # the catalog's table_exists first, which pyiceberg answers with a full load
                # (a sixth of the driver's CPU at 1,000 tables, docs/benchmarks.md)
                continue
            except RollbackNotReplayableError as exc:
                if str(exc) not in self._refused:
                    self._refused.add(str(exc))
                    log.error("rollback not replayed: %s", exc)
                continue
            except Exception as exc:  # e.g. DataLossError: the other tables go on
                log.warning("replaying the rollback of %s failed, retrying: %s", name, exc)
                continue
            self.replayed.add(rollback.writer_id)
            done.append(rollback)
        return done
