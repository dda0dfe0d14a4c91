"""Row deltas: turn writers' key files into position deletes and commit them with the data.

Why this module exists: pyiceberg 0.12 reads position deletes but cannot read equality deletes,
and it has no API to write delete files or to add them to a snapshot. Upsert and CDC tables
therefore get, per batch, data files (the final row image of each key) and *key files* (Parquet
files holding only the identifier columns, announced as equality deletes, never committed). At
commit time this module finds the rows those keys replace and writes spec-valid position delete
files for them, then commits data and deletes in one snapshot.

This is the ONE module of icefloe that reaches into pyiceberg internals (``_MergeAppendFiles``,
``ManifestWriterV2``, ``_read_deletes`` and the Parquet statistics helpers of
``pyiceberg.io.pyarrow``); when pyiceberg gains a public row-delta API, only this module changes.

Resolution order: batches in the order given (the committer passes channel order). Every key of
batch B deletes the live rows with that key in the table's data files at the base snapshot
(minus rows already position-deleted) and in the data files of batches before B; then B's data
files become live. Candidate files are pruned by partition (partition fields whose source is an
identifier column) and by the identifier columns' lower/upper bounds before any is read, and
only the identifier columns are read.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyiceberg.conversions import from_bytes
from pyiceberg.io import FileIO
from pyiceberg.io.pyarrow import (
    _read_deletes,
    compute_statistics_plan,
    data_file_statistics_from_parquet_metadata,
    parquet_path_to_id_mapping,
    schema_to_pyarrow,
)
from pyiceberg.manifest import (
    DataFile,
    DataFileContent,
    FileFormat,
    ManifestEntry,
    ManifestFile,
)
from pyiceberg.partitioning import PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.table import Table, Transaction
from pyiceberg.table.snapshots import Operation
from pyiceberg.table.update.snapshot import _MergeAppendFiles, _SnapshotProducer
from pyiceberg.typedef import EMPTY_DICT, Record
from pyiceberg.types import (
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    NestedField,
    PrimitiveType,
    StringType,
    TimestampType,
    TimestamptzType,
    TimeType,
)

from icefloe.commit import fastappend
from icefloe.errors import RowDeltaTableError
from icefloe.records.changes import comparable_type, leaf_fields

FILE_PATH_FIELD_ID = 2147483546
POS_FIELD_ID = 2147483545
# the spec's position delete schema; pyiceberg's POSITIONAL_DELETE_SCHEMA types pos as int,
# the spec says long
POSITION_DELETE_SCHEMA = Schema(
    NestedField(FILE_PATH_FIELD_ID, "file_path", StringType(), required=True),
    NestedField(POS_FIELD_ID, "pos", LongType(), required=True),
)
_POSITION_DELETE_ARROW = pa.schema(
    [
        pa.field("file_path", pa.string(), False, {b"PARQUET:field_id": str(FILE_PATH_FIELD_ID)}),
        pa.field("pos", pa.int64(), False, {b"PARQUET:field_id": str(POS_FIELD_ID)}),
    ]
)
# full path bounds: pyiceberg (and Java) then index a single-file delete by its data file path
_DELETE_METRICS = {"write.metadata.metrics.default": "full"}
_FIELD_ID = b"PARQUET:field_id"
# identifier types whose bounds decode to values comparable with numpy arrays of the keys
_ORDERED_TYPES = (
    IntegerType,
    LongType,
    DateType,
    TimeType,
    TimestampType,
    TimestamptzType,
    StringType,
    DecimalType,
    FloatType,
    DoubleType,
)
# not cut by: NaN has no place in a sort that bounds (which leave NaN out) agree with
_FLOATS = (FloatType, DoubleType)


@dataclass(frozen=True)
class Batch:
    """One writer batch of an upsert/CDC table: its data files and its key files."""

    data_files: Sequence[DataFile]
    key_files: Sequence[DataFile]


@dataclass
class Resolution:
    """Rows to delete per data file path, and what pruning spared (for tests and metrics)."""

    positions: dict[str, np.ndarray[Any, np.dtype[np.int64]]] = field(default_factory=dict)
    targets: dict[str, DataFile] = field(default_factory=dict)
    candidates: int = 0  # (batch, file) pairs considered
    files_read: int = 0  # distinct data files whose identifier columns were read
    deleted_rows: int = 0


def identifier_fields(table: Table) -> list[NestedField]:
    """The table's identifier fields; raises RowDeltaTableError when it cannot take deltas."""
    metadata = table.metadata
    name = ".".join(table.name())
    if metadata.format_version < 2:
        raise RowDeltaTableError(
            f"table '{name}' is Iceberg format version {metadata.format_version}; upsert and "
            "CDC need format version 2 (position deletes). Upgrade it with "
            "`ALTER TABLE ... SET TBLPROPERTIES ('format-version'='2')` or recreate it"
        )
    if metadata.format_version > 2:
        # v3 forbids adding position delete files: deletes there are deletion vectors
        raise RowDeltaTableError(
            f"table '{name}' is Iceberg format version {metadata.format_version}; icefloe's "
            "upsert and CDC write position deletes, which only format version 2 allows"
        )
    schema = metadata.schema()
    ids = sorted(schema.identifier_field_ids)
    if not ids:
        raise RowDeltaTableError(
            f"table '{name}' has no identifier fields; upsert and CDC need them (id_columns)"
        )
    return [schema.find_field(i) for i in ids]


