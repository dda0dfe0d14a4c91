"""Count what a table holds without the committer's code: a pyiceberg scan to Arrow and,
separately, the manifests' per-file record counts checked against each Parquet file's footer.

Two readers that must agree: a scan that silently skipped a manifest would still be caught by
the manifest sum, and a manifest that lies about a file is caught by the file's own footer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyiceberg.manifest import DataFileContent, ManifestEntryStatus
from pyiceberg.table import Table

KEY = "id"


@dataclass
class Tally:
    """Keys found in one or more tables, and what the two readers said."""

    keys: Counter[int] = field(default_factory=Counter)
    scanned_rows: int = 0
    manifest_rows: int = 0
    problems: list[str] = field(default_factory=list)

    def add_table(
        self, table: Table, label: str, belongs: Callable[[int], bool] | None = None
    ) -> None:
        """Count the table's keys; ``belongs`` (when routed) tells the keys it may hold."""
        snapshot = table.current_snapshot()
        if snapshot is None:
            return
        ids = table.scan(selected_fields=(KEY,)).to_arrow()[KEY].to_pylist()
        self.keys.update(int(i) for i in ids)
        if belongs is not None:
            stray = sum(1 for i in ids if not belongs(int(i)))
            if stray:
                self.problems.append(f"{label}: {stray} rows routed to another table")
        self.scanned_rows += len(ids)
        listed = 0
        for manifest in snapshot.manifests(table.io):
            for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=True):
                if entry.status == ManifestEntryStatus.DELETED:
                    continue
                data_file = entry.data_file
                if data_file.content != DataFileContent.DATA:
                    self.problems.append(f"{label}: delete file {data_file.file_path}")
                    continue
                listed += data_file.record_count
                footer = pq.ParquetFile(table.io.new_input(data_file.file_path).open()).metadata
                if footer.num_rows != data_file.record_count:
                    self.problems.append(
                        f"{label}: {data_file.file_path} has {footer.num_rows} rows, its "
                        f"manifest says {data_file.record_count}"
                    )
        self.manifest_rows += listed
        if listed != len(ids):
            self.problems.append(f"{label}: scan read {len(ids)} rows, manifests list {listed}")

    def add_keyed_table(self, table: Table, label: str, want: Callable[[int], str]) -> None:
        """A table written by key (row deltas): pyiceberg's scan, and separately the scan
        plan's data files minus the rows their position delete files name, read with pyarrow
        alone, must hold the same rows; each row must carry its key's last ``name``."""
        columns = [KEY, "name"]
        scanned = table.scan(selected_fields=tuple(columns)).to_arrow().select(columns)
        parts = []
        for task in table.scan().plan_files():
            path = task.file.file_path
            data = pq.read_table(table.io.new_input(path).open(), columns=columns)
            gone: set[int] = set()
            for delete in task.delete_files:
                deletes = pq.read_table(table.io.new_input(delete.file_path).open())
                gone.update(deletes.filter(pc.equal(deletes["file_path"], path))["pos"].to_pylist())
            keep = pa.array([i not in gone for i in range(data.num_rows)], pa.bool_())
            parts.append(data.filter(keep))
        by_hand = pa.concat_tables(parts) if parts else scanned.slice(0, 0)
        rows = sorted(zip(*(scanned[c].to_pylist() for c in columns), strict=True))
        if rows != sorted(zip(*(by_hand[c].to_pylist() for c in columns), strict=True)):
            self.problems.append(f"{label}: scan and data files minus deletes disagree")
        stale = [(k, name) for k, name in rows if name != want(int(k))]
        if stale:
            self.problems.append(f"{label}: {len(stale)} rows not at their last version")
        self.keys.update(int(k) for k, _ in rows)
        self.scanned_rows += len(rows)


@dataclass(frozen=True)
class Verdict:
    expected: int
    rows: int
    missing: int
    duplicated: int
    unexpected: int
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not (self.missing or self.duplicated or self.unexpected or self.problems)

    def describe(self) -> str:
        text = (
            f"{self.rows} rows for {self.expected} keys: {self.missing} missing, "
            f"{self.duplicated} duplicated, {self.unexpected} unexpected"
        )
        return "; ".join([text, *self.problems])


def judge(tally: Tally, expected: Iterable[int]) -> Verdict:
    """Every expected key exactly once and nothing else."""
    want = set(expected)
    return Verdict(
        expected=len(want),
        rows=tally.scanned_rows,
        missing=len(want - tally.keys.keys()),
        duplicated=sum(n - 1 for n in tally.keys.values() if n > 1),
        unexpected=sum(n for k, n in tally.keys.items() if k not in want),
        problems=tuple(tally.problems),
    )
