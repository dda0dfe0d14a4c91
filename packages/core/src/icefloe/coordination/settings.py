"""The coordinator's public data types: settings, fault-injection hooks and cycle results."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from icefloe.commit.policy import TablePolicies
from icefloe.commit.quarantine import DEFAULT_QUARANTINE_TABLE
from icefloe.commit.request import TableCommitResult
from icefloe.config import CoordinationConfig, PipelineConfig

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog

POLL_S = 0.2  # longest single wait inside a cycle, so lease renewal keeps its pace


@dataclass(frozen=True)
class CatalogSpec:
    """How to build the pipeline's catalog (``[catalog]``): what a committer process needs
    to open its own, since a catalog object cannot cross a process boundary."""

    name: str
    properties: Mapping[str, str] = field(repr=False)  # may hold credentials: never logged

    def load(self) -> Catalog:
        from pyiceberg.catalog import load_catalog

        return load_catalog(self.name, **self.properties)


@dataclass(frozen=True)
class CoordinatorSettings:
    """Commit cadence (the ``[coordination]`` keys of the pipeline configuration)."""

    commit_interval_s: float = 10.0
    commit_timeout_s: float = 30.0
    commit_when_idle: bool = False
    """Start a cycle as soon as files are pending when the last cycle committed none (or
    none has run yet), instead of waiting out ``commit_interval_s``. On in the pipeline
    configuration; off here, so code driving cycles by hand keeps them where it puts them."""
    max_pending_bytes: int | None = None
    max_pending_files: int | None = None
    writer_timeout_s: float = 120.0
    branch: str = "main"
    policies: TablePolicies | None = None
    """Per-table branch and small-file merging; None: every table on ``branch``, unmerged."""
    quarantine_table: str = DEFAULT_QUARANTINE_TABLE
    """Iceberg table (in the pipeline's catalog) recording quarantined files."""
    quarantine_after_failures: int = 10
    """Attempts of a table failing with a PermanentTableError before its pending files are
    quarantined (so the channel position advances for the others); with any other error,
    failures in a row before the table is reported as failing (its files stay pending)."""
    table_retry_base_s: float = 1.0
    """First wait before retrying a failed table; doubles per failure up to the max."""
    table_retry_max_s: float = 300.0
    stall_after_s: float = 120.0
    """How long the channel's end may move on while the read position stands still before
    the coordinator reports a stalled channel (see :mod:`icefloe.coordination.stall`)."""
    compaction_budget_s: float = 30.0
    """The longest compaction round after a cycle (tables whose policy compacts them; see
    :mod:`icefloe.commit.compaction`): a cycle waits for at most one round."""
    commit_parallelism: int = 1
    """Threads committing a cycle's tables at once (1: one table after another). A cycle's
    wall time is mostly catalog and storage latency per table, which threads overlap."""
    commit_processes: int = 0
    """Committer processes on this machine (:mod:`icefloe.coordination.processes`) that
    commit a cycle's tables, each with its own catalog; 0: the coordinator's process commits
    (on ``commit_parallelism`` threads). Takes the place of ``commit_parallelism``."""
    catalog: CatalogSpec | None = None
    """The catalog's configuration, for committer processes (or a runner's committers, e.g.
    Spark tasks) to open their own."""
    commit_interval_from: Literal["start", "end"] = "start"
    """``start``: a cycle starts ``commit_interval_s`` after the previous one started (as
    Kafka Connect's ``commit.interval``), so a table gets a snapshot every interval while
    cycles take less; one that took longer is followed at once. ``end``: the interval is a
    quiet gap after each cycle, which keeps the data path's share of the CPU when cycles are
    long (measured in docs/benchmarks.md), at the price of snapshots further apart. (Last
    field, so that positional arguments keep their meaning.)"""

    def __post_init__(self) -> None:
        if self.commit_parallelism < 1:
            raise ValueError(
                "coordination.commit_parallelism must be at least 1 "
                f"(got {self.commit_parallelism})"
            )
        if self.commit_processes < 0:
            raise ValueError(
                "coordination.commit_processes must be 0 (commit in the coordinator's "
                f"process) or more (got {self.commit_processes})"
            )

    @classmethod
    def for_pipeline(cls, config: PipelineConfig) -> CoordinatorSettings:
        """The settings of a pipeline: its ``[coordination]`` keys, per-table policies and
        (for committer processes, or the Spark runner's commit tasks) its catalog."""
        settings = cls.from_config(config.coordination, TablePolicies.from_config(config))
        if not settings.commit_processes and not config.spark.commit_tasks:
            return settings
        spec = CatalogSpec(config.catalog.name, dict(config.catalog.properties))
        return dataclasses.replace(settings, catalog=spec)

    @classmethod
    def from_config(
        cls, c: CoordinationConfig, policies: TablePolicies | None = None
    ) -> CoordinatorSettings:
        """``policies``: :meth:`TablePolicies.from_config` of the pipeline's configuration."""
        return cls(
            policies=policies,
            commit_interval_s=c.commit_interval_s,
            commit_interval_from=c.commit_interval_from,
            commit_timeout_s=c.commit_timeout_s,
            commit_when_idle=c.commit_when_idle,
            max_pending_bytes=c.max_pending_bytes,
            max_pending_files=c.max_pending_files,
            writer_timeout_s=c.writer_timeout_s,
            branch=c.branch,
            quarantine_table=c.quarantine_table,
            quarantine_after_failures=c.quarantine_after_failures,
            table_retry_base_s=c.table_retry_base_s,
            table_retry_max_s=c.table_retry_max_s,
            stall_after_s=c.stall_after_s,
            compaction_budget_s=c.compaction_budget_s,
            commit_parallelism=c.commit_parallelism,
            commit_processes=c.commit_processes,
        )


@dataclass(frozen=True)
class CycleResult:
    """What one commit cycle did."""

    commit_id: str
    complete: bool  # every live writer answered -> VTTS recorded
    valid_through_ms: int | None
    tables: tuple[TableCommitResult, ...]
    failed: Mapping[str, str]  # table -> error text (left pending, retried after a backoff)
    quarantined: Mapping[str, int] = field(default_factory=dict)  # table -> files quarantined
    deferred: tuple[str, ...] = ()  # tables skipped: still backing off after a failure
    failing: Mapping[str, int] = field(default_factory=dict)
    """Tables that failed ``quarantine_after_failures`` commits in a row or more (and have not
    committed since): their failures in a row."""


@dataclass(frozen=True)
class CoordinatorHooks:
    """Fault-injection points at the dangerous moments of a cycle, for tests.

    Each runs in the coordinator's thread; raising from one (e.g. a ``BaseException`` that
    nothing catches, or killing the process) simulates a crash exactly there.
    """

    before_table_commit: Callable[[str], None] | None = None
    """Before a table's commit; an ``Exception`` fails that table only. With
    ``commit_processes``: as the table is handed to its committer process."""
    after_lease_check: Callable[[str], None] | None = None
    """After the lease was renewed right before a catalog commit attempt (a zombie pausing
    here is the race invariant 3 is about)."""
    after_iceberg_commits: Callable[[CycleResult], None] | None = None
    """After every table commit of the cycle, before the broadcasts and ``store_position``."""
    during_compaction: Callable[[str], None] | None = None
    """In a compaction round after a cycle: the table's new files are written, its replace
    snapshot is not committed yet."""
    after_compaction: Callable[[str], None] | None = None
    """After a table's compaction snapshot landed, before the next cycle."""
    in_committer: Callable[[str, str], None] | None = None
    """With ``commit_processes`` (or a runner's committers): runs in a committer with
    (moment, table), at ``before_commit`` (right before each catalog commit attempt) and
    ``after_commit`` (the commit landed, the answer not sent). Must be picklable (a
    module-level function or an instance of a module-level class)."""
