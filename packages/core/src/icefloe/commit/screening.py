"""The file rules: why a table can never take an announced file (another incarnation of the
table, outside its location, an old partition spec, a delete file, a key file it cannot
resolve, metadata it cannot describe, a small file already merged away, a file to merge that is
not a data file of the table). Each reason concerns one file alone, so the coordinator
quarantines just that file and commits the rest.

One exception: the files of a *keyed batch* (one writer batch of an upsert/CDC table, that is
the files of one ``(writer_id, batch_seq)`` for one table, with at least one key file) are
accepted or refused together (:func:`screen`). Its key file deletes the rows its data files
replace: keys applied without the new images lose the keys, images committed without the keys
duplicate them. A writer publishes one DataWritten per table and batch, so these files share
one channel offset too, and the dedupe rule covers all of them or none."""

from __future__ import annotations

import posixpath
import uuid
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from pyiceberg.schema import index_by_id
from pyiceberg.table import Table

from icefloe.commit.dedupe import CommitBoundary
from icefloe.commit.policy import TablePolicy
from icefloe.commit.request import PendingFile, table_name
from icefloe.errors import (
    DataFileMissingError,
    FileOutsideTableError,
    InvalidDataFileError,
    KeyedBatchRefusedError,
    NotADataFileError,
    PartitionSpecChangedError,
    RefusedFileError,
    RowDeltaNotSupportedError,
    RowDeltaTableError,
    TableMismatchError,
)
from icefloe.events import DataFileMeta, FileContent
from icefloe.records.datafiles import DataFileBuilder

if TYPE_CHECKING:  # Arrow loads where a file is read: the path rules here need none of it
    import pyarrow as pa

# Table properties under which files may legitimately live outside the table location.
_DATA_PATH_PROPERTIES = (
    "write.data.path",
    "write.object-storage.path",
    "write.folder-storage.path",
)
# URI schemes that name the same storage.
_SCHEME_ALIASES = {"": "file", "s3a": "s3", "s3n": "s3"}
# Iceberg reserves field ids from Integer.MAX_VALUE - 200 up for metadata and delete columns
# (a position-delete file's file_path and pos are 2147483546 and 2147483545)
_RESERVED_FIELD_IDS = 2**31 - 1 - 200
_FIELD_ID = b"PARQUET:field_id"


@dataclass(frozen=True)
class Screening:
    """A table's verdict on pending files before any commit: which can never be committed."""

    accepted: tuple[PendingFile, ...]
    refused: tuple[tuple[PendingFile, RefusedFileError], ...]


def screen(
    table: Table,
    files: Iterable[PendingFile],
    boundary: CommitBoundary,
    policy: TablePolicy,
    live: Collection[str] = frozenset(),
) -> Screening:
    """Sort ``files`` into those ``table`` may take and those it refuses for good. Files
    ``boundary`` covers, and files the branch holds (``live``: their paths, live at its head
    or taken off it), count as accepted: the commit drops them, and a file the table holds is
    no refused file. A keyed
    batch is refused whole when any of its files is (see the module docstring)."""
    rules = _FileRules.of(table)
    verdicts: list[tuple[PendingFile, RefusedFileError | None]] = []
    held: set[str] = set()
    for f in files:
        covered = boundary.holds(f, f.meta.path) or f.meta.path in live
        error = None if covered else _refusal(table, f, rules)
        if error is None and not covered and policy.merge_small_files:
            error = _unmergeable(table, f, policy.target_file_size_bytes)
        verdicts.append((f, error))
        if covered:
            held.add(f.meta.path)
    # a file written for another incarnation of the table (a dropped table of the same name
    # and location) is refused in every copy the table does not hold already: announced again
    # without a uuid (a writer under a new id, a forgery) it was committed while the copy with
    # the uuid was quarantined, its rows in both places (found by the simulation)
    foreign = {
        canonical_path(f.meta.path): e for f, e in verdicts if isinstance(e, TableMismatchError)
    }
    verdicts = [
        (f, e if e is not None or f.meta.path in held else foreign.get(canonical_path(f.meta.path)))
        for f, e in verdicts
    ]
    sunk = _sunk_keyed_batches(verdicts)
    accepted: list[PendingFile] = []
    refused: list[tuple[PendingFile, RefusedFileError]] = []
    for f, error in verdicts:
        # a file the table holds is never quarantined, not even with the rest of its batch
        sinks = error is None and f.meta.path not in held
        cause = sunk.get(batch_of(f)) if sinks else None
        if cause is not None:
            error = KeyedBatchRefusedError(
                f"table '{table_name(table)}': {f.meta.path} is refused with the rest of its "
                f"keyed batch (writer {f.writer_id} batch {f.batch_seq}), because "
                f"{cause[0].meta.path} is: {cause[1]}. A keyed batch is committed whole or not "
                "at all; recover the batch's files together (see docs/upsert.md)"
            )
        if error is None:
            accepted.append(f)
        else:
            refused.append((f, error))
    return Screening(tuple(accepted), tuple(refused))


