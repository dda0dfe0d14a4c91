"""The one "already committed?" rule, shared by the coordinator and the committer.

A table's :class:`CommitBoundary` says which announced files it already holds: every
DataWritten before its channel ``positions`` and every ``(writer_id, batch_seq)`` at or below
its writer ``watermarks``. The coordinator uses it to skip replays while reading, the
committer to drop covered files right before each commit attempt; keeping both on this one
type (parsed from and written to snapshot summaries only here) means a change to the rule
cannot land in one of them only.

Watermarks of writers that are gone are *retired* (:meth:`CommitBoundary.retire`): moved out
of the summary into an immutable side file in the table's metadata directory, named by the
summary (``icefloe.retired-writers``). Summaries (written on every snapshot, and every table
metadata file repeats every retained snapshot's) then grow with the live writers only, while a
replay of a retired writer's old batch is still covered: the rule reads both maps.

A small file merged away (``merge_small_files``) is committed as much as any file, yet no
snapshot names it and its batch is covered only under the writer id that announced it. Until
the coordinator has deleted it, it is listed in another side file the summary names
(``icefloe.merged-originals``), carried from commit to commit while the file exists, and the
rule holds it by path (:meth:`CommitBoundary.holds`): the same file announced again under
another writer id is not committed a second time. Once deleted, an announcement of it is
quarantined as missing (:mod:`icefloe.commit.screening`).

Two more kinds of file are committed, or were, while no snapshot of the branch names them, and
would come back announced under another writer id (a writer that lost its identity, a forged
announcement): *key files* (an upsert/CDC batch's keys are applied as position deletes, the key
file itself is never committed) and the data files a rollback (``icefloe rollback``) took out
of the branch. A third side file the summary names (``icefloe.applied-files``) lists both
(:class:`Applied`), and the rule holds them by path like merged originals, whatever writer id
announces them. It stays bounded: a key file's entry goes once the file is gone from storage
(``icefloe maintain`` removes applied key files as orphans; announced again, a missing key file
is quarantined as missing), and rolled-back files are recorded once per rollback.

The same side file lists the data files a rewrite took off the branch (the pipeline's own
compaction, another engine's rewrite or delete) after the pipeline committed them
(:attr:`Applied.removed`, :func:`icefloe.commit.applied.with_removed`). The rewrite's snapshot
tells the rule so while it is retained, but once the pipeline committed above it
``icefloe maintain`` may expire it, and the file, announced again under another writer id
before it is deleted as an orphan, would be committed a second time (issue 23). An entry goes
once its file is gone from storage.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Protocol

POSITIONS_KEY = "icefloe.channel-positions"
WATERMARKS_KEY = "icefloe.writer-watermarks"
CHANNEL_ID_KEY = "icefloe.channel-id"
RETIRED_KEY = "icefloe.retired-writers"
MERGED_KEY = "icefloe.merged-originals"
APPLIED_KEY = "icefloe.applied-files"


class Announced(Protocol):
    """Where a file was announced: its DataWritten's channel place and writer batch."""

    @property
    def partition(self) -> str: ...

    @property
    def offset(self) -> int: ...

    @property
    def writer_id(self) -> str: ...

    @property
    def batch_seq(self) -> int: ...


@dataclass(frozen=True)
class Applied:
    """Files the pipeline applied or took out that no snapshot of the branch names."""

    keys: tuple[str, ...] = ()
    """Key files applied (their keys resolved into position deletes), oldest first."""
    retired: frozenset[str] = frozenset()
    """Data files a rollback took out of the branch."""
    removed: tuple[str, ...] = ()
    """Data files a snapshot between two of the pipeline's commits took off the branch (its
    compaction, another engine's rewrite or delete), while they are in storage; the next to
    look up first."""

    @cached_property
    def _paths(self) -> frozenset[str]:
        return self.retired.union(self.keys, self.removed)

    def __contains__(self, path: object) -> bool:
        return path in self._paths

    def __bool__(self) -> bool:
        return bool(self.keys or self.retired or self.removed)