def resolve(
    table: Table, base_snapshot_id: int | None, batches: Sequence[Batch], *, prune: bool = True
) -> Resolution:
    """Find the rows the batches' keys replace, as new positions per data file.

    ``prune=False`` reads every live file (only to measure what pruning saves)."""
    fields = identifier_fields(table)
    # full names: an identifier field may be nested in a struct, and leaf names may repeat
    names = [table.metadata.schema().find_column_name(f.field_id) or f.name for f in fields]
    ids = [f.field_id for f in fields]
    # keys are matched by value: uuid columns as their 16 bytes (Arrow hashes no extension)
    arrow_schema = pa.schema(
        [
            pa.field(name, comparable_type(schema_to_pyarrow(f.field_type)), nullable=False)
            for name, f in zip(names, fields, strict=True)
        ]
    )
    io = table.io
    live: dict[str, DataFile] = {}
    dead: dict[str, np.ndarray[Any, np.dtype[np.bool_]]] = {}  # per data file: row deleted?
    delete_files: dict[str, list[DataFile]] = {}
    if base_snapshot_id is not None:
        for task in table.scan(snapshot_id=base_snapshot_id).plan_files():
            live[task.file.file_path] = task.file
            if task.delete_files:
                delete_files[task.file.file_path] = list(task.delete_files)
    read_deletes: dict[str, dict[str, np.ndarray[Any, np.dtype[np.int64]]]] = {}
    cache: dict[str, pa.Table] = {}
    result = Resolution()
    pruner = _Pruner(table, fields)

    def dead_rows(path: str, rows: int) -> np.ndarray[Any, np.dtype[np.bool_]]:
        # a mask, not a set of positions: marking and testing stay O(positions) per file
        mask = dead.get(path)
        if mask is None:
            mask = deleted_mask(io, path, rows, delete_files.get(path, ()), read_deletes)
            dead[path] = mask
        return mask

    for batch in batches:
        if batch.key_files:
            keys = _distinct(
                pa.concat_tables(
                    [_read_ids(io, k.file_path, ids, names, arrow_schema) for k in batch.key_files]
                )
            )
            if keys.num_rows:
                test = pruner.for_keys(keys) if prune else _all_keys(keys)
                for path, data_file in live.items():
                    result.candidates += 1
                    held = test(data_file)
                    if held is None:
                        continue
                    rows = cache.get(path)
                    if rows is None:
                        rows = _read_ids(io, path, ids, names, arrow_schema)
                        cache[path] = rows
                        result.files_read += 1
                    hit = _matching_positions(rows, held, names)
                    if not hit.size:
                        continue
                    mask = dead_rows(path, rows.num_rows)
                    new = hit[~mask[hit]]
                    if new.size:
                        mask[new] = True
                        previous = result.positions.get(path)
                        result.positions[path] = (
                            new if previous is None else np.union1d(previous, new)
                        )
                        result.targets[path] = data_file
                        result.deleted_rows += int(new.size)
        for data_file in batch.data_files:
            live[data_file.file_path] = data_file
    return result


