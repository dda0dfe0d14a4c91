"""`icefloe doctor` on a cluster names each path only the driver's machine can open: an SQLite
catalog, a local warehouse, a local checkpoint; nothing in local mode or on shared storage."""

from __future__ import annotations

from typing import Any

import pytest

from icefloe.config import config_from_dict
from icefloe_spark.checks import cluster_checks

pytestmark = pytest.mark.unit

LOCAL = {"type": "sql", "uri": "sqlite:////srv/c.db", "warehouse": "file:///srv/wh"}
SHARED = {"type": "sql", "uri": "postgresql+psycopg://cat/db", "warehouse": "s3://b/wh"}


def _checks(master: str, catalog: dict[str, str], checkpoint: str | None) -> dict[str, Any]:
    data = {
        "name": "p",
        "source": {"bootstrap_servers": "k:9092", "topics": ["t"]},
        "tables": [{"name": "db.t"}],
        "catalog": {"name": "c", "properties": catalog},
        "coordination": {"backend": "kafka", "kafka": {"bootstrap_servers": "k:9092"}},
        "spark": {"master": master, "checkpoint_location": checkpoint},
    }
    return {c.name: c for c in cluster_checks(config_from_dict(data))}


def test_a_cluster_on_local_paths_is_warned_of_each() -> None:
    checks = _checks("spark://m:7077", LOCAL, "/srv/ckpt")
    assert sorted(checks) == ["cluster catalog", "cluster checkpoint", "cluster warehouse"]
    assert all(c.status == "warn" for c in checks.values())
    assert "sqlite:////srv/c.db" in checks["cluster catalog"].detail
    assert "file:///srv/wh" in checks["cluster warehouse"].detail
    assert "s3a://" in checks["cluster checkpoint"].detail


def test_a_cluster_on_shared_storage_is_ok() -> None:
    checks = _checks("spark://m:7077", SHARED, "hdfs://nn/ckpt")
    assert [(n, c.status) for n, c in checks.items()] == [("cluster storage", "ok")]


def test_a_rest_catalogs_warehouse_name_is_no_path() -> None:
    rest = {"type": "rest", "uri": "https://cat", "warehouse": "analytics"}
    assert list(_checks("yarn", rest, "s3a://b/ckpt")) == ["cluster storage"]


def test_local_mode_has_nothing_to_share() -> None:
    assert _checks("local[2]", LOCAL, None) == {}