@dataclass(frozen=True)
class CommitBoundary:
    """What a table holds already, for one pipeline. Values only move forward."""

    positions: Mapping[str, int] = field(default_factory=dict)
    """``{channel partition: next offset}``: every DataWritten before it is committed."""
    watermarks: Mapping[str, int] = field(default_factory=dict)
    """``{writer_id: highest batch_seq committed}``."""
    channel_id: str | None = None
    """The channel ``positions`` belong to; None in summaries written before channels had an
    identity (their positions are taken to belong to whatever channel reads them)."""
    retired_file: str | None = None
    """Location of the side file holding ``retired`` (None: no writer was retired yet)."""
    retired: Mapping[str, int] = field(default_factory=dict)
    """``{writer_id: highest batch_seq committed}`` of writers gone from ``watermarks``; read
    from ``retired_file`` by whoever parsed the summary (:meth:`from_summary` leaves it empty
    and the committer loads it)."""
    merged_file: str | None = None
    """Location of the side file listing ``merged`` (None: no merged original is left)."""
    merged: frozenset[str] = frozenset()
    """Paths of small files merged into committed files and not yet known to be deleted; read
    from ``merged_file`` by the committer, like ``retired``."""
    applied_file: str | None = None
    """Location of the side file listing ``applied`` (None: nothing applied or taken out)."""
    applied: Applied = Applied()
    """Key files applied, files a rollback took out and files a rewrite took off; read from
    ``applied_file`` by the committer, like ``retired``."""

    @classmethod
    def from_summary(cls, summary: Mapping[str, str | None]) -> CommitBoundary:
        """Parse a snapshot summary. Raises ValueError/TypeError/AttributeError when unreadable."""
        return cls(
            positions=_int_map(json.loads(summary.get(POSITIONS_KEY) or "{}")),
            watermarks=_int_map(json.loads(summary.get(WATERMARKS_KEY) or "{}")),
            channel_id=summary.get(CHANNEL_ID_KEY) or None,
            retired_file=summary.get(RETIRED_KEY) or None,
            merged_file=summary.get(MERGED_KEY) or None,
            applied_file=summary.get(APPLIED_KEY) or None,
        )

    def to_summary(self) -> dict[str, str]:
        """The summary properties recording this boundary."""
        out = {POSITIONS_KEY: _json(self.positions), WATERMARKS_KEY: _json(self.watermarks)}
        if self.channel_id is not None:
            out[CHANNEL_ID_KEY] = self.channel_id
        if self.retired_file is not None:
            out[RETIRED_KEY] = self.retired_file
        if self.merged_file is not None:
            out[MERGED_KEY] = self.merged_file
        if self.applied_file is not None:
            out[APPLIED_KEY] = self.applied_file
        return out

    def for_channel(self, channel_id: str | None) -> CommitBoundary:
        """This boundary as seen by a reader of ``channel_id``.

        Positions number events of one channel only: those recorded through another channel
        (a swapped backend, a recreated topic or schema) cover nothing here, while writer
        watermarks (writer ids and batch numbers, which belong to the writers) still apply.
        """
        if channel_id is None or self.channel_id == channel_id:
            return self
        if self.channel_id is None:  # recorded before identities existed: same channel
            return replace(self, channel_id=channel_id)
        return replace(self, positions={}, channel_id=channel_id)

    def covers(self, f: Announced) -> bool:
        """Whether the table already holds what was announced at ``f`` (by its DataWritten's
        place or writer batch; :meth:`holds` also knows files by path)."""
        if f.offset < self.positions.get(f.partition, 0):
            return True
        mark = self.watermarks.get(f.writer_id)
        if mark is None or f.batch_seq > mark:
            mark = self.retired.get(f.writer_id)
        return mark is not None and f.batch_seq <= mark

    def holds(self, f: Announced, path: str) -> bool:
        """Whether the table already holds the file at ``path`` announced at ``f``: its batch is
        covered, it is a merged original (committed inside a merged file), an applied key file,
        a file a rollback took out or one a rewrite took off after it was committed
        (:class:`Applied`)."""
        return self.covers(f) or path in self.merged or path in self.applied

    def retirable(self, keep: Iterable[str]) -> set[str]:
        """Writers in ``watermarks`` that are not in ``keep`` (the live ones)."""
        return set(self.watermarks) - set(keep)

    def retire(self, writers: Iterable[str], retired_file: str) -> CommitBoundary:
        """Move ``writers``' watermarks to ``retired`` (to be stored at ``retired_file``).
        Nothing is forgotten: :meth:`covers` answers exactly as before."""
        gone = set(writers)
        moved = {w: m for w, m in self.watermarks.items() if w in gone}
        return replace(
            self,
            watermarks={w: m for w, m in self.watermarks.items() if w not in gone},
            retired=max_merge(self.retired, moved),
            retired_file=retired_file,
        )

    def advanced(self, positions: Mapping[str, int], files: Iterable[Announced]) -> CommitBoundary:
        """The boundary after committing ``files`` read up to ``positions``; never regresses."""
        batches: dict[str, int] = {}
        for f in files:
            batches[f.writer_id] = max(batches.get(f.writer_id, f.batch_seq), f.batch_seq)
        return replace(
            self,
            positions=max_merge(self.positions, positions),
            watermarks=max_merge(self.watermarks, batches),
        )


