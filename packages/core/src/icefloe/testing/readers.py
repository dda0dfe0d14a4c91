"""A table reader for tests that shares no code with pyiceberg's scan or icefloe's committer.

Why: a test of row deltas or compaction must count rows with something other than the code
under test. This reads the current snapshot's manifest list and manifests with fastavro, and
the data and position delete files with pyarrow, and applies the deletes by path and position.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import fastavro
import pyarrow.parquet as pq
from pyiceberg.table import Table

_DELETED = 2  # manifest entry status
_DATA = 0  # data file content


def local(path: str) -> str:
    """The local path of a ``file://`` location."""
    return urlsplit(path).path


def read_avro(path: str) -> list[dict[str, Any]]:
    """The records of a local Avro file (a manifest list or a manifest)."""
    with open(local(path), "rb") as stream:
        return [r for r in fastavro.reader(stream) if isinstance(r, dict)]


def live_files(table: Table) -> tuple[list[str], list[str]]:
    """Data and delete files of the current snapshot (entries not marked deleted)."""
    head = table.current_snapshot()
    if head is None:
        return [], []
    data: list[str] = []
    deletes: list[str] = []
    for manifest in read_avro(head.manifest_list):
        for entry in read_avro(manifest["manifest_path"]):
            if entry["status"] == _DELETED:
                continue
            f = entry["data_file"]
            (data if f["content"] == _DATA else deletes).append(f["file_path"])
    return data, deletes


def independent_rows(table: Table, columns: Sequence[str]) -> list[tuple[Any, ...]]:
    """The current snapshot's rows (``columns`` of them): its data files minus the positions
    its position delete files name (paths are unique, so sequence numbers need no check)."""
    data, deletes = live_files(table)
    dead: dict[str, set[int]] = {}
    for path in deletes:
        for r in pq.read_table(local(path), columns=["file_path", "pos"]).to_pylist():
            dead.setdefault(r["file_path"], set()).add(r["pos"])
    out: list[tuple[Any, ...]] = []
    for path in data:
        gone = dead.get(path, set())
        rows = pq.read_table(local(path), columns=list(columns)).to_pylist()
        out += [tuple(r[c] for c in columns) for i, r in enumerate(rows) if i not in gone]
    return out