def write_position_deletes(table: Table, resolution: Resolution) -> list[DataFile]:
    """Write one spec-valid position delete file per partition of the targeted data files."""
    groups: dict[tuple[int, tuple[Any, ...]], list[str]] = {}
    for path, target in resolution.targets.items():
        record = target.partition
        key = (target.spec_id or 0, tuple(record[i] for i in range(len(record))))
        groups.setdefault(key, []).append(path)
    stats_plan = compute_statistics_plan(POSITION_DELETE_SCHEMA, _DELETE_METRICS)
    mapping = parquet_path_to_id_mapping(POSITION_DELETE_SCHEMA)
    written: list[DataFile] = []
    for (spec_id, partition), paths in groups.items():
        paths.sort()
        rows = pa.table(
            {
                "file_path": pa.array(
                    np.repeat(
                        np.array(paths, dtype=object), [len(resolution.positions[p]) for p in paths]
                    ),
                    pa.string(),
                ),
                "pos": pa.array(np.concatenate([np.sort(resolution.positions[p]) for p in paths])),
            },
            schema=_POSITION_DELETE_ARROW,
        )
        location = table.location_provider().new_data_location(
            f"icefloe-deletes-{uuid.uuid4()}.parquet"
        )
        output = table.io.new_output(location)
        with (
            output.create(overwrite=True) as stream,
            pq.ParquetWriter(stream, schema=_POSITION_DELETE_ARROW) as writer,
        ):
            writer.write_table(rows)
        stats = data_file_statistics_from_parquet_metadata(
            parquet_metadata=writer.writer.metadata,
            stats_columns=stats_plan,
            parquet_column_mapping=mapping,
        )
        delete_file = DataFile.from_args(
            content=DataFileContent.POSITION_DELETES,
            file_path=location,
            file_format=FileFormat.PARQUET,
            partition=Record(*partition),
            file_size_in_bytes=len(output),
            sort_order_id=None,
            spec_id=spec_id,
            equality_ids=None,
            key_metadata=None,
            **stats.to_serialized_dict(),
        )
        delete_file.spec_id = spec_id  # from_args does not set it; the manifests need it
        written.append(delete_file)
    return written


def stage(
    tx: Transaction,
    branch: str | None,
    summary: dict[str, str],
    data_files: Iterable[DataFile],
    delete_files: Iterable[DataFile],
) -> int:
    """Add one snapshot with ``data_files`` and ``delete_files`` to ``tx``; its id."""
    data = list(data_files)
    deletes = list(delete_files)
    operation = fastappend.operation_of(data, deletes)
    producer = _RowDelta(operation, tx, tx._table.io, branch, summary, deletes)
    with producer:
        for f in data:
            producer.append_data_file(f)
    return producer.snapshot_id


def write_delete_manifest(
    producer: _SnapshotProducer[Any], spec_id: int, entries: Iterable[ManifestEntry]
) -> ManifestFile:
    """One DELETES manifest of ``entries`` (under spec ``spec_id``) for ``producer``'s
    snapshot: the row delta adds delete files in one, compaction merges them into one."""
    return fastappend.delete_manifest(
        producer.spec(spec_id),
        producer.schema(),
        producer.new_manifest_output(),
        producer.snapshot_id,
        producer._compression,
        entries,
    )


class _RowDelta(_MergeAppendFiles):
    """A merge append that also adds delete files, in their own DELETES manifest(s).

    Why subclass this one: it is what icefloe's appends use (same manifest merging, same
    fast-append treatment of existing manifests, same branch and summary handling), and the
    row delta only adds manifests; overriding ``_process_manifests`` (which sees the final
    list) and ``_summary`` is the smallest change that keeps the rest of pyiceberg's snapshot
    producer. Concurrency is validated by the committer: the branch-head requirement fails
    the commit if anyone committed in between, and the committer re-resolves on the new head.
    """

    def __init__(
        self,
        operation: Operation,
        transaction: Transaction,
        io: FileIO,
        branch: str | None,
        snapshot_properties: dict[str, str] = EMPTY_DICT,
        delete_files: Sequence[DataFile] = (),
    ) -> None:
        super().__init__(
            operation, transaction, io, branch=branch, snapshot_properties=snapshot_properties
        )
        self._added_delete_files = list(delete_files)

    def _process_manifests(self, manifests: list[ManifestFile]) -> list[ManifestFile]:
        merged = super()._process_manifests(manifests)
        for spec_id, files in fastappend.by_spec(self._added_delete_files):
            entries = fastappend.added_entries(self.snapshot_id, files)
            merged.append(write_delete_manifest(self, spec_id, entries))
        return merged

    def _summary(self, snapshot_properties: dict[str, str] = EMPTY_DICT) -> Any:
        # the summary collector counts delete files by their content: let it see them too
        data = self._added_data_files
        self._added_data_files = data + self._added_delete_files
        try:
            return super()._summary(snapshot_properties)
        finally:
            self._added_data_files = data