def batch_of(f: PendingFile) -> tuple[str, int]:
    """The writer batch ``f`` was announced in: per table, one DataWritten of one
    ``(writer_id, batch_seq)`` (a replay under the same key is dropped before it gets here)."""
    return f.writer_id, f.batch_seq


def _sunk_keyed_batches(
    verdicts: Iterable[tuple[PendingFile, RefusedFileError | None]],
) -> dict[tuple[str, int], tuple[PendingFile, RefusedFileError]]:
    """Per keyed batch with a refused file, its first refused file and why."""
    keyed = {batch_of(f) for f, _ in verdicts if f.is_key_file}
    sunk: dict[tuple[str, int], tuple[PendingFile, RefusedFileError]] = {}
    for f, error in verdicts:
        if error is not None and batch_of(f) in keyed:
            sunk.setdefault(batch_of(f), (f, error))
    return sunk


def first_refusal(table: Table, files: Iterable[PendingFile]) -> RefusedFileError | None:
    """Why ``table`` can never take the first of ``files`` it refuses, or None."""
    rules = _FileRules.of(table)
    for f in files:
        error = _refusal(table, f, rules)
        if error is not None:
            return error
    return None


@dataclass(frozen=True)
class _FileRules:
    """What every file's check against one loaded table shares, prepared once: a commit
    carries up to 100,000s of files, and per-file setup cost as much as the checks."""

    roots: tuple[_Root, ...]
    table_uuid: str
    build: Callable[[DataFileMeta], object]

    @classmethod
    def of(cls, table: Table) -> _FileRules:
        metadata = table.metadata
        roots = [metadata.location] + [
            metadata.properties[p] for p in _DATA_PATH_PROPERTIES if metadata.properties.get(p)
        ]
        return cls(
            tuple(_split_root(r) for r in roots),
            str(metadata.table_uuid),
            DataFileBuilder(metadata).build,
        )


def _key_file_refusal(table: Table, f: PendingFile) -> RefusedFileError | None:
    """Why ``table`` cannot resolve the key file ``f``, or None."""
    from icefloe.commit import rowdelta

    try:
        fields = rowdelta.identifier_fields(table)
    except RowDeltaTableError as e:
        return RowDeltaTableError(f"{f.meta.path}: {e}")
    expected = tuple(field.field_id for field in fields)
    if tuple(sorted(f.meta.equality_ids or ())) != expected:
        return RowDeltaTableError(
            f"table '{table_name(table)}': key file {f.meta.path} names equality ids "
            f"{list(f.meta.equality_ids or ())}, but the table's identifier fields are "
            f"{list(expected)} (id_columns changed?); rewrite it with the current id columns"
        )
    # an applied key file is an orphan at once, so `icefloe maintain` deletes it in time
    return _missing(
        table,
        f,
        "Key files are never committed, so `icefloe maintain` deletes applied ones as orphans",
        "applied",
        "apply a batch without its keys",
    )


