"""The commit cycle: broadcast StartCommit, wait for the live writers' answers (or the commit
timeout), commit every table with pending files, then broadcast results, store the read
position and prune the channel."""

from __future__ import annotations

import logging
import threading
import time
import uuid

from icefloe.channel import CoordinatorChannel
from icefloe.committer import IcebergCommitter, TableCommitRequest, TableCommitResult
from icefloe.coordination.leadership import Leadership
from icefloe.coordination.reading import EventReader
from icefloe.coordination.settings import POLL_S, CoordinatorHooks, CoordinatorSettings, CycleResult
from icefloe.errors import ChannelIdentityError, NotLeaderError, StaleFencingTokenError
from icefloe.events import CommitComplete, CommitToTable, Event, StartCommit
from icefloe.hookspecs import TableCommitted
from icefloe.plugins import Plugins, get_plugins

log = logging.getLogger("icefloe.coordinator")


class CommitCycle:
    """Runs cycles for one leadership; shares the reader's state and the leadership's lease."""

    def __init__(
        self,
        group_id: str,
        coordinator_id: str,
        channel: CoordinatorChannel,
        committer: IcebergCommitter,
        reader: EventReader,
        leadership: Leadership,
        settings: CoordinatorSettings,
        hooks: CoordinatorHooks,
        plugins: Plugins | None,
    ) -> None:
        self._group_id = group_id
        self._coordinator_id = coordinator_id
        self._channel = channel
        self._committer = committer
        self._reader = reader
        self._leadership = leadership
        self._settings = settings
        self._hooks = hooks
        self._plugins = plugins
        self.stop: threading.Event | None = None  # set by run(): cut a cycle's wait short
        self.last_end = time.monotonic()

    def restart_clock(self) -> None:
        """The interval counts from now (after recovery, or after losing leadership)."""
        self.last_end = time.monotonic()

    def due(self) -> bool:
        s = self._settings
        if time.monotonic() - self.last_end >= s.commit_interval_s:
            return True
        if (
            s.max_pending_files is not None
            and sum(self._reader.pending_files().values()) >= s.max_pending_files
        ):
            return True
        return (
            s.max_pending_bytes is not None and self._reader.pending_bytes() >= s.max_pending_bytes
        )

    def run(self) -> CycleResult:
        commit_id = str(uuid.uuid4())
        reader = self._reader
        expected = reader.live_writers()
        reader.cycle_id, reader.answered = commit_id, set()
        try:
            self._channel.broadcast(Event(self._group_id, StartCommit(commit_id)))
            deadline = time.monotonic() + self._settings.commit_timeout_s
            while not expected <= reader.answered:
                left = deadline - time.monotonic()
                if left <= 0 or (self.stop is not None and self.stop.is_set()):
                    break  # commit what was read, as a partial cycle
                reader.poll(min(left, POLL_S))
                self._leadership.renew_if_due()
            complete = expected <= reader.answered
            silent = sorted(expected - reader.answered)
        finally:
            reader.cycle_id = None
        # the decision point: everything read so far (and only that) goes into this cycle
        return self._commit(commit_id, complete, silent)

    def _commit(self, commit_id: str, complete: bool, silent: list[str]) -> CycleResult:
        reader = self._reader
        position = dict(reader.read_pos)
        vtts = reader.valid_through() if complete else None
        if not complete:
            log.warning(
                "commit %s: no answer from %s within %.1fs; partial commit without VTTS",
                commit_id,
                silent,
                self._settings.commit_timeout_s,
            )
        sources: dict[str, dict[int, int]] = {}
        for (topic, part), p in reader.source_positions().items():
            sources.setdefault(topic, {})[part] = p.offset
        results: list[TableCommitResult] = []
        failed: dict[str, str] = {}
        for table in sorted(t for t, fs in reader.pending.items() if fs):
            files = tuple(reader.pending[table])
            try:
                if self._hooks.before_table_commit is not None:
                    self._hooks.before_table_commit(table)
                result = self._committer.commit(
                    TableCommitRequest(
                        table=table,
                        commit_id=commit_id,
                        files=files,
                        positions=position,
                        source_offsets=sources,
                        fencing_token=self._leadership.token(),
                        valid_through_ms=vtts,
                        channel_id=reader.channel_id,
                    )
                )
            except (NotLeaderError, StaleFencingTokenError) as exc:
                # a newer leader exists: stop here, it re-reads and finishes our work
                raise NotLeaderError(f"{self._coordinator_id}: {exc}") from exc
            except ChannelIdentityError:
                raise  # no retry can help: stop and let the operator act on the message
            except Exception as exc:  # tables commit independently; this one stays pending
                log.error("commit %s: table %s failed: %s", commit_id, table, exc)
                failed[table] = f"{type(exc).__name__}: {exc}"
                continue
            reader.committed(table, files, position)
            results.append(result)
        cycle = CycleResult(commit_id, complete, vtts, tuple(results), failed)
        if self._hooks.after_iceberg_commits is not None:
            self._hooks.after_iceberg_commits(cycle)
        if not failed and position != reader.stored:
            self._channel.store_position(position)
            reader.stored = position
        for r in results:
            self._channel.broadcast(
                Event(self._group_id, CommitToTable(commit_id, r.table, r.snapshot_id, vtts))
            )
            self._notify(r, vtts)
        if not failed:
            self._channel.broadcast(Event(self._group_id, CommitComplete(commit_id, vtts)))
            if reader.stored:
                self._channel.prune(reader.stored)
        self.last_end = time.monotonic()
        log.info(
            "commit %s: %s, vtts=%s, %d tables committed (%d files, %d records), %d failed%s",
            commit_id,
            "complete" if complete else "partial",
            vtts,
            sum(1 for r in results if r.snapshot_id is not None),
            sum(r.data_files for r in results),
            sum(r.records for r in results),
            len(failed),
            f": {failed}" if failed else "",
        )
        return cycle

    def _notify(self, result: TableCommitResult, vtts: int | None) -> None:
        plugins = self._plugins or get_plugins()
        plugins.after_table_commit(
            TableCommitted(
                group_id=self._group_id,
                table=result.table,
                commit_id=result.commit_id,
                snapshot_id=result.snapshot_id,
                data_files=result.data_files,
                records=result.records,
                valid_through_ms=vtts,
            )
        )