def positions_by_path(
    io: FileIO, delete_file: DataFile
) -> dict[str, np.ndarray[Any, np.dtype[np.int64]]]:
    """The positions a position delete file deletes, per data file path: read once and split
    by path in one sort (pyiceberg's reader filters the whole file once per path)."""
    if delete_file.file_format != FileFormat.PARQUET:
        return {
            path: positions.to_numpy().astype(np.int64)
            for path, positions in _read_deletes(io, delete_file).items()
        }
    with io.new_input(delete_file.file_path).open() as stream:
        rows = pq.read_table(stream, columns=["file_path", "pos"])
    encoded = pc.dictionary_encode(rows.column("file_path").combine_chunks())
    codes = encoded.indices.to_numpy(zero_copy_only=False)
    positions = rows.column("pos").to_numpy().astype(np.int64)
    order = np.argsort(codes, kind="stable")
    bounds = np.searchsorted(codes[order], np.arange(len(encoded.dictionary) + 1))
    return {
        path: positions[order[bounds[i] : bounds[i + 1]]]
        for i, path in enumerate(encoded.dictionary.to_pylist())
    }


def deleted_mask(
    io: FileIO,
    path: str,
    rows: int,
    delete_files: Iterable[DataFile],
    read: dict[str, dict[str, np.ndarray[Any, np.dtype[np.int64]]]],
) -> np.ndarray[Any, np.dtype[np.bool_]]:
    """Which of the ``rows`` rows of data file ``path`` its position ``delete_files`` delete.
    ``read`` keeps each delete file's positions per data file (:func:`positions_by_path`):
    one read per delete file, however many data files it targets."""
    mask = np.zeros(rows, dtype=np.bool_)
    for delete_file in delete_files:
        by_path = read.get(delete_file.file_path)
        if by_path is None:
            by_path = read[delete_file.file_path] = positions_by_path(io, delete_file)
        positions = by_path.get(path)
        if positions is not None:
            mask[positions[positions < rows]] = True
    return mask


def _all_keys(keys: pa.Table) -> Callable[[DataFile], pa.Table | None]:
    return lambda data_file: keys


def _read_ids(
    io: FileIO, path: str, ids: Sequence[int], names: Sequence[str], schema: pa.Schema
) -> pa.Table:
    """The identifier columns of a Parquet file, found by field id (so renames do not
    matter; inside structs too), as flat columns named and typed as ``schema`` says."""
    with io.new_input(path).open() as stream:
        parquet = pq.ParquetFile(stream)
        by_id = {
            int(raw): path
            for path, column in leaf_fields(parquet.schema_arrow)
            if (raw := (column.metadata or {}).get(_FIELD_ID)) is not None
        }
        missing = [i for i in ids if i not in by_id]
        if missing:
            raise ValueError(f"{path} has no column with field id(s) {missing}")
        rows = parquet.read(columns=sorted({by_id[i][0] for i in ids}))
    columns = []
    for i in ids:
        top, *inner = by_id[i]
        column = rows.column(top)
        if inner:
            column = pc.struct_field(column, inner)
        columns.append(column)
    return pa.table(columns, names=list(names)).cast(schema)


def _distinct(keys: pa.Table) -> pa.Table:
    return keys.group_by(keys.column_names, use_threads=False).aggregate([])


