"""Child process of test_live_view.py: `icefloe run`'s log set-up and live view
(:func:`icefloe_spark.cli.console.watch`) on the terminal it is given, with INFO lines logged
while the view refreshes. The pipeline is a stand-in (no Spark): the view reads its query's
last progress, its publish counters and the tables of a real SQLite catalog."""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from pyiceberg.catalog.sql import SqlCatalog

from icefloe.config import config_from_dict
from icefloe.testing.fixtures import sqlite_catalog_properties
from icefloe_spark.cli import console, progress
from icefloe_spark.sink.publish import PublishStats

LINES = 6


def main(directory: Path) -> None:
    console.setup_logging(logging.INFO, "text")
    config = config_from_dict(
        {
            "name": "pty",
            "source": {"topics": ["t"], "bootstrap_servers": "127.0.0.1:1"},
            "tables": [{"name": "db.t"}],
            "coordination": {"backend": "memory"},
        }
    )
    progress.Monitor._watermarks = lambda self: None  # type: ignore[method-assign]  # no broker
    stats = PublishStats()
    # an idle batch that took 28 ms after one that carried 5,000 records: Spark's own rate
    # would say 178,571 records/s while nothing moves
    query = SimpleNamespace(
        isActive=True, lastProgress={"batchId": 7, "durationMs": {"triggerExecution": 28}}
    )
    pipeline = SimpleNamespace(
        query=query,
        catalog=SqlCatalog("pty", **sqlite_catalog_properties(directory)),
        config=config,
        source_extra_options={},
        stats=stats,
        publisher=None,
        coordinator=None,
        reads_ranges=True,
    )
    stats.last_batch_records = 5_000
    stop = threading.Event()
    log = logging.getLogger("icefloe_spark.pipeline")

    def talk() -> None:
        for i in range(LINES):
            time.sleep(0.4)
            log.info("log line %d of the pipeline", i)
        time.sleep(1.5)
        stop.set()

    threading.Thread(target=talk, daemon=True).start()
    console.watch(pipeline, stop)  # type: ignore[arg-type]
    sys.stderr.flush()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
