"""What the coordinator hands the committer and gets back, apart from the committer itself, so
the modules that judge files, summaries and branches can name them without importing it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pyiceberg.table import Table

from icefloe.events import DataFileMeta, FileContent, SourcePosition


@dataclass(frozen=True)
class PendingFile:
    """A file announced by a DataWritten event, with where that event sits in the channel."""

    meta: DataFileMeta
    writer_id: str
    batch_seq: int
    partition: str
    offset: int
    table_uuid: str | None = None
    source_positions: tuple[SourcePosition, ...] = ()
    """Where its batch reached in the source (its DataComplete's positions): unlike the channel
    offset, comparable with a rollback's source range across a backend swap."""

    @property
    def source_offsets(self) -> dict[str, dict[int, int]] | None:
        """``source_positions`` as topic -> partition -> next offset (None: none known)."""
        if not self.source_positions:
            return None
        out: dict[str, dict[int, int]] = {}
        for p in self.source_positions:
            out.setdefault(p.topic, {})[p.partition] = p.offset
        return out

    @property
    def is_key_file(self) -> bool:
        """Whether this is an upsert/CDC key file (resolved at commit time, never committed)."""
        return self.meta.content == FileContent.EQUALITY_DELETES


@dataclass(frozen=True)
class TableCommitRequest:
    """One table's share of a commit cycle.

    ``positions`` is the channel read position R: every DataWritten for this table before R
    is in ``files`` or already committed.
    """

    table: str
    commit_id: str
    files: tuple[PendingFile, ...]
    positions: Mapping[str, int]
    source_offsets: Mapping[str, Mapping[int, int]]
    fencing_token: int
    valid_through_ms: int | None = None
    channel_id: str | None = None
    """The identity of the channel ``positions`` and the files' offsets belong to."""
    live_writers: frozenset[str] | None = None
    """Writers the coordinator still hears from. Once ``RETIRE_AT`` others have watermarks in
    the summary, theirs are retired to a side file (see :mod:`icefloe.commit.retirement`);
    None: never."""


@dataclass(frozen=True)
class TableCommitResult:
    """The outcome of one table commit; ``snapshot_id`` is None when nothing was new."""

    table: str
    commit_id: str
    snapshot_id: int | None
    data_files: int
    records: int
    skipped_files: int
    added_files: int | None = None
    """Files the snapshot added, when merging small files changed their number (else
    ``data_files``)."""
    metadata_location: str | None = None
    """The table version this commit made, in which no rollback waits for its replay (the
    commit checked): a rollback watcher need not load it again. None when nothing was
    committed, when the outcome was only learnt later, or when a rollback is pending."""


def table_name(table: Table) -> str:
    """The name a request gives ``table`` (``namespace.table``), as error messages say it."""
    return ".".join(table.name())
