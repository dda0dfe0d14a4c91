"""Read-only reads of the backlog (where a writer without a checkpoint resumes, what
``icefloe maintain`` keeps, what ``icefloe status`` counts) go to the channel's end measured
before the read, never "until a few polls found nothing": over the reference channel with
polls that come back empty for a while (a slow fetch), and a channel whose end no read
reaches (a stall). The same on the real Kafka broker: backend-kafka's test_read_to_end.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from pyiceberg.catalog.sql import SqlCatalog

from icefloe.channel import ChannelPosition, ChannelRecord
from icefloe.coordination.backlog import short_of, stalled
from icefloe.coordination.reading import announced_files
from icefloe.coordination.resume import Progress, published, start_offsets
from icefloe.coordination.writer import WriterClient
from icefloe.errors import ChannelStalledError
from icefloe.testing.fixtures import make_sqlite_catalog
from icefloe.testing.harness import RowSource
from icefloe.testing.memory import MemoryCoordinatorChannel, MemoryServer, MemoryWriterChannel

GROUP = "pipe"
TABLE = "db.events"


class SlowFetch(MemoryCoordinatorChannel):
    """The reference channel, with its first polls coming back empty after their timeout, as a
    fetch the server answers late does."""

    def __init__(self, server: MemoryServer, empty_polls: int) -> None:
        super().__init__(server, GROUP, "reader", 10.0)
        self.empty_polls = empty_polls

    def poll(self, timeout: float, max_records: int = 1000) -> list[ChannelRecord]:
        if self.empty_polls > 0:
            self.empty_polls -= 1
            time.sleep(min(timeout, 0.05))
            return []
        return super().poll(timeout, max_records)


class EndOutOfReach(MemoryCoordinatorChannel):
    """A channel whose end lies past what any read gets (an event held back for good)."""

    def end_position(self) -> ChannelPosition:
        return {p: o + 1 for p, o in super().end_position().items()}


@pytest.fixture
def catalog(tmp_path: Path) -> SqlCatalog:
    return make_sqlite_catalog(tmp_path / "iceberg")


def publish(server: MemoryServer, catalog: SqlCatalog, batches: int) -> set[str]:
    """``batches`` batches of writer w, published, not committed; their file paths."""
    source = RowSource.create(catalog, [TABLE])
    writer = WriterClient(MemoryWriterChannel(server, GROUP, "w"), GROUP, "w")
    writer.start()
    try:
        return {f.path for seq in range(batches) for f in source.publish(writer, seq).files[TABLE]}
    finally:
        writer.close()


def test_empty_polls_do_not_end_the_read_before_the_channel_end(catalog: SqlCatalog) -> None:
    """Four empty polls, then the three batches: the resume read and maintain's read both get
    all of them."""
    server = MemoryServer()
    paths = publish(server, catalog, 3)

    progress = published(SlowFetch(server, empty_polls=4), GROUP)
    assert progress.batches == {"w": 2}
    assert start_offsets(progress, Progress()) == {"source": {0: 15}}
    assert announced_files(SlowFetch(server, empty_polls=4), GROUP) == paths


def test_a_read_that_cannot_reach_the_end_refuses_to_answer(catalog: SqlCatalog) -> None:
    server = MemoryServer()
    publish(server, catalog, 1)
    reader = EndOutOfReach(server, GROUP, "reader", 10.0)
    with pytest.raises(ChannelStalledError, match=r"partition 0: read to 2, end 3"):
        published(reader, GROUP, timeout_s=0.5)
    with pytest.raises(ChannelStalledError, match="holds events no reader gets"):
        announced_files(reader, GROUP, timeout_s=0.5)


def test_how_far_short_of_the_end_a_read_stands() -> None:
    assert short_of({"0": 10}, {"0": 11}, {"0": 11}) == {}  # read through a marker
    assert short_of({}, None, {}) == {}
    assert short_of({"0": 12}, None, {"0": 11}) == {}  # read on past the measured end
    short = short_of({"0": 10}, None, {"0": 10, "1": 7})
    assert short == {"1": (0, 7)}
    assert "partition 1: read to 0, end 7" in stalled(short, 10)
