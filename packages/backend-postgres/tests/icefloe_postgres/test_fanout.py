"""Many writers in one process (issue 15's fan-out): they share one LISTEN connection, so the
server connections they use stay bounded (counted in pg_stat_activity), and a cycle completes
with every row exactly once (pyiceberg scan)."""

from __future__ import annotations

import uuid
from pathlib import Path

import psycopg

from icefloe.testing.fixtures import make_sqlite_catalog
from icefloe.testing.harness import fan_out_cycle
from icefloe_postgres.testing import BackendMaker

WRITERS = 256  # above PostgreSQL's default max_connections (100)


def test_writers_of_one_process_share_connections_and_complete_a_cycle(
    make_backend: BackendMaker, pg_dsn: str, tmp_path: Path
) -> None:
    app = f"icefloe-fanout-{uuid.uuid4().hex[:8]}"
    backend = make_backend(application_name=app)
    pool_max = backend.config.pool_max_size

    def connections() -> int:
        with psycopg.connect(pg_dsn) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (app,)
            ).fetchone()
        assert row is not None
        return int(row[0])

    seen = fan_out_cycle(
        backend, make_sqlite_catalog(tmp_path), backend.group_id, WRITERS, during=connections
    )
    assert seen.result.complete, "some writer's answer never reached the coordinator"
    assert not seen.result.failed
    assert seen.answered == WRITERS
    # the pool, the writers' one shared LISTEN connection, and at most the coordinator's own
    assert isinstance(seen.during, int)
    assert 1 <= seen.during <= pool_max + 3, (
        f"{seen.during} server connections for {WRITERS} writers"
    )
