"""Prometheus metrics of ``icefloe run`` and ``icefloe coordinator`` (``--metrics-port``).

The metrics live in prometheus-client's default registry and are updated whether or not an
endpoint serves them (an update is a lock and an add), so instrumented code needs no flag.
The names are listed in docs/operations.md.
"""

from __future__ import annotations

import logging

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from icefloe.options import MetricsPortOption as MetricsPortOption  # where it was

log = logging.getLogger(__name__)

RECORDS_READ = Counter(
    "icefloe_records_read", "Source records read by the streaming query's published batches."
)
RECORDS_WRITTEN = Counter(
    "icefloe_records_written", "Records written to data files and published by this writer."
)
RECORDS_DEAD_LETTERED = Counter(
    "icefloe_records_dead_lettered", "Records routed to the dead-letter destination."
)
RECORDS_SKIPPED = Counter(
    "icefloe_records_skipped", "Bad records dropped under the [errors] policy 'skip'."
)
FILES_WRITTEN = Counter("icefloe_files_written", "Data files written and published.")
BYTES_WRITTEN = Counter("icefloe_bytes_written", "Bytes of data files written and published.")
COMMIT_CYCLES = Counter(
    "icefloe_commit_cycles",
    "Commit cycles run by the leading coordinator, by result.",
    ["result"],  # complete | partial | failed
)
COMMIT_CYCLE_SECONDS = Histogram(
    "icefloe_commit_cycle_seconds",
    "Duration of a commit cycle, from StartCommit to the last table commit.",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
TABLE_COMMIT_SECONDS = Histogram(
    "icefloe_table_commit_seconds",
    "Duration of one table's part of a cycle (screening and its Iceberg commit): with many "
    "tables, the shape of this decides the cycle time and what commit_parallelism can gain.",
    # one histogram for every table, not one per table: hundreds of tables times the buckets
    # would swamp a Prometheus server; the slow tables show in the log and in status
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
TABLE_COMMITS = Counter("icefloe_table_commits", "Iceberg commits made, per table.", ["table"])
FILES_QUARANTINED = Counter(
    "icefloe_files_quarantined",
    "Announced files recorded in the quarantine instead of committed, per table.",
    ["table"],
)
TABLE_FAILING = Gauge(
    "icefloe_table_failing",
    "Commits of a table that failed in a row, once they reached "
    "coordination.quarantine_after_failures (0: below that, or committing again).",
    ["table"],
)
PENDING_FILES = Gauge("icefloe_pending_files", "Data files read by the coordinator, uncommitted.")
PENDING_BYTES = Gauge("icefloe_pending_bytes", "Bytes of data files read, uncommitted.")
SOURCE_LAG = Gauge(
    "icefloe_source_lag_records",
    "Source records not yet committed, per table and source partition.",
    ["table", "topic", "partition"],
)
LEADERSHIP_CHANGES = Counter(
    "icefloe_leadership_changes",
    "Times this process gained or lost the coordinator lease.",
    ["change"],  # acquired | lost
)
CHANNEL_STALLED_SECONDS = Gauge(
    "icefloe_channel_stalled_seconds",
    "How long the control channel's end has moved on while the leading coordinator's read "
    "position stood still (0: not stalled; reported once over coordination.stall_after_s).",
)
IS_LEADER = Gauge("icefloe_leader", "1 while this process holds the coordinator lease.")


def start_metrics(port: int | None, address: str = "0.0.0.0") -> int | None:
    """Serve the default registry on ``port`` (None: do nothing); returns the bound port."""
    if port is None:
        return None
    server, _thread = start_http_server(port, addr=address)
    bound = int(server.server_address[1])
    log.info("Prometheus metrics on port %d (/metrics)", bound)
    return bound
