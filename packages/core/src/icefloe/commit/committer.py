"""The Iceberg committer: one idempotent, fenced fast append per table per commit cycle.

For each :class:`~icefloe.commit.request.TableCommitRequest` the committer, inside its retry
loop and against the table's current version on every attempt (loaded from the catalog, or
the version it loaded or committed last while the catalog still names it:
:mod:`icefloe.commit.versions`):

1. finds the newest snapshot of this group (``icefloe.group-id``) in the branch's ancestry
   (:mod:`icefloe.commit.summary`), skipping snapshots of foreign writers and other
   pipelines, and refuses a request whose
   fencing token is below the one the table records
   (:class:`~icefloe.errors.StaleFencingTokenError`: a zombie coordinator);
2. drops files that snapshot already covers (:class:`~icefloe.commit.dedupe.CommitBoundary`:
   channel offset before its ``icefloe.channel-positions`` or batch at or below its
   ``icefloe.writer-watermarks``), zero-record files and repeated paths;
3. refuses the request if a remaining file can never be committed (a
   :class:`~icefloe.errors.RefusedFileError`, :mod:`icefloe.commit.screening`;
   :meth:`IcebergCommitter.screen` sorts those out per file beforehand, so this only catches
   a table changed in between), and drops files the branch holds already: live data files
   of its head, or files a retained snapshot in its history removed (another engine's
   rewrite or delete, a compaction: :mod:`icefloe.commit.livefiles`);
4. appends what is left in one fast append on the branch, with the summary properties of
   ``docs/architecture.md``, and raises the table property ``icefloe.fencing-token.<group>``
   in the same transaction (the plain append built by :mod:`icefloe.commit.fastappend`,
   else pyiceberg's transaction).

Positions, watermarks and source offsets are merged per key with the previous snapshot's
values, so they never move backwards. A commit conflict (``CommitFailedException``) or an
unknown outcome reloads the table and redoes steps 1-4, so a foreign writer or a concurrent
coordinator can neither cause a loss nor a duplicate.

Each table is committed to its own branch (:class:`~icefloe.commit.policy.TablePolicies`:
``tables.branch``, else ``coordination.branch``); every step above reads and writes that
branch's state. Tables with ``merge_small_files`` have the cycle's small data files rewritten
per partition before step 4 (:mod:`icefloe.commit.merge`), only files the pipeline provably
owns (:mod:`icefloe.commit.ownership`); the snapshot adds the merged files, the summary is that
of the announced files plus the list of merged originals not yet deleted (the dedupe rule holds
those by path), and the originals are deleted once the snapshot is known to have landed, if
still provably owned.

A branch that does not exist yet is created in the same transaction as the append, from the
table's current snapshot, or from an empty root snapshot the committer adds to an empty table
first (:mod:`icefloe.commit.branches`); until then :meth:`IcebergCommitter.state` reports the
state the new branch will inherit. Watermarks of writers that are gone are retired to a side
file (:mod:`icefloe.commit.retirement`).

Upsert and CDC tables: writers announce, besides data files, *key files* (equality-delete
content whose equality ids are the table's identifier fields). Key files are never committed:
when a request holds any, step 4 becomes a row delta (:mod:`icefloe.commit.rowdelta`), which
resolves the keys into position deletes against the loaded table and commits data and deletes in one
snapshot; everything else (summary, fencing, branch, dedupe) is the same. Position delete files
announced by writers are refused with :class:`~icefloe.errors.RowDeltaNotSupportedError`, as
are key files a table cannot take (:class:`~icefloe.errors.RowDeltaTableError`).
"""

from __future__ import annotations

import json
import logging
import random
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import (
    CommitFailedException,
    CommitStateUnknownException,
    NoSuchTableError,
)
from pyiceberg.table import Table
from pyiceberg.table.refs import MAIN_BRANCH
from pyiceberg.table.snapshots import Snapshot
from pyiceberg.table.update.snapshot import ManageSnapshots

from icefloe.commit import branches, fastappend, screening
from icefloe.commit.applied import with_applied_keys, with_removed, with_rolled_back
from icefloe.commit.compaction import Compactor, Thresholds
from icefloe.commit.dedupe import APPLIED_KEY, CommitBoundary
from icefloe.commit.livefiles import LiveFiles
from icefloe.commit.merge import Merge, SmallFileMerger, merged_originals
from icefloe.commit.ownership import Ownership
from icefloe.commit.policy import TablePolicies, backoff_s
from icefloe.commit.request import PendingFile, TableCommitRequest, TableCommitResult, table_name
from icefloe.commit.retirement import SideFiles, next_boundary
from icefloe.commit.rollback import Rollback, detect, is_replay_writer, lost_channel_range
from icefloe.commit.screening import Screening
from icefloe.commit.summary import (
    FENCING_TOKEN_KEY,
    SEQUENCE_NUMBER_KEY,
    RecordedCommit,
    compact_json,
    drained_property,
    fencing_token_property,
    find_recorded,
    kept_record,
    kept_sequence_number,
    kept_state,
    new_summary,
    of_group,
    property_token,
    recorded_token,
    state_property,
)
from icefloe.commit.versions import KnownVersions, without_retries
from icefloe.config import PipelineConfig
from icefloe.errors import (
    ChannelChangedError,
    CommitError,
    CommitHistoryLostError,
    DataFileMissingError,
    RollbackNotReplayableError,
    RollbackPendingError,
    StaleFencingTokenError,
    TableMissingError,
)
from icefloe.events import DataFileMeta
from icefloe.records.datafiles import DataFileBuilder, written_for