def _matching_positions(
    rows: pa.Table, keys: pa.Table, names: Sequence[str]
) -> np.ndarray[Any, np.dtype[np.int64]]:
    """Sorted row positions of ``rows`` whose key is in ``keys`` (vectorised)."""
    if len(names) == 1:
        ids, wanted = rows.column(0), keys.column(0)
        if len(wanted) > len(ids):
            # is_in builds a hash set of its value set on every call, and this runs once per
            # candidate file: a set of the file's ids picks the keys it may hold, instead of
            # a set of all the batch's keys built again for every file
            # (docs/benchmarks.md, "Upsert compaction": 1M keys against 100 files)
            wanted = wanted.filter(pc.is_in(wanted, value_set=ids.combine_chunks()))
        mask = pc.is_in(ids, value_set=wanted.combine_chunks())
        hits = np.flatnonzero(mask.to_numpy(zero_copy_only=False))
        return hits.astype(np.int64)
    numbered = rows.append_column("__icefloe_pos", pa.array(np.arange(rows.num_rows)))
    joined = numbered.join(keys, keys=list(names), join_type="left semi", use_threads=False)
    return np.sort(joined.column("__icefloe_pos").to_numpy()).astype(np.int64)


def _physical(values: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """Arrow values as Iceberg stores them in bounds and partitions (days, micros)."""
    if pa.types.is_date32(values.type):
        return values.cast(pa.int32())
    if pa.types.is_timestamp(values.type) or pa.types.is_time(values.type):
        return values.cast(pa.int64())
    return values


class _Pruner:
    """Decides, per data file, whether a batch's keys can occur in it: by partition values
    of partition fields sourced from identifier columns, and by each identifier column's
    lower/upper bounds. Conservative: anything it cannot decode keeps the file."""

    def __init__(self, table: Table, fields: Sequence[NestedField]) -> None:
        self._fields = list(fields)
        self._schema = table.metadata.schema()
        self._specs = table.metadata.specs()

    def for_keys(self, keys: pa.Table) -> Callable[[DataFile], pa.Table | None]:
        """Per data file, the keys it may hold (None: none). The keys are sorted by the first
        ordered identifier column and cut to a file's bounds on it: the files a compaction
        sorted hold disjoint key ranges, so each is matched against its share of the batch,
        not all of it (keys x files probes before; docs/benchmarks.md, "Upsert compaction")."""
        sorted_keys: list[tuple[int, PrimitiveType, Any]] = []
        sliced: int | None = None  # the field id the keys are sorted and cut by
        for f, column in zip(self._fields, keys.columns, strict=True):
            if not isinstance(f.field_type, _ORDERED_TYPES):
                continue
            values = _physical(column).to_numpy(zero_copy_only=False)
            if not sorted_keys and not isinstance(f.field_type, _FLOATS):
                # numpy's order, the one searchsorted below relies on
                order = np.argsort(values, kind="stable")
                keys, values, sliced = keys.take(order), values[order], f.field_id
            else:
                values = np.sort(values)
            sorted_keys.append((f.field_id, f.field_type, values))
        partition_sets: dict[int, list[tuple[int, frozenset[Any]]]] = {}
        for spec_id, spec in self._specs.items():
            partition_sets[spec_id] = self._partition_values(spec, keys)

        def may_hold(data_file: DataFile) -> pa.Table | None:
            for index, allowed in partition_sets.get(data_file.spec_id or 0, ()):
                if data_file.partition[index] not in allowed:
                    return None
            lower_bounds = data_file.lower_bounds or {}
            upper_bounds = data_file.upper_bounds or {}
            held = keys
            for field_id, field_type, values in sorted_keys:
                lower = lower_bounds.get(field_id)
                upper = upper_bounds.get(field_id)
                if lower is None or upper is None:
                    continue
                low = from_bytes(field_type, lower)
                high = from_bytes(field_type, upper)
                i = int(np.searchsorted(values, low, side="left"))
                if i >= len(values) or values[i] > high:
                    return None
                if field_id == sliced:
                    j = int(np.searchsorted(values, high, side="right"))
                    held = keys.slice(i, j - i)
            return held

        return may_hold

    def _partition_values(
        self, spec: PartitionSpec, keys: pa.Table
    ) -> list[tuple[int, frozenset[Any]]]:
        by_id = {f.field_id: i for i, f in enumerate(self._fields)}
        found: list[tuple[int, frozenset[Any]]] = []
        for index, pfield in enumerate(spec.fields):
            column = by_id.get(pfield.source_id)
            if column is None:
                continue  # partitioned by a non-key column: a key can be in any partition
            try:
                source_type = self._schema.find_type(pfield.source_id)
                transform = pfield.transform.pyarrow_transform(source_type)
                values = _physical(transform(keys.column(column).combine_chunks()))
                found.append((index, frozenset(values.to_pylist())))
            except Exception:  # no arrow transform for it here: do not prune by it
                continue
        return found
