# mypy: disable-error-code="empty-body"
"""Hook specifications of the ``icefloe`` plugin system.

A plugin is any module or object registered under the ``icefloe`` entry-point group; the
built-in backends and codecs register exactly like a third party's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import pluggy
from pydantic import BaseModel

if TYPE_CHECKING:
    import pyarrow as pa

    from icefloe.channel import Backend
    from icefloe.config import PipelineConfig

PROJECT = "icefloe"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@dataclass(frozen=True)
class BackendContext:
    """What a backend factory is told besides its own config section."""

    group_id: str
    lease_ttl_s: float = 10.0
    #: absolute directory of the pipeline file (``config_dir``), None for a config built in
    #: code; resolve relative paths of the backend's section with :meth:`resolve`
    config_dir: Path | None = None
    #: the pipeline's ``source.bootstrap_servers``: a Kafka-protocol backend defaults to them
    #: (the control topic lives on the cluster the pipeline reads unless configured otherwise)
    source_bootstrap_servers: str | None = None

    def resolve(self, path: str | Path) -> Path:
        """``path`` made absolute against :attr:`config_dir` (the working directory when
        there is none), so it names the same file in the driver, executors and coordinator."""
        p = Path(path).expanduser()
        return p if p.is_absolute() else (self.config_dir or Path.cwd()) / p


@dataclass(frozen=True)
class BackendSpec:
    """A coordination backend: its config name, typed config model and factory, and the
    version of the backend contract (``icefloe.channel.CONTRACT_VERSION``) it implements.

    Write ``contract`` as a number (``contract=2``), never as the constant: a backend must
    claim a new contract only once it follows it. None (the default) is what backends written
    before contracts had versions declare, contract 1; core refuses, when it loads a backend,
    one of a contract it cannot drive (``icefloe.plugins.backends``)."""

    name: str
    config_model: type[BaseModel]
    factory: Callable[[Any, BackendContext], Backend]
    description: str = ""
    contract: int | None = None


@dataclass(frozen=True)
class DecodeContext:
    """Where a batch of raw values came from, for error messages that name the record.

    ``locate`` False: the caller finds the failing record itself (it splits the batch), so a
    codec may raise for the batch without spending time on naming the record."""

    topics: pa.Array
    partitions: pa.Array
    offsets: pa.Array
    locate: bool = True


class RecordCodec(Protocol):
    """Turns raw source values into Arrow columns of the target schema, a whole batch at a time
    (per-record Python objects cost most of the throughput budget)."""

    def decode(self, values: pa.Array, schema: pa.Schema, context: DecodeContext) -> pa.Table:
        """Decode binary ``values`` into a table, one row per value (a null value: a row of
        nulls), with ``schema``'s columns typed as closely as the format allows; columns it
        does not name may be kept. ``icefloe.records.conform.conform`` makes the exact table
        schema (names, aliases, casts); errors name the record through ``context``
        (:func:`icefloe.errors.record_error`)."""
        ...


# Schema metadata a codec may read: the caller matches names case-insensitively, so a codec
# that would drop fields not named in the schema should keep them instead.
CASE_INSENSITIVE_KEY = b"icefloe.case-insensitive"
# Schema metadata asking a codec to decode every field with the types it finds (no schema to
# follow): what schema inference and evolution look at (icefloe.records.evolution).
INFER_ALL_KEY = b"icefloe.infer-all"


def failing_prefix_end(arr: pa.Array, fn: Callable[[pa.Array], Any]) -> int:
    """The last index of the shortest prefix of ``arr`` that ``fn`` rejects (``arr`` as a whole
    is known to fail), by a binary search over prefixes: O(log n) vectorised calls. That element
    is not always at fault itself: it may only conflict with an earlier one. How a codec finds
    the record to name when a whole batch fails."""
    import pyarrow as pa  # here, not at the top: loading plugins needs no Arrow

    rejected = (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, OverflowError)
    lo, hi = 1, len(arr)
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            fn(arr.slice(0, mid))
        except rejected:
            hi = mid
        else:
            lo = mid + 1
    return lo - 1


@dataclass(frozen=True)
class CodecSpec:
    """A record format (json, avro, ...) and the factory that builds a codec from options."""

    name: str
    factory: Callable[[dict[str, Any]], RecordCodec]
    description: str = ""


Status = Literal["ok", "warn", "fail"]


@dataclass(frozen=True)
class Check:
    """One line of the `icefloe doctor` report, from core or a plugin's ``icefloe_doctor``.
    ``fail``: ``run`` would fail; ``warn``: it would run with a weaker guarantee or a
    surprise."""

    name: str
    status: Status
    detail: str


@dataclass(frozen=True)
class TableCommitted:
    """Notification that the coordinator committed one table."""

    group_id: str
    table: str
    commit_id: str
    snapshot_id: int | None
    data_files: int
    records: int
    valid_through_ms: int | None
    metadata_location: str | None = None
    """The table version the commit made, when no rollback waits in it
    (:attr:`icefloe.commit.request.TableCommitResult.metadata_location`)."""


class IcefloeHookSpecs:
    """The hooks a plugin may implement (each is optional)."""

    @hookspec
    def icefloe_register_backends(self) -> Sequence[BackendSpec]:
        """Return the coordination backends this plugin provides, each declaring the backend
        contract it implements (``BackendSpec.contract``)."""

    @hookspec
    def icefloe_register_codecs(self) -> Sequence[CodecSpec]:
        """Return the record codecs (source formats) this plugin provides."""

    @hookspec
    def icefloe_after_table_commit(self, event: TableCommitted) -> None:
        """Called after each successful table commit, for metrics, lineage or alerts.
        Exceptions are logged and never fail the commit that already happened."""

    @hookspec
    def icefloe_doctor(self, config: PipelineConfig) -> Sequence[Check]:
        """Checks `icefloe doctor` runs for this plugin's part of the pipeline (the Spark
        runner: the Kafka source and its topics, Java), as :class:`Check`s."""

    @hookspec
    def icefloe_source_lag(self, config: PipelineConfig) -> Mapping[str, int | None]:
        """Source records not yet committed, per target table (for `icefloe status`), from a
        plugin that knows the source (the Spark runner knows Kafka)."""

    @hookspec
    def icefloe_cli(self, app: Any) -> None:
        """Add commands to the ``icefloe`` CLI (a ``typer.Typer``); how the Spark runner adds
        ``run`` and ``demo`` without core knowing Spark."""
