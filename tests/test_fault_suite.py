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


def test_killing_one_tree_spares_its_siblings_of_the_same_run(tmp_path: Path) -> None:
    """A driver stopped while the run's standalone coordinators keep going: only its tree
    dies (it once took every process of the run with it)."""
    run = f"t-{uuid.uuid4().hex[:8]}"
    env = {"PATH": "/usr/bin:/bin"}
    driver = Tree(["sleep", "300"], tmp_path / "driver.log", env, run)
    sibling = Tree(["sleep", "301"], tmp_path / "coord.log", env, run)
    deadline = time.monotonic() + 30
    while len(marked(run)) < 2:
        assert time.monotonic() < deadline, f"trees never started: {marked(run)}"
        time.sleep(0.1)
    driver.kill()
    assert sibling.alive()
    assert [p.pid for p in marked(run)] == [sibling.pid]
    sibling.kill()
    assert marked(run) == []


SPAWNER = """
import multiprocessing, subprocess, time
if __name__ == "__main__":
    child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(300,))
    child.start()
    subprocess.Popen(["sleep", "301"])
    child.join()
"""


def test_committers_are_the_roots_spawned_children(tmp_path: Path) -> None:
    """What kill-committers kills: the root's multiprocessing-spawned children (the
    committer processes), not its other children."""
    script = tmp_path / "spawner.py"
    script.write_text(SPAWNER)
    env = {"PATH": "/usr/bin:/bin"}
    tree = Tree([sys.executable, str(script)], tmp_path / "log", env, f"t-{uuid.uuid4().hex[:8]}")
    try:
        deadline = time.monotonic() + 60
        while len(tree.members()) < 3 or not tree.committers():
            assert time.monotonic() < deadline, f"never spawned: {tree.members()}"
            time.sleep(0.1)
        committers = tree.committers()
        assert len(committers) == 1
        assert "spawn_main" in " ".join(committers[0].cmdline())
        others = [p for p in tree.members() if p.pid not in (tree.pid, committers[0].pid)]
        assert any(p.name() == "sleep" for p in others)
    finally:
        tree.kill()
    assert tree.committers() == []


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


def test_tally_sees_keys_routed_to_the_wrong_table(sqlite_catalog: Catalog) -> None:
    """With routed tables each key must be in its own table: a key that landed in another
    table is a problem even when every key is there once."""
    from tests.faults.harness import kind_of

    table = create_rows_table(sqlite_catalog, "f.kind_a")
    schema = table.schema().as_arrow()
    ids = [0, 3, 6, 4]  # 4 is a "b" key
    table.append(
        pa.table(
            {
                "id": pa.array(ids, pa.int64()),
                "writer": pa.array(["w"] * len(ids), pa.string()),
                "batch_seq": pa.array([0] * len(ids), pa.int64()),
            },
            schema=schema,
        )
    )
    tally = Tally()
    tally.add_table(sqlite_catalog.load_table("f.kind_a"), "f.kind_a", kind_of("a"))
    assert tally.problems == ["f.kind_a: 1 rows routed to another table"]
    assert not judge(tally, ids).ok
    fine = Tally()
    fine.add_table(sqlite_catalog.load_table("f.kind_a"), "f.kind_a")  # not routed
    assert judge(fine, ids).ok


@pytest.mark.parametrize(
    "scenario",
    [
        "kill-after-commit",
        "paused-leader",
        "checkpoint-loss",
        "kill-committers",
        "kill-commit-tasks",
    ],
)
def test_scenarios_are_registered(scenario: str) -> None:
    from tests.faults.scenarios import REGISTRY

    assert REGISTRY[scenario].help


def test_kill_committers_runs_in_ci_on_one_backend() -> None:
    from tests.faults.scenarios import REGISTRY

    assert REGISTRY["kill-committers"].ci == ("redis",)
