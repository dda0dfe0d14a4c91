"""Typed errors. Every failure a user can cause or meet has its own class, so callers and
tests can tell them apart without parsing messages."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import pyarrow as pa


class IcefloeError(Exception):
    """Base of every error icefloe raises on purpose."""


class ConfigError(IcefloeError):
    """A configuration value is missing or wrong. Names the key, the bad value and the fix."""

    def __init__(self, key: str, problem: str, fix: str, value: object = None) -> None:
        self.key = key
        self.problem = problem
        self.fix = fix
        self.value = value
        shown = "" if value is None else f" (got {value!r})"
        super().__init__(f"config key '{key}': {problem}{shown}. Fix: {fix}")


class KeyedTableError(ConfigError):
    """An upsert/CDC table that cannot take keyed writes as it is: not format version 2, or
    its identifier fields are not the configured ``id_columns``. Raised before anything is
    written, so no file is made that the coordinator could not resolve by key."""


class PluginError(IcefloeError):
    """A plugin could not be found, loaded or registered."""


# backends published from this repository: the only package names icefloe ever suggests
# (suggesting `icefloe-backend-<whatever was typed>` would invite typosquatting)
KNOWN_BACKEND_PACKAGES = {
    "kafka": "icefloe-backend-kafka",
    "postgres": "icefloe-backend-postgres",
    "redis": "icefloe-backend-redis",
}


class UnknownBackendError(PluginError):
    """The configured coordination backend is not installed."""

    def __init__(self, name: str, installed: list[str], source: str | None = None) -> None:
        import difflib

        self.name = name
        self.installed = installed
        self.source = source
        listing = ", ".join(sorted(installed)) or "none"
        candidates = sorted(set(installed) | set(KNOWN_BACKEND_PACKAGES))
        close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
        where = f" (set by {source})" if source else ""
        guess = f"; did you mean '{close[0]}'?" if close and close[0] != name else "."
        target = name if name in KNOWN_BACKEND_PACKAGES else (close[0] if close else None)
        if target in KNOWN_BACKEND_PACKAGES and target not in installed:
            install = f"install it with `pip install {KNOWN_BACKEND_PACKAGES[target]}`"
        elif close:
            install = ""  # a misspelling of an installed backend: the guess is the fix
        else:
            install = (
                f"install the package that registers backend '{name}' (an icefloe plugin; "
                "`icefloe backends` lists what is installed)"
            )
        fixes = [install] if install else []
        if installed:
            fixes.append(f"set coordination.backend to one of: {listing}")
        super().__init__(
            f"coordination backend '{name}'{where} is not installed (installed: {listing})"
            f"{guess} Fix: " + " or ".join(fixes)
        )


class DuplicateBackendError(PluginError):
    """Two distributions register a backend under the same name."""

    def __init__(self, name: str, first: str, second: str) -> None:
        self.name = name
        self.distributions = (first, second)
        super().__init__(
            f"coordination backend '{name}' is registered twice: by '{first}' and by '{second}'. "
            "Uninstall one of them."
        )


class BackendContractError(PluginError):
    """An installed backend implements another version of the backend contract than this
    icefloe-core drives (``icefloe.channel.CONTRACT_VERSION``), so it is refused when it is
    loaded rather than failing later with a raw ``TypeError``. The message names the backend,
    its distribution and version, what to implement and the section of
    docs/backend-authors.md to read."""


class MissingBackendMethodError(BackendContractError, TypeError, NotImplementedError):
    """A backend class lacks a method of the contract (abstract, or a required test hook left
    at its default). A ``TypeError`` (what instantiating an abstract class always raised) and
    a ``NotImplementedError`` (what the test hooks raised), so older callers still catch it.
    ``missing`` holds qualified names such as ``CoordinatorChannel.channel_id``."""

    def __init__(self, message: str, missing: tuple[str, ...]) -> None:
        self.missing = missing
        super().__init__(message)


class UnknownCodecError(PluginError):
    """No installed codec handles the configured record format."""

    def __init__(self, name: str, installed: list[str]) -> None:
        self.name = name
        self.installed = installed
        listing = ", ".join(sorted(installed)) or "none"
        super().__init__(f"record format '{name}' has no codec (installed: {listing}).")


class EventDecodeError(IcefloeError):
    """Bytes read from a channel are not a control event this version can decode."""


class ChannelError(IcefloeError):
    """A coordination backend failed in a way the caller may retry."""


class WriterFencedError(ChannelError):
    """A newer instance of the same writer exists; this instance must stop publishing."""


class NotLeaderError(ChannelError):
    """This coordinator does not (or no longer) hold the leadership lease."""


class ChannelStalledError(ChannelError):
    """A read of the channel did not reach the end the channel reported before it began, in
    the time allowed (e.g. a Kafka transaction left open holds read_committed readers back).
    Nothing is decided from a read cut short: it would miss published batches."""


class CommitError(IcefloeError):
    """An Iceberg commit could not be made."""


class StaleFencingTokenError(CommitError):
    """The table records a newer coordinator's fencing token: this coordinator is a zombie."""