def max_merge(old: Mapping[Any, int], new: Mapping[Any, int]) -> dict[str, int]:
    """Per-key maximum of two maps (keys as strings), so recorded progress never regresses."""
    merged = {str(k): int(v) for k, v in old.items()}
    for k, v in new.items():
        merged[str(k)] = max(merged.get(str(k), int(v)), int(v))
    return merged


def _int_map(raw: Any) -> dict[str, int]:
    return {str(k): int(v) for k, v in raw.items()}


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def encode_retired(retired: Mapping[str, int]) -> bytes:
    """The retired-writers side file's content (JSON ``{"writers": {id: batch_seq}}``)."""
    return _json({"writers": dict(sorted(retired.items()))}).encode()


def decode_retired(data: bytes) -> dict[str, int]:
    """Parse :func:`encode_retired`'s output. Raises ValueError/TypeError/AttributeError/KeyError
    when unreadable."""
    return _int_map(json.loads(data)["writers"])


def encode_merged(paths: Iterable[str]) -> bytes:
    """The merged-originals side file's content (JSON ``{"paths": [...]}``)."""
    return _json({"paths": sorted(paths)}).encode()


def decode_merged(data: bytes) -> frozenset[str]:
    """Parse :func:`encode_merged`'s output. Raises ValueError/TypeError/KeyError when
    unreadable."""
    return frozenset(_str_list(json.loads(data), "paths"))


def encode_applied(applied: Applied) -> bytes:
    """The applied-files side file's content (JSON ``{"keys": [...], "retired": [...]}``, key
    files oldest first, and ``"removed": [...]`` when there are any)."""
    raw: dict[str, list[str]] = {"keys": list(applied.keys), "retired": sorted(applied.retired)}
    if applied.removed:
        raw["removed"] = list(applied.removed)
    return _json(raw).encode()


def decode_applied(data: bytes) -> Applied:
    """Parse :func:`encode_applied`'s output. Raises ValueError/TypeError/KeyError when
    unreadable."""
    raw = json.loads(data)
    removed = tuple(_str_list(raw, "removed")) if "removed" in raw else ()
    return Applied(tuple(_str_list(raw, "keys")), frozenset(_str_list(raw, "retired")), removed)


def _str_list(raw: Any, key: str) -> list[str]:
    values = raw[key]
    if not isinstance(values, list):
        raise TypeError(f"{key} is a {type(values).__name__}, not a list")
    return [str(v) for v in values]
