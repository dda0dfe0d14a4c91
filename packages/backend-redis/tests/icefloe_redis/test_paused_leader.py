"""A leader stopped with SIGSTOP past its lease, then resumed, makes no commit that becomes
visible after the takeover, and every row is committed exactly once.

The leaders are separate processes (``coordinator_proc.py``) sharing the real Redis and a
SqlCatalog file; the writer runs here and answers StartCommit from its responder thread.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from icefloe.coordination.writer import WriterClient
from icefloe.testing.fixtures import (
    assert_exactly_once,
    create_rows_table,
    group_snapshots,
    make_sqlite_catalog,
    sqlite_catalog_properties,
    write_rows,
)

PROC = Path(__file__).with_name("coordinator_proc.py")
LEASE_TTL_S = 1.5


class Leader:
    """One coordinator process and its control files."""

    def __init__(self, name: str, control: Path, args: dict[str, Any]) -> None:
        self.name = name
        self.control = control
        self.log = (control / f"{name}.log").open("wb")
        cmd = [sys.executable, str(PROC), json.dumps({**args, "coordinator_id": name})]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return (self.control / f"{self.name}.log").read_text()

    def wait_for(self, marker: str, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while not (self.control / f"{self.name}.{marker}").exists():
            if self.proc.poll() is not None:
                pytest.fail(f"{self.name} exited before '{marker}':\n{self.output()}")
            if time.monotonic() > deadline:
                pytest.fail(f"{self.name} did not reach '{marker}':\n{self.output()}")
            time.sleep(0.05)

    def result(self, timeout: float = 90) -> dict[str, Any]:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.name} did not finish:\n{self.output()}")
        assert code == 0, f"{self.name} failed ({code}):\n{self.output()}"
        data: dict[str, Any] = json.loads((self.control / f"{self.name}.json").read_text())
        return data

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.mark.parametrize(
    "pause_at",
    [
        # renewed its lease, about to make its Iceberg commit (invariant 3's race)
        "after_lease_check",
        # committed to Iceberg, about to store the channel position
        "after_iceberg_commits",
    ],
)
def test_paused_leader_makes_no_visible_commit_after_takeover(
    pause_at: str, make_backend, config, group_id: str, tmp_path: Path
) -> None:
    catalog_dir = tmp_path / "iceberg"
    catalog = make_sqlite_catalog(catalog_dir)
    table = create_rows_table(catalog, "ns.t")
    backend = make_backend(lease_ttl_s=LEASE_TTL_S)
    writer = WriterClient(backend.writer("w"), group_id, "w")
    writer.start()
    for seq in range(3):
        ids = range(seq * 10, seq * 10 + 10)
        assert writer.publish(seq, {"ns.t": write_rows(table, ids, "w", seq)}, [])
    read_to = int(backend.client.get(backend.keys.event_seq)) + 1

    control = tmp_path / "control"
    control.mkdir()
    args = {
        "url": config.url,
        "key_prefix": config.key_prefix,
        "group_id": group_id,
        "lease_ttl_s": LEASE_TTL_S,
        "catalog": sqlite_catalog_properties(catalog_dir),
        "control_dir": str(control),
        "read_to": read_to,
    }
    zombie = Leader("A", control, {**args, "pause_at": pause_at})
    successor: Leader | None = None
    try:
        zombie.wait_for("paused")
        os.kill(zombie.proc.pid, signal.SIGSTOP)
        # B can only lead once A's lease has expired, A being stopped and not renewing
        successor = Leader("B", control, {**args, "pause_at": None})
        b = successor.result()
        (control / "A.go").write_text("")
        os.kill(zombie.proc.pid, signal.SIGCONT)
        a = zombie.result()
    finally:
        zombie.kill()
        if successor is not None:
            successor.kill()
        writer.close()

    assert b["outcome"] == "committed"
    assert b["token"] > a["token"]
    assert a["outcome"].startswith("not-leader"), a
    snaps = group_snapshots(catalog, "ns.t", group_id)
    tokens = [
        int(s.summary.additional_properties["icefloe.fencing-token"]) for s in snaps if s.summary
    ]
    if pause_at == "after_lease_check":
        # A never committed; B committed everything in one snapshot
        assert tokens == [b["token"]]
    else:
        # A's commit happened while it led; B found nothing left to commit
        assert tokens == [a["token"]]
        assert b["snapshots"] == []
    assert_exactly_once(catalog, "ns.t", list(range(30)))
    # the resumed zombie could not move the stored position either: B's stands (A's would
    # be lower: B also read the answers to A's StartCommit)
    assert b["stored"]["0"] >= read_to
    assert backend.coordinator("probe").stored_position() == b["stored"]