class CommitterProcessError(CommitError):
    """A committer process (``coordination.commit_processes``) died while it held the table's
    commit (killed, out of memory). The table stays pending; its next attempt, in a new
    process, finds a commit that landed before the death by its commit id."""


class RefusedFileError(CommitError):
    """One announced file can never be committed to its table. The coordinator quarantines
    that file and commits the rest, instead of failing the whole table every cycle."""


class PermanentTableError(CommitError):
    """The table itself cannot take commits until an operator acts (missing, history lost).
    After repeated attempts the coordinator quarantines its pending files, so the channel
    position can advance for every other table."""


class TableMissingError(PermanentTableError):
    """The target table does not exist in the catalog."""


class TableMismatchError(RefusedFileError):
    """The table is not the one the files were written for (dropped and recreated, or moved)."""


class FileOutsideTableError(RefusedFileError):
    """A data file lies outside the table's location and is refused."""


class InvalidDataFileError(RefusedFileError):
    """A file's announced metadata cannot be described against the table (bad partition or
    statistics for the table's schema)."""


class NotADataFileError(RefusedFileError):
    """A file announced as data is not a data file of its table: its Parquet schema holds
    Iceberg's reserved delete columns (a position-delete file) or field ids no schema of the
    table has. Merging it would invent rows; committing it as data would too."""


class DataFileMissingError(RefusedFileError):
    """An announced data or key file no longer exists. With ``merge_small_files`` the
    coordinator deletes files it merged once their commit landed, and ``icefloe maintain``
    deletes applied key files as orphans, so such a file announced again afterwards (e.g. under
    another writer id) is gone: its rows, or its deletes, are in the table already."""


class RecordConversionError(IcefloeError):
    """A source record cannot be written: it does not decode, route or fit the table schema.

    ``kind`` says which (``decode``, ``route``, ``conform``), ``table`` the target table when
    known, ``fix`` how to get past it (appended to the message)."""

    kind = "decode"

    def __init__(
        self,
        topic: str,
        partition: int,
        offset: int,
        field: str | None,
        problem: str,
        *,
        table: str | None = None,
        fix: str | None = None,
    ) -> None:
        self.topic = topic
        self.partition = partition
        self.offset = offset
        self.field = field
        self.problem = problem
        self.table = table
        self.fix = fix
        where = f"{topic}[{partition}]@{offset}"
        what = f" field '{field}'" if field else ""
        into = f" (table {table})" if table else ""
        hint = f". Fix: {fix}" if fix else ""
        super().__init__(f"record {where}{what}{into}: {problem}{hint}")

    def with_(self, *, table: str | None = None, fix: str | None = None) -> RecordConversionError:
        """The same error of the same class, with the target table or a fix added."""
        return type(self)(
            self.topic,
            self.partition,
            self.offset,
            self.field,
            self.problem,
            table=table or self.table,
            fix=fix or self.fix,
        )

    def __reduce__(self) -> tuple[object, ...]:
        # keyword-only arguments: default pickling (Spark ships task errors) would drop them
        args = (self.topic, self.partition, self.offset, self.field, self.problem)
        return (_rebuild_record_error, (type(self), args, self.table, self.fix))


def _rebuild_record_error(
    cls: type[RecordConversionError],
    args: tuple[str, int, int, str | None, str],
    table: str | None,
    fix: str | None,
) -> RecordConversionError:
    return cls(*args, table=table, fix=fix)


