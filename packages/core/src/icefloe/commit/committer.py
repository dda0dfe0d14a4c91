"""The Iceberg committer: one idempotent, fenced fast append per table per commit cycle.

For each :class:`TableCommitRequest` the committer, inside its retry loop and after reloading
the table from the catalog on every attempt:

1. finds the newest snapshot of this group (``icefloe.group-id``) in the branch's ancestry,
   skipping snapshots of foreign writers and other pipelines, and refuses a request whose
   fencing token is below the one the table records
   (:class:`~icefloe.errors.StaleFencingTokenError`: a zombie coordinator);
2. drops files that snapshot already covers (:class:`~icefloe.commit.dedupe.CommitBoundary`:
   channel offset before its ``icefloe.channel-positions`` or batch at or below its
   ``icefloe.writer-watermarks``), zero-record files and repeated paths;
3. refuses the request if a remaining file can never be committed (a
   :class:`~icefloe.errors.RefusedFileError`; :meth:`IcebergCommitter.screen` sorts those out
   per file beforehand, so this only catches a table changed in between), and drops files
   the branch head already references as live data files;
4. appends what is left in one fast append on the branch, with the summary properties of
   ``docs/architecture.md``, and raises the table property ``icefloe.fencing-token.<group>``
   in the same transaction.

Positions, watermarks and source offsets are merged per key with the previous snapshot's
values, so they never move backwards. A commit conflict (``CommitFailedException``) or an
unknown outcome reloads the table and redoes steps 1-4, so a foreign writer or a concurrent
coordinator can neither cause a loss nor a duplicate.

Each table is committed to its own branch (:class:`~icefloe.commit.policy.TablePolicies`:
``tables.branch``, else ``coordination.branch``); every step above reads and writes that
branch's state. Tables with ``merge_small_files`` have the cycle's small data files rewritten
per partition before step 4 (:mod:`icefloe.commit.merge`); the snapshot adds the merged files, the
summary is unchanged, and the originals are deleted once the snapshot landed.

A branch that does not exist yet is created in the same transaction as the append, from the
table's current snapshot (as Iceberg's Java ``toBranch`` does); until then
:meth:`IcebergCommitter.state` reports the state the new branch will inherit. Catalogs refuse
to create a non-main branch on a table without snapshots, so on an empty table the committer
first adds one empty, unreferenced root snapshot (summary ``icefloe.branch-root``) and forks the
branch from it.

Upsert and CDC tables: writers announce, besides data files, *key files* (equality-delete
content whose equality ids are the table's identifier fields). Key files are never committed:
when a request holds any, step 4 becomes a row delta (:mod:`icefloe.commit.rowdelta`), which
resolves the keys into position deletes against the loaded table and commits data and deletes in one
snapshot; everything else (summary, fencing, branch, dedupe) is the same. Position delete files
announced by writers are refused with :class:`~icefloe.errors.RowDeltaNotSupportedError`, as
are key files a table cannot take (:class:`~icefloe.errors.RowDeltaTableError`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import posixpath
import random
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import (
    CommitFailedException,
    CommitStateUnknownException,
    NoSuchTableError,
)
from pyiceberg.manifest import ManifestContent, ManifestFile
from pyiceberg.table import Table, TableProperties, Transaction
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.table.refs import MAIN_BRANCH, SnapshotRefType
from pyiceberg.table.snapshots import Snapshot, ancestors_of
from pyiceberg.table.update.snapshot import ManageSnapshots

from icefloe.commit import rowdelta
from icefloe.commit.dedupe import POSITIONS_KEY as POSITIONS_KEY  # re-exported: summary keys
from icefloe.commit.dedupe import WATERMARKS_KEY as WATERMARKS_KEY
from icefloe.commit.dedupe import CommitBoundary, decode_retired, encode_retired, max_merge
from icefloe.commit.merge import Merge, SmallFileMerger
from icefloe.commit.policy import TablePolicies
from icefloe.commit.rollback import Rollback, detect, is_replay_writer
from icefloe.config import PipelineConfig
from icefloe.errors import (
    ChannelChangedError,
    CommitError,
    CommitHistoryLostError,
    DataFileMissingError,
    FileOutsideTableError,
    InvalidDataFileError,
    PartitionSpecChangedError,
    RefusedFileError,
    RollbackNotReplayableError,
    RollbackPendingError,
    RowDeltaNotSupportedError,
    RowDeltaTableError,
    StaleFencingTokenError,
    TableMismatchError,
    TableMissingError,
)
from icefloe.events import DataFileMeta, FileContent
from icefloe.records.datafiles import DataFileBuilder

logger = logging.getLogger("icefloe.committer")

GROUP_ID_KEY = "icefloe.group-id"
COMMIT_ID_KEY = "icefloe.commit-id"
SOURCE_OFFSETS_KEY = "icefloe.source-offsets"
FENCING_TOKEN_KEY = "icefloe.fencing-token"
VALID_THROUGH_KEY = "icefloe.valid-through-ms"
BRANCH_ROOT_KEY = "icefloe.branch-root"
STATE_KEY = "icefloe.state"
DRAINED_KEY = "icefloe.channel-drained"

# Table properties under which files may legitimately live outside the table location.
_DATA_PATH_PROPERTIES = (
    "write.data.path",
    "write.object-storage.path",
    "write.folder-storage.path",
)
# Manifests whose live paths are kept in memory (oldest dropped first).
_MANIFEST_CACHE_SIZE = 4096
# Writers gone from the summary's watermarks before they are retired together: one side file
# per this many, instead of one per writer that stops.
RETIRE_AT = 32
# Retired-writers files kept in memory (immutable, so cached by location).
_RETIRED_CACHE_SIZE = 16
# URI schemes that name the same storage.
_SCHEME_ALIASES = {"": "file", "s3a": "s3", "s3n": "s3"}


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
class PendingFile:
    """A file announced by a DataWritten event, with where that event sits in the channel."""

    meta: DataFileMeta
    writer_id: str
    batch_seq: int
    partition: str
    offset: int
    table_uuid: str | None = None


@dataclass(frozen=True)
class CommitState:
    """What the newest snapshot of this group on the branch records."""

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
    the summary, theirs are retired to a side file (see :mod:`icefloe.commit.dedupe`); None:
    never."""


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


