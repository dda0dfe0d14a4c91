"""Count what a table holds without the committer's code: a pyiceberg scan to Arrow and,
separately, the manifests' per-file record counts checked against each Parquet file's footer.

Two readers that must agree: a scan that silently skipped a manifest would still be caught by
the manifest sum, and a manifest that lies about a file is caught by the file's own footer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

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

    def add_table(self, table: Table, label: str) -> None:
        snapshot = table.current_snapshot()
        if snapshot is None:
            return
        ids = table.scan(selected_fields=(KEY,)).to_arrow()[KEY].to_pylist()
        self.keys.update(int(i) for i in ids)
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
