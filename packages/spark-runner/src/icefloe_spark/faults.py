"""Fault hooks for the end-to-end tests, and nothing else.

Exactly-once claims need the fault at the dangerous moment, in the real processes. Each hook
is inert unless a test switches it on: the driver crashes (after a publish, after a
coordinator's Iceberg commit) through environment variables of the driver process, the task
failure through a sink option. Never set either in production.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from icefloe.errors import IcefloeError

if TYPE_CHECKING:  # the sink's planner processes import this module: keep it light
    from icefloe.coordination.coordinator import CoordinatorHooks, CycleResult

log = logging.getLogger(__name__)

EXIT_AFTER_PUBLISH_ENV = "ICEFLOE_TEST_EXIT_AFTER_PUBLISH"
"""Batch id after whose publish the publishing process exits at once (no cleanup)."""
EXIT_AFTER_COMMIT_ENV = "ICEFLOE_TEST_EXIT_AFTER_COMMIT"
"""N (1-based): the driver's coordinator exits at once after the Iceberg commits of its N-th
cycle that committed a table, before it stores the channel position."""
MARK_COMMITTERS_ENV = "ICEFLOE_TEST_MARK_COMMITTERS"
"""A directory: right before each catalog commit, a committer that runs outside the driver's
Python (a Spark commit task's Python worker, a committer process) touches a file there named
by its process id, so a fault test can find a committer in a commit and kill it."""
EXIT_CODE = 86
FAIL_TASK_OPTION = "test.fail_task"
"""Sink option, JSON ``{"batch": id, "partition": id, "marker_dir": path}``: the first attempt
of that task raises after writing its files."""


class InjectedFaultError(IcefloeError):
    """Raised by a test fault hook."""


def exit_after_publish(batch_seq: int) -> None:
    """Kill this process right after ``batch_seq`` was published, before Spark records it."""
    wanted = os.environ.get(EXIT_AFTER_PUBLISH_ENV)
    if wanted is not None and wanted.strip() == str(batch_seq):
        log.warning("test fault: exiting after publishing batch %s", batch_seq)
        sys.stderr.flush()
        os._exit(EXIT_CODE)


class MarkCommitter:
    """An ``in_committer`` hook (picklable: it travels to Spark's Python workers and to
    committer processes): touch ``directory/<pid>`` right before each catalog commit."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __call__(self, moment: str, table: str) -> None:
        if moment == "before_commit":
            Path(self.directory, str(os.getpid())).touch()


def coordinator_hooks() -> CoordinatorHooks | None:
    """The coordinator's fault hooks this process's environment asks for, or None (inert)."""
    from icefloe.coordination.coordinator import CoordinatorHooks

    marks = os.environ.get(MARK_COMMITTERS_ENV)
    in_committer = MarkCommitter(marks) if marks else None
    wanted = os.environ.get(EXIT_AFTER_COMMIT_ENV)
    if wanted is None or not wanted.strip():
        return CoordinatorHooks(in_committer=in_committer) if in_committer else None
    target = int(wanted)
    seen = 0

    def after_iceberg_commits(cycle: CycleResult) -> None:
        nonlocal seen
        if not any(r.snapshot_id is not None for r in cycle.tables):
            return
        seen += 1
        if seen == target:
            log.warning("test fault: exiting after the Iceberg commits of cycle %s", seen)
            sys.stderr.flush()
            os._exit(EXIT_CODE)

    return CoordinatorHooks(after_iceberg_commits=after_iceberg_commits, in_committer=in_committer)


def parse_fail_task(raw: str | None) -> dict[str, Any] | None:
    """The task-failure spec from the sink option, or None when off."""
    if not raw:
        return None
    spec = json.loads(raw)
    if not isinstance(spec, dict) or "partition" not in spec or "marker_dir" not in spec:
        raise ValueError(f"{FAIL_TASK_OPTION} needs partition and marker_dir")
    return spec


def fail_task_if_chosen(
    spec: dict[str, Any] | None,
    batch_id: int | None,
    partition_id: int,
    attempt: int,
    written: list[str],
) -> None:
    """Raise in the first attempt of the chosen task, after recording what it wrote."""
    if spec is None or attempt != 0 or partition_id != int(spec["partition"]):
        return
    if spec.get("batch") is not None and batch_id != int(spec["batch"]):
        return
    marker_dir = Path(spec["marker_dir"])
    marker_dir.mkdir(parents=True, exist_ok=True)
    marker = {"batch": batch_id, "partition": partition_id, "attempt": attempt, "files": written}
    (marker_dir / f"failed-{batch_id}-{partition_id}.json").write_text(json.dumps(marker))
    raise InjectedFaultError(
        f"test fault: task {partition_id} of batch {batch_id}, attempt {attempt}"
    )
