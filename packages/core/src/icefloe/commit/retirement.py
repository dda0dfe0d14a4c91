"""Retiring writers: when the committer moves the watermarks of writers that are gone out of the
summary into a side file (:mod:`icefloe.commit.dedupe` has the rule), and reading them back,
so summaries grow with the live writers only. The reader also reads the other side files a
summary names: the merged originals (:mod:`icefloe.commit.merge`) and the applied files
(:mod:`icefloe.commit.applied`)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import TypeVar

from pyiceberg.table import Table

from icefloe.commit.caches import SharedCache
from icefloe.commit.dedupe import (
    Applied,
    CommitBoundary,
    decode_applied,
    decode_merged,
    decode_retired,
    encode_retired,
    max_merge,
)
from icefloe.commit.request import TableCommitRequest, table_name
from icefloe.commit.summary import RecordedCommit
from icefloe.errors import CommitError

# Writers gone from the summary's watermarks before they are retired together: one side file
# per this many, instead of one per writer that stops.
RETIRE_AT = 32
# Side files kept in memory (immutable, so cached by location).
_SIDE_FILE_CACHE_SIZE = 16

_Content = TypeVar("_Content")


def next_boundary(
    table: Table, request: TableCommitRequest, state: RecordedCommit | None
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
    location, content = side_file(table, "retired", encode_retired(retired))
    return boundary.retire(gone, location), (location, content)


def side_file(table: Table, kind: str, content: bytes) -> tuple[str, bytes]:
    """Where a side file of ``kind`` with ``content`` goes (location, content): in the table's
    metadata directory, named by its content, so a retried attempt rewrites the same file."""
    name = f"icefloe-{kind}-{hashlib.sha256(content).hexdigest()[:40]}.json"
    return table.location_provider().new_metadata_location(name), content


class SideFiles:
    """Reads the side files summaries name (retired writers' watermarks, merged originals),
    caching the few in use (they never change)."""

    def __init__(self) -> None:
        # (what, side file) -> its content
        self._files: SharedCache[tuple[str, str], object] = SharedCache(_SIDE_FILE_CACHE_SIZE)

    def retired(self, table: Table, location: str, group_id: str) -> dict[str, int]:
        """The watermarks of retired writers, from the side file the summary names."""
        # without them a replay of a retired writer's batch would be committed again
        return self._read(table, location, decode_retired, "retired writers' watermarks", group_id)

    def merged(self, table: Table, location: str, group_id: str) -> frozenset[str]:
        """The merged originals not yet known to be deleted, from the side file the summary
        names."""
        # without them an original announced again would be merged a second time
        return self._read(table, location, decode_merged, "merged originals", group_id)

    def applied(self, table: Table, location: str, group_id: str) -> Applied:
        """The key files applied and files rolled back, from the side file the summary names."""
        # without them such a file announced again would be applied or committed again
        return self._read(table, location, decode_applied, "applied files", group_id)

    def _read(
        self,
        table: Table,
        location: str,
        decode: Callable[[bytes], _Content],
        what: str,
        group_id: str,
    ) -> _Content:
        key = (what, location)
        cached = self._files.get(key)
        if cached is None:
            try:
                with table.io.new_input(location).open() as stream:
                    cached = decode(stream.read())
            except Exception as e:
                raise CommitError(
                    f"table '{table_name(table)}': cannot read the {what} of group "
                    f"'{group_id}' from {location} ({e}); restore that file (it is written "
                    "once and never changed; `icefloe maintain` keeps it)"
                ) from e
            self._files.put(key, cached)
        return cached  # type: ignore[return-value]  # what names the decoder that stored it
