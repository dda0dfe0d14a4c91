"""The table versions a committer knows, so an unchanged table is not loaded again.

Loading a table (catalog lookup, reading and parsing its metadata.json) was a fifth of a
small commit's CPU, and the coordinator loaded every table twice per cycle (screen, then
commit). A committer keeps the metadata of the version it last loaded or committed, and
reuses it while the catalog still names that version: a metadata location names exactly
one immutable metadata file, so equal locations mean equal tables. Catalogs that can tell
the location without the full load are asked for it (:func:`current_location`); with the
others every load is a full load, except that a commit may use the version its own
screening loaded a moment before (the commit's requirements reject it if the branch moved,
and its retry loads afresh).
"""

from __future__ import annotations

import contextlib
from functools import cache
from typing import Any

from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import CommitFailedException
from pyiceberg.table import CommitTableResponse, Table, TableProperties
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.update import TableRequirement, TableUpdate

from icefloe.commit.caches import SharedCache

# Tables whose versions are kept in memory (the least recently committed dropped first). A
# version is the parsed metadata, which grows with the table's snapshots until they are
# expired: bounded so that thousands of long-history tables cannot hold gigabytes.
_CACHE_SIZE = 1024


def current_location(catalog: Catalog, name: str) -> str | None:
    """The metadata location the catalog names for table ``name`` now, by a single lookup
    that reads no metadata file; None when the catalog offers no such lookup (or the table
    does not exist)."""
    sql = _sql_catalog_type()
    if sql is None or not isinstance(catalog, sql):
        return None
    return _sql_location(catalog, name)


@cache
def _sql_catalog_type() -> type[Catalog] | None:
    try:  # an optional extra of pyiceberg (sqlalchemy)
        from pyiceberg.catalog.sql import SqlCatalog
    except ImportError:
        return None
    return SqlCatalog


def _sql_location(catalog: Any, name: str) -> str | None:
    """The ``metadata_location`` column of the table's row in a SQL catalog (the column the
    catalog's own commit compares and swaps)."""
    identifier = Catalog.identifier_to_tuple(name)
    values = {
        "catalog": catalog.name,
        "namespace": Catalog.namespace_to_string(identifier[:-1]),
        "table": identifier[-1],
    }
    with catalog.engine.connect() as connection:
        location = connection.execute(_sql_location_query(), values).scalar()
    return None if location is None else str(location)


@cache
def _sql_location_query() -> Any:
    """Built once: building a SQLAlchemy statement costs more than running this one."""
    from pyiceberg.catalog.sql import IcebergTables
    from sqlalchemy import bindparam, select

    return select(IcebergTables.metadata_location).where(
        IcebergTables.catalog_name == bindparam("catalog"),
        IcebergTables.table_namespace == bindparam("namespace"),
        IcebergTables.table_name == bindparam("table"),
    )


@cache
def _sql_swap_statement() -> Any:
    """The compare-and-swap of a table's row in pyiceberg's SQL catalog (the statement its
    ``commit_table`` runs), built once: building it cost more than running it."""
    from pyiceberg.catalog.sql import IcebergTables
    from sqlalchemy import bindparam, update

    return (
        update(IcebergTables)
        .where(
            IcebergTables.catalog_name == bindparam("catalog"),
            IcebergTables.table_namespace == bindparam("namespace"),
            IcebergTables.table_name == bindparam("table"),
            IcebergTables.metadata_location == bindparam("old_location"),
        )
        .values(
            metadata_location=bindparam("new_location"),
            previous_metadata_location=bindparam("old_location"),
        )
    )


class KnownVersions:
    """Per table: the metadata location and metadata of the version last loaded or committed,
    and whether the current cycle's screening just loaded it."""

    def __init__(self, maxsize: int = _CACHE_SIZE) -> None:
        self._known: SharedCache[str, Table] = SharedCache(maxsize)
        # tables whose screening just loaded them (each table is committed by one thread at
        # a time, and set.add/discard are atomic: no lock needed)
        self._screened: set[str] = set()

    def remember(self, name: str, table: Table) -> None:
        """Keep ``table`` as loaded or just committed (a copy: pyiceberg's commit updates
        the Table object it committed through)."""
        self._known.put(name, _copy(table))

    def screened(self, name: str) -> None:
        """The screening of ``name`` just loaded it: the commit that follows may use it."""
        self._screened.add(name)

    def reusable(self, catalog: Catalog, name: str, after_screen: bool) -> Table | None:
        """With ``after_screen``, the version the screening that just ran loaded or
        confirmed; else the known version of ``name`` when the catalog still names it; else
        None.

        Why no lookup after a screening: the commit asserts the version it planned on (the
        compare-and-swap of :func:`commit_known`, or the catalog's requirements), so a table
        that changed in between fails that attempt and the next one looks again; asking the
        catalog first cost one round trip per table and cycle for a change that is rare."""
        screened = name in self._screened
        self._screened.discard(name)
        known = self._known.get(name)
        if known is None:
            return None
        if after_screen and screened:
            return _copy(known)
        location = current_location(catalog, name)
        if location is None:  # no cheap lookup: load
            return None
        return _copy(known) if location == known.metadata_location else None

    def forget(self, name: str) -> None:
        """Our own write other than a commit changed ``name``: load it afresh next time."""
        self._known.pop(name)
        self._screened.discard(name)


def _copy(table: Table) -> Table:
    """A Table object of the same version (metadata is immutable: shared, not copied)."""
    return with_metadata(table, table.metadata, table.metadata_location)


