"""The commit cycle: broadcast StartCommit, wait for the live writers' answers (or the commit
timeout, or the memory bound), screen and commit every table with pending files, broadcast
the results and notify plugins, then store the position and prune the channel.

One table's trouble never stops the others, nor the position:

* files a table refuses for good are quarantined (:mod:`icefloe.commit.quarantine`) before the rest
  is committed;
* a failing table is retried with an exponential backoff instead of every cycle, and after
  ``quarantine_after_failures`` attempts failing with a
  :class:`~icefloe.errors.PermanentTableError` its pending files are quarantined;
* a table failing ``quarantine_after_failures`` times in a row with any other exception is
  *failing*: one ERROR names the table and the error, ``icefloe status`` shows it (a mark
  kept with the quarantine) and the ``icefloe_table_failing`` metric counts its failures
  until it commits again. Its files stay pending: a transient fault (catalog or storage
  down) must not quarantine data, and an upsert/CDC table's batches must commit in order;
* the stored position is the read position lowered to the oldest file still pending, so it
  advances (and the channel is pruned) while a table fails;
* tables commit largest first, and tables that failed their last attempt after the others;
* with ``commit_parallelism`` above 1 the tables of a cycle are committed by that many threads
  (:meth:`CommitCycle._run_tables`); the coordinator alone decides what the cycle holds, and
  stores the position only once every table committed, failed or was deferred.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from icefloe import metrics
from icefloe.channel import CoordinatorChannel
from icefloe.commit.committer import IcebergCommitter
from icefloe.commit.policy import backoff_s
from icefloe.commit.quarantine import FailingTable, Quarantine, QuarantineEntry
from icefloe.commit.request import PendingFile, TableCommitRequest, TableCommitResult
from icefloe.commit.rollback import Rollback, is_replay_writer, replays
from icefloe.commit.screening import Screening
from icefloe.coordination.leadership import Leadership
from icefloe.coordination.processes import CommitAnswer, CommitTask, Committers
from icefloe.coordination.reading import EventReader
from icefloe.coordination.settings import POLL_S, CoordinatorHooks, CoordinatorSettings, CycleResult
from icefloe.errors import (
    ChannelIdentityError,
    CommitterProcessError,
    NotLeaderError,
    PermanentTableError,
    RollbackPendingError,
    StaleFencingTokenError,
)
from icefloe.events import CommitComplete, CommitToTable, Event, StartCommit
from icefloe.hookspecs import TableCommitted
from icefloe.plugins.manager import Plugins, get_plugins

log = logging.getLogger("icefloe.coordinator")
# the one line per cycle (INFO when it committed, failed or quarantined something, else DEBUG):
# its own logger, so `icefloe run`, which logs each table commit, can leave it out
cycles_log = logging.getLogger("icefloe.coordinator.cycles")
# a cycle's CommitToTable events per broadcast_all call, the lease renewed between calls
BROADCAST_CHUNK = 500


@dataclass(frozen=True)
class _CycleJob:
    """What the coordinator decided for one cycle, the same for every table of it."""

    commit_id: str
    position: dict[str, int]
    sources: dict[str, dict[int, int]]
    vtts: int | None
    writers: frozenset[str]


@dataclass
class _TableOutcome:
    """One table's part of a cycle: its commit, its error, its files quarantined."""

    table: str
    result: TableCommitResult | None = None
    error: str | None = None
    quarantined: int | None = None