logger = logging.getLogger("icefloe.committer")


@dataclass(frozen=True)
class _Plan:
    """What one commit attempt will do, decided against one loaded version of the table."""

    files: tuple[PendingFile, ...]
    skipped: int
    summary: dict[str, str]
    raise_token: bool
    fork_from: int | None  # create the branch from this snapshot first
    clear_drained: bool = False  # the drained channel is in use again: its mark is stale
    side_files: tuple[tuple[str, bytes], ...] = ()  # new side files: location, content
    merge: Merge | None = None  # small files merged: what to append instead, what it replaces
    merged: frozenset[str] = frozenset()  # merged originals the summary lists (to delete)
    keys: tuple[str, ...] = ()  # applied key files the summary lists (the pipeline's: to delete)

    def appended(self) -> list[DataFileMeta]:
        """The data files the snapshot adds (merged ones instead of what they replace)."""
        if self.merge is not None:
            return list(self.merge.appended)
        return [f.meta for f in self.files if not f.is_key_file]


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
        self._live_files = LiveFiles()
        self._side_files = SideFiles()
        self._ownership = Ownership(group_id)
        self._versions = KnownVersions()
        # (table, snapshot id): kept snapshots taken as expired without proof (logged once)
        self._assumed_expired: set[tuple[str, int]] = set()
        # per table: the merged originals deleted after its last commit here (not to look for)
        self._deleted: dict[str, set[str]] = {}

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

    def compactor(self, after_write: Callable[[str], None] | None = None) -> Compactor:
        """Compaction rounds for this pipeline's tables: the same catalog, branches and lease
        check as the commits (``after_write``: a test hook, see :class:`Compactor`)."""
        return Compactor(
            self._group_id, self._load, self.branch_of, self._before_commit, after_write
        )

    def compaction_of(self, table: str) -> Thresholds | None:
        """When ``table`` is compacted (its policy's thresholds; None: never)."""
        return self._policies(table).compaction

    def target_file_size_of(self, table: str) -> int:
        """The data file size ``table``'s policy aims at."""
        return self._policies(table).target_file_size_bytes

    def branch_of(self, table: str) -> str:
        """The branch ``table`` is committed to (its policy's)."""
        return self._policies.branch(table)

    def _branch_for(self, table: Table) -> str:
        return self.branch_of(table_name(table))

    def state(self, table: str) -> RecordedCommit | None:
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
        rolled-back rows stay out and nothing is replayed. Either way the kept state lists the
        data files the rollback takes out, so they never come back announced again
        (:mod:`icefloe.commit.applied`). ``only_if`` (a replay writer id) changes nothing
        unless that rollback is the one pending (not a newer one)."""
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
            if target is None or target not in branches.history(head, loaded.metadata):
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
            if raw is not None:
                kept = json.loads(raw)
                lost = loaded.metadata.snapshot_by_id(int(kept["snapshot-id"]))
                kept["summary"] = self._rolled_back(loaded, [head, lost], target, kept["summary"])
                if not replay:
                    kept["snapshot-id"] = target
                    restored = loaded.metadata.snapshot_by_id(target)
                    assert restored is not None  # it is in the branch history
                    kept[SEQUENCE_NUMBER_KEY] = restored.sequence_number
                tx.set_properties({prop: compact_json(kept)})
            try:
                tx.commit_transaction()
            except CommitFailedException:
                continue
            finally:
                self._versions.forget(table)
            return self.rollback(table)
        raise CommitError(f"table '{table}': could not roll back to snapshot {snapshot_id}")

    def _rolled_back(
        self, table: Table, sources: list[Snapshot | None], target: int, summary: dict[str, Any]
    ) -> dict[str, Any]:
        """The kept state's ``summary`` listing the data files a rollback of ``sources`` (the
        head, the pipeline's lost snapshot) to ``target`` takes out of the branch, with the
        side file it names written: announced again under any writer id, they are held as
        committed (:mod:`icefloe.commit.applied`), so rows a rollback removed stay out."""
        boundary = self._read_side_files(table, CommitBoundary.from_summary(summary))
        restored = table.metadata.snapshot_by_id(target)
        boundary, side = self._taken_out(table, boundary, sources, restored)
        if side is None:
            return summary
        _write_side_file(table, *side)
        return {**summary, APPLIED_KEY: side[0]}

    def _taken_out(
        self,
        table: Table,
        boundary: CommitBoundary,
        sources: Iterable[Snapshot | None],
        target: Snapshot | None,
    ) -> tuple[CommitBoundary, tuple[str, bytes] | None]:
        """``boundary`` listing the data files live in ``sources`` but not in ``target``, and
        those a snapshot in the history of ``sources`` above ``target`` removed (another
        engine's delete of the pipeline's rows: the rollback takes that removal out of the
        branch's history, where the dedupe rule found it)."""
        files = self._live_files
        base = branches.history(target, table.metadata)
        taken: set[str] = set()
        for source in sources:
            if source is not None:
                taken |= files.all_live(table, source) | files.removed_above(table, source, base)
        if target is not None:
            taken -= files.all_live(table, target)
        return with_rolled_back(table, boundary, taken)

    def boundary(self, table: str, channel_id: str | None) -> CommitBoundary:
        """What ``table`` holds already, as seen through the channel ``channel_id``.

        Raises :class:`~icefloe.errors.ChannelChangedError` when the table's last commit came
        through another channel that was not drained."""
        return self.incarnation_boundary(table, channel_id)[1]

    def incarnation_boundary(
        self, table: str, channel_id: str | None
    ) -> tuple[uuid.UUID, CommitBoundary]:
        """:meth:`boundary`, with the UUID of the table it was read from: what a dropped
        table held says nothing about the table created again under its name."""
        loaded = self._load(table)
        head, _ = self._branch_head(loaded)
        state = self._for_channel(loaded, self._own_state(loaded, head), channel_id)
        boundary = CommitBoundary(channel_id=channel_id) if state is None else state.boundary
        return loaded.metadata.table_uuid, boundary

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
            finally:
                self._versions.forget(table)
        raise CommitError(f"table '{table}': could not record the drained channel")

    def screen(
        self, table: str, files: Iterable[PendingFile], channel_id: str | None = None
    ) -> Screening:
        """Sort out the files ``table`` can never take (wrong table incarnation, outside its
        location, old partition spec, delete files, undescribable), so the caller can
        quarantine them and commit the rest. Covered files count as accepted (commit drops
        them), judged as the commit judges them: through ``channel_id``, the channel the files
        were announced on (after a backend swap the old channel's positions cover nothing, so
        a refused file must not pass here as covered and then fail the whole commit); so do
        files the branch holds (:meth:`~icefloe.commit.livefiles.LiveFiles.held`; announced
        again under another writer id: a file already in the table, or taken off it, is no
        refused file, and quarantining it would invite adding it twice).
        A file is refused as missing only on a version loaded after it was seen missing: a
        committer of a deposed leader may commit it (or the batch of a missing key file, or
        the merged file of a missing original) and delete it right after an older version was
        loaded, and the newer version then holds it as committed.
        Raises TableMissingError, CommitHistoryLostError or ChannelChangedError for the whole
        table."""
        files = tuple(files)
        loaded = self._load(table)
        seen_missing: set[str] = set()  # files seen missing before ``loaded`` was loaded
        while True:
            self._versions.screened(table)  # the commit that follows may use this version
            verdict = self._screen(table, loaded, files, channel_id)
            missing = {
                f.meta.path for f, e in verdict.refused if isinstance(e, DataFileMissingError)
            }
            if missing <= seen_missing:
                return verdict
            # rare (a file deleted once its commit landed, or lost): judge it again on a
            # version not older than its disappearance; each round sees a new file missing,
            # so this ends
            seen_missing |= missing
            self._versions.forget(table)
            loaded = self._load(table)

    def _screen(
        self, table: str, loaded: Table, files: tuple[PendingFile, ...], channel_id: str | None
    ) -> Screening:
        """:meth:`screen` against one loaded version of the table."""
        head, _ = self._branch_head(loaded)
        state = self._for_channel(loaded, self._own_state(loaded, head), channel_id)
        held = self._live_files.held(loaded, head, {f.meta.path for f in files})
        held |= self._stale_replays(loaded, head, files)
        return screening.screen(loaded, files, _boundary(state), self._policies(table), held)

    def _stale_replays(
        self, loaded: Table, head: Snapshot | None, files: tuple[PendingFile, ...]
    ) -> set[str]:
        """Paths of replay batches' files made for no rollback the table waits for (one
        undone, superseded, or of a dropped table of the same name): the commit drops them
        (:func:`_select`), so they count as held and are never quarantined. Refused first
        (another engine dropped and created the table: its files name the old table), their
        records were in quarantine beside another copy (the simulation, seed 24000 once a
        zombie rule drew more), or beside the table that holds them again (an undone rollback)."""
        replays = [f for f in files if is_replay_writer(f.writer_id)]
        if not replays:
            return set()
        try:
            rollback = self._states(loaded, head)[1]
        except Exception:  # the commit reports it; screening judges the files as before
            return set()
        waited = None if rollback is None else rollback.writer_id
        return {f.meta.path for f in replays if _stale_replay(f, waited)}

    def commit(self, request: TableCommitRequest, run_attempt: str = "") -> TableCommitResult:
        """Append the request's new files to its table in one snapshot (or none if nothing
        is new). ``run_attempt`` names this run of the request when another run of it may
        overlap (a Spark commit task's attempt): merged small files get names of its own, so
        a run never overwrites one another run committed ("": the only run at a time).

        Raises StaleFencingTokenError, TableMismatchError, FileOutsideTableError or
        CommitError, and then committed nothing; only after a catalog reported an unknown
        outcome may that attempt still land, which a later replay of the request detects.
        """
        # snapshots of attempts whose outcome is unknown: they may have landed after all
        unknown: list[tuple[int, _Plan]] = []
        last_error: Exception | None = None
        policy = self._policies(request.table)
        merger = (
            SmallFileMerger(request.commit_id, policy.target_file_size_bytes, run_attempt)
            if policy.merge_small_files
            else None
        )
        for attempt in range(self._max_attempts):
            if attempt:
                self._backoff(attempt)
            table = self._load(request.table, after_screen=attempt == 0)
            for snapshot_id, earlier in unknown:
                if table.metadata.snapshot_by_id(snapshot_id) is not None:
                    return self._landed(table, request, earlier, snapshot_id)
            if branches.needs_root(table, self._branch_for(table)):
                try:
                    self._commit_root(table)
                except (CommitFailedException, CommitStateUnknownException) as e:
                    last_error = e  # the next attempt looks for the root again
                    continue
                table = self._load(request.table)
            # merges before the lease check: a leader that lost its lease meanwhile commits
            # nothing, and what it merged is an orphan
            plan = self._plan(table, request, merger)
            if not plan.files:
                logger.info(
                    "%s: nothing new to commit for %s (%d files skipped)",
                    request.table,
                    request.commit_id,
                    plan.skipped,
                )
                return _result(request, plan, None)
            if self._before_commit is not None:
                self._before_commit()
            commit, snapshot_id = self._stage(table, plan)
            try:
                committed = commit()
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
            appended = [m.path for m in plan.appended()]
            self._versions.remember(request.table, committed)
            self._live_files.remember_added(committed, snapshot_id, appended)
            result = self._landed(committed, request, plan, snapshot_id)
            if self._states(committed, self._branch_head(committed)[0])[1] is not None:
                return result
            return replace(result, metadata_location=committed.metadata_location)
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
        """The result of ``plan``'s snapshot, which is known to be in ``table``: now (never
        before, and never on an unknown outcome) the merged originals and the applied key files
        its summary lists can go, those :class:`~icefloe.commit.ownership.Ownership` still
        proves the pipeline's (key files of other writers are never deleted here). One that
        cannot be deleted stays listed, so it is never committed or applied twice, and is tried
        again after the next commit; one left by a crash before this point is deleted by the
        next commit of any coordinator of the group. Deleted, it leaves the list at the next
        commit: announced again, it is quarantined as missing."""
        keys = {k for k in plan.keys if written_for(k, self._group_id)}
        doomed = plan.merged | keys
        owned = self._ownership.deletable(table, doomed) if doomed else set()
        deleted: set[str] = set()
        for path in sorted(doomed):
            if path not in owned:
                logger.warning(
                    "%s: not deleting applied file %s: a snapshot names it now",
                    request.table,
                    path,
                )
                continue
            try:
                table.io.delete(path)
            except FileNotFoundError:
                pass  # deleted already (by an earlier attempt, or by `icefloe maintain`)
            except Exception as exc:  # committed either way: the file is only garbage now
                logger.warning("%s: cannot delete applied file %s: %s", request.table, path, exc)
                continue
            deleted.add(path)
        self._deleted[request.table] = deleted
        return _result(request, plan, snapshot_id)

    def _load(self, name: str, after_screen: bool = False) -> Table:
        """The table's current version (:mod:`icefloe.commit.versions`: reused when known
        and unchanged, else loaded from the catalog), with pyiceberg's own commit retries off.

        Why off: pyiceberg 0.12 retries a failed commit by re-applying the same files and
        properties to the refreshed table, skipping our idempotency and fencing checks; every
        retry must redo them, so retries happen only in :meth:`commit`. The override lives
        only in this in-memory copy; catalogs apply our updates to their own metadata.
        """
        table = self._versions.reusable(self._catalog, name, after_screen)
        if table is None:
            try:
                table = self._catalog.load_table(name)
            except NoSuchTableError as e:
                self._versions.forget(name)
                raise TableMissingError(
                    f"table '{name}' does not exist in the catalog; create it (or route its "
                    "records elsewhere): its pending files are quarantined after repeated attempts"
                ) from e
            self._versions.remember(name, table)
        return without_retries(table)

    def _branch_head(self, table: Table) -> tuple[Snapshot | None, int | None]:
        """The branch's head, and the snapshot to fork it from when it does not exist yet."""
        return branches.branch_head(table, self._branch_for(table))

    def _commit_root(self, table: Table) -> None:
        """Add an empty snapshot that no ref points to yet, to fork the branch from."""
        if self._before_commit is not None:
            self._before_commit()
        self._versions.forget(table_name(table))
        branches.commit_root(table, self._branch_for(table))

    def _own_state(self, table: Table, head: Snapshot | None) -> RecordedCommit | None:
        return self._states(table, head)[0]

    def _states(
        self, table: Table, head: Snapshot | None
    ) -> tuple[RecordedCommit | None, Rollback | None]:
        """This group's state on the branch, and the rollback waiting for its replay.

        The state is the newest snapshot of the group in the branch history, or the copy kept
        in the table property when that one is newer: its snapshots were expired (invariant 8;
        without a copy it refuses to guess), or the table was rolled back from it (the state
        holds again once the replay is committed, so files and new writers are judged by it).
        """
        metadata = table.metadata
        state, truncated = find_recorded(head, metadata, self._group_id)
        kept = kept_record(table, self._group_id, self._branch_for(table))
        rollback = None
        if kept is not None and (
            state is None
            or (kept.snapshot_id, kept.commit_id) != (state.snapshot_id, state.commit_id)
        ):
            # in the history: re-anchored by an accepted rollback
            expired: bool | None = kept.snapshot_id in branches.history(head, metadata)
            if not expired and state is None:
                expired = self._expired(table, head, kept, truncated)
            if expired is False and state is None and truncated:
                # a rollback (the line tells) onto a history an expiry cut: the earlier
                # metadata files may still link it to the restored snapshot, as they did when
                # the replay was published (found by the simulation, seed 24704: another
                # engine expired the restored snapshot between the replay's publish and its
                # commit, and the pending replay was refused)
                state = self._recorded_in_log(table, head)
            if expired:
                state = kept
            elif state is None and (truncated or expired is None):
                raise RollbackNotReplayableError(
                    f"table '{table_name(table)}': its branch's history no longer reaches the "
                    f"pipeline's snapshot {kept.snapshot_id}; it stops at an expired snapshot "
                    "(or begins after that one), and nothing shows that it descends from it "
                    "(the branch lacks files that snapshot held): rolled back to a snapshot "
                    "whose older history was expired, or another engine expired snapshots "
                    "between and deleted those files. What it holds of pipeline "
                    f"'{self._group_id}' is unknown, so nothing can be replayed exactly. Fix: "
                    "roll back to a snapshot the pipeline made, or go on from what the table "
                    "holds (accepting a rollback without a replay): icefloe rollback --config "
                    f"<pipeline.toml> {table_name(table)} <snapshot id> --no-replay"
                )
            else:
                if state is None:
                    state = self._recorded_in_log(table, head)
                rollback = detect(
                    self._group_id, self._branch_for(table), table_name(table), state, kept
                )
                if rollback is not None:
                    restored = CommitBoundary() if state is None else state.boundary
                    same = restored.channel_id in (None, kept.boundary.channel_id)
                    span = lost_channel_range(restored.positions, kept.boundary.positions, same)
                    rollback = replace(rollback, channel_range=span)
                state = kept
        if state is None and truncated and property_token(table, self._group_id) is not None:
            # the group committed here before (it left its token), yet no snapshot of it is
            # left in the history: treating everything as new could commit files twice
            raise CommitHistoryLostError(
                f"table '{table_name(table)}': group '{self._group_id}' committed to branch "
                f"'{self._branch_for(table)}' before, but its snapshots were expired from the "
                "branch history; keep the group's last snapshot when expiring snapshots, or remove "
                f"the table property {fencing_token_property(self._group_id)} to start over"
            )
        if state is None:
            return state, rollback
        return replace(state, boundary=self._read_side_files(table, state.boundary)), rollback

    def _recorded_in_log(self, table: Table, head: Snapshot | None) -> RecordedCommit | None:
        """The group's newest snapshot in the history of ``head`` that only the table's
        earlier metadata files still link (:func:`icefloe.commit.branches.ancestors_in_log`):
        what a rollback onto a snapshot whose link to the pipeline's snapshots an expiry cut
        restored. Without it the replay would start from nothing and bring back rows the
        restored snapshot holds (another engine's rewrite of them, found by the simulation)."""
        oldest = branches.oldest_of(head, table.metadata)
        for snapshot in branches.ancestors_in_log(table, oldest):
            if of_group(snapshot, self._group_id):
                return RecordedCommit.of_snapshot(snapshot)
        return None

    def _read_side_files(self, table: Table, boundary: CommitBoundary) -> CommitBoundary:
        """``boundary`` (parsed from a summary) with the side files it names read."""
        side, group = self._side_files, self._group_id
        if boundary.retired_file is not None:
            boundary = replace(boundary, retired=side.retired(table, boundary.retired_file, group))
        if boundary.merged_file is not None:
            boundary = replace(boundary, merged=side.merged(table, boundary.merged_file, group))
        if boundary.applied_file is not None:
            boundary = replace(boundary, applied=side.applied(table, boundary.applied_file, group))
        return boundary

    def _expired(
        self, table: Table, head: Snapshot | None, kept: RecordedCommit, truncated: bool
    ) -> bool | None:
        """Whether ``head``, whose history holds no snapshot of the group, descends from the
        kept one (True: the snapshots between were expired by another engine), was moved off
        its line (False: a rollback), or that cannot be told (None)."""
        line = branches.line(head, table.metadata, kept.snapshot_id)
        sequence = kept_sequence_number(table, self._group_id, self._branch_for(table))
        verdict = line.descends(sequence)
        if verdict is not None or not (truncated or line.after(sequence)):
            return bool(verdict)  # told by the line, or it runs down to a root without it
        snapshot = table.metadata.snapshot_by_id(kept.snapshot_id)
        if snapshot is not None:
            if self._descends(table, head, snapshot) or self._holds(table, head, snapshot):
                return True
            # the earlier metadata files may tell; None: a rollback whose older history was
            # expired, or not
            return branches.told_by_log(table, line.oldest, kept.snapshot_id, sequence)
        # nothing left to compare: taken as expired, as a rollback to a snapshot older than
        # the kept one shows in the line unless that snapshot was expired as well
        key = (table_name(table), kept.snapshot_id)
        if key not in self._assumed_expired:
            self._assumed_expired.add(key)
            logger.warning(
                "%s: the pipeline's snapshot %d was expired and the branch's history begins "
                "after it: taken as expired by another engine, not rolled back (a rollback "
                "whose restored snapshot was expired as well looks the same, and is not "
                "replayed: docs/operations.md, Rollback)",
                *key,
            )
        return True

    def _descends(self, table: Table, head: Snapshot | None, snapshot: Snapshot) -> bool:
        """Whether ``head`` descends from ``snapshot`` although the walk down the branch stops
        at an expired snapshot above it: ``head`` still references a file (data or delete)
        ``snapshot`` added, or a retained snapshot in its history removed one of its data files
        (another engine's rewrite or delete), which no snapshot outside its line of descent
        does (a rollback below it removed them all, and its history holds no such removal).
        False when that cannot be told (all its files removed by snapshots expired since, or
        it added none)."""
        data, deletes = branches.added_files(table, snapshot)
        if self._live_files.held(table, head, data):
            return True
        return bool(deletes and deletes & branches.live_delete_files(table, head))

    def _holds(self, table: Table, head: Snapshot | None, snapshot: Snapshot) -> bool:
        """Whether ``head`` references every file (data or delete) ``snapshot`` references,
        where the walk down the branch stops at an expired snapshot above it and
        :meth:`_descends` cannot tell (``snapshot`` added nothing, as a batch that only
        deletes keys no row holds): nothing it held is missing, so no rollback from it took
        out a row or a delete, and none waits for a replay."""
        if head is None:
            return False
        data = self._live_files.all_live
        if not data(table, snapshot) <= data(table, head):
            return False
        deletes = branches.live_delete_files
        return deletes(table, snapshot) <= deletes(table, head)

    def _for_channel(
        self, table: Table, state: RecordedCommit | None, channel_id: str | None
    ) -> RecordedCommit | None:
        return self._switch(table, state, channel_id)[0]

    def _switch(
        self, table: Table, state: RecordedCommit | None, channel_id: str | None
    ) -> tuple[RecordedCommit | None, bool]:
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
                f"table '{table_name(table)}': pipeline '{self._group_id}' last committed "
                f"through channel {recorded}, now it reads channel {channel_id}. Batches "
                "published to the old channel and not yet committed would be lost: drain the "
                "old backend first, `icefloe drain --config <old config>` (see "
                "docs/operations.md, swapping the backend); if the old channel is gone for "
                "good, set the table property "
                f"{drained_property(self._group_id)}={recorded} to accept that loss"
            )
        switched = recorded not in (None, channel_id)
        return replace(state, boundary=state.boundary.for_channel(channel_id)), switched

    def _plan(
        self, table: Table, request: TableCommitRequest, merger: SmallFileMerger | None
    ) -> _Plan:
        head, fork_from = self._branch_head(table)
        own, rollback = self._states(table, head)
        replay = None if rollback is None else rollback.writer_id
        if rollback is not None and not any(f.writer_id == replay for f in request.files):
            raise RollbackPendingError(
                f"table '{request.table}' was rolled back from snapshot "
                f"{rollback.lost_snapshot_id} to {rollback.restored_snapshot_id}; its files "
                f"wait for the replay of source offsets {compact_json(rollback.from_offsets)} to "
                f"{compact_json(rollback.to_offsets)} (writer {replay}), which a running `icefloe "
                "run` of this pipeline publishes",
                replay_writer=replay,
            )
        state, switched = self._switch(table, own, request.channel_id)
        # fencing tokens, like positions, are issued by one channel: after a switch from a
        # drained channel its tokens fence nothing here (its leaders were stopped for the drain)
        recorded = None if switched else recorded_token(table, self._group_id, state)
        if recorded is not None and recorded > request.fencing_token:
            raise StaleFencingTokenError(
                f"table '{request.table}' records fencing token {recorded} for group "
                f"'{self._group_id}', above this coordinator's {request.fencing_token}: "
                "a newer coordinator has taken over"
            )
        files, skipped = _select(request.files, state, replay)
        # files the branch holds (the head, or a rewrite or delete took them off it) are
        # dropped before any refusal, as screen() accepts them
        live = self._live_files.held(table, head, {f.meta.path for f in files})
        if live:
            logger.warning(
                "%s: %d announced file(s) are already in the table, or were until a rewrite or "
                "delete took them off (announced again, e.g. under another writer id); not "
                "committing them again: %s",
                request.table,
                len(live),
                sorted(live)[:3],
            )
            files = tuple(f for f in files if f.meta.path not in live)
            skipped += len(live)
            # a batch whose data is in the table already must not apply its keys again:
            # they would delete the very rows it committed
            done = {(f.writer_id, f.batch_seq) for f in request.files if f.meta.path in live}
            stale_keys = [f for f in files if f.is_key_file and (f.writer_id, f.batch_seq) in done]
            files = tuple(f for f in files if f not in stale_keys)
            skipped += len(stale_keys)
        error = screening.first_refusal(table, files)
        if error is not None:
            # screen() sorts these out first; reaching here means the table changed in
            # between (e.g. recreated): refuse the whole request, the next cycle re-screens
            raise error
        merge = None
        if merger is not None and files and not any(f.is_key_file for f in files):
            merge = merger.merge(table, [f.meta for f in files], self._ownership)
            logger.info(
                "%s: %d file(s) to add for %d announced (small files merged) for %s",
                request.table,
                len(merge.appended),
                len(files),
                request.commit_id,
            )
        prop = property_token(table, self._group_id)
        boundary, retired = next_boundary(table, request, state)
        deleted = self._deleted.get(request.table, set())
        boundary, merged = merged_originals(table, boundary, merge, deleted)
        keys = [f.meta.path for f in files if f.is_key_file]
        boundary, applied = with_applied_keys(table, boundary, keys, deleted)
        if state is not None:  # files taken off since its last commit: committed as any file
            removed = self._live_files.removed_since(table, head, self._group_id)
            boundary, listed = with_removed(table, boundary, removed)
            applied = listed or applied
        if rollback is not None:  # made by any tool: list what it took out, as roll_back does
            lost = table.metadata.snapshot_by_id(rollback.lost_snapshot_id)
            boundary, taken = self._taken_out(table, boundary, [lost], head)
            applied = taken or applied
        return _Plan(
            files=files,
            skipped=skipped,
            summary=new_summary(self._group_id, request, state, boundary),
            side_files=tuple(f for f in (retired, merged, applied) if f is not None),
            merge=merge,
            merged=boundary.merged,
            keys=boundary.applied.keys,
            raise_token=switched or prop is None or request.fencing_token > prop,
            fork_from=fork_from,
            clear_drained=request.channel_id is not None
            and table.metadata.properties.get(drained_property(self._group_id))
            == request.channel_id,
        )

    def _stage(self, table: Table, plan: _Plan) -> tuple[Callable[[], Table], int]:
        """Stage the commit of ``plan``; returns what commits it (and returns the committed
        table) and the snapshot id it will add."""
        branch = self._branch_for(table)
        for location, content in plan.side_files:
            _write_side_file(table, location, content)
        properties: dict[str, str] = {}
        if plan.raise_token:
            properties[fencing_token_property(self._group_id)] = plan.summary[FENCING_TOKEN_KEY]
        # committing through the drained channel again: it holds work once more, so a later
        # switch away from it needs a new drain
        removals = [drained_property(self._group_id)] if plan.clear_drained else []
        head, _ = self._branch_head(table)
        build = DataFileBuilder(table.metadata).build
        keyed = any(f.is_key_file for f in plan.files)
        data, deletes = (
            self._resolve_row_delta(table, plan, build)
            if keyed
            else ([build(meta) for meta in plan.appended()], [])
        )
        if plan.fork_from is None and fastappend.applicable(table, branch, head):
            snapshot_id = table.metadata.new_snapshot_id()
            properties[state_property(self._group_id, branch)] = kept_state(
                snapshot_id, table.metadata.next_sequence_number(), plan.summary
            )
            staged = fastappend.stage(
                table,
                branch,
                head,
                () if head is None else self._live_files.manifests(table, head),
                data,
                plan.summary,
                properties,
                removals,
                snapshot_id,
                deletes,
            )
            if staged is not None:
                return self._committing_append(staged), snapshot_id
            del properties[state_property(self._group_id, branch)]
        tx = table.transaction()
        if plan.fork_from is not None:
            with ManageSnapshots(tx) as refs:
                refs.create_branch(plan.fork_from, branch)
        if properties:
            tx.set_properties(properties)
        if removals:
            tx.remove_properties(*removals)
        if keyed:
            from icefloe.commit import rowdelta  # loaded already: the files were resolved

            snapshot_id = rowdelta.stage(tx, branch, plan.summary, data, deletes)
        else:
            # pyiceberg's merge append is a fast append unless the table enables manifest
            # merging (commit.manifest-merge.enabled, set on tables icefloe creates): see
            # icefloe.ops.maintenance
            snapshot = tx.update_snapshot(snapshot_properties=plan.summary, branch=branch)
            with snapshot.merge_append() as append:
                for data_file in data:
                    append.append_data_file(data_file)
            snapshot_id = append.snapshot_id
        # the number pyiceberg gave the snapshot: staging it changed nothing that counts
        kept = kept_state(snapshot_id, table.metadata.next_sequence_number(), plan.summary)
        tx.set_properties({state_property(self._group_id, branch): kept})
        return tx.commit_transaction, snapshot_id

    def _committing_append(self, staged: fastappend.StagedAppend) -> Callable[[], Table]:
        def commit() -> Table:
            committed = staged.commit()
            self._live_files.remember_list(staged.manifest_list, staged.manifests)
            return committed

        return commit

    def _resolve_row_delta(
        self, table: Table, plan: _Plan, build: Callable[[DataFileMeta], Any]
    ) -> tuple[list[Any], list[Any]]:
        """Resolve the plan's key files against the branch head of ``table`` (the version this
        attempt loaded; a commit on top of another head fails and is re-resolved) into
        position-delete files: the snapshot's data files and delete files."""
        # Arrow and numpy load with the first keyed commit, not with every committer (reading
        # a table's state, as `icefloe status` does, needs neither)
        from icefloe.commit import rowdelta

        batches: dict[tuple[str, int], tuple[list[Any], list[Any]]] = {}
        for f in plan.files:  # channel order; one writer's batches in source order
            data, keys = batches.setdefault((f.writer_id, f.batch_seq), ([], []))
            (keys if f.is_key_file else data).append(build(f.meta))
        base, _ = self._branch_head(table)
        resolution = rowdelta.resolve(
            table,
            None if base is None else base.snapshot_id,
            [rowdelta.Batch(data, keys) for data, keys in batches.values()],
        )
        deletes = rowdelta.write_position_deletes(table, resolution)
        logger.info(
            "%s: %d key file(s) delete %d row(s) in %d file(s) (%d of %d candidates read)",
            table_name(table),
            sum(len(keys) for _, keys in batches.values()),
            resolution.deleted_rows,
            len(resolution.targets),
            resolution.files_read,
            resolution.candidates,
        )
        return [d for data, _ in batches.values() for d in data], deletes

    def _backoff(self, attempt: int) -> None:
        # jittered exponential backoff, so competing committers do not retry in lockstep
        wait = backoff_s(self._retry_wait_s, self._max_retry_wait_s, attempt)
        time.sleep(wait * random.uniform(0.5, 1.0))