@dataclass(frozen=True)
class Screening:
    """A table's verdict on pending files before any commit: which can never be committed."""

    accepted: tuple[PendingFile, ...]
    refused: tuple[tuple[PendingFile, RefusedFileError], ...]


@dataclass(frozen=True)
class _Plan:
    """What one commit attempt will do, decided against one loaded version of the table."""

    files: tuple[PendingFile, ...]
    skipped: int
    summary: dict[str, str]
    raise_token: bool
    fork_from: int | None  # create the branch from this snapshot first
    clear_drained: bool = False  # the drained channel is in use again: its mark is stale
    retired: tuple[str, bytes] | None = None  # a new retired-writers file: location, content
    merge: Merge | None = None  # small files merged: what to append instead, what it replaces

    def appended(self) -> list[DataFileMeta]:
        """The data files the snapshot adds (merged ones instead of what they replace)."""
        if self.merge is not None:
            return list(self.merge.appended)
        return [f.meta for f in self.files if not _is_key_file(f)]


def _data_manifests(table: Table, snapshot: Snapshot) -> list[ManifestFile]:
    return [m for m in snapshot.manifests(table.io) if m.content == ManifestContent.DATA]


class IcebergCommitter:
    """Commits a group's pending files to Iceberg tables, idempotently and fenced.

    ``before_commit`` runs right before every catalog commit attempt (the coordinator renews
    its lease there); if it raises, the exception propagates and nothing is committed.
    """

    def __init__(
        self,
        catalog: Catalog,
        group_id: str,
        branch: str = MAIN_BRANCH,
        max_attempts: int = 10,
        before_commit: Callable[[], None] | None = None,
        retry_wait_s: float = 0.05,
        max_retry_wait_s: float = 2.0,
        policies: TablePolicies | None = None,
    ) -> None:
        if not group_id:
            raise ValueError("group_id must not be empty")
        if not branch:
            raise ValueError("branch must not be empty")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1 (got {max_attempts})")
        self._catalog = catalog
        self._group_id = group_id
        # per table: its branch (``branch`` for tables the policies do not name) and merging
        self._policies = policies or TablePolicies.single(branch)
        self._max_attempts = max_attempts
        self._before_commit = before_commit
        self._retry_wait_s = retry_wait_s
        self._max_retry_wait_s = max_retry_wait_s
        self._manifest_paths: dict[str, frozenset[str]] = {}  # manifest location -> live paths
        self._retired: dict[str, dict[str, int]] = {}  # retired-writers file -> its watermarks

    @classmethod
    def for_pipeline(
        cls, catalog: Catalog, config: PipelineConfig, **options: Any
    ) -> IcebergCommitter:
        """The committer of a pipeline configuration: its group, each table's branch."""
        return cls(
            catalog,
            config.name,
            branch=config.coordination.branch,
            policies=TablePolicies.from_config(config),
            **options,
        )

    @property
    def group_id(self) -> str:
        return self._group_id

    @property
    def branch(self) -> str:
        """The branch of tables the policies do not name."""
        return self._policies.default.branch

    def branch_of(self, table: str) -> str:
        """The branch ``table`` is committed to (its policy's)."""
        return self._policies.branch(table)

    def _branch_for(self, table: Table) -> str:
        return self.branch_of(_name(table))

    def state(self, table: str) -> CommitState | None:
        """The state recorded by this group's newest snapshot on the branch, if any. While a
        rollback waits for its replay, the state from before the rollback: what the table
        holds again once the replay is committed (where a new writer must start)."""
        loaded = self._load(table)
        head, _ = self._branch_head(loaded)
        return self._own_state(loaded, head)

    def rollback(self, table: str) -> Rollback | None:
        """The rollback of ``table`` still waiting for its replay, if any (see
        :mod:`icefloe.commit.rollback`). Raises RollbackNotReplayableError when the table was rolled
        back into a history whose older snapshots were expired (what it holds is unknown)."""
        loaded = self._load(table)
        head, _ = self._branch_head(loaded)
        return self._states(loaded, head)[1]

    def roll_back(
        self,
        table: str,
        snapshot_id: int | None,
        replay: bool = True,
        only_if: str | None = None,
    ) -> Rollback | None:
        """Move the branch of ``table`` back to ``snapshot_id`` (the head or one of its
        ancestors; None: the head) and return the rollback the pipeline will replay. With
        ``replay=False`` the rollback (this one, or one made by another tool) is accepted in
        the same transaction instead: the kept state is re-anchored on the new head, so the
        rolled-back rows stay out and nothing is replayed. ``only_if`` (a replay writer id)
        changes nothing unless that rollback is the one pending (not a newer one)."""
        for attempt in range(self._max_attempts):
            if attempt:
                self._backoff(attempt)
            loaded = self._load(table)
            head, _ = self._branch_head(loaded)
            if only_if is not None:
                pending = self._states(loaded, head)[1]
                if pending is None or pending.writer_id != only_if:
                    return pending
            target = snapshot_id if snapshot_id is not None or head is None else head.snapshot_id
            branch = self.branch_of(table)
            if target is None or target not in _history(head, loaded.metadata):
                raise CommitError(
                    f"table '{table}': snapshot {target} is not in the history of branch "
                    f"'{branch}' (head {None if head is None else head.snapshot_id}); "
                    "roll back to the head or one of its ancestors (see the table's snapshots)"
                )
            tx = loaded.transaction()
            with ManageSnapshots(tx) as refs:  # asserts the head did not move meanwhile
                refs.create_branch(target, branch)
            prop = state_property(self._group_id, branch)
            raw = loaded.metadata.properties.get(prop)
            if not replay and raw is not None:
                kept = json.loads(raw)
                tx.set_properties({prop: _json({**kept, "snapshot-id": target})})
            try:
                tx.commit_transaction()
            except CommitFailedException:
                continue
            return self.rollback(table)
        raise CommitError(f"table '{table}': could not roll back to snapshot {snapshot_id}")

    def boundary(self, table: str, channel_id: str | None) -> CommitBoundary:
        """What ``table`` holds already, as seen through the channel ``channel_id``.

        Raises :class:`~icefloe.errors.ChannelChangedError` when the table's last commit came
        through another channel that was not drained."""
        loaded = self._load(table)
        head, _ = self._branch_head(loaded)
        state = self._for_channel(loaded, self._own_state(loaded, head), channel_id)
        return CommitBoundary(channel_id=channel_id) if state is None else state.boundary

    def mark_drained(self, table: str, channel_id: str) -> bool:
        """Record that ``channel_id`` holds nothing uncommitted for this group, so the pipeline
        may continue on another channel. Only marks a table whose last commit of this group
        came through ``channel_id`` (or that has none); returns whether it marked."""
        if not self._catalog.table_exists(table):
            return False  # nothing was ever committed to it
        for attempt in range(self._max_attempts):
            if attempt:
                self._backoff(attempt)
            loaded = self._load(table)
            head, _ = self._branch_head(loaded)
            state = self._own_state(loaded, head)
            recorded = None if state is None else state.boundary.channel_id
            if recorded not in (None, channel_id):
                return False
            if loaded.metadata.properties.get(drained_property(self._group_id)) == channel_id:
                return True
            tx = loaded.transaction()
            tx.set_properties({drained_property(self._group_id): channel_id})
            try:
                tx.commit_transaction()
                return True
            except CommitFailedException:
                continue
        raise CommitError(f"table '{table}': could not record the drained channel")

    def screen(self, table: str, files: Iterable[PendingFile]) -> Screening:
        """Sort out the files ``table`` can never take (wrong table incarnation, outside its
        location, old partition spec, delete files, undescribable), so the caller can
        quarantine them and commit the rest. Covered files count as accepted (commit drops
        them). Raises TableMissingError or CommitHistoryLostError for the whole table."""
        loaded = self._load(table)
        head, _ = self._branch_head(loaded)
        boundary = _boundary(self._own_state(loaded, head))
        accepted: list[PendingFile] = []
        refused: list[tuple[PendingFile, RefusedFileError]] = []
        rules = _FileRules.of(loaded)
        policy = self._policies(table)
        for f in files:
            covered = boundary.covers(f)
            error = None if covered else _refusal(loaded, f, rules)
            if error is None and not covered and policy.merge_small_files:
                error = _missing(loaded, f, policy.target_file_size_bytes)
            if error is None:
                accepted.append(f)
            else:
                refused.append((f, error))
        return Screening(tuple(accepted), tuple(refused))

    def commit(self, request: TableCommitRequest) -> TableCommitResult:
        """Append the request's new files to its table in one snapshot (or none if nothing
        is new).

        Raises StaleFencingTokenError, TableMismatchError, FileOutsideTableError or
        CommitError, and then committed nothing; only after a catalog reported an unknown
        outcome may that attempt still land, which a later replay of the request detects.
        """
        # snapshots of attempts whose outcome is unknown: they may have landed after all
        unknown: list[tuple[int, _Plan]] = []
        last_error: Exception | None = None
        policy = self._policies(request.table)
        merger = (
            SmallFileMerger(request.commit_id, policy.target_file_size_bytes)
            if policy.merge_small_files
            else None
        )
        for attempt in range(self._max_attempts):
            if attempt:
                self._backoff(attempt)
            table = self._load(request.table)
            for snapshot_id, earlier in unknown:
                if table.metadata.snapshot_by_id(snapshot_id) is not None:
                    return self._landed(table, request, earlier, snapshot_id)
            if self._needs_root(table):
                try:
                    self._commit_root(table)
                except (CommitFailedException, CommitStateUnknownException) as e:
                    last_error = e  # the next attempt looks for the root again
                    continue
                table = self._load(request.table)
            plan = self._plan(table, request)
            if not plan.files:
                logger.info(
                    "%s: nothing new to commit for %s (%d files skipped)",
                    request.table,
                    request.commit_id,
                    plan.skipped,
                )
                return _result(request, plan, None)
            if merger is not None and not any(_is_key_file(f) for f in plan.files):
                # before the lease check: a leader that lost its lease meanwhile commits
                # nothing, and what it merged is an orphan
                merge = merger.merge(table, [f.meta for f in plan.files])
                plan = replace(plan, merge=merge)
                logger.info(
                    "%s: %d file(s) to add for %d announced (small files merged) for %s",
                    request.table,
                    len(merge.appended),
                    len(plan.files),
                    request.commit_id,
                )
            if self._before_commit is not None:
                self._before_commit()
            tx, snapshot_id = self._stage(table, plan)
            try:
                committed = tx.commit_transaction()
            except CommitFailedException as e:
                last_error = e
                logger.warning(
                    "%s: commit conflict on attempt %d/%d, retrying: %s",
                    request.table,
                    attempt + 1,
                    self._max_attempts,
                    e,
                )
                continue
            except CommitStateUnknownException as e:
                last_error = e
                unknown.append((snapshot_id, plan))
                logger.warning(
                    "%s: commit outcome unknown on attempt %d/%d, re-checking: %s",
                    request.table,
                    attempt + 1,
                    self._max_attempts,
                    e,
                )
                continue
            logger.info(
                "%s: committed %d files (%d skipped) as snapshot %d for %s",
                request.table,
                len(plan.files),
                plan.skipped,
                snapshot_id,
                request.commit_id,
            )
            self._remember_added(committed, snapshot_id, plan)
            return self._landed(committed, request, plan, snapshot_id)
        # the last attempt may have landed even though its outcome was unknown
        if unknown:
            table = self._load(request.table)
            for snapshot_id, earlier in unknown:
                if table.metadata.snapshot_by_id(snapshot_id) is not None:
                    return self._landed(table, request, earlier, snapshot_id)
        raise CommitError(
            f"table '{request.table}': commit {request.commit_id} failed after "
            f"{self._max_attempts} attempts: {last_error}"
        ) from last_error

    def _landed(
        self, table: Table, request: TableCommitRequest, plan: _Plan, snapshot_id: int
    ) -> TableCommitResult:
        """The result of ``plan``'s snapshot, which is in the table: now (never before) the
        originals its merged files replace can go. One that cannot be deleted, or one left by a
        crash before this point, is an orphan for ``icefloe maintain``."""
        for path in () if plan.merge is None else plan.merge.replaced:
            try:
                table.io.delete(path)
            except Exception as exc:  # committed either way: the file is only garbage now
                logger.warning("%s: cannot delete merged file %s: %s", request.table, path, exc)
        return _result(request, plan, snapshot_id)

    def _load(self, name: str) -> Table:
        """Load the table fresh from the catalog, with pyiceberg's own commit retries off.

        Why off: pyiceberg 0.12 retries a failed commit by re-applying the same files and
        properties to the refreshed table, skipping our idempotency and fencing checks; every
        retry must redo them, so retries happen only in :meth:`commit`. The override lives
        only in this in-memory copy; catalogs apply our updates to their own metadata.
        """
        try:
            table = self._catalog.load_table(name)
        except NoSuchTableError as e:
            raise TableMissingError(
                f"table '{name}' does not exist in the catalog; create it (or route its records "
                "elsewhere): its pending files are quarantined after repeated attempts"
            ) from e
        metadata = table.metadata
        properties = {**metadata.properties, TableProperties.COMMIT_NUM_RETRIES: "0"}
        return Table(
            identifier=table.name(),
            metadata=metadata.model_copy(update={"properties": properties}),
            metadata_location=table.metadata_location,
            io=table.io,
            catalog=table.catalog,
            config=table.config,
        )

    def _branch_head(self, table: Table) -> tuple[Snapshot | None, int | None]:
        """The branch's head, and the snapshot to fork it from when it does not exist yet."""
        metadata = table.metadata
        branch = self._branch_for(table)
        ref = metadata.refs.get(branch)
        if ref is not None:
            if ref.snapshot_ref_type != SnapshotRefType.BRANCH:
                raise CommitError(
                    f"table '{_name(table)}': '{branch}' is a tag, not a branch; "
                    "set the table's branch (or coordination.branch) to a branch name"
                )
            return metadata.snapshot_by_id(ref.snapshot_id), None
        if branch == MAIN_BRANCH:
            return None, None
        base = metadata.current_snapshot() or _root(metadata, branch)
        return base, None if base is None else base.snapshot_id

    def _needs_root(self, table: Table) -> bool:
        metadata = table.metadata
        branch = self._branch_for(table)
        return (
            branch != MAIN_BRANCH
            and branch not in metadata.refs
            and metadata.current_snapshot() is None
            and _root(metadata, branch) is None
        )

    def _commit_root(self, table: Table) -> None:
        """Add an empty snapshot that no ref points to yet, to fork the branch from."""
        if self._before_commit is not None:
            self._before_commit()
        tx = table.transaction()
        root = {BRANCH_ROOT_KEY: self._branch_for(table)}
        with tx.update_snapshot(snapshot_properties=root, branch=None).fast_append():
            pass
        tx.commit_transaction()

    def _own_state(self, table: Table, head: Snapshot | None) -> CommitState | None:
        return self._states(table, head)[0]

    def _states(
        self, table: Table, head: Snapshot | None
    ) -> tuple[CommitState | None, Rollback | None]:
        """This group's state on the branch, and the rollback waiting for its replay.

        The state is the newest snapshot of the group in the branch history, or the copy kept
        in the table property when that one is newer: its snapshots were expired (invariant 8;
        without a copy it refuses to guess), or the table was rolled back from it (the state
        holds again once the replay is committed, so files and new writers are judged by it).
        """
        metadata = table.metadata
        state, truncated = _find_state(head, metadata, self._group_id)
        kept = self._kept_state(table)
        rollback = None
        if kept is not None and (
            state is None
            or (kept.snapshot_id, kept.commit_id) != (state.snapshot_id, state.commit_id)
        ):
            expired = metadata.snapshot_by_id(kept.snapshot_id) is None
            if kept.snapshot_id in _history(head, metadata) or (
                expired and state is None and truncated
            ):
                state = kept  # re-anchored by an accepted rollback, or expired
            elif state is None and truncated:
                raise RollbackNotReplayableError(
                    f"table '{_name(table)}' was rolled back to a snapshot whose older history "
                    f"was expired: what it holds of pipeline '{self._group_id}' is unknown, "
                    "so nothing can be replayed exactly. Fix: roll back to a snapshot the "
                    "pipeline made, or accept the rollback without a replay: icefloe rollback "
                    f"--config <pipeline.toml> {_name(table)} <snapshot id> --no-replay"
                )
            else:
                rollback = detect(
                    self._group_id, self._branch_for(table), _name(table), state, kept
                )
                state = kept
        if state is None and truncated and _property_token(table, self._group_id) is not None:
            # the group committed here before (it left its token), yet no snapshot of it is
            # left in the history: treating everything as new could commit files twice
            raise CommitHistoryLostError(
                f"table '{_name(table)}': group '{self._group_id}' committed to branch "
                f"'{self._branch_for(table)}' before, but its snapshots were expired from the "
                "branch history; keep the group's last snapshot when expiring snapshots, or remove "
                f"the table property {fencing_token_property(self._group_id)} to start over"
            )
        if state is None or state.boundary.retired_file is None:
            return state, rollback
        retired = self._read_retired(table, state.boundary.retired_file)
        return replace(state, boundary=replace(state.boundary, retired=retired)), rollback

    def _read_retired(self, table: Table, location: str) -> dict[str, int]:
        """The watermarks of retired writers, from the side file the summary names."""
        cached = self._retired.get(location)
        if cached is None:
            try:
                with table.io.new_input(location).open() as stream:
                    cached = decode_retired(stream.read())
            except Exception as e:
                # without them a replay of a retired writer's batch would be committed again
                raise CommitError(
                    f"table '{_name(table)}': cannot read the retired writers' watermarks of "
                    f"group '{self._group_id}' from {location} ({e}); restore that file (it is "
                    "written once and never changed; `icefloe maintain` keeps it)"
                ) from e
            if len(self._retired) >= _RETIRED_CACHE_SIZE:
                self._retired.pop(next(iter(self._retired)))
            self._retired[location] = cached
        return cached

    def _kept_state(self, table: Table) -> CommitState | None:
        prop = state_property(self._group_id, self._branch_for(table))
        raw = table.metadata.properties.get(prop)
        if raw is None:
            return None
        try:
            kept = json.loads(raw)
            return _state_from_summary(int(kept["snapshot-id"]), kept["summary"])
        except (ValueError, KeyError, TypeError) as e:
            raise CommitError(
                f"table '{_name(table)}': property {prop} is unreadable ({e}); restore it "
                "from the group's last snapshot summary or remove it"
            ) from e

    def _for_channel(
        self, table: Table, state: CommitState | None, channel_id: str | None
    ) -> CommitState | None:
        return self._switch(table, state, channel_id)[0]

    def _switch(
        self, table: Table, state: CommitState | None, channel_id: str | None
    ) -> tuple[CommitState | None, bool]:
        """``state`` as seen through ``channel_id``, and whether the pipeline switched to it
        from another (drained) channel. Refuses a switch from an undrained channel: its
        uncommitted batches would be lost, and its positions mean nothing here."""
        if state is None or channel_id is None:
            return state, False
        recorded = state.boundary.channel_id
        drained = table.metadata.properties.get(drained_property(self._group_id))
        if recorded is None and drained not in (None, channel_id):
            # recorded before channels had identities, and a drain moved the pipeline since:
            # those positions belong to the drained channel, not to this one
            foreign = replace(state.boundary, positions={}, channel_id=channel_id)
            return replace(state, boundary=foreign), True
        if recorded not in (None, channel_id) and drained != recorded:
            raise ChannelChangedError(
                f"table '{_name(table)}': pipeline '{self._group_id}' last committed "
                f"through channel {recorded}, now it reads channel {channel_id}. Batches "
                "published to the old channel and not yet committed would be lost. Run "
                "`icefloe drain --config <old config>` against the old backend first (see "
                "docs/operations.md, swapping the backend); if the old channel is gone for "
                "good, set the table property "
                f"{drained_property(self._group_id)}={recorded} to accept that loss"
            )
        switched = recorded not in (None, channel_id)
        return replace(state, boundary=state.boundary.for_channel(channel_id)), switched

    def _plan(self, table: Table, request: TableCommitRequest) -> _Plan:
        head, fork_from = self._branch_head(table)
        own, rollback = self._states(table, head)
        replay = None if rollback is None else rollback.writer_id
        if rollback is not None and not any(f.writer_id == replay for f in request.files):
            raise RollbackPendingError(
                f"table '{request.table}' was rolled back from snapshot "
                f"{rollback.lost_snapshot_id} to {rollback.restored_snapshot_id}; its files "
                f"wait for the replay of source offsets {_json(rollback.from_offsets)} to "
                f"{_json(rollback.to_offsets)} (writer {replay}), which a running `icefloe "
                "run` of this pipeline publishes"
            )
        state, switched = self._switch(table, own, request.channel_id)
        # fencing tokens, like positions, are issued by one channel: after a switch from a
        # drained channel its tokens fence nothing here (its leaders were stopped for the drain)
        recorded = None if switched else _recorded_token(table, self._group_id, state)
        if recorded is not None and recorded > request.fencing_token:
            raise StaleFencingTokenError(
                f"table '{request.table}' records fencing token {recorded} for group "
                f"'{self._group_id}', above this coordinator's {request.fencing_token}: "
                "a newer coordinator has taken over"
            )
        files, skipped = _select(request.files, state, replay)
        rules = _FileRules.of(table)
        for f in files:
            error = _refusal(table, f, rules)
            if error is not None:
                # screen() sorts these out first; reaching here means the table changed in
                # between (e.g. recreated): refuse the whole request, the next cycle re-screens
                raise error
        live = self._live_paths(table, head, {f.meta.path for f in files})
        if live:
            logger.warning(
                "%s: %d announced file(s) are already in the table (announced again, e.g. "
                "under another writer id); not committing them again: %s",
                request.table,
                len(live),
                sorted(live)[:3],
            )
            files = tuple(f for f in files if f.meta.path not in live)
            skipped += len(live)
            # a batch whose data is in the table already must not apply its keys again:
            # they would delete the very rows it committed
            done = {(f.writer_id, f.batch_seq) for f in request.files if f.meta.path in live}
            stale_keys = [
                f for f in files if _is_key_file(f) and (f.writer_id, f.batch_seq) in done
            ]
            files = tuple(f for f in files if f not in stale_keys)
            skipped += len(stale_keys)
        prop = _property_token(table, self._group_id)
        boundary, retired = _next_boundary(table, request, state)
        return _Plan(
            files=files,
            skipped=skipped,
            summary=_summary(self._group_id, request, state, boundary),
            retired=retired,
            raise_token=switched or prop is None or request.fencing_token > prop,
            fork_from=fork_from,
            clear_drained=request.channel_id is not None
            and table.metadata.properties.get(drained_property(self._group_id))
            == request.channel_id,
        )

    def _stage(self, table: Table, plan: _Plan) -> tuple[Transaction, int]:
        """Build the transaction for ``plan``; returns it and the snapshot id it will add."""
        tx = table.transaction()
        branch = self._branch_for(table)
        if plan.fork_from is not None:
            with ManageSnapshots(tx) as refs:
                refs.create_branch(plan.fork_from, branch)
        if plan.raise_token:
            tx.set_properties(
                {fencing_token_property(self._group_id): plan.summary[FENCING_TOKEN_KEY]}
            )
        if plan.clear_drained:
            # committing through the drained channel again: it holds work once more, so a
            # later switch away from it needs a new drain
            tx.remove_properties(drained_property(self._group_id))
        if plan.retired is not None:
            # before the commit that names it; named by its content, so a retry rewrites the
            # same file, and one left by a failed attempt is an orphan for `icefloe maintain`
            location, content = plan.retired
            with table.io.new_output(location).create(overwrite=True) as stream:
                stream.write(content)
        snapshot = tx.update_snapshot(snapshot_properties=plan.summary, branch=branch)
        # read once: pyiceberg rebuilds (deep-copies) the transaction's metadata on every
        # read, which made this loop cost seconds per 10,000 files, growing with history
        build = DataFileBuilder(tx.table_metadata).build
        if any(_is_key_file(f) for f in plan.files):
            snapshot_id = self._stage_row_delta(table, tx, plan, build)
        else:
            # pyiceberg's merge append is a fast append unless the table enables manifest
            # merging (commit.manifest-merge.enabled, set on tables icefloe creates): see
            # icefloe.ops.maintenance
            with snapshot.merge_append() as append:
                for meta in plan.appended():
                    append.append_data_file(build(meta))
            snapshot_id = append.snapshot_id
        kept = {"snapshot-id": snapshot_id, "summary": plan.summary}
        tx.set_properties({state_property(self._group_id, branch): _json(kept)})
        return tx, snapshot_id

    def _stage_row_delta(
        self, table: Table, tx: Transaction, plan: _Plan, build: Callable[[DataFileMeta], Any]
    ) -> int:
        """Resolve the plan's key files against the branch head of ``table`` (the version this
        attempt loaded; a commit on top of another head fails and is re-resolved) and stage
        its data files plus the resulting position deletes as one snapshot."""
        batches: dict[tuple[str, int], tuple[list[Any], list[Any]]] = {}
        for f in plan.files:  # channel order; one writer's batches in source order
            data, keys = batches.setdefault((f.writer_id, f.batch_seq), ([], []))
            (keys if _is_key_file(f) else data).append(build(f.meta))
        base, _ = self._branch_head(table)
        resolution = rowdelta.resolve(
            table,
            None if base is None else base.snapshot_id,
            [rowdelta.Batch(data, keys) for data, keys in batches.values()],
        )
        deletes = rowdelta.write_position_deletes(table, resolution)
        logger.info(
            "%s: %d key file(s) delete %d row(s) in %d file(s) (%d of %d candidates read)",
            _name(table),
            sum(len(keys) for _, keys in batches.values()),
            resolution.deleted_rows,
            len(resolution.targets),
            resolution.files_read,
            resolution.candidates,
        )
        return rowdelta.stage(
            tx,
            self._branch_for(table),
            plan.summary,
            (d for data, _ in batches.values() for d in data),
            deletes,
        )

    def _live_paths(self, table: Table, head: Snapshot | None, paths: set[str]) -> set[str]:
        """Which of ``paths`` the branch head already references as live data files.

        Reads the head's data manifests; manifest files never change once written, so each
        one's paths are cached by its location and only new manifests are read per commit.
        """
        if head is None or not paths:
            return set()
        found: set[str] = set()
        for manifest in head.manifests(table.io):
            if manifest.content != ManifestContent.DATA:
                continue
            cached = self._manifest_paths.get(manifest.manifest_path)
            if cached is None:
                cached = self._decode_live(table, manifest)
                self._cache_manifest(manifest.manifest_path, cached)
            found |= paths & cached
        return found

    @staticmethod
    def _decode_live(table: Table, manifest: ManifestFile) -> frozenset[str]:
        """The live data-file paths of one manifest: the costly read the cache avoids."""
        return frozenset(
            e.data_file.file_path
            for e in manifest.fetch_manifest_entry(table.io, discard_deleted=True)
        )

    def _cache_manifest(self, location: str, paths: frozenset[str]) -> None:
        if len(self._manifest_paths) >= _MANIFEST_CACHE_SIZE:
            self._manifest_paths.pop(next(iter(self._manifest_paths)))
        self._manifest_paths[location] = paths

    def _remember_added(self, table: Table, snapshot_id: int, plan: _Plan) -> None:
        """Cache the paths of the manifests this commit wrote, so the next commit's live-path
        check does not decode them again (as costly as writing them).

        A plain append writes one manifest holding exactly the files just appended. When
        pyiceberg also merged older manifests (``commit.manifest-merge.enabled``), the merged
        manifest holds the live paths of the manifests it replaced, which are cached already
        in a running committer: their union is its content. Each guess is checked against the
        manifest's file counts. Without this, the commit after every merge decoded the whole
        merged manifest.
        """
        try:
            snapshot = table.metadata.snapshot_by_id(snapshot_id)
            manifests = [] if snapshot is None else _data_manifests(table, snapshot)
            written = [m for m in manifests if m.added_snapshot_id == snapshot_id]
            merged = [m for m in written if m.existing_files_count]
            older = self._replaced_paths(table, snapshot, manifests) if merged else frozenset()
        except Exception as exc:  # the commit landed; the cache is only an optimisation
            logger.debug("cannot list the manifests of snapshot %d: %s", snapshot_id, exc)
            return
        if older is None:
            return  # a replaced manifest is not cached: the next check decodes the merged one
        appended = frozenset(m.path for m in plan.appended())
        own = [m for m in written if not m.existing_files_count]
        if len(written) == 1:  # the files just appended, with the replaced ones if merged
            guesses = [(written[0], older | appended)]
        elif len(own) == 1 and len(merged) == 1:
            guesses = [(own[0], appended), (merged[0], older)]
        else:
            return  # several merged bins: the next check decodes them
        for manifest, paths in guesses:
            if not manifest.deleted_files_count and len(paths) == (
                (manifest.existing_files_count or 0) + (manifest.added_files_count or 0)
            ):
                self._cache_manifest(manifest.manifest_path, paths)

    def _replaced_paths(
        self, table: Table, snapshot: Snapshot | None, manifests: list[ManifestFile]
    ) -> frozenset[str] | None:
        """The cached live paths of the parent's data manifests that ``snapshot`` no longer
        lists (the ones a merge replaced); None when one of them is not cached."""
        parent_id = None if snapshot is None else snapshot.parent_snapshot_id
        parent = None if parent_id is None else table.metadata.snapshot_by_id(parent_id)
        if parent is None:
            return None
        kept = {m.manifest_path for m in manifests}
        replaced = [
            self._manifest_paths.get(m.manifest_path)
            for m in _data_manifests(table, parent)
            if m.manifest_path not in kept
        ]
        if any(paths is None for paths in replaced):
            return None
        return frozenset().union(*(paths for paths in replaced if paths is not None))

    def _backoff(self, attempt: int) -> None:
        # jittered exponential backoff, so competing committers do not retry in lockstep
        wait = min(self._retry_wait_s * 2 ** (attempt - 1), self._max_retry_wait_s)
        time.sleep(wait * random.uniform(0.5, 1.0))


