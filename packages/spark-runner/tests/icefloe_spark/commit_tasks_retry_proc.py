"""Child process of test_commit_tasks.py: a coordinator committing on Spark tasks in a local
session of its own that retries a failed task (``local[2,2]``: two attempts per task, as a
cluster's ``spark.task.maxFailures`` allows), whose Python worker is killed by SIGKILL right
after one table's commit landed. Prints what the cycle did as JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from icefloe.coordination.coordinator import CoordinatorHooks
from icefloe.coordination.processes import WorkerSpec
from icefloe.testing.harness import CommittersPipeline, KillCommitter, lead, wait_pending
from icefloe.testing.memory import MemoryServer
from icefloe_spark.committers import SparkCommitters
from icefloe_spark.testing import local_spark

TABLES = tuple(f"retry.t{i}" for i in range(4))
VICTIM = TABLES[1]


def main(directory: Path) -> None:
    marker = directory / "killed"
    with local_spark("local[2,2]") as spark:

        def committers(spec: WorkerSpec) -> SparkCommitters:
            return SparkCommitters(lambda: spark, 2, spec)

        pipe = CommittersPipeline(directory, MemoryServer(), TABLES)
        try:
            w = pipe.writer("w")
            hooks = CoordinatorHooks(
                in_committer=KillCommitter("after_commit", VICTIM, str(marker))
            )
            coord = pipe.coordinator("c1", hooks, committers, catalog=pipe.spec)
            lead(coord)
            wait_pending(coord, pipe.source.publish(w, 0).file_count)
            result = coord.commit_now()
            pipe.assert_rows_once()
            out = {
                "killed": marker.exists(),
                "failed": dict(result.failed),
                "committed": {r.table: r.snapshot_id for r in result.tables},
                "snapshots": {t: pipe.snapshots(t) for t in TABLES},
                "stored": pipe.stored() == coord.read_position,
                "victim": VICTIM,
            }
        finally:
            pipe.close()
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
