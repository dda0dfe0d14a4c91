"""What pyiceberg's writer derives from a table's schema, spec and properties, kept per table
version instead of recomputed for every data file.

Why: a task of a stream fanned out to many tables writes a small file per table
(``write_data_files`` per table, ~125 rows at 1,000 tables), and about half of pyiceberg's
~3.6 ms per such file is work that is the same for every file of a table version: converting
the Arrow schema back to an Iceberg one (``pyarrow_to_schema``), sanitizing the column names,
the statistics plan, the Parquet path -> field id mapping, the writer's options, and reading
pyiceberg's configuration (``Config()`` walks the whole environment) twice (issue 27).

How, without re-implementing pyiceberg's writer: :func:`plan_for` keeps one :class:`WritePlan`
per (table uuid, schema id, spec id, format version, location, properties, Arrow schema of the
rows). The writer is given a copy of the table metadata whose schema and properties are the
plan's own objects, and :func:`install` wraps those pyiceberg functions (in the module that
calls them, ``pyiceberg.io.pyarrow``) so that, called with exactly a plan's objects, they
answer from the plan; any other call (other code, a plan evicted meanwhile) runs pyiceberg's
function. pyiceberg's configuration is read once per process for icefloe's writes (only while
one is running; a worker's environment does not change). Files and their metadata are the same
byte for byte as without the plans (``test_writeplan.py``). If a pyiceberg release renames a
wrapped function, the wrapper is simply not installed (and ``test_writeplan`` says so).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cachetools import LRUCache, cached

if TYPE_CHECKING:
    import pyarrow as pa
    from pyiceberg.schema import Schema
    from pyiceberg.table.metadata import TableMetadata

# plans kept: a worker writing for 1,000 tables keeps one each; more are rebuilt when used
MAX_PLANS = 4096
# the keyword arguments pyiceberg's writer passes to pyarrow_to_schema (a cached answer is kept
# per value of the last two; any other argument is not answered from a plan)
_TO_SCHEMA_ARGS = frozenset({"name_mapping", "downcast_ns_timestamp_to_us", "format_version"})


@dataclass(eq=False)
class WritePlan:
    """One table version's writer inputs and what pyiceberg derives from them (filled on first
    use by the wrapped functions). ``schema`` and ``properties`` are the objects the writer is
    given; the wrappers recognise them, and the derived sanitized schema, by identity."""

    schema: Schema
    properties: dict[str, str]
    arrow_schema: pa.Schema
    derived: dict[Any, Any] = field(default_factory=dict)
    # id -> object for every object the wrappers recognise (held, so its id is not reused)
    objects: dict[int, Any] = field(default_factory=dict)

    def owns(self, obj: object) -> bool:
        return self.objects.get(id(obj)) is obj


_lock = threading.Lock()
_plans: LRUCache[tuple[Any, ...], WritePlan] = LRUCache(MAX_PLANS)
# id of an object a live plan holds -> that plan (an evicted plan's entries go with it)
_by_id: weakref.WeakValueDictionary[int, WritePlan] = weakref.WeakValueDictionary()
_installed: dict[str, Callable[..., Any]] = {}  # wrapped name -> pyiceberg's function
_writing = 0  # icefloe writes in progress: pyiceberg's Config is cached only meanwhile
_config_read: Any = None  # pyiceberg's Config, read once


def plan_key(metadata: TableMetadata, arrow_schema: pa.Schema) -> tuple[Any, ...]:
    """What a plan is valid for. A table never reuses a schema or spec id for other contents
    (Iceberg's rule); properties and location are compared as they are."""
    return (
        metadata.table_uuid,
        metadata.current_schema_id,
        metadata.default_spec_id,
        metadata.format_version,
        metadata.location,
        tuple(sorted(metadata.properties.items())),
        arrow_schema,
    )


@cached(_plans, key=plan_key, lock=_lock)
def plan_for(metadata: TableMetadata, arrow_schema: pa.Schema) -> WritePlan:
    """The plan for writing rows of ``arrow_schema`` into this table version (kept for the
    :data:`MAX_PLANS` most recently used versions)."""
    schema = metadata.schema()
    plan = WritePlan(schema, dict(metadata.properties), arrow_schema)
    for obj in (schema, plan.properties, schema.name_mapping):
        _adopt(plan, obj)
    return plan


def _adopt(plan: WritePlan, obj: object) -> None:
    """Let the wrappers recognise ``obj`` as ``plan``'s. Plain assignments (atomic under the
    GIL): a race at worst makes a wrapper compute what it could have reused."""
    plan.objects[id(obj)] = obj
    _by_id[id(obj)] = plan


def _owner(obj: object) -> WritePlan | None:
    plan = _by_id.get(id(obj))
    return plan if plan is not None and plan.owns(obj) else None


def planned_metadata(metadata: TableMetadata, plan: WritePlan) -> TableMetadata:
    """A copy of ``metadata`` whose current schema and properties are the plan's objects
    (equal to the table's: the plan's key says so)."""
    current = metadata.current_schema_id
    schemas = [plan.schema if s.schema_id == current else s for s in metadata.schemas]
    return metadata.model_copy(update={"schemas": schemas, "properties": plan.properties})


@contextmanager
def writing() -> Iterator[None]:
    """Around an icefloe write (its files all written inside): the wrappers installed, and
    pyiceberg's configuration read once."""
    global _writing
    install()
    with _lock:
        _writing += 1
    try:
        yield
    finally:
        with _lock:
            _writing -= 1


def _derived(plan: WritePlan, key: Any, compute: Callable[[], Any]) -> Any:
    value = plan.derived.get(key)
    if value is None:
        value = compute()
        plan.derived[key] = value
    return value


def _to_schema(original: Callable[..., Any]) -> Callable[..., Any]:
    """``pyarrow_to_schema(rows' schema, name_mapping=the plan's, ...)``: the rows' Iceberg
    schema, once per plan (the rows' Arrow schema, field ids included, must be the plan's)."""

    def wrapped(provided: pa.Schema, *args: Any, **kwargs: Any) -> Any:
        plan = _owner(kwargs.get("name_mapping"))
        if (
            plan is None
            or args
            or not kwargs.keys() <= _TO_SCHEMA_ARGS
            or not provided.equals(plan.arrow_schema, check_metadata=True)
        ):
            return original(provided, *args, **kwargs)
        key = (
            "pyarrow_to_schema",
            kwargs.get("downcast_ns_timestamp_to_us"),
            kwargs.get("format_version"),
        )
        return _derived(plan, key, lambda: original(provided, **kwargs))

    return wrapped


def _sanitized(original: Callable[..., Any]) -> Callable[..., Any]:
    """``sanitize_column_names(the plan's schema)``: once per plan; the schema itself when
    nothing needed sanitizing (pyiceberg then writes that schema: it compares by value)."""

    def wrapped(schema: Schema) -> Any:
        plan = _owner(schema)
        if plan is None or schema is not plan.schema:
            return original(schema)

        def compute() -> Any:
            out = original(schema)
            out = schema if out == schema else out
            _adopt(plan, out)
            return out

        return _derived(plan, "sanitize_column_names", compute)

    return wrapped


def _per_schema(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """``name(a plan's schema[, the plan's properties])``: once per plan and schema."""

    def wrapped(schema: Schema, *args: Any) -> Any:
        plan = _owner(schema)
        if plan is None or any(a is not plan.properties for a in args):
            return original(schema, *args)
        return _derived(plan, (name, id(schema)), lambda: original(schema, *args))

    return wrapped


def _writer_kwargs(original: Callable[..., Any]) -> Callable[..., Any]:
    """``_get_parquet_writer_kwargs(the plan's properties)``: once per plan (a fresh copy
    each call, as pyiceberg's is)."""

    def wrapped(properties: dict[str, str]) -> Any:
        plan = _owner(properties)
        if plan is None:
            return original(properties)
        return dict(_derived(plan, "writer_kwargs", lambda: original(properties)))

    return wrapped


def _config(original: Callable[[], Any]) -> Callable[[], Any]:
    """``Config()``: read once per process while icefloe writes, else as pyiceberg does."""

    def wrapped() -> Any:
        global _config_read
        if not _writing:
            return original()
        if _config_read is None:
            _config_read = original()
        return _config_read

    return wrapped


_WRAPPERS: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "pyarrow_to_schema": _to_schema,
    "sanitize_column_names": _sanitized,
    "compute_statistics_plan": lambda f: _per_schema("compute_statistics_plan", f),
    "parquet_path_to_id_mapping": lambda f: _per_schema("parquet_path_to_id_mapping", f),
    "_get_parquet_writer_kwargs": _writer_kwargs,
    "Config": _config,
}


def install() -> None:
    """Wrap pyiceberg's per-file functions in ``pyiceberg.io.pyarrow``, once per process. A
    name the installed pyiceberg lacks is left alone (its work is then done per file)."""
    if _installed:
        return
    from pyiceberg.io import pyarrow as writer

    with _lock:
        if _installed:
            return
        for name, wrap in _WRAPPERS.items():
            original = getattr(writer, name, None)
            if original is not None:
                setattr(writer, name, wrap(original))
                _installed[name] = original


def clear() -> None:
    """Forget every plan (tests; a worker has no need to)."""
    global _config_read
    with _lock:
        _plans.clear()
        _config_read = None
