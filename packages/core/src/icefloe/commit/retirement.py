"""Retiring writers: when the committer moves the watermarks of writers that are gone out of the
summary into a side file (:mod:`icefloe.commit.dedupe` has the rule), and reading them back,
so summaries grow with the live writers only."""

from __future__ import annotations

import hashlib

from pyiceberg.table import Table

from icefloe.commit.dedupe import CommitBoundary, decode_retired, encode_retired, max_merge
from icefloe.commit.request import TableCommitRequest, table_name
from icefloe.commit.summary import RecordedCommit
from icefloe.errors import CommitError

# Writers gone from the summary's watermarks before they are retired together: one side file
# per this many, instead of one per writer that stops.
RETIRE_AT = 32
# Retired-writers files kept in memory (immutable, so cached by location).
_RETIRED_CACHE_SIZE = 16


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
    content = encode_retired(retired)
    name = f"icefloe-retired-{hashlib.sha256(content).hexdigest()[:40]}.json"
    location = table.location_provider().new_metadata_location(name)
    return boundary.retire(gone, location), (location, content)


class RetiredWriters:
    """Reads retired-writers side files, caching the few in use (they never change)."""

    def __init__(self) -> None:
        self._retired: dict[str, dict[str, int]] = {}  # retired-writers file -> its watermarks

    def read(self, table: Table, location: str, group_id: str) -> dict[str, int]:
        """The watermarks of retired writers, from the side file the summary names."""
        cached = self._retired.get(location)
        if cached is None:
            try:
                with table.io.new_input(location).open() as stream:
                    cached = decode_retired(stream.read())
            except Exception as e:
                # without them a replay of a retired writer's batch would be committed again
                raise CommitError(
                    f"table '{table_name(table)}': cannot read the retired writers' watermarks "
                    f"of group '{group_id}' from {location} ({e}); restore that file (it is "
                    "written once and never changed; `icefloe maintain` keeps it)"
                ) from e
            if len(self._retired) >= _RETIRED_CACHE_SIZE:
                self._retired.pop(next(iter(self._retired)))
            self._retired[location] = cached
        return cached