def _name(table: Table) -> str:
    return ".".join(table.name())


@dataclass(frozen=True)
class _FileRules:
    """What every file's check against one loaded table shares, prepared once: a commit
    carries up to 100,000s of files, and per-file setup cost as much as the checks."""

    roots: tuple[_Root, ...]
    table_uuid: str
    build: Callable[[DataFileMeta], object]

    @classmethod
    def of(cls, table: Table) -> _FileRules:
        metadata = table.metadata
        roots = [metadata.location] + [
            metadata.properties[p] for p in _DATA_PATH_PROPERTIES if metadata.properties.get(p)
        ]
        return cls(
            tuple(_split_root(r) for r in roots),
            str(metadata.table_uuid),
            DataFileBuilder(metadata).build,
        )


def _root(metadata: TableMetadata, branch: str) -> Snapshot | None:
    """The newest empty root snapshot made for ``branch``, if any."""
    roots = [
        s
        for s in metadata.snapshots
        if s.summary is not None and s.summary[BRANCH_ROOT_KEY] == branch
    ]
    return max(roots, key=lambda s: s.sequence_number or 0, default=None)


def _is_key_file(f: PendingFile) -> bool:
    """Whether ``f`` is an upsert/CDC key file (resolved at commit time, never committed)."""
    return f.meta.content == FileContent.EQUALITY_DELETES


