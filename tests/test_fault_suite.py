"""The fault suite's own parts (tests/faults): its process-tree kill leaves nothing behind, and
its independent reader sees duplicates and missing keys in a real table."""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pytest
from pyiceberg.catalog import Catalog

from icefloe.testing.fixtures import create_rows_table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests.faults` from the root
from tests.faults.count import Tally, judge
from tests.faults.procs import Tree, marked


def test_tree_kill_reaches_grandchildren_and_escaped_sessions(tmp_path: Path) -> None:
    """A child that left the process group (setsid, as a daemon may) dies with the tree."""
    marker = f"t-{uuid.uuid4().hex[:8]}"
    script = "sleep 300 & setsid sleep 301 & bash -c 'sleep 302; true' & wait"
    tree = Tree(["bash", "-c", script], tmp_path / "log", {"PATH": "/usr/bin:/bin"}, marker)
    deadline = time.monotonic() + 30
    while len(marked(marker)) < 5:  # bash, three sleeps, the inner bash
        assert time.monotonic() < deadline, f"tree never grew: {marked(marker)}"
        time.sleep(0.1)
    pids = [p.pid for p in tree.members()]
    tree.kill()
    assert not tree.alive()
    assert marked(marker) == []
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in _state(pid), f"{pid} survived"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0]
    except FileNotFoundError:
        return "Z"


def test_tally_sees_duplicates_missing_and_unexpected_keys(sqlite_catalog: Catalog) -> None:
    table = create_rows_table(sqlite_catalog, "f.rows")
    schema = table.schema().as_arrow()
    rows = pa.table({"id": pa.array(range(10), pa.int64())}).select(["id"])
    full = pa.table(
        {
            "id": rows["id"],
            "writer": pa.array(["w"] * 10, pa.string()),
            "batch_seq": pa.array([0] * 10, pa.int64()),
        },
        schema=schema,
    )
    table.append(full)
    table.append(full.slice(0, 3))  # keys 0, 1, 2 twice
    tally = Tally()
    tally.add_table(sqlite_catalog.load_table("f.rows"), "f.rows")
    assert tally.problems == []
    assert tally.scanned_rows == tally.manifest_rows == 13
    verdict = judge(tally, range(12))  # 10 and 11 never arrived; 0..2 twice
    assert (verdict.missing, verdict.duplicated, verdict.unexpected) == (2, 3, 0)
    assert not verdict.ok
    assert judge(tally, range(5)).unexpected == 5
    exact = Tally()
    exact.add_table(sqlite_catalog.load_table("f.rows"), "f.rows")
    exact.keys.subtract({0: 1, 1: 1, 2: 1})
    assert judge(exact, range(10)).ok


@pytest.mark.parametrize("scenario", ["kill-after-commit", "paused-leader", "checkpoint-loss"])
def test_scenarios_are_registered(scenario: str) -> None:
    from tests.faults.scenarios import REGISTRY

    assert REGISTRY[scenario].help
