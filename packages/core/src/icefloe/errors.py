"""Typed errors. Every failure a user can cause or meet has its own class, so callers and
tests can tell them apart without parsing messages."""

from __future__ import annotations


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
        hints: list[str] = []
        if close and close[0] != name:
            hints.append(f"did you mean '{close[0]}'?")
        target = name if name in KNOWN_BACKEND_PACKAGES else (close[0] if close else None)
        if target in KNOWN_BACKEND_PACKAGES and target not in installed:
            hints.append(f"install it with `pip install {KNOWN_BACKEND_PACKAGES[target]}`")
        hints.append("or set coordination.backend to one of the installed backends")
        super().__init__(
            f"coordination backend '{name}'{where} is not installed (installed: {listing}). "
            + "; ".join(hints)
            + "."
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


class CommitError(IcefloeError):
    """An Iceberg commit could not be made."""


class StaleFencingTokenError(CommitError):
    """The table records a newer coordinator's fencing token: this coordinator is a zombie."""


class TableMismatchError(CommitError):
    """The table is not the one the files were written for (dropped and recreated, or moved)."""


class FileOutsideTableError(CommitError):
    """A data file lies outside the table's location and is refused."""


class RecordConversionError(IcefloeError):
    """A source record does not fit the target table's schema."""

    def __init__(
        self, topic: str, partition: int, offset: int, field: str | None, problem: str
    ) -> None:
        self.topic = topic
        self.partition = partition
        self.offset = offset
        self.field = field
        where = f"{topic}[{partition}]@{offset}"
        what = f" field '{field}'" if field else ""
        super().__init__(f"record {where}{what}: {problem}")


class RowDeltaNotSupportedError(CommitError):
    """A commit request holds delete files; pyiceberg 0.12 cannot commit a row delta yet."""


class PartitionSpecChangedError(CommitError):
    """A data file was written with a partition spec that is no longer the table's default."""


class CommitHistoryLostError(CommitError):
    """The group committed to the table before, but its snapshots were expired from the
    branch's history, so what is already committed can no longer be told."""