def _key_file_refusal(table: Table, f: PendingFile) -> RefusedFileError | None:
    """Why ``table`` cannot resolve the key file ``f``, or None."""
    try:
        fields = rowdelta.identifier_fields(table)
    except RowDeltaTableError as e:
        return RowDeltaTableError(f"{f.meta.path}: {e}")
    expected = tuple(field.field_id for field in fields)
    if tuple(sorted(f.meta.equality_ids or ())) != expected:
        return RowDeltaTableError(
            f"table '{_name(table)}': key file {f.meta.path} names equality ids "
            f"{list(f.meta.equality_ids or ())}, but the table's identifier fields are "
            f"{list(expected)} (id_columns changed?); rewrite it with the current id columns"
        )
    return None


def _refusal(table: Table, f: PendingFile, rules: _FileRules) -> RefusedFileError | None:
    """Why ``table`` can never take ``f``, or None. Each reason concerns this file alone."""
    metadata = table.metadata
    path = f.meta.path
    key_file = _is_key_file(f)
    if key_file:
        error = _key_file_refusal(table, f)
        if error is not None:
            return error
    elif f.meta.content != FileContent.DATA:
        return RowDeltaNotSupportedError(
            f"table '{_name(table)}': {path} is a delete file ({f.meta.content}); icefloe "
            "builds a row delta's position deletes itself from key files (equality-delete "
            "content on the table's identifier fields), so writers announce data and key files "
            "only"
        )
    if (
        f.table_uuid is not None
        and f.table_uuid != rules.table_uuid
        and not _same_uuid(f.table_uuid, metadata.table_uuid)
    ):
        return TableMismatchError(
            f"table '{_name(table)}' has UUID {metadata.table_uuid}, but {path} was "
            f"written for table UUID {f.table_uuid} (dropped and recreated?); refusing to "
            "commit it"
        )
    if not any(_inside(path, root) for root in rules.roots):
        return FileOutsideTableError(
            f"table '{_name(table)}': {path} lies outside the table location "
            f"{metadata.location}; refusing to commit it"
        )
    if not key_file and f.meta.spec_id != metadata.default_spec_id:
        # pyiceberg 0.12's fast append writes one manifest with the default spec
        return PartitionSpecChangedError(
            f"table '{_name(table)}': {path} was written with partition spec "
            f"{f.meta.spec_id}, but the table's default spec is now "
            f"{metadata.default_spec_id}; rewrite the file under the current spec"
        )
    try:
        rules.build(f.meta)
    except (ValueError, KeyError, TypeError) as e:
        return InvalidDataFileError(f"table '{_name(table)}': cannot describe {path}: {e}")
    return None


