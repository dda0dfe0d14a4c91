"""The standalone cluster helper's failure path; its success path is tests/test_cluster.py."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from icefloe_spark.runtime.standalone import ClusterStartError, standalone_cluster

pytestmark = pytest.mark.spark  # the master is a JVM, started without a fixture


def test_a_worker_that_cannot_start_raises_with_its_output_and_leaves_no_process(
    tmp_path: Path,
) -> None:
    """A worker given a memory size Spark cannot parse exits at once: the error says which
    process exited and shows its output, and the master already running is killed."""
    with (
        pytest.raises(ClusterStartError, match="exited") as raised,
        standalone_cluster(tmp_path, workers=1, memory="lots"),
    ):
        pytest.fail("the cluster came up with a worker of unparsable memory")
    assert f"--- {tmp_path / 'worker1.out'}" in str(raised.value)
    assert "Usage: Worker" in str(raised.value)  # the worker's own complaint
    assert not _working_in(tmp_path)


def _working_in(directory: Path) -> list[int]:
    """Pids of live processes whose working directory is ``directory`` (the helper starts
    the master and the workers there), from /proc."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to read
            if Path(os.readlink(proc / "cwd")) == directory:
                pids.append(int(proc.name))
    return pids
