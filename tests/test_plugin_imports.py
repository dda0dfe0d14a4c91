"""Loading every installed plugin, as each CLI command does, imports no backend's client
library: `icefloe status` on a Redis pipeline paid ~0.3 s for psycopg's pool and Kafka's
backend before the plugin modules imported their backends lazily (issue 24, item 8)."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
from icefloe.plugins.manager import get_plugins
names = sorted(get_plugins().backends())
heavy = ("psycopg", "psycopg_pool", "redis.asyncio", "icefloe_kafka.backend",
         "icefloe_redis.backend", "icefloe_postgres.backend", "pyspark")
print(json.dumps({"backends": names, "imported": [m for m in heavy if m in sys.modules]}))
"""


def test_loading_plugins_imports_no_backend_client() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    found = json.loads(out.stdout)
    assert {"kafka", "postgres", "redis"} <= set(found["backends"])
    assert found["imported"] == []


def test_backend_classes_still_import_from_the_package() -> None:
    from icefloe_kafka import KafkaBackend
    from icefloe_postgres import PostgresBackend
    from icefloe_redis import RedisBackend, RedisStateLostError

    assert KafkaBackend.__module__ == "icefloe_kafka.backend"
    assert PostgresBackend.__module__ == "icefloe_postgres.backend"
    assert RedisBackend.__module__ == "icefloe_redis.backend"
    assert issubclass(RedisStateLostError, Exception)