def _missing(table: Table, f: PendingFile, target: int) -> RefusedFileError | None:
    """Why a file a merge would read cannot be committed: it no longer exists (merged and
    deleted by an earlier cycle, so the live-path check cannot see it in the table)."""
    if f.meta.content != FileContent.DATA or f.meta.file_size_in_bytes >= target:
        return None
    if table.io.new_input(f.meta.path).exists():
        return None
    return DataFileMissingError(
        f"table '{_name(table)}': {f.meta.path} no longer exists. merge_small_files deletes "
        "the files it merged once their commit landed, so this file was most likely committed "
        "already (merged) and is announced again (under another writer id?); otherwise it was "
        "lost. Refusing to commit a reference to a missing file"
    )


def _same_uuid(text: str, table_uuid: uuid.UUID) -> bool:
    try:
        return uuid.UUID(text) == table_uuid
    except ValueError:
        return False


def _split(uri: str) -> tuple[str, str, str]:
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    return _SCHEME_ALIASES.get(scheme, scheme), parts.netloc, posixpath.normpath(parts.path)


_Root = tuple[str, str, str, str]  # raw prefix, then scheme, netloc, path (ending in "/")


def _split_root(root: str) -> _Root:
    """``root`` prepared for :func:`_inside`."""
    scheme, netloc, path = _split(root)
    return root.rstrip("/") + "/", scheme, netloc, path.rstrip("/") + "/"


