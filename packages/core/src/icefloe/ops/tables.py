"""Every table a pipeline commits to, for the commands that act on all of them
(``icefloe drain``, ``icefloe status``, ``icefloe maintain``).

The coordinator commits whatever table a writer batch names: the ``[[tables]]`` entries, the
``[errors] dead_letter_table`` and the tables ``[dynamic_tables]`` routes records to, which no
configuration lists. A command that covered ``[[tables]]`` only left the others out: a drain
that did not mark them made the swapped pipeline stop with ``ChannelChangedError`` although
nothing was lost. So the others are found where the pipeline leaves traces: in the catalog, by
the table property every commit of the group writes
(:func:`icefloe.commit.summary.fencing_token_property`), and on the channel, by the tables its
batches name (the caller passes those it read).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError
from pyiceberg.typedef import Identifier

from icefloe.commit.summary import fencing_token_property
from icefloe.config import ChangeOptions, PipelineConfig


def pipeline_tables(
    catalog: Catalog,
    config: PipelineConfig,
    seen: Iterable[str] = (),
    known: set[str] | None = None,
) -> list[str]:
    """The ``[[tables]]`` entries in their order, then, sorted: the dead-letter table (when it
    exists), the tables of ``[dynamic_tables]`` the group committed to, and ``seen`` (tables
    that batches on the channel name, whether they exist or not). ``known``: see
    :func:`committed_tables`."""
    listed = [t.name for t in config.tables]
    extra = set(seen)
    dead_letter = config.errors.dead_letter_table
    if dead_letter is not None and catalog.table_exists(dead_letter):
        extra.add(dead_letter)
    if config.dynamic_tables is not None:
        extra |= committed_tables(catalog, config.name, config.dynamic_tables.namespace, known)
    return listed + sorted(extra - set(listed))


def change_options(config: PipelineConfig, table: str) -> ChangeOptions | None:
    """How records change ``table``, one of :func:`pipeline_tables`: its ``[[tables]]``
    entry, else (any other table but the dead-letter table is one ``[dynamic_tables]`` routes
    to) the ``[dynamic_tables]`` options; None for the dead-letter table (appended)."""
    entry = next((t for t in config.tables if t.name == table), None)
    if entry is not None or table == config.errors.dead_letter_table:
        return entry
    return config.dynamic_tables


def committed_tables(
    catalog: Catalog, group_id: str, namespace: str | None, known: set[str] | None = None
) -> set[str]:
    """The tables of ``namespace`` and the namespaces below it (of the whole catalog when
    None, as dynamic table names then carry their namespace) that ``group_id`` committed to:
    they carry its fencing-token property. Loads each table's metadata once.

    ``known``: names found by an earlier call, which a caller that asks again and again (the
    rollback watcher, every few seconds) keeps; a listed table named there is taken without
    loading it (the property, once set, stays with the table), and the tables found are added
    to it. Why: at 1,000 dynamic tables loading every table each time was half of the
    driver's CPU (docs/benchmarks.md)."""
    key = fencing_token_property(group_id)
    found: set[str] = set()
    for identifier in _tables_below(catalog, namespace):
        name = ".".join(identifier)
        if known is not None and name in known:
            found.add(name)
            continue
        try:
            properties = catalog.load_table(identifier).metadata.properties
        except NoSuchTableError:
            continue  # dropped since it was listed
        if key in properties:
            found.add(name)
    if known is not None:
        known |= found
    return found


def _tables_below(catalog: Catalog, namespace: str | None) -> Iterator[Identifier]:
    todo: list[Identifier] = (
        [Catalog.identifier_to_tuple(namespace)] if namespace else catalog.list_namespaces()
    )
    visited: set[Identifier] = set()
    while todo:
        current = todo.pop()
        if current in visited:
            continue
        visited.add(current)
        try:
            tables = catalog.list_tables(current)
            todo.extend(catalog.list_namespaces(current))
        except NoSuchNamespaceError:
            continue  # not created yet (no dynamic table so far), or dropped
        yield from tables
