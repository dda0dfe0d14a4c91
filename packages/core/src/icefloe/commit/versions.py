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

from functools import cache
from typing import Any

from pyiceberg.catalog import Catalog
from pyiceberg.table import Table, TableProperties
from pyiceberg.table.metadata import TableMetadata

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
        """The known version of ``name`` when the catalog still names it; for a catalog
        without a cheap lookup, with ``after_screen``, the version the screening that just
        ran loaded; else None."""
        screened = name in self._screened
        self._screened.discard(name)
        known = self._known.get(name)
        if known is None:
            return None
        location = current_location(catalog, name)
        if location is None:  # no cheap lookup: only a commit right after its screening
            return _copy(known) if after_screen and screened else None
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


def without_retries(table: Table) -> Table:
    """``table`` with pyiceberg's own commit retries off (in this in-memory copy only).

    Why: pyiceberg 0.12 retries a failed commit by re-applying the same changes to the
    refreshed table; icefloe's commits must be planned again on the new head instead (the
    committer's idempotency and fencing checks, a compaction's choice of files, the
    quarantine's fence)."""
    metadata = table.metadata
    properties = {**metadata.properties, TableProperties.COMMIT_NUM_RETRIES: "0"}
    return with_metadata(
        table, metadata.model_copy(update={"properties": properties}), table.metadata_location
    )