def _inside(path: str, root: _Root) -> bool:
    """Whether ``path`` lies under ``root``, normalising '..' so it cannot escape."""
    raw = root[0]
    if path.startswith(raw) and "/." not in path[len(raw) - 1 :] and "//" not in path[len(raw) :]:
        return True  # the common case, decided without parsing: nothing to normalise
    scheme, netloc, file_path = _split(path)
    return (scheme, netloc) == root[1:3] and file_path.startswith(root[3])


def _find_state(
    head: Snapshot | None, metadata: TableMetadata, group_id: str
) -> tuple[CommitState | None, bool]:
    """The state of the newest snapshot of ``group_id`` in the ancestry of ``head``, and
    whether that ancestry is cut short by expired snapshots."""
    oldest = None
    for snapshot in ancestors_of(head, metadata):
        summary = snapshot.summary
        if summary is not None and summary[GROUP_ID_KEY] == group_id:
            return _parse_state(snapshot), False
        oldest = snapshot
    return None, oldest is not None and _cut_short(oldest)


def _history(head: Snapshot | None, metadata: TableMetadata) -> set[int]:
    """Ids of ``head`` and its ancestors still in the table."""
    return {s.snapshot_id for s in ancestors_of(head, metadata)}


def _cut_short(oldest: Snapshot) -> bool:
    """Whether ``oldest``, the oldest snapshot still reachable, had ancestors once."""
    if oldest.parent_snapshot_id is not None:
        return True  # its parent was expired (Iceberg Java keeps the dangling id)
    # pyiceberg's expiry clears the parent id instead; a true root holds only the files it
    # added, so more files in total means it had a parent
    summary = oldest.summary
    if summary is None:
        return False
    try:
        total = int(summary["total-data-files"] or 0)
        added = int(summary["added-data-files"] or 0)
    except ValueError:
        return False
    return total > added