def with_metadata(table: Table, metadata: TableMetadata, location: str) -> Table:
    """A Table object like ``table`` (same name, catalog, io) at another metadata version."""
    return Table(
        identifier=table.name(),
        metadata=metadata,
        metadata_location=location,
        io=table.io,
        catalog=table.catalog,
        config=table.config,
    )


class RetriesOff(Table):
    """A table version with pyiceberg's commit retries off in memory (:func:`without_retries`),
    which knows that version's metadata as the catalog stores it."""

    _stored: tuple[str, TableMetadata]

    @property
    def stored(self) -> TableMetadata | None:
        """The stored metadata of the version this object is; None once a commit through it
        (pyiceberg's ``Table`` moves itself to the committed version) made it another."""
        location, metadata = self._stored
        return metadata if location == self.metadata_location else None


def without_retries(table: Table) -> RetriesOff:
    """``table`` with pyiceberg's own commit retries off (in this in-memory copy only).

    Why: pyiceberg 0.12 retries a failed commit by re-applying the same changes to the
    refreshed table; icefloe's commits must be planned again on the new head instead (the
    committer's idempotency and fencing checks, a compaction's choice of files, the
    quarantine's fence)."""
    stored = (table.stored if isinstance(table, RetriesOff) else None) or table.metadata
    properties = {**stored.properties, TableProperties.COMMIT_NUM_RETRIES: "0"}
    off = RetriesOff(
        identifier=table.name(),
        metadata=stored.model_copy(update={"properties": properties}),
        metadata_location=table.metadata_location,
        io=table.io,
        catalog=table.catalog,
        config=table.config,
    )
    off._stored = (table.metadata_location, stored)
    return off


def commit_table(
    table: Table, requirements: tuple[TableRequirement, ...], updates: tuple[TableUpdate, ...]
) -> CommitTableResponse:
    """Commit ``updates`` to the catalog on top of the version ``table`` is, if
    ``requirements`` hold for it.

    Why not always the catalog's ``commit_table``: pyiceberg's SQL catalog loads the table
    again inside every commit (its row, its metadata file read and parsed) to validate the
    requirements and apply the updates, although the committer has just planned on a version
    it knows; that load was about a fifth of a small table commit's CPU at hundreds of tables
    per cycle (docs/benchmarks.md). For pyiceberg's SQL catalog, on a database that reports
    updated rows, and a version that came through :func:`without_retries` (so its stored
    metadata is known), :func:`commit_known` applies the updates to that version instead.
    Other catalogs, versions, and SQL catalogs whose ``commit_table`` a subclass replaced
    (it may do more than pyiceberg's) take the catalog's path; such a subclass may define
    ``icefloe_commit_known(table, requirements, updates)`` to be called instead."""
    catalog = table.catalog
    if isinstance(table, RetriesOff) and table.stored is not None:
        hook = getattr(catalog, "icefloe_commit_known", None)
        if hook is not None:
            response: CommitTableResponse = hook(table, requirements, updates)
            return response
        if _plain_sql(catalog):
            return commit_known(catalog, table, requirements, updates)
    response = catalog.commit_table(table, requirements, updates)
    return response


def _plain_sql(catalog: Any) -> bool:
    """Whether ``catalog`` commits as pyiceberg's SQL catalog does, with a compare-and-swap
    of the table's row that reports whether it swapped (pyiceberg locks the row instead on
    databases that do not count updated rows)."""
    sql = _sql_catalog_type()
    engine: Any = getattr(catalog, "engine", None)
    return (
        sql is not None
        and isinstance(catalog, sql)
        and type(catalog).commit_table is sql.commit_table
        and bool(engine.dialect.supports_sane_rowcount)
    )


def commit_known(
    catalog: Any,
    table: RetriesOff,
    requirements: tuple[TableRequirement, ...],
    updates: tuple[TableUpdate, ...],
) -> CommitTableResponse:
    """pyiceberg's SQL catalog commit on the stored version ``table`` is: the requirements
    validated and the updates staged and written by pyiceberg's own code, then the table's
    row swapped only where it still names that version (the catalog's compare-and-swap), so a
    version that is no longer current is refused with CommitFailedException, as a failed
    requirement is, and the caller plans again on the new one."""
    if table.stored is None:
        raise ValueError("commit_known needs a version whose stored metadata is known")
    base = with_metadata(table, table.stored, table.metadata_location)
    staged = catalog._update_and_stage_table(base, table.name(), requirements, updates)
    catalog._write_metadata(
        metadata=staged.metadata, io=staged.io, metadata_path=staged.metadata_location
    )
    identifier = Catalog.identifier_to_tuple(table.name())
    values = {
        "catalog": catalog.name,
        "namespace": Catalog.namespace_to_string(identifier[:-1]),
        "table": identifier[-1],
        "old_location": table.metadata_location,
        "new_location": staged.metadata_location,
    }
    with catalog.engine.begin() as connection:  # one transaction, committed on leaving
        swapped = connection.execute(_sql_swap_statement(), values).rowcount
    if swapped < 1:
        # refused for sure: nothing names the file just written
        with contextlib.suppress(Exception):
            staged.io.delete(staged.metadata_location)
        raise CommitFailedException(
            f"table '{'.'.join(identifier)}' changed since version {table.metadata_location}"
        )
    # pyiceberg's models take field names (populate_by_name); mypy's plugin knows only aliases
    return CommitTableResponse(  # type: ignore[call-arg]
        metadata=staged.metadata, metadata_location=staged.metadata_location
    )
