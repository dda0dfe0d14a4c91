"""``icefloe doctor``: every check ``run`` depends on, one line each, non-zero when any would
make ``run`` fail.

Core checks what it knows (plugins, the backend and its server, the catalog, the tables);
plugins add theirs through the ``icefloe_doctor`` hook (the Spark runner: the Kafka source
and its topics, Java). Each check catches its own failure, so one unreachable server does
not hide the others' results.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from icefloe.config import PipelineConfig
from icefloe.hookspecs import Check as Check  # re-exported: plugins imported it from here

# client libraries that log every failed connection attempt: doctor reports the cause once
_NOISY_LOGGERS = ("psycopg.pool", "icefloe_kafka", "icefloe_spark.kafka", "icefloe_redis", "redis")


def cause_of(exc: BaseException) -> str:
    """The innermost message of an exception chain, one line (the cause, not the wrapper)."""
    seen: set[int] = set()
    inner = exc
    while id(inner) not in seen:
        seen.add(id(inner))
        nxt = inner.__cause__ or (None if inner.__suppress_context__ else inner.__context__)
        if nxt is None:
            break
        inner = nxt
    text = str(exc) if inner is exc else f"{exc} ({type(inner).__name__}: {inner})"
    return " ".join(text.split())


def attempt(name: str, fn: Callable[[], str]) -> Check:
    """Run ``fn`` (returns the ok detail); any exception is a failed check naming its cause."""
    try:
        return Check(name, "ok", fn())
    except Exception as exc:
        return Check(name, "fail", cause_of(exc))


@contextmanager
def quiet_clients(verbose: bool) -> Iterator[None]:
    """Silence client libraries' retry chatter for the duration (unless debugging)."""
    if verbose:
        yield
        return
    saved = {name: logging.getLogger(name).level for name in _NOISY_LOGGERS}
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


def backend_checks(config: PipelineConfig) -> list[Check]:
    """The backend: installed and configured, its server reachable, its durability settings."""
    from icefloe.channel import Backend
    from icefloe.plugins.backends import backend_config, open_backend

    name = config.coordination.backend

    def configured() -> str:
        backend_config(config)
        return f"installed, [coordination.{name}] valid"

    out = [attempt(f"backend {name}", configured)]
    if out[0].status == "fail":
        return out
    try:
        backend: Backend = open_backend(config)
    except Exception as exc:
        return [*out, Check(f"backend {name} server", "fail", cause_of(exc))]
    try:
        try:
            backend.probe()
            out.append(Check(f"backend {name} server", "ok", "reachable"))
        except NotImplementedError:
            out.append(Check(f"backend {name} server", "warn", "the backend cannot be probed"))
        except Exception as exc:
            out.append(Check(f"backend {name} server", "fail", cause_of(exc)))
            return out
        warnings = backend.doctor()
        if not warnings:
            out.append(Check(f"backend {name} durability", "ok", "no weakening setting found"))
        out.extend(Check(f"backend {name} durability", "warn", w) for w in warnings)
    finally:
        backend.close()
    return out


def catalog_checks(config: PipelineConfig) -> list[Check]:
    """The catalog answers, every table exists or is created by ``run``, and the store under
    the tables (and the warehouse) takes writes with the catalog's FileIO settings."""
    from pyiceberg.catalog import Catalog, load_catalog

    from icefloe.ops.storage import hint, probe_location, storage_locations

    holder: list[Catalog] = []

    def connect() -> str:
        catalog = load_catalog(config.catalog.name, **config.catalog.properties)
        catalog.list_namespaces()
        holder.append(catalog)
        return f"'{config.catalog.name}' answers"

    out = [attempt("catalog", connect)]
    if not holder:
        return out
    catalog = holder[0]
    existing: dict[str, bool | None] = {}
    for t in config.tables:
        existing[t.name] = None
        try:
            exists = existing[t.name] = catalog.table_exists(t.name)
        except Exception as exc:
            cause = cause_of(exc)
            out.append(Check(f"table {t.name}", "fail", hint(cause, catalog.properties) or cause))
            continue
        if exists:
            out.append(Check(f"table {t.name}", "ok", "exists"))
            out.extend(_metadata_advice(catalog, t.name))
        elif t.auto_create:
            out.append(Check(f"table {t.name}", "warn", "missing; run creates it (auto_create)"))
        else:
            out.append(
                Check(
                    f"table {t.name}",
                    "fail",
                    "does not exist; create it (or set auto_create = true)",
                )
            )
    try:
        locations = storage_locations(catalog, existing)
    except Exception as exc:
        locations = []
        cause = cause_of(exc)
        out.append(Check("storage", "fail", hint(cause, catalog.properties) or cause))
    for location in locations:
        out.append(
            attempt(f"storage {location}", functools.partial(probe_location, catalog, location))
        )
    return out + channel_checks(config, catalog)


