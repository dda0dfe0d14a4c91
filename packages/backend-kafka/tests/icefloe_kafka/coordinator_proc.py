"""A coordinator in its own process, for tests that kill or pause one for real.

Usage: ``python coordinator_proc.py '<json spec>'``. The spec names the broker, the pipeline,
the catalog and the mode:

* ``crash``: lead, wait for ``pending_files`` files, commit them to Iceberg and SIGKILL itself
  right after the Iceberg commits, before the channel position is stored.
* ``zombie``: lead, wait for ``pending_files`` files, print ``READY``, then wait for a line on
  stdin (the test SIGSTOPs the process meanwhile) and try to commit; exit 3 when refused as
  no longer the leader, 0 when it committed.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from pyiceberg.catalog.sql import SqlCatalog

from icefloe.coordination.coordinator import (
    Coordinator,
    CoordinatorHooks,
    CoordinatorSettings,
    CycleResult,
)
from icefloe.errors import NotLeaderError
from icefloe.plugins.manager import new_plugins
from icefloe.testing.harness import lead, wait_pending
from icefloe_kafka import KafkaBackend, KafkaBackendConfig

REFUSED = 3


def _sigkill_self(_: CycleResult) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main(spec: dict[str, object]) -> int:
    config = KafkaBackendConfig.model_validate(spec["kafka"])
    group_id = str(spec["group_id"])
    backend = KafkaBackend(config, group_id, float(str(spec["lease_ttl_s"])))
    catalog_props = {str(k): str(v) for k, v in dict(spec["catalog"]).items()}  # type: ignore[call-overload]
    crash = spec["mode"] == "crash"
    coordinator = Coordinator(
        group_id,
        backend.coordinator(str(spec["name"])),
        SqlCatalog(str(spec["catalog_name"]), **catalog_props),
        CoordinatorSettings(commit_interval_s=3600.0, commit_timeout_s=20.0),
        coordinator_id=str(spec["name"]),
        plugins=new_plugins(autoload=False),
        hooks=CoordinatorHooks(after_iceberg_commits=_sigkill_self if crash else None),
    )
    lead(coordinator, 60.0)
    wait_pending(coordinator, int(str(spec["pending_files"])), 60.0)
    if not crash:
        print("READY", flush=True)
        sys.stdin.readline()
    try:
        coordinator.commit_now()
    except NotLeaderError as exc:
        print(f"REFUSED {exc}", flush=True)
        return REFUSED
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