def _write_side_file(table: Table, location: str, content: bytes) -> None:
    """Write a side file the next commit names, before that commit; named by its content, so a
    retry writes the same file, and one left by a failed attempt is an orphan for
    `icefloe maintain`. One already there with this content is left alone: another run of the
    same commit (a Spark commit task's speculative copy) may have landed a snapshot naming it,
    and rewriting it in place shows readers a partial file meanwhile (for good if the rewrite
    is killed). Any other content there is a partial write of a run that died: replaced."""
    try:
        with table.io.new_input(location).open() as stream:
            if stream.read() == content:
                return
    except FileNotFoundError:
        pass
    with table.io.new_output(location).create(overwrite=True) as stream:
        stream.write(content)


def _boundary(state: RecordedCommit | None) -> CommitBoundary:
    return CommitBoundary() if state is None else state.boundary


def _stale_replay(f: PendingFile, replay: str | None) -> bool:
    """A file of a replay batch made for another rollback than the one the table waits for
    (``replay``: its replay's writer id)."""
    return is_replay_writer(f.writer_id) and f.writer_id != replay


def _select(
    files: Iterable[PendingFile], state: RecordedCommit | None, replay: str | None = None
) -> tuple[tuple[PendingFile, ...], int]:
    """The files still to commit, and how many were dropped. Replay batches count only for
    the rollback they were made for (``replay``): one of a rollback that was undone, or
    superseded by a deeper one, would add its rows a second time."""
    boundary = _boundary(state)
    files = tuple(files)
    # a keyed batch is applied whole: one whose key file the table holds as applied had its
    # data files committed with it, whatever writer id announces them again now (and they
    # may be gone from storage since, which nothing checks for data files)
    applied = {
        (f.writer_id, f.batch_seq)
        for f in files
        if f.is_key_file and boundary.holds(f, f.meta.path)
    }
    seen: set[str] = set()
    keep: list[PendingFile] = []
    skipped = 0
    for f in files:
        stale = _stale_replay(f, replay)
        held = boundary.holds(f, f.meta.path) or (f.writer_id, f.batch_seq) in applied
        name = screening.canonical_path(f.meta.path)  # s3a://b/k is s3://b/k
        if name in seen or f.meta.record_count <= 0 or stale or held:
            skipped += 1
        else:
            keep.append(f)
        seen.add(name)
    return tuple(keep), skipped


def _result(request: TableCommitRequest, plan: _Plan, snapshot_id: int | None) -> TableCommitResult:
    committed = [f for f in plan.files if not f.is_key_file] if snapshot_id is not None else []
    return TableCommitResult(
        table=request.table,
        commit_id=request.commit_id,
        snapshot_id=snapshot_id,
        data_files=len(committed),
        records=sum(f.meta.record_count for f in committed),
        skipped_files=plan.skipped,
        added_files=None if plan.merge is None or snapshot_id is None else len(plan.appended()),
    )