@dataclass
class _TableBackoff:
    """A table's consecutive failures, and when to try it again."""

    failures: int
    retry_at: float
    since_ms: int  # wall clock of the first failure in a row
    alarmed: bool = False  # reached quarantine_after_failures: reported as failing
    # the last failure: its rollback's replay batch not read yet. That batch's writer id when
    # known (an older rollback's replay may be pending too), else True
    replay_pending: str | bool = False


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
        quarantine: Quarantine,
        pool: Committers | None = None,
    ) -> None:
        self._group_id = group_id
        self._pool = pool  # committer processes or a runner's committers; None: commit here
        self._coordinator_id = coordinator_id
        self._channel = channel
        self._committer = committer
        self._reader = reader
        self._leadership = leadership
        self._settings = settings
        self._hooks = hooks
        self._plugins = plugins
        self._quarantine = quarantine
        self._trouble: dict[str, _TableBackoff] = {}
        # held by commit workers while they change what tables share: the reader's pending
        # files and boundaries, the backoff counters, the quarantine and its marks
        self._shared = threading.RLock()
        self._compaction_turn = 0  # which table a compaction round starts with
        # tables marked failing in the quarantine (by any leader), read at the first commit
        self._marked: set[str] | None = None
        self.quarantined_files = 0  # since this coordinator started (a metric)
        reader.backing_off = self.backing_off
        reader.awaiting_replay = self.awaiting_replay
        self.stop: threading.Event | None = None  # set by run(): cut a cycle's wait short
        self.last_start = self.last_end = time.monotonic()
        # no cycle of this leadership has committed a file yet, or the last one committed none
        self.idle = True

    def restart_clock(self) -> None:
        """The interval counts from now (after recovery, or after losing leadership)."""
        self.last_start = self.last_end = time.monotonic()

    def failing(self) -> dict[str, int]:
        """Tables failing ``quarantine_after_failures`` times in a row or more: failures."""
        return {t: b.failures for t, b in self._trouble.items() if b.alarmed}

    def backing_off(self, table: str) -> bool:
        """Whether ``table`` failed recently and waits for its next attempt."""
        trouble = self._trouble.get(table)
        return trouble is not None and time.monotonic() < trouble.retry_at

    def awaiting_replay(self, table: str) -> bool:
        """Whether ``table``'s files wait for its rollback's replay batch, which is not among
        them yet (its last attempt failed with RollbackPendingError): they cannot commit before
        the reader reaches that batch."""
        trouble = self._trouble.get(table)
        if trouble is None or not trouble.replay_pending:
            return False
        awaited = trouble.replay_pending
        pending = self._reader.pending.get(table, ())
        if isinstance(awaited, str):
            # an older rollback's replay among them is not the batch they wait for: counting
            # them against the memory bound then stopped the reader before that batch for good
            return not any(f.writer_id == awaited for f in pending)
        return not any(is_replay_writer(f.writer_id) for f in pending)

    def due(self) -> bool:
        s = self._settings
        since = self.last_start if s.commit_interval_from == "start" else self.last_end
        if time.monotonic() - since >= s.commit_interval_s:
            return True
        # files of tables backing off do not count: they must not make cycles spin
        files, size = self._reader.pending_size(
            t for t in self._reader.pending if not self.backing_off(t)
        )
        if s.commit_when_idle and self.idle and files:
            # the first files after a start or a quiet spell need not wait out the interval;
            # the cycle that commits them makes the pipeline busy again, so a steady stream
            # still commits once per interval (no more snapshots than without this)
            return True
        if s.max_pending_files is not None and files and files >= s.max_pending_files:
            return True
        return s.max_pending_bytes is not None and files > 0 and size >= s.max_pending_bytes

    def run(self, wait_for_writers: bool = True) -> CycleResult:
        """A cycle; without ``wait_for_writers`` it commits what was read at once, as a
        partial cycle, without asking the writers (they are stopped: ``icefloe drain``)."""
        commit_id = str(uuid.uuid4())
        self.last_start = time.monotonic()
        reader = self._reader
        expected = reader.prune_writers()
        if not wait_for_writers:
            return self._commit(commit_id, False, None)
        reader.cycle_id, reader.answered = commit_id, set()
        cut_short = ""
        try:
            self._channel.broadcast(Event(self._group_id, StartCommit(commit_id)))
            deadline = time.monotonic() + self._settings.commit_timeout_s
            while not expected <= reader.answered:
                left = deadline - time.monotonic()  # > 0 when polled: 0 or less may block
                if left <= 0:
                    cut_short = "timeout"
                elif self.stop is not None and self.stop.is_set():
                    cut_short = "stop"
                elif reader.full():
                    cut_short = "full"
                if cut_short:
                    break  # commit what was read, as a partial cycle
                reader.poll(min(left, POLL_S))
                self._leadership.renew_if_due()
            answered = set(reader.answered)
        finally:
            reader.cycle_id = None
        complete = expected <= answered
        if not complete:
            silent = sorted(expected - answered)
            if cut_short == "timeout":
                log.warning(
                    "commit %s: no answer from %s within %.1fs; partial commit without VTTS",
                    commit_id,
                    silent,
                    self._settings.commit_timeout_s,
                )
            else:  # stopping, or the memory bound: expected, not a fault
                log.info(
                    "commit %s: %s before %s answered; partial commit without VTTS",
                    commit_id,
                    "stopping" if cut_short == "stop" else "pending files at the bound",
                    silent,
                )
        # the decision point: everything read so far (and only that) goes into this cycle
        vtts = reader.valid_through(answered) if complete else None
        return self._commit(commit_id, complete, vtts)

    def _commit(self, commit_id: str, complete: bool, vtts: int | None) -> CycleResult:
        reader = self._reader
        position = reader.commit_position()
        sources: dict[str, dict[int, int]] = {}
        for (topic, part), p in reader.source_positions().items():
            sources.setdefault(topic, {})[part] = p.offset
        results: list[TableCommitResult] = []
        failed: dict[str, str] = {}
        quarantined: dict[str, int] = {}
        deferred: list[str] = []
        todo: list[str] = []
        for table in self._schedule():
            (deferred if self.backing_off(table) else todo).append(table)
        job = _CycleJob(commit_id, position, sources, vtts, frozenset(reader.writers))
        for outcome in self._run_tables(job, todo):
            if outcome.result is not None:
                results.append(outcome.result)
            if outcome.error is not None:
                failed[outcome.table] = outcome.error
            if outcome.quarantined is not None:
                quarantined[outcome.table] = outcome.quarantined
        cycle = CycleResult(
            commit_id,
            complete,
            vtts,
            tuple(results),
            failed,
            quarantined,
            tuple(deferred),
            self.failing(),
        )
        if self._hooks.after_iceberg_commits is not None:
            self._hooks.after_iceberg_commits(cycle)
        # tell writers and plugins first: a failing store below must not swallow these
        broadcast_in_chunks(
            self._channel,
            [
                Event(self._group_id, CommitToTable(commit_id, r.table, r.snapshot_id, vtts))
                for r in results
            ],
            self._leadership.renew_if_due,
        )
        for r in results:
            self._notify(r, vtts)
        safe = reader.safe_position(position)
        if safe != reader.stored and any(
            o > (reader.stored or {}).get(p, 0) for p, o in safe.items()
        ):
            self._channel.store_position(safe)
            reader.stored = safe
        if not failed and not deferred:
            self._channel.broadcast(Event(self._group_id, CommitComplete(commit_id, vtts)))
        if reader.stored:
            self._channel.prune(reader.stored)
        self.last_end = time.monotonic()
        self.idle = not any(r.data_files for r in results)
        eventful = not self.idle or failed or deferred or any(quarantined.values())
        cycles_log.log(
            logging.INFO if eventful else logging.DEBUG,  # an idle pipeline cycles all day
            "commit %s: %s, vtts=%s, %d tables committed (%d files, %d records), "
            "%d failed%s, %d deferred, %d files quarantined",
            commit_id,
            "complete" if complete else "partial",
            vtts,
            sum(1 for r in results if r.snapshot_id is not None),
            sum(r.data_files for r in results),
            sum(r.records for r in results),
            len(failed),
            f": {failed}" if failed else "",
            len(deferred),
            sum(quarantined.values()),
        )
        self._compact(results)
        return cycle

    def _run_tables(self, job: _CycleJob, tables: list[str]) -> list[_TableOutcome]:
        """Commit ``tables`` (in schedule order) one after another, or spread over
        ``commit_parallelism`` threads: the cycle's wall time is mostly the catalog's and the
        store's latency per commit, which threads overlap. The outcomes come back in schedule
        order. A worker that finds this coordinator deposed (or the channel replaced) stops the
        tables not yet started; that error is raised once every started table is done."""
        if self._pool is not None and tables:
            return self._run_in_processes(self._pool, job, tables)
        n = self._settings.commit_parallelism
        if n <= 1 or len(tables) <= 1:
            return [self._commit_table(job, table) for table in tables]
        abort = threading.Event()

        def work(table: str) -> _TableOutcome | None:
            if abort.is_set():
                return None  # not started: stays pending for the next leader or cycle
            try:
                return self._commit_table(job, table)
            except BaseException:
                abort.set()
                raise

        with ThreadPoolExecutor(n, thread_name_prefix="icefloe-commit") as pool:
            futures = [pool.submit(work, table) for table in tables]  # the queue keeps order
            wait(futures)
        errors = [e for f in futures if (e := f.exception()) is not None]
        fatal = [e for e in errors if isinstance(e, NotLeaderError)] or errors
        if fatal:
            raise fatal[0]
        return [o for o in (f.result() for f in futures) if o is not None]

    def _commit_table(self, job: _CycleJob, table: str) -> _TableOutcome:
        """Screen and commit one table of the cycle ``job``. Safe to run in parallel for
        distinct tables: the committer's caches are thread-safe, and this cycle's shared
        bookkeeping (the reader's pending files, the backoff counters, the quarantine) is
        changed only under ``self._shared``."""
        reader = self._reader
        outcome = _TableOutcome(table)
        started = time.monotonic()
        with self._shared:
            files = tuple(reader.pending[table])
        try:
            if self._hooks.before_table_commit is not None:
                self._hooks.before_table_commit(table)
            screening = self._committer.screen(table, files, reader.channel_id)
            accepted = self._screened(job, table, screening, outcome)
            if accepted:
                request = self._request(job, table, accepted, self._leadership.token())
                outcome.result = self._committer.commit(request)
        except Exception as exc:
            self._failure(job, table, exc, outcome)
            return outcome
        self._settled(job, table, accepted, outcome, time.monotonic() - started)
        return outcome

    def _request(
        self, job: _CycleJob, table: str, files: tuple[PendingFile, ...], token: int
    ) -> TableCommitRequest:
        """The commit of ``files`` to ``table`` in the cycle ``job``, fenced by ``token``."""
        return TableCommitRequest(
            table=table,
            commit_id=job.commit_id,
            files=files,
            positions=job.position,
            source_offsets=job.sources,
            fencing_token=token,
            valid_through_ms=job.vtts,
            channel_id=self._reader.channel_id,
            live_writers=job.writers,
        )

    def _screened(
        self, job: _CycleJob, table: str, screening: Screening, outcome: _TableOutcome
    ) -> tuple[PendingFile, ...]:
        """Act on a table's screening before its commit: quarantine the refused files (and
        accept a rollback whose replay is refused whole), retire what a replay writes again.
        Returns the files to commit."""
        if screening.refused:
            with self._shared:
                self._replays_refused(table, screening)
                outcome.quarantined = self._isolate(job.commit_id, table, screening.refused)
        accepted = screening.accepted
        if accepted:
            with self._shared:
                self._retire_replayed(table, accepted)
        return accepted

    def _settled(
        self,
        job: _CycleJob,
        table: str,
        committed: tuple[PendingFile, ...],
        outcome: _TableOutcome,
        seconds: float,
    ) -> None:
        """A table's part of the cycle is done: forget its committed files and failures."""
        with self._shared:
            if committed:
                self._reader.committed(table, committed, job.position)
            self._committing(table)
        if outcome.result is not None:
            metrics.TABLE_COMMIT_SECONDS.observe(seconds)

    def _failure(self, job: _CycleJob, table: str, exc: Exception, outcome: _TableOutcome) -> None:
        """A table's commit raised ``exc``: it stays pending and backs off, unless the error
        ends this leadership (raised as NotLeaderError) or no retry can help (raised)."""
        if isinstance(exc, (NotLeaderError, StaleFencingTokenError)):
            # a newer leader exists: stop here, it re-reads and finishes our work
            raise NotLeaderError(f"{self._coordinator_id}: {exc}") from exc
        if isinstance(exc, ChannelIdentityError):
            raise exc  # no retry can help: stop and let the operator act on the message
        # tables commit independently; this one stays pending
        outcome.error = f"{type(exc).__name__}: {exc}"
        with self._shared:
            n = self._failed(job.commit_id, table, exc)
        if n:
            outcome.quarantined = (outcome.quarantined or 0) + n

    def _run_in_processes(
        self, pool: Committers, job: _CycleJob, tables: list[str]
    ) -> list[_TableOutcome]:
        """Commit ``tables`` on the committers (processes, ``commit_processes``, or a
        runner's, e.g. Spark tasks): each table is screened and committed by its committer,
        while this thread keeps the bookkeeping, acts on refused files between a screening
        and its commit, and renews the lease. The submits of a round (every table, then the
        tables screened again) are followed by a ``flush``, so a committer with a cost per
        hand-out runs a round at once. A committer that dies fails its tables
        (CommitterProcessError: they stay pending and back off as after any failure, so a
        table that kills its committer every time is reported failing) and is replaced. A
        table whose answer ends the leadership cancels the tables not started; that error is
        raised once the others are done. Outcomes come back in schedule order."""
        reader = self._reader
        self._leadership.before_commit()  # prove we lead before handing the cycle out
        token = self._leadership.token()

        def task(table: str, files: tuple[PendingFile, ...], screen: bool) -> CommitTask:
            return CommitTask(self._request(job, table, files, token), screen)

        outcomes = {t: _TableOutcome(t) for t in tables}
        seconds = dict.fromkeys(tables, 0.0)
        running: dict[Future[CommitAnswer], tuple[str, tuple[PendingFile, ...]]] = {}
        dropped: set[str] = set()  # cancelled: not started, left pending
        died: set[int] = set()
        fatal: BaseException | None = None
        try:
            for table in tables:
                files = tuple(reader.pending[table])
                try:
                    if self._hooks.before_table_commit is not None:
                        self._hooks.before_table_commit(table)
                except Exception as exc:
                    self._failure(job, table, exc, outcomes[table])
                    continue
                running[pool.submit(task(table, files, True))] = (table, files)
            pool.flush()  # the first round: every table
            while running:
                done, _ = wait(running, timeout=POLL_S, return_when=FIRST_COMPLETED)
                if fatal is None:
                    try:
                        self._leadership.renew_if_due()
                    except NotLeaderError as exc:
                        fatal = exc
                for future in done:
                    table, files = running.pop(future)
                    outcome = outcomes[table]
                    if future.cancelled():
                        dropped.add(table)
                        continue
                    try:
                        answer = future.result()
                    except (BrokenProcessPool, CommitterProcessError) as exc:
                        died.add(pool.worker_of(table))
                        death = (
                            exc
                            if isinstance(exc, CommitterProcessError)
                            else CommitterProcessError(f"committer process died: {exc}")
                        )
                        self._failure(job, table, death, outcome)  # a table failure like any
                        continue
                    seconds[table] += answer.seconds
                    try:
                        if answer.error is not None:
                            raise answer.error
                        if answer.verdicts is not None:
                            screening = answer.verdicts.screening(files)
                            accepted = self._screened(job, table, screening, outcome)
                            if accepted:
                                running[pool.submit(task(table, accepted, False))] = (
                                    table,
                                    accepted,
                                )
                                continue
                            files = accepted
                        outcome.result = answer.result
                        self._settled(job, table, files, outcome, seconds[table])
                    except Exception as exc:
                        try:
                            self._failure(job, table, exc, outcome)
                        except Exception as stop:
                            log.warning("commit %s: %s: %s", job.commit_id, table, stop)
                            fatal = fatal or stop
                if fatal is not None:
                    for future in running:
                        future.cancel()  # not started yet: stays pending for the next leader
                pool.flush()  # the tables screened again after the coordinator acted
            for i in sorted(died):
                pool.replace(i)
            if fatal is not None:
                raise fatal
        except BaseException:
            # nothing of this cycle may be handed out later (by the next cycle's flush)
            for future in running:
                future.cancel()
            pool.flush()
            raise
        return [outcomes[t] for t in tables if t not in dropped]

    def _compact(self, results: Sequence[TableCommitResult]) -> None:
        """A compaction round right after the cycle, for the tables it committed to whose
        policy compacts them: the coordinator is their one writer, so a round never races its
        own cycles (:mod:`icefloe.commit.compaction`). Bounded by ``compaction_budget_s``; a
        table whose round fails stays as it is (its rows unchanged) and is tried after its
        next commit."""
        committer = self._committer
        tables = sorted(
            r.table
            for r in results
            if r.snapshot_id is not None and committer.compaction_of(r.table) is not None
        )
        if not tables:
            return
        # each round starts with another table, so a spent budget starves none of them
        first = self._compaction_turn % len(tables)
        self._compaction_turn += 1
        tables = tables[first:] + tables[:first]
        compactor = committer.compactor(self._hooks.during_compaction)
        deadline = time.monotonic() + self._settings.compaction_budget_s
        for i, table in enumerate(tables):
            thresholds = committer.compaction_of(table)
            left = deadline - time.monotonic()
            if thresholds is None or (i and left <= 0):
                continue  # the first table of a round always gets its turn
            try:
                result = compactor.compact(table, thresholds, max(left, 0.0))
            except NotLeaderError:
                raise  # a newer leader exists: stop here, as a commit would
            except Exception as exc:  # the table keeps its files; the next round retries
                log.warning("compaction of %s failed, nothing changed: %s", table, exc)
                continue
            if result.snapshot_id is not None and self._hooks.after_compaction is not None:
                self._hooks.after_compaction(table)

    def _schedule(self) -> list[str]:
        """The pending tables in commit order: the largest (pending bytes) first, so a cycle's
        biggest commits start earliest; tables that failed their last attempt after all the
        others, so a table that keeps failing (often slowly: timeouts) does not delay the
        healthy ones in the cycle it is retried."""
        reader = self._reader

        def order(table: str) -> tuple[bool, int, str]:
            return table in self._trouble, -reader.pending_size([table])[1], table

        return sorted(reader.pending, key=order)

    def _failed(self, commit_id: str, table: str, exc: Exception) -> int:
        """Count a table failure and set its backoff; once ``quarantine_after_failures`` are
        reached, quarantine its pending files (a permanent error) or raise the alarm (any
        other). Returns how many files were quarantined."""
        s = self._settings
        trouble = self._trouble.get(table) or _TableBackoff(0, 0.0, _now_ms())
        trouble.failures += 1
        # a rolled-back table waits for its replay, which comes soon: no growing backoff
        waiting = isinstance(exc, RollbackPendingError)
        trouble.replay_pending = (
            (exc.replay_writer or True) if isinstance(exc, RollbackPendingError) else False
        )
        wait = backoff_s(s.table_retry_base_s, s.table_retry_max_s, trouble.failures)
        if waiting:
            wait = s.table_retry_base_s
        trouble.retry_at = time.monotonic() + wait
        self._trouble[table] = trouble
        (log.warning if waiting else log.error)(
            "commit %s: table %s failed (%d in a row, next try in %.1fs): %s",
            commit_id,
            table,
            trouble.failures,
            wait,
            exc,
        )
        if trouble.failures < s.quarantine_after_failures:
            return 0
        if isinstance(exc, PermanentTableError):
            files = tuple(self._reader.pending.get(table, ()))
            try:
                n = self._isolate(commit_id, table, [(f, exc) for f in files])
            except NotLeaderError:
                raise
            except StaleFencingTokenError as stale:  # a newer leader exists, as in _failure
                raise NotLeaderError(f"{self._coordinator_id}: {stale}") from stale
            except Exception as qexc:  # the files stay pending; retried after the backoff
                log.error("commit %s: cannot quarantine files of %s: %s", commit_id, table, qexc)
            else:
                self._committing(table)  # nothing of it is pending any more
                return n
        if not trouble.alarmed:
            self._alarm(table, trouble, exc, wait)
        return 0

    def _alarm(self, table: str, trouble: _TableBackoff, exc: Exception, wait: float) -> None:
        """Report ``table`` as failing: once in the log, and as a mark ``icefloe status`` reads."""
        trouble.alarmed = True
        error = f"{type(exc).__name__}: {exc}"
        log.error(
            "table %s failed %d commits in a row (coordination.quarantine_after_failures = %d), "
            "the last with %s. Its %d pending file(s) stay pending and hold the channel "
            "position; retrying every %.0fs until it commits. Fix the cause (`icefloe status` "
            "shows it)",
            table,
            trouble.failures,
            self._settings.quarantine_after_failures,
            error,
            len(self._reader.pending.get(table, ())),
            wait,
        )
        mark = FailingTable(trouble.failures, error, trouble.since_ms, _now_ms())
        try:
            self._quarantine.mark_failing(self._group_id, table, mark)
        except Exception as mexc:  # the log line and the metric still say it
            log.warning("cannot record failing table %s for `icefloe status`: %s", table, mexc)

    def _committing(self, table: str) -> None:
        """``table`` committed (or has nothing left pending): forget its failures, and clear
        a failing mark (this leader's, or one an earlier leader left)."""
        trouble = self._trouble.pop(table, None)
        if self._marked is None:
            try:
                self._marked = set(self._quarantine.failing(self._group_id))
            except Exception as exc:
                log.warning("cannot read failing tables from the quarantine: %s", exc)
                self._marked = set()
        if trouble is None or not trouble.alarmed:
            if table not in self._marked:
                return
        else:
            log.info("table %s commits again after %d failures in a row", table, trouble.failures)
        try:
            self._quarantine.clear_failing(self._group_id, table)
            self._marked.discard(table)
        except Exception as exc:  # status ignores marks older than the table's last commit
            log.warning("cannot clear the failing mark of %s: %s", table, exc)

    def _retire_replayed(self, table: str, files: Sequence[PendingFile]) -> None:
        """Before committing the replay of a rollback of ``table``: retire the quarantine
        entries of files whose batches lie in the rolled-back source range (by the source
        offsets an entry records, which hold across a backend swap; an entry without them: by
        the rolled-back channel range). The replay reads that source range again, the records
        of those files included (under today's spec, say, they fit): left in the quarantine,
        recovering them with ``add_files`` as the entry says would add them twice. Retired
        before the commit, not after: a crash in between leaves the replay pending, and it is
        committed (or quarantined, its files holding those records) later; after the commit
        the rollback would no longer be known."""
        replayers = {f.writer_id for f in files if is_replay_writer(f.writer_id)}
        if not replayers:
            return
        rollback = self._committer.rollback(table)
        if rollback is None or rollback.writer_id not in replayers:
            return  # a stale replay: the commit drops it
        self._retire_range(table, rollback, "commits")

    def _retire_range(self, table: str, rollback: Rollback, fate: str) -> None:
        """Retire the quarantine entries of files whose batches lie in ``rollback``'s range:
        its replay holds their records again (committed or quarantined, as ``fate`` says)."""
        paths = [
            e.file_path
            for e in self._quarantine.list(self._group_id, table)
            if replays(rollback, e.source_offsets, e.channel_partition, e.channel_offset)
        ]
        why = f"the replay of a rollback of {table} (writer {rollback.writer_id}) holds its records"
        token, channel_id = self._leadership.token(), self._reader.channel_id
        if self._quarantine.retire(self._group_id, table, paths, why, token, channel_id):
            log.warning(
                "table %s: the replay of its rollback (writer %s), which this cycle %s, holds "
                "the records of %d quarantined file(s) of the rolled-back range again; their "
                "quarantine entries are retired: %s",
                table,
                rollback.writer_id,
                fate,
                len(paths),
                paths[:3],
            )

    def _replays_refused(self, table: str, screening: Screening) -> None:
        """Accept the pending rollback of ``table`` when its replay batch is refused whole.

        Why: the table's other files wait for a request that carries a replay file
        (:class:`~icefloe.errors.RollbackPendingError`), and a replay whose every file is
        refused (e.g. written under a partition spec that changed since) brings none: they
        would wait for good. Its rows go to the quarantine (recoverable with ``add_files``),
        so the rollback is done; accepting it keeps the pre-rollback boundary and lets the
        other files commit. Done before the quarantine is written: a crash in between leaves
        the files pending, screened and refused again, never quarantined with the rollback
        still pending.

        The replay holds the records of the range's quarantined files again, so their entries
        are retired first, as before a replay's commit (:meth:`_retire_replayed`): left, those
        records would be in the quarantine twice, and recovering both entries with
        ``add_files`` adds them twice. First, while the rollback is pending (its range is
        known): a crash after it leaves the replay pending, refused and quarantined later."""
        refused = {f.writer_id for f, _ in screening.refused if is_replay_writer(f.writer_id)}
        for writer_id in sorted(refused - {f.writer_id for f in screening.accepted}):
            rollback = self._committer.rollback(table)
            if rollback is None or rollback.writer_id != writer_id:
                continue  # a replay of no pending rollback: it would be dropped anyway
            self._retire_range(table, rollback, "quarantines")
            self._committer.roll_back(table, None, replay=False, only_if=writer_id)
            log.warning(
                "table %s: every file of the replay of its rollback (writer %s, snapshot %s "
                "back to %s) was refused; the rollback is accepted and the replayed rows go "
                "to the quarantine (see `icefloe quarantine list`)",
                table,
                writer_id,
                rollback.lost_snapshot_id,
                rollback.restored_snapshot_id,
            )

    def _isolate(
        self, commit_id: str, table: str, refused: Sequence[tuple[PendingFile, Exception]]
    ) -> int:
        """Record ``refused`` in the quarantine (durably, before anything else happens to the
        table), then forget them. Raises if the record cannot be written, and
        StaleFencingTokenError when a newer leader raised its fence (the files stay: the
        newer leader reads them again)."""
        now = dt.datetime.now(dt.UTC)
        entries = [
            QuarantineEntry(
                group_id=self._group_id,
                table_name=table,
                file_path=f.meta.path,
                record_count=f.meta.record_count,
                file_size_in_bytes=f.meta.file_size_in_bytes,
                writer_id=f.writer_id,
                batch_seq=f.batch_seq,
                channel_partition=f.partition,
                channel_offset=f.offset,
                table_uuid=f.table_uuid,
                error_type=type(e).__name__,
                error_message=str(e),
                commit_id=commit_id,
                quarantined_at=now,
                source_offsets=f.source_offsets,
            )
            for f, e in refused
        ]
        # fenced: a deposed leader's entries would not be in its heir's view of the quarantine
        token, channel_id = self._leadership.token(), self._reader.channel_id
        new = self._quarantine.add(entries, token, channel_id)
        for e in new:  # logged once: re-reads skip quarantined paths, add() skips known ones
            log.error(
                "quarantined %s of table %s (writer %s batch %d, channel %s@%d): %s: %s",
                e.file_path,
                table,
                e.writer_id,
                e.batch_seq,
                e.channel_partition,
                e.channel_offset,
                e.error_type,
                e.error_message,
            )
        self.quarantined_files += len(new)
        self._reader.note_quarantined(table, [f for f, _ in refused])
        self._reader.remove(table, [f for f, _ in refused])
        return len(new)

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
                metadata_location=result.metadata_location,
            )
        )


def _now_ms() -> int:
    return int(time.time() * 1000)


def broadcast_in_chunks(
    channel: CoordinatorChannel,
    events: Sequence[Event],
    renew: Callable[[], None],
    size: int = BROADCAST_CHUNK,
) -> None:
    """``events`` in ``broadcast_all`` calls of at most ``size``, with ``renew`` (the lease's
    renewal when due) between them. Why: a backend that sends them one by one (the default
    ``broadcast_all``) checks the lease on each, and at a thousand tables a cycle's
    broadcasts can outlast a short lease (found by the conformance rule on a file-based
    third-party backend under load)."""
    for start in range(0, len(events), size):
        if start:
            renew()
        channel.broadcast_all(events[start : start + size])