class RecordDecodeError(RecordConversionError):
    """The codec cannot decode the record's value (malformed JSON/Avro, a tombstone when
    tombstones are errors)."""

    kind = "decode"


class RecordRouteError(RecordConversionError):
    """No target table takes the record (its route field is missing, null or has a value no
    table lists)."""

    kind = "route"


class RecordConformError(RecordConversionError):
    """The record does not fit the target table's schema (wrong type, null or missing
    required field)."""

    kind = "conform"


class RecordPositions(Protocol):
    """Where each row of a batch came from: what :func:`record_error` reads of a codec's
    ``icefloe.hookspecs.DecodeContext`` (a protocol, so errors import no other module)."""

    @property
    def topics(self) -> pa.Array: ...

    @property
    def partitions(self) -> pa.Array: ...

    @property
    def offsets(self) -> pa.Array: ...


def record_error(
    context: RecordPositions | None,
    row: int,
    field: str | None,
    problem: str,
    error: type[RecordConversionError] = RecordDecodeError,
) -> RecordConversionError:
    """A RecordConversionError (by default a decode error, what codecs raise) for ``row`` of
    the batch ``context`` describes."""
    if context is None or row >= len(context.offsets):
        return error("<batch>", -1, row, field, f"row {row}: {problem}")
    return error(
        str(context.topics[row].as_py()),
        int(context.partitions[row].as_py()),
        int(context.offsets[row].as_py()),
        field,
        problem,
    )


class RowDeltaNotSupportedError(RefusedFileError):
    """A commit request holds delete files; pyiceberg 0.12 cannot commit a row delta yet."""


class RowDeltaTableError(RowDeltaNotSupportedError):
    """A table cannot take upsert/CDC key files: it is format version 1 (no position deletes),
    has no identifier fields, or a key file's equality ids are not its identifier fields."""


class PartitionSpecChangedError(RefusedFileError):
    """A data file was written with a partition spec that is no longer the table's default."""


class KeyedBatchRefusedError(RefusedFileError):
    """A file of an upsert/CDC writer batch the table would take by itself, refused because
    another file of the same batch is: a keyed batch's keys and row images are committed
    together or not at all (one half alone loses or duplicates keys)."""


class CommitHistoryLostError(PermanentTableError):
    """The group committed to the table before, but its snapshots were expired from the
    branch's history, so what is already committed can no longer be told."""


class RollbackPendingError(CommitError):
    """The table was rolled back below what the pipeline committed, and the replay of the
    rolled-back source range has not arrived yet: its other files wait (committing them
    first would record offsets past rows the table no longer holds). Not permanent.
    ``replay_writer``: the writer id of the replay batch the files wait for (None: unknown)."""

    def __init__(self, message: str, replay_writer: str | None = None) -> None:
        super().__init__(message)
        self.replay_writer = replay_writer

    def __reduce__(self) -> tuple[object, ...]:
        # default pickling (committer processes, Spark tasks) would drop the writer id
        return (type(self), (str(self), self.replay_writer))


class RollbackNotReplayableError(IcefloeError):
    """A rollback that icefloe cannot replay exactly (a keyed table, or no recorded start for
    a source partition). Nothing is replayed; the message names the operator's way out."""


class ChannelIdentityError(IcefloeError):
    """The channel is not the one the tables' commits were recorded with, or it lost events
    (recreated, restored from a backup, restarted without persistence, swapped without a
    drain). Deliberately not a :class:`ChannelError`: retrying cannot fix it; the message
    names the recovery."""


class ChannelChangedError(ChannelIdentityError):
    """A table's last commit came through another channel that was not drained."""


class ChannelResetError(ChannelIdentityError):
    """The channel holds fewer events than positions recorded earlier prove it had."""


class WriterRegressionError(IcefloeError):
    """A writer id would publish batch numbers it has used before: its Spark checkpoint does
    not know batches the channel or a table already holds for it (a fresh or older checkpoint
    under an explicit ``writer_id``). Its new batches would be dropped as replays, so the
    start is refused; the message names the fix."""


class MaintenanceError(IcefloeError):
    """``icefloe maintain`` could not finish a step on a table (the store refused a request):
    the message names the table, the step and what to check. What was done before stays
    done; no file a snapshot references is touched."""