def _refusal(table: Table, f: PendingFile, rules: _FileRules) -> RefusedFileError | None:
    """Why ``table`` can never take ``f``, or None. Each reason concerns this file alone."""
    metadata = table.metadata
    path = f.meta.path
    key_file = f.is_key_file
    if key_file:
        error = _key_file_refusal(table, f)
        if error is not None:
            return error
    elif f.meta.content != FileContent.DATA:
        return RowDeltaNotSupportedError(
            f"table '{table_name(table)}': {path} is a delete file ({f.meta.content}); icefloe "
            "builds a row delta's position deletes itself from key files (equality-delete "
            "content on the table's identifier fields), so writers announce data and key files "
            "only"
        )
    if (
        f.table_uuid is not None
        and f.table_uuid != rules.table_uuid
        and not same_uuid(f.table_uuid, metadata.table_uuid)
    ):
        return TableMismatchError(
            f"table '{table_name(table)}' has UUID {metadata.table_uuid}, but {path} was "
            f"written for table UUID {f.table_uuid} (dropped and recreated?); refusing to "
            "commit it"
        )
    if not any(_inside(path, root) for root in rules.roots):
        return FileOutsideTableError(
            f"table '{table_name(table)}': {path} lies outside the table location "
            f"{metadata.location}; refusing to commit it"
        )
    if not key_file and f.meta.spec_id != metadata.default_spec_id:
        # pyiceberg 0.12's fast append writes one manifest with the default spec
        return PartitionSpecChangedError(
            f"table '{table_name(table)}': {path} was written with partition spec "
            f"{f.meta.spec_id}, but the table's default spec is now "
            f"{metadata.default_spec_id}; rewrite the file under the current spec"
        )
    try:
        rules.build(f.meta)
    except (ValueError, KeyError, TypeError) as e:
        return InvalidDataFileError(f"table '{table_name(table)}': cannot describe {path}: {e}")
    return None


def _unmergeable(table: Table, f: PendingFile, target: int) -> RefusedFileError | None:
    """Why a file a merge would read cannot be committed: it no longer exists (merged and
    deleted by an earlier cycle, so the live-path check cannot see it in the table), or it is
    not a data file of the table (:func:`content_refusal`)."""
    if f.meta.content != FileContent.DATA or f.meta.file_size_in_bytes >= target:
        return None
    missing = _missing(
        table,
        f,
        "merge_small_files deletes the files it merged once their commit landed",
        "committed (merged)",
        "commit a reference to a missing file",
    )
    return missing or content_refusal(table, f.meta)


def _missing(
    table: Table, f: PendingFile, deleter: str, done: str, refused: str
) -> DataFileMissingError | None:
    """A refusal of ``f`` when it no longer exists: ``deleter`` says who deletes such files
    once ``done``, ``refused`` what committing it would do."""
    if table.io.new_input(f.meta.path).exists():
        return None
    return DataFileMissingError(
        f"table '{table_name(table)}': {f.meta.path} no longer exists. {deleter}, "
        f"so this file was most likely {done} already and is announced again "
        f"(under another writer id?); otherwise it was lost. Refusing to {refused}"
    )


