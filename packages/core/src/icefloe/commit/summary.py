"""What a table records for a pipeline: the snapshot-summary keys of ``docs/architecture.md``
(the boundary's own are in :mod:`icefloe.commit.dedupe`), the table properties that repeat or
fence them, and how a :class:`RecordedCommit` is read back from either. Kept in one place so
writing and reading a key cannot drift apart."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pyiceberg.table import Table
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.snapshots import Snapshot, ancestors_of

from icefloe.commit.dedupe import CommitBoundary, max_merge
from icefloe.commit.request import TableCommitRequest, table_name
from icefloe.errors import CommitError

GROUP_ID_KEY = "icefloe.group-id"
COMMIT_ID_KEY = "icefloe.commit-id"
SOURCE_OFFSETS_KEY = "icefloe.source-offsets"
FENCING_TOKEN_KEY = "icefloe.fencing-token"
VALID_THROUGH_KEY = "icefloe.valid-through-ms"
BRANCH_ROOT_KEY = "icefloe.branch-root"
STATE_KEY = "icefloe.state"
DRAINED_KEY = "icefloe.channel-drained"
SEQUENCE_NUMBER_KEY = "sequence-number"  # in the value of state_property, next to snapshot-id


def fencing_token_property(group_id: str) -> str:
    """The table property holding the highest fencing token of ``group_id`` that committed."""
    return f"{FENCING_TOKEN_KEY}.{group_id}"


def state_property(group_id: str, branch: str) -> str:
    """The table property repeating the group's newest summary on ``branch`` (with its snapshot
    id), written in the same transaction as the append: expiring snapshots cannot lose it."""
    return f"{STATE_KEY}.{group_id}.{branch}"


def drained_property(group_id: str) -> str:
    """The table property naming the channel ``icefloe drain`` emptied for ``group_id``: the
    one channel from which a pipeline may move to another without refusal."""
    return f"{DRAINED_KEY}.{group_id}"


@dataclass(frozen=True)
class RecordedCommit:
    """What the newest snapshot of this group on the branch records: the commit, the channel
    boundary, source offsets, fencing token and valid-through timestamp."""

    snapshot_id: int
    commit_id: str
    boundary: CommitBoundary
    source_offsets: dict[str, dict[int, int]]
    fencing_token: int
    valid_through_ms: int | None

    @property
    def positions(self) -> dict[str, int]:
        return dict(self.boundary.positions)

    @property
    def watermarks(self) -> dict[str, int]:
        return dict(self.boundary.watermarks)

    @classmethod
    def from_summary(cls, snapshot_id: int, summary: Mapping[str, str | None]) -> RecordedCommit:
        """Raises ValueError/TypeError/AttributeError when the summary is unreadable."""
        valid_through = summary.get(VALID_THROUGH_KEY)
        return cls(
            snapshot_id=snapshot_id,
            commit_id=str(summary.get(COMMIT_ID_KEY)),
            boundary=CommitBoundary.from_summary(summary),
            source_offsets={
                str(topic): {int(p): int(o) for p, o in offsets.items()}
                for topic, offsets in json.loads(summary.get(SOURCE_OFFSETS_KEY) or "{}").items()
            },
            fencing_token=int(summary.get(FENCING_TOKEN_KEY)),  # type: ignore[arg-type]
            valid_through_ms=None if valid_through is None else int(valid_through),
        )

    @classmethod
    def of_snapshot(cls, snapshot: Snapshot) -> RecordedCommit:
        """What ``snapshot`` (one of the group's) records; CommitError when unreadable."""
        summary = snapshot.summary
        assert summary is not None  # checked by the caller
        try:
            return cls.from_summary(snapshot.snapshot_id, summary)
        except (TypeError, ValueError, AttributeError) as e:
            # without a readable state the committer cannot know what is already in the table
            raise CommitError(
                f"snapshot {snapshot.snapshot_id} carries an unreadable icefloe summary: {e}"
            ) from e


def find_recorded(
    head: Snapshot | None, metadata: TableMetadata, group_id: str
) -> tuple[RecordedCommit | None, bool]:
    """The record of the newest snapshot of ``group_id`` in the ancestry of ``head``, and
    whether that ancestry is cut short by expired snapshots."""
    oldest = None
    for snapshot in ancestors_of(head, metadata):
        if of_group(snapshot, group_id):
            return RecordedCommit.of_snapshot(snapshot), False
        oldest = snapshot
    return None, oldest is not None and _cut_short(oldest)


def of_group(snapshot: Snapshot, group_id: str) -> bool:
    """Whether ``snapshot`` is a commit of the pipeline ``group_id``."""
    summary = snapshot.summary
    return summary is not None and summary[GROUP_ID_KEY] == group_id


def _cut_short(oldest: Snapshot) -> bool:
    """Whether ``oldest``, the oldest snapshot still reachable, had ancestors once."""
    if oldest.parent_snapshot_id is not None:
        return True  # its parent was expired (Iceberg Java keeps the dangling id)
    # pyiceberg's expiry clears the parent id instead; a true root holds only the files it
    # added and removes none, so more files in total, or any removed, mean it had a parent
    # (a rewrite's `delete` of every file holds none at all, yet had one)
    summary = oldest.summary
    if summary is None:
        return False
    try:
        total = int(summary["total-data-files"] or 0)
        added = int(summary["added-data-files"] or 0)
        removed = int(summary["deleted-data-files"] or 0)
    except ValueError:
        return False
    return total > added or removed > 0


def kept_state(snapshot_id: int, sequence_number: int, summary: Mapping[str, Any]) -> str:
    """The value of :func:`state_property` for the group's snapshot ``snapshot_id``. Why the
    sequence number: once that snapshot is expired, it still tells whether the branch's line
    passes below it (a rollback) or begins after it (expired by another engine), see
    :func:`kept_sequence_number`."""
    kept: dict[str, Any] = {"snapshot-id": snapshot_id, "summary": summary}
    if sequence_number > 0:  # format v1 numbers no snapshot
        kept[SEQUENCE_NUMBER_KEY] = sequence_number
    return compact_json(kept)


def kept_sequence_number(table: Table, group_id: str, branch: str) -> int | None:
    """The sequence number of the snapshot :func:`state_property` names: the snapshot's own
    while it exists, else the one the property records (None: written by an icefloe version
    that did not record it, or a format v1 table)."""
    raw = table.metadata.properties.get(state_property(group_id, branch))
    if raw is None:
        return None
    kept = json.loads(raw)
    snapshot = table.metadata.snapshot_by_id(int(kept["snapshot-id"]))
    number = kept.get(SEQUENCE_NUMBER_KEY) if snapshot is None else snapshot.sequence_number
    return int(number) if number else None


def kept_record(table: Table, group_id: str, branch: str) -> RecordedCommit | None:
    """The record the table property :func:`state_property` keeps, if any."""
    prop = state_property(group_id, branch)
    raw = table.metadata.properties.get(prop)
    if raw is None:
        return None
    try:
        kept = json.loads(raw)
        return RecordedCommit.from_summary(int(kept["snapshot-id"]), kept["summary"])
    except (ValueError, KeyError, TypeError) as e:
        raise CommitError(
            f"table '{table_name(table)}': property {prop} is unreadable ({e}); restore it "
            "from the group's last snapshot summary or remove it"
        ) from e


def property_token(table: Table, group_id: str) -> int | None:
    """The fencing token the table property :func:`fencing_token_property` holds, if any."""
    raw = table.metadata.properties.get(fencing_token_property(group_id))
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError as e:
        raise CommitError(
            f"table '{table_name(table)}': property {fencing_token_property(group_id)} is not "
            f"an integer ({raw!r}); fix or remove it"
        ) from e


def recorded_token(table: Table, group_id: str, state: RecordedCommit | None) -> int | None:
    """The highest token the table knows for the group: its property or its last snapshot."""
    candidates = (property_token(table, group_id), None if state is None else state.fencing_token)
    return max((t for t in candidates if t is not None), default=None)


def new_summary(
    group_id: str,
    request: TableCommitRequest,
    state: RecordedCommit | None,
    boundary: CommitBoundary,
) -> dict[str, str]:
    """Summary properties of the new snapshot; positions and watermarks never regress."""
    old_offsets = {} if state is None else state.source_offsets
    offsets = {
        topic: max_merge(old_offsets.get(topic, {}), request.source_offsets.get(topic, {}))
        for topic in sorted(set(old_offsets) | set(request.source_offsets))
    }
    summary = {
        GROUP_ID_KEY: group_id,
        COMMIT_ID_KEY: request.commit_id,
        **boundary.to_summary(),
        SOURCE_OFFSETS_KEY: compact_json(offsets),
        FENCING_TOKEN_KEY: str(request.fencing_token),
    }
    if request.valid_through_ms is not None:
        summary[VALID_THROUGH_KEY] = str(request.valid_through_ms)
    return summary


@dataclass(frozen=True)
class RowCounts:
    """The rows a snapshot holds, from its summary (no scan): Iceberg's ``total-records``
    counts every row of the data files, deleted ones included, so an upsert/CDC table would
    look several times its size. A position delete removes exactly one row (the committer
    never deletes a row twice), so records minus position deletes is exact; an equality delete
    removes any number of rows, so with any the live count is only an upper bound."""

    records: int  # rows in the data files (``total-records``)
    position_deletes: int  # ``total-position-deletes``
    equality_deletes: int  # ``total-equality-deletes``: rows they remove are unknown

    @classmethod
    def of(cls, summary: Mapping[str, str | None]) -> RowCounts | None:
        """The counts a snapshot summary records; None when it records no total."""
        records = summary.get("total-records")
        if records is None:
            return None
        return cls(
            int(records),
            int(summary.get("total-position-deletes") or 0),
            int(summary.get("total-equality-deletes") or 0),
        )

    @property
    def live(self) -> int:
        """Rows a reader sees (an upper bound unless :attr:`exact`)."""
        return max(0, self.records - self.position_deletes)

    @property
    def deleted(self) -> int:
        """Rows of the data files that position deletes remove."""
        return self.records - self.live

    @property
    def exact(self) -> bool:
        return self.equality_deletes == 0

    def describe(self) -> str:
        return describe_rows(self.live, self.deleted, self.exact)


def describe_rows(live: int, deleted: int | None, exact: bool = True) -> str:
    """``1,668 rows (2,900 deleted)``, the deletes only when there are any; what status, the
    progress log and the live view say of a table's rows (:class:`RowCounts`)."""
    text = f"{live:,} rows" if exact else f"at most {live:,} rows"
    notes = [f"{deleted:,} deleted"] if deleted else []
    if not exact:
        notes.append("equality deletes not counted")
    return text + (f" ({', '.join(notes)})" if notes else "")


def compact_json(value: Any) -> str:
    """``value`` as summary values and table properties store JSON (sorted, no spaces)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))