def _state_from_summary(snapshot_id: int, summary: Mapping[str, str | None]) -> CommitState:
    """Raises ValueError/TypeError/AttributeError when the summary is unreadable."""
    valid_through = summary.get(VALID_THROUGH_KEY)
    return CommitState(
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


def _parse_state(snapshot: Snapshot) -> CommitState:
    summary = snapshot.summary
    assert summary is not None  # checked by the caller
    try:
        return _state_from_summary(snapshot.snapshot_id, summary)
    except (TypeError, ValueError, AttributeError) as e:
        # without a readable state the committer cannot know what is already in the table
        raise CommitError(
            f"snapshot {snapshot.snapshot_id} carries an unreadable icefloe summary: {e}"
        ) from e


def _property_token(table: Table, group_id: str) -> int | None:
    raw = table.metadata.properties.get(fencing_token_property(group_id))
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError as e:
        raise CommitError(
            f"table '{_name(table)}': property {fencing_token_property(group_id)} is not an "
            f"integer ({raw!r}); fix or remove it"
        ) from e


def _recorded_token(table: Table, group_id: str, state: CommitState | None) -> int | None:
    """The highest token the table knows for the group: its property or its last snapshot."""
    candidates = (_property_token(table, group_id), None if state is None else state.fencing_token)
    return max((t for t in candidates if t is not None), default=None)


def _boundary(state: CommitState | None) -> CommitBoundary:
    return CommitBoundary() if state is None else state.boundary


def _select(
    files: Iterable[PendingFile], state: CommitState | None, replay: str | None = None
) -> tuple[tuple[PendingFile, ...], int]:
    """The files still to commit, and how many were dropped. Replay batches count only for
    the rollback they were made for (``replay``): one of a rollback that was undone, or
    superseded by a deeper one, would add its rows a second time."""
    boundary = _boundary(state)
    seen: set[str] = set()
    keep: list[PendingFile] = []
    skipped = 0
    for f in files:
        stale = is_replay_writer(f.writer_id) and f.writer_id != replay
        if f.meta.path in seen or f.meta.record_count <= 0 or stale or boundary.covers(f):
            skipped += 1
        else:
            keep.append(f)
        seen.add(f.meta.path)
    return tuple(keep), skipped


def _next_boundary(
    table: Table, request: TableCommitRequest, state: CommitState | None
) -> tuple[CommitBoundary, tuple[str, bytes] | None]:
    """The boundary after this request, and the retired-writers file to write first (once
    ``RETIRE_AT`` writers with watermarks are neither live nor in the request)."""
    start = CommitBoundary(channel_id=request.channel_id) if state is None else state.boundary
    boundary = start.advanced(request.positions, request.files)
    if request.live_writers is None:
        return boundary, None
    gone = boundary.retirable(request.live_writers | {f.writer_id for f in request.files})
    if len(gone) < RETIRE_AT:
        return boundary, None
    retired = max_merge(boundary.retired, {w: boundary.watermarks[w] for w in gone})
    content = encode_retired(retired)
    name = f"icefloe-retired-{hashlib.sha256(content).hexdigest()[:40]}.json"
    location = table.location_provider().new_metadata_location(name)
    return boundary.retire(gone, location), (location, content)


def _summary(
    group_id: str, request: TableCommitRequest, state: CommitState | None, boundary: CommitBoundary
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
        SOURCE_OFFSETS_KEY: _json(offsets),
        FENCING_TOKEN_KEY: str(request.fencing_token),
    }
    if request.valid_through_ms is not None:
        summary[VALID_THROUGH_KEY] = str(request.valid_through_ms)
    return summary


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _result(request: TableCommitRequest, plan: _Plan, snapshot_id: int | None) -> TableCommitResult:
    committed = [f for f in plan.files if not _is_key_file(f)] if snapshot_id is not None else []
    return TableCommitResult(
        table=request.table,
        commit_id=request.commit_id,
        snapshot_id=snapshot_id,
        data_files=len(committed),
        records=sum(f.meta.record_count for f in committed),
        skipped_files=plan.skipped,
        added_files=None if plan.merge is None or snapshot_id is None else len(plan.appended()),
    )
