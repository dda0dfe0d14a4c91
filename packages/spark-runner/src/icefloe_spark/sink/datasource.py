"""The ``icefloe`` streaming sink: a PySpark Python data source with an Arrow stream writer.

``df.writeStream.format("icefloe").option("config", <PipelineConfig JSON>)`` accepts any
streaming DataFrame in Spark's Kafka layout. Tasks (executors) decode, route and write Parquet
files and return their metadata; they never touch the coordination backend. The driver's
``commit(messages, batchId)`` publishes the batch as one writer batch keyed by
``(writer_id, batchId)``, so a batch Spark replays after a crash publishes the same key again
and is dropped. Spark calls ``commit`` only with the messages of successful task attempts, so
files of failed attempts are never published; ``abort`` publishes and deletes nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from pydantic import ValidationError
from pyspark.sql.datasource import (
    DataSource,
    DataSourceStreamArrowWriter,
    DataSourceStreamWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

from icefloe.config import PipelineConfig, config_error_from, load_config
from icefloe.coordination.writer import merge_positions
from icefloe.errors import ConfigError, TableMismatchError
from icefloe.events import DataFileMeta, SourcePosition
from icefloe.records.codecs.options import self_contained
from icefloe_spark import faults
from icefloe_spark.kafka.options import SourceOptions
from icefloe_spark.kafka.planning import RANGE_ARROW_SCHEMA
from icefloe_spark.kafka.reading import read_ranges
from icefloe_spark.runtime import workergc
from icefloe_spark.sink.publish import (
    BatchPublisher,
    PublishRequest,
    RemotePublisher,
    local_publisher,
)
from icefloe_spark.sink.task import TaskOutput, check_columns

# Spark imports this module in a fresh Python process for each planning step of the query and
# for the sink's commit on the driver, one after another before the first batch is committed:
# what only the write tasks use (pyiceberg's catalog and Parquet writer, the converter) is
# imported where it is used, not here (docs/benchmarks.md, start-up)
if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog
    from pyiceberg.table import Table

    from icefloe.records.converter import RecordConverter

log = logging.getLogger("icefloe_spark.sink")

SINK_NAME = "icefloe"
# sink options (Spark lower-cases option keys)
OPT_CONFIG = "config"
OPT_CONFIG_FILE = "config_file"
OPT_WRITER_ID = "writer_id"
OPT_CHECKPOINT = "checkpointlocation"
OPT_PUBLISHER_ADDRESS = "publisher.address"
OPT_PUBLISHER_SECRET = "publisher.secret"
OPT_SOURCE = "source.options"  # JSON reader options: tasks read the ranges they are given


INCARNATION_FILE = "icefloe-incarnation"


def checkpoint_filesystem(
    checkpoint_location: str, properties: Mapping[str, str] | None = None
) -> tuple[Any, str]:
    """The pyarrow file system of the checkpoint and its path there, made as pyiceberg makes
    one for a table location from the catalog's FileIO ``properties`` (so a checkpoint on the
    warehouse's object store uses its ``s3.endpoint`` and credentials; ``s3a://`` is S3).
    Raises a :class:`ConfigError` naming ``spark.checkpoint_location`` for a scheme that no
    file system serves."""
    from icefloe.ops.storage import location_filesystem

    uri = (
        checkpoint_location
        if "://" in checkpoint_location
        else os.path.abspath(checkpoint_location)
    )
    try:
        return location_filesystem(uri, properties)
    except ValueError as exc:
        raise ConfigError(
            "spark.checkpoint_location",
            f"no file system serves {uri} ({exc})",
            "use a local or shared path, hdfs://, or an object store URL (s3://, gs://, "
            "abfs://) reachable with the catalog's FileIO properties",
        ) from None


def checkpoint_incarnation(
    checkpoint_location: str, properties: Mapping[str, str] | None = None
) -> str:
    """An id kept inside the checkpoint: the same for every restart from this checkpoint, new
    when the checkpoint is deleted and started afresh at the same location.

    Why: a fresh checkpoint restarts Spark's batch ids at 0, and the coordinator drops batches
    at or below a writer's committed watermark, so reusing the old writer id would silently
    drop the new query's first batches. Any location :func:`checkpoint_filesystem` serves
    (local, object stores with the catalog's ``properties``, hdfs...).
    """
    filesystem, base = checkpoint_filesystem(checkpoint_location, properties)
    marker = base.rstrip("/") + "/" + INCARNATION_FILE
    try:
        with filesystem.open_input_stream(marker) as f:
            found = bytes(f.read()).decode().strip()
        if found:
            return found
    except FileNotFoundError:
        pass
    filesystem.create_dir(base, recursive=True)
    incarnation = uuid.uuid4().hex[:12]
    with filesystem.open_output_stream(marker) as out:
        out.write(incarnation.encode())
    return incarnation


def derive_writer_id(
    group_id: str, checkpoint_location: str, properties: Mapping[str, str] | None = None
) -> str:
    """A writer id that stays the same across restarts of one query: the pipeline name, a
    digest of the checkpoint location (the query's identity in Spark) and the checkpoint's
    incarnation (see :func:`checkpoint_incarnation`; ``properties``: the catalog's, for a
    checkpoint on the warehouse's object store)."""
    location = checkpoint_location
    if "://" not in location:
        location = os.path.abspath(location)
    digest = hashlib.sha256(location.rstrip("/").encode()).hexdigest()[:16]
    incarnation = checkpoint_incarnation(checkpoint_location, properties)
    return f"{group_id}-spark-{digest}-{incarnation}"


@dataclass(frozen=True)
class SinkOptions:
    """The sink's options, parsed and validated once on the driver."""

    config: PipelineConfig = field(repr=False)  # may hold catalog credentials
    writer_id: str
    publisher_address: str | None = None
    publisher_secret: str | None = field(default=None, repr=False)
    fail_task: dict[str, Any] | None = None
    source: SourceOptions | None = field(default=None, repr=False)  # for range rows

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SinkOptions:
        opts = {k.lower(): v for k, v in options.items()}
        if OPT_CONFIG in opts:
            try:
                config = PipelineConfig.model_validate_json(opts[OPT_CONFIG])
            except ValidationError as exc:
                raise config_error_from(exc, prefix="sink option config: ") from None
        elif OPT_CONFIG_FILE in opts:
            config = load_config(opts[OPT_CONFIG_FILE])
        else:
            raise ConfigError(
                "sink option config",
                "missing",
                "pass .option('config', pipeline_config.model_dump_json()) or "
                ".option('config_file', 'pipeline.toml')",
            )
        # parsed on the driver, the writer is pickled to executors: ship the schema file's text
        config = self_contained(config)
        writer_id = opts.get(OPT_WRITER_ID)
        if not writer_id:
            checkpoint = opts.get(OPT_CHECKPOINT) or config.spark.checkpoint_location
            if not checkpoint:
                raise ConfigError(
                    "sink option writer_id",
                    "cannot derive a stable writer id without a checkpoint location",
                    "set .option('checkpointLocation', ...) or .option('writer_id', ...)",
                )
            writer_id = derive_writer_id(config.name, checkpoint, config.catalog.properties)
        address = opts.get(OPT_PUBLISHER_ADDRESS) or None
        secret = opts.get(OPT_PUBLISHER_SECRET) or None
        if (address is None) != (secret is None):
            raise ConfigError(
                "sink option publisher.address",
                "publisher.address and publisher.secret go together",
                "set both (the pipeline does) or neither",
            )
        fail_task = faults.parse_fail_task(opts.get(faults.FAIL_TASK_OPTION))
        source = SourceOptions.parse(json.loads(opts[OPT_SOURCE])) if OPT_SOURCE in opts else None
        return cls(config, writer_id, address, secret, fail_task, source)

    def publisher(self) -> BatchPublisher:
        """The driver's server when the pipeline runs one, else this process's own client."""
        if self.publisher_address and self.publisher_secret:
            return RemotePublisher(self.publisher_address, self.publisher_secret)
        return local_publisher(self.config, self.writer_id)


@dataclass(frozen=True)
class IcefloeCommitMessage(WriterCommitMessage):
    """What one successful task attempt returns to the driver."""

    partition_id: int
    attempt: int
    output: TaskOutput = field(default_factory=TaskOutput)


def merge_messages(messages: Sequence[WriterCommitMessage | None], batch_id: int) -> PublishRequest:
    """One publish request from all task messages of a batch: files per table, and per source
    partition the furthest offset and newest timestamp."""
    files: dict[str, list[DataFileMeta]] = {}
    uuids: dict[str, str] = {}
    positions: dict[tuple[str, int], SourcePosition] = {}
    records = skipped = dead_lettered = 0
    for m in messages:
        if not isinstance(m, IcefloeCommitMessage):
            raise TypeError(f"batch {batch_id}: unexpected commit message {m!r}")
        out = m.output
        records += out.records
        skipped += out.skipped
        dead_lettered += out.dead_lettered
        for table, metas in out.files.items():
            files.setdefault(table, []).extend(metas)
        for table, table_uuid in out.table_uuids.items():
            if uuids.setdefault(table, table_uuid) != table_uuid:
                raise TableMismatchError(
                    f"batch {batch_id}: tasks wrote table {table} as two different tables "
                    f"({uuids[table]} and {table_uuid}); it was dropped and recreated"
                )
        merge_positions(positions, out.positions)
    seen: set[str] = set()
    for table_files in files.values():
        for meta in table_files:
            if meta.path in seen:
                raise ValueError(f"batch {batch_id}: file {meta.path} returned twice")
            seen.add(meta.path)
    return PublishRequest(
        batch_seq=batch_id,
        files={t: tuple(ms) for t, ms in files.items()},
        positions=tuple(positions[k] for k in sorted(positions)),
        table_uuids=uuids,
        records=records,
        skipped=skipped,
        dead_lettered=dead_lettered,
    )


class _ExecutorRuntime:
    """Per Python worker: the catalog, built once (Spark reuses workers across tasks). Tables
    and the converter are made per task, so schema and spec changes apply from the next batch."""

    _lock = threading.Lock()
    _cache: dict[str, _ExecutorRuntime] = {}

    def __init__(self, config: PipelineConfig) -> None:
        from pyiceberg.catalog import load_catalog

        from icefloe_spark.sink.tables import TableResolver

        self.config = config
        self.catalog: Catalog = load_catalog(config.catalog.name, **config.catalog.properties)
        self.resolver = TableResolver(self.catalog, config)

    @classmethod
    def get(cls, config: PipelineConfig) -> _ExecutorRuntime:
        key = config.model_dump_json()
        with cls._lock:
            if key not in cls._cache:
                cls._cache[key] = cls(config)
            return cls._cache[key]

    def prepare(self, data: pa.Table) -> tuple[dict[str, Table], RecordConverter]:
        """The tables this task writes (target tables, created and evolved as ``data``
        needs, and the dead-letter table) and the converter into their schemas."""
        return self.resolver.prepare(data)


def _batch_id_of_task() -> int | None:
    from pyspark import TaskContext

    ctx = TaskContext.get()
    raw = ctx.getLocalProperty("streaming.sql.batchId") if ctx is not None else None
    return int(raw) if raw is not None else None


class IcefloeStreamWriter(DataSourceStreamArrowWriter):
    """Tasks write files; the driver publishes them."""

    def __init__(self, options: SinkOptions) -> None:
        self.options = options

    def write(self, iterator: Iterator[pa.RecordBatch]) -> IcefloeCommitMessage:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        partition_id = ctx.partitionId() if ctx is not None else 0
        attempt = ctx.attemptNumber() if ctx is not None else 0
        batches = list(iterator)
        if batches and batches[0].schema.names == RANGE_ARROW_SCHEMA.names:
            if self.options.source is None:
                raise ConfigError(
                    "sink option source.options",
                    "the input rows are offset ranges (icefloe-kafka-ranges) but the sink "
                    "was not told how to read them",
                    "pass the source's reader options as JSON in .option('source.options', "
                    "...), as icefloe run does",
                )
            batches = read_ranges(self.options.source, batches)
        if not batches:
            return IcefloeCommitMessage(partition_id, attempt)
        from icefloe_spark.sink.task import write_task

        data = pa.Table.from_batches(batches)
        runtime = _ExecutorRuntime.get(self.options.config)
        tables, converter = runtime.prepare(data)
        written: list[str] = []
        try:
            output = write_task(
                data,
                tables,
                converter,
                on_file=written.append,
                errors=self.options.config.errors,
                pipeline=self.options.config.name,
            )
            faults.fail_task_if_chosen(
                self.options.fail_task, _batch_id_of_task(), partition_id, attempt, written
            )
        except BaseException:
            # this attempt's files will never be published: do not leave them behind
            _delete_quietly(tables, written)
            raise
        workergc.freeze_new()
        return IcefloeCommitMessage(partition_id, attempt, output)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803 - Spark's name
        request = merge_messages(messages, batchId)
        added = self.options.publisher().publish(request)
        log.info(
            "batch %s: %s (%d files, %d records)",
            batchId,
            "published" if added else "already published, replay ignored",
            request.file_count,
            request.records,
        )

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803 - Spark's name
        """Publish nothing and delete nothing.

        Spark also calls ``abort`` when ``commit`` raised, and a publish that raised may still
        have landed (a Kafka commit that timed out, or a broker that shows aborted
        transactions): the coordinator may then commit these very files, so deleting them
        could lose rows. They are left for orphan-file cleanup instead.
        """
        files = sum(
            len(metas)
            for m in messages
            if isinstance(m, IcefloeCommitMessage)
            for metas in m.output.files.values()
        )
        log.warning(
            "batch %s aborted; %d written files left in place (orphans unless a publish landed)",
            batchId,
            files,
        )


def _delete_quietly(tables: Mapping[str, Table], paths: Sequence[str]) -> None:
    """Best effort: an orphan file costs space, never correctness."""
    for table in tables.values():
        for path in paths:
            if not path.startswith(table.location().rstrip("/") + "/"):
                continue
            try:
                table.io.delete(path)
            except Exception:
                log.debug("could not delete %s", path, exc_info=True)


class IcefloeSink(DataSource):
    """``format("icefloe")``: see the module docstring."""

    @classmethod
    def name(cls) -> str:
        return SINK_NAME

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:  # noqa: N802 - Spark's name
        names = [f.name for f in schema.fields]
        if names != RANGE_ARROW_SCHEMA.names:
            check_columns(names)
        return IcefloeStreamWriter(SinkOptions.parse(dict(self.options)))


def sink_options(
    config: PipelineConfig,
    writer_id: str,
    publisher_address: str | None = None,
    publisher_secret: str | None = None,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The options the pipeline passes to ``format("icefloe")``. With a driver-side publisher
    the backend's section is left out: no executor or commit worker needs its credentials."""
    data = config.model_dump(mode="json")
    if publisher_address:
        data["coordination"] = {
            k: v for k, v in data["coordination"].items() if k != config.coordination.backend
        }
    out = {OPT_CONFIG: json.dumps(data), OPT_WRITER_ID: writer_id}
    if publisher_address and publisher_secret:
        out[OPT_PUBLISHER_ADDRESS] = publisher_address
        out[OPT_PUBLISHER_SECRET] = publisher_secret
    out.update(extra or {})
    return out
