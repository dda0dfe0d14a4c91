"""How the committer treats each table: the branch it commits to, whether it merges a
cycle's small files and when it compacts the table (the per-table ``branch``,
``merge_small_files``, ``target_file_size_bytes`` and ``compact*`` keys of ``[[tables]]`` and
``[dynamic_tables]``).

One object answers for every table, so every reader of per-branch state (committer, resume,
status, drain, maintain) resolves a table's branch the same way: its ``[[tables]]`` entry,
else ``[dynamic_tables]`` for a table no entry names, else ``coordination.branch``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from icefloe.commit.compaction import Thresholds
from icefloe.config import DEFAULT_TARGET_FILE_SIZE

if TYPE_CHECKING:
    from icefloe.config import PipelineConfig, TableCommitOptions

MAIN_BRANCH = "main"


def backoff_s(base_s: float, max_s: float, failures: int) -> float:
    """``base_s`` doubled per failure after the first, at most ``max_s``. The exponent stops
    at 64 (far past any cap): ``base_s * 2 ** n`` overflows a float from n = 1,024, which a
    table retried every second reaches in 17 minutes."""
    return min(base_s * 2.0 ** min(max(failures - 1, 0), 64), max_s)


@dataclass(frozen=True)
class TablePolicy:
    """One table's commit settings."""

    branch: str = MAIN_BRANCH
    merge_small_files: bool = False
    """Rewrite a cycle's small data files into files of about ``target_file_size_bytes``
    before the commit (append tables only; see :mod:`icefloe.commit.merge`)."""
    target_file_size_bytes: int = DEFAULT_TARGET_FILE_SIZE
    compaction: Thresholds | None = None
    """When the coordinator compacts the table between cycles (None: never; see
    :mod:`icefloe.commit.compaction`)."""


@dataclass(frozen=True)
class TablePolicies:
    """Every table's :class:`TablePolicy`: ``tables`` by name, ``default`` for the rest."""

    default: TablePolicy = field(default_factory=TablePolicy)
    tables: Mapping[str, TablePolicy] = field(default_factory=dict)

    def __call__(self, table: str) -> TablePolicy:
        return self.tables.get(table, self.default)

    def branch(self, table: str) -> str:
        return self(table).branch

    @classmethod
    def single(cls, branch: str = MAIN_BRANCH) -> TablePolicies:
        """Every table on ``branch``, nothing merged (the committer's default)."""
        return cls(TablePolicy(branch=branch))

    @classmethod
    def from_config(cls, config: PipelineConfig) -> TablePolicies:
        """The policies a pipeline configuration sets. The dead-letter table follows
        ``coordination.branch`` and is never merged."""
        base = config.coordination.branch

        def of(options: TableCommitOptions) -> TablePolicy:
            return TablePolicy(
                branch=options.branch or base,
                merge_small_files=options.merge_small_files,
                target_file_size_bytes=options.target_file_size_bytes,
                compaction=Thresholds(
                    delete_ratio=options.compact_delete_ratio,
                    delete_files=options.compact_delete_files,
                    small_files=options.compact_small_files,
                    target_file_size_bytes=options.target_file_size_bytes,
                )
                if options.compact
                else None,
            )

        dynamic = config.dynamic_tables
        tables = {t.name: of(t) for t in config.tables}
        if config.errors.dead_letter_table:
            tables[config.errors.dead_letter_table] = TablePolicy(branch=base)
        default = of(dynamic) if dynamic is not None else TablePolicy(branch=base)
        return cls(default, tables)