def content_refusal(table: Table, meta: DataFileMeta) -> RefusedFileError | None:
    """Why the Parquet file ``meta`` announces as data is no data file of ``table``, or None.

    Reads the file's footer, so only files a merge reads anyway are checked: a merge reads
    columns by field id, and would turn a position-delete file (Iceberg's reserved
    ``file_path``/``pos`` ids) or another table's file into rows of nulls. An equality-delete
    file holds table columns and cannot be told from data by its footer; icefloe's own key
    files are never named for the pipeline, so they are never merged
    (:mod:`icefloe.commit.ownership`). An unreadable footer (not Parquet) is refused; an I/O
    error is raised.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    if meta.file_format != "PARQUET":
        return None
    try:
        with table.io.new_input(meta.path).open() as stream:
            schema = pq.read_schema(stream)
    except pa.ArrowInvalid as e:
        return NotADataFileError(
            f"table '{table_name(table)}': {meta.path} is announced as a Parquet data file "
            f"but cannot be read as one ({e}); refusing to merge or commit it"
        )
    why = _not_data(_field_ids(schema), {i for s in table.metadata.schemas for i in index_by_id(s)})
    if why is None:
        return None
    return NotADataFileError(
        f"table '{table_name(table)}': {meta.path} is announced as a data file, but its "
        f"Parquet schema holds {why}: it is not a data file of this table; refusing to merge "
        "or commit it as data"
    )


def _not_data(ids: set[int], known: set[int]) -> str | None:
    """What in a file's field ids ``ids`` shows it is no data file of a table whose schemas
    have the field ids ``known``, or None."""
    reserved = sorted(i for i in ids if i >= _RESERVED_FIELD_IDS)
    if reserved:
        return f"Iceberg's reserved field ids {reserved} (a delete file)"
    foreign = sorted(ids - known)
    if foreign:
        return f"field ids {foreign} that no schema of the table has"
    return None if ids else "no Iceberg field ids"


def _field_ids(schema: pa.Schema) -> set[int]:
    """Every Iceberg field id in a Parquet file's Arrow schema, nested fields included."""
    import pyarrow as pa

    found: set[int] = set()
    stack: list[pa.Field] = list(schema)
    while stack:
        field = stack.pop()
        raw = (field.metadata or {}).get(_FIELD_ID)
        if raw is not None:
            found.add(int(raw))
        kind = field.type
        if pa.types.is_struct(kind):
            stack.extend(kind.field(i) for i in range(kind.num_fields))
        elif pa.types.is_list(kind) or pa.types.is_large_list(kind):
            stack.append(kind.value_field)
        elif pa.types.is_map(kind):
            stack.extend([kind.key_field, kind.item_field])
    return found


def same_uuid(text: str, table_uuid: uuid.UUID | None) -> bool:
    """Whether ``text`` (a UUID as an event carries it, in any spelling) names
    ``table_uuid``."""
    try:
        return uuid.UUID(text) == table_uuid
    except ValueError:
        return False


def _split(uri: str) -> tuple[str, str, str]:
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    return _SCHEME_ALIASES.get(scheme, scheme), parts.netloc, posixpath.normpath(parts.path)


_Root = tuple[str, str, str, str]  # raw prefix, then scheme, netloc, path (ending in "/")


def _split_root(root: str) -> _Root:
    """``root`` prepared for :func:`_inside`."""
    scheme, netloc, path = _split(root)
    return root.rstrip("/") + "/", scheme, netloc, path.rstrip("/") + "/"


def canonical_path(path: str) -> str:
    """``path`` under one name per object: ``s3a://`` and ``s3n://`` (Hadoop's spellings)
    become ``s3://``, so a file announced under either name is recognised as the same file."""
    scheme, sep, rest = path.partition("://")
    alias = _SCHEME_ALIASES.get(scheme.lower()) if sep else None
    return f"{alias}://{rest}" if alias is not None and alias != scheme else path


def lies_under(path: str, root: str) -> bool:
    """Whether ``path`` lies under the directory ``root`` ('..' normalised, so it cannot
    escape; ``s3a``/``s3n`` name ``s3``)."""
    return _inside(path, _split_root(root))


def _inside(path: str, root: _Root) -> bool:
    """Whether ``path`` lies under ``root``, normalising '..' so it cannot escape."""
    raw = root[0]
    if path.startswith(raw) and "/." not in path[len(raw) - 1 :] and "//" not in path[len(raw) :]:
        return True  # the common case, decided without parsing: nothing to normalise
    scheme, netloc, file_path = _split(path)
    return (scheme, netloc) == root[1:3] and file_path.startswith(root[3])