def channel_checks(config: PipelineConfig, catalog: Any) -> list[Check]:
    """Every table's last commit came through the configured backend's channel or a drained
    one: the property ``run`` refuses on (:class:`icefloe.errors.ChannelChangedError`, after
    Spark started and a batch was published), so doctor fails where run would. The backend is
    opened only when a table records a channel that was not drained."""
    import uuid

    from icefloe.commit.committer import IcebergCommitter
    from icefloe.commit.summary import drained_property
    from icefloe.errors import ChannelIdentityError
    from icefloe.ops.tables import pipeline_tables
    from icefloe.plugins.backends import open_backend

    try:
        committer = IcebergCommitter.for_pipeline(catalog, config)
        recorded: list[str] = []
        for name in pipeline_tables(catalog, config):
            if not catalog.table_exists(name):
                continue  # nothing committed yet (its own line says whether that is fine)
            state = committer.state(name)
            channel = None if state is None else state.boundary.channel_id
            drained = catalog.load_table(name).properties.get(drained_property(config.name))
            if channel is not None and channel != drained:
                recorded.append(name)
        if not recorded:
            return []
        backend = open_backend(config)
        try:
            reader = backend.coordinator(f"doctor-{uuid.uuid4().hex[:8]}")
            try:
                channel_id = reader.channel_id()
            finally:
                reader.close()
        finally:
            backend.close()
    except Exception as exc:
        return [Check("channel identity", "fail", cause_of(exc))]
    out = []
    for name in recorded:
        try:
            committer.boundary(name, channel_id)
            out.append(Check(f"table {name} channel", "ok", "last committed through this one"))
        except ChannelIdentityError as exc:
            out.append(Check(f"table {name} channel", "fail", cause_of(exc)))
    return out


def _metadata_advice(catalog: Any, table: str) -> list[Check]:
    """Warnings about metadata settings that let an existing table's metadata grow without
    bound (icefloe sets them on tables it creates)."""
    from icefloe.ops.maintenance import table_property_advice  # pulls in pyiceberg

    try:
        properties = catalog.load_table(table).properties
    except Exception as exc:
        return [Check(f"table {table} metadata", "fail", cause_of(exc))]
    return [
        Check(f"table {table} metadata", "warn", w)
        for w in table_property_advice(table, properties)
    ]


def run_checks(config: PipelineConfig, verbose: bool = False) -> list[Check]:
    """Every check, core's then the plugins'."""
    from icefloe.plugins.manager import get_plugins

    plugins = get_plugins()
    with quiet_clients(verbose):
        out = [attempt("plugins", lambda: _plugins_ok(plugins))]
        if out[0].status == "ok":
            out += outdated_backends(plugins, config.coordination.backend)
        out += backend_checks(config)
        out += catalog_checks(config)
        out += plugins.doctor_checks(config)
    return out


def _plugins_ok(plugins: object) -> str:
    """The plugins load and name real hooks; the installed backends with the contract each
    implements and where it comes from."""
    from icefloe.plugins.backends import installed_backends
    from icefloe.plugins.manager import Plugins

    assert isinstance(plugins, Plugins)
    plugins.check_pending()
    listed = ", ".join(
        f"{b.spec.name} (contract {b.contract}, {b.origin})" for b in installed_backends(plugins)
    )
    return f"backends: {listed or 'none'}; {len(plugins.codecs())} codec(s)"


def outdated_backends(plugins: object, selected: str) -> list[Check]:
    """A warning per installed backend of a contract this core cannot drive, other than the
    selected one (whose own check fails, as ``run`` would): the pipeline runs, but a switch to
    it would not."""
    from icefloe.plugins.backends import installed_backends
    from icefloe.plugins.manager import Plugins

    assert isinstance(plugins, Plugins)
    return [
        Check(f"plugin {b.distribution}", "warn", f"{refusal}; not selected, so this pipeline runs")
        for b in installed_backends(plugins)
        if b.spec.name != selected and (refusal := b.refusal()) is not None
    ]
