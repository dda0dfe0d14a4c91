"""A coordinator in its own process, for the SIGSTOP test: lead, read up to an offset, run one
commit cycle, write the outcome as JSON. Optionally stops at a fault hook, announcing it with
a marker file and waiting for a go file, so the test can SIGSTOP it exactly there.

Usage: python coordinator_proc.py '<json arguments>' (see ``main``).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from pyiceberg.catalog.sql import SqlCatalog

from icefloe.coordination.coordinator import Coordinator, CoordinatorHooks, CoordinatorSettings
from icefloe.errors import NotLeaderError
from icefloe_redis import RedisBackend, RedisConfig


def main() -> None:
    args: dict[str, Any] = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    me: str = args["coordinator_id"]
    control = Path(args["control_dir"])

    def pause(*_: object) -> None:  # fits every hook's signature
        (control / f"{me}.paused").write_text("")
        while not (control / f"{me}.go").exists():
            time.sleep(0.02)

    hooks = CoordinatorHooks(**{args["pause_at"]: pause}) if args["pause_at"] else None
    config = RedisConfig(url=args["url"], key_prefix=args["key_prefix"])
    backend = RedisBackend(config, args["group_id"], args["lease_ttl_s"])
    catalog = SqlCatalog("icefloe_test", **args["catalog"])
    settings = CoordinatorSettings(commit_interval_s=3600, commit_timeout_s=30)
    coordinator = Coordinator(
        args["group_id"], backend.coordinator(me), catalog, settings, me, hooks=hooks
    )
    deadline = time.monotonic() + 60
    while coordinator.lease is None or coordinator.read_position.get("0", 0) < args["read_to"]:
        if time.monotonic() > deadline:
            raise SystemExit(f"{me}: no lease or events within 60 s")
        coordinator.step(0.2)
    assert coordinator.lease is not None
    out: dict[str, Any] = {"token": coordinator.lease.token}
    try:
        result = coordinator.commit_now()
        out["outcome"] = "committed"
        out["snapshots"] = [r.snapshot_id for r in result.tables if r.snapshot_id is not None]
    except NotLeaderError as exc:
        out["outcome"] = f"not-leader: {exc}"
    out["stored"] = backend.coordinator("probe").stored_position()
    (control / f"{me}.json").write_text(json.dumps(out))
    coordinator.close()
    backend.close()


if __name__ == "__main__":
    main()
