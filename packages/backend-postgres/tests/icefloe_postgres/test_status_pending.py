"""`icefloe status` counts the files published on the PostgreSQL channel that no commit covers
yet, reading without the lease; real PostgreSQL, real catalog and Parquet files."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from icefloe.config import config_from_dict
from icefloe.coordination.writer import WriterClient
from icefloe.ops.status import collect, render_lines
from icefloe.testing.fixtures import make_sqlite_catalog, sqlite_catalog_properties
from icefloe.testing.harness import RowSource, commit_batches

TABLE = "db.t"


def test_status_counts_published_but_uncommitted_files(
    tmp_path: Path, pg_dsn: str, session_schema: str, make_backend: Any
) -> None:
    group = f"status-{uuid.uuid4().hex[:8]}"
    catalog = make_sqlite_catalog(tmp_path / "cat", "c")
    source = RowSource.create(catalog, [TABLE])
    backend = make_backend(group)
    commit_batches(backend, catalog, group, source, [0])  # committed: not pending
    writer = WriterClient(backend.writer("w"), group, "w")
    writer.start()
    try:
        uncommitted = [source.publish(writer, seq) for seq in (1, 2)]
    finally:
        writer.close()
    config = config_from_dict(
        {
            "name": group,
            "source": {"bootstrap_servers": "127.0.0.1:9", "topics": ["t"]},
            "tables": [{"name": TABLE}],
            "catalog": {"name": "c", "properties": sqlite_catalog_properties(tmp_path / "cat")},
            "coordination": {
                "backend": "postgres",
                "postgres": {"dsn": pg_dsn, "schema": session_schema},
            },
        }
    )

    status = collect(config)

    files = [f for b in uncommitted for f in b.files[TABLE]]
    [table] = status.tables
    assert table.pending_files == len(files)
    assert table.pending_bytes == sum(f.file_size_in_bytes for f in files)
    assert status.backend_status is not None
    assert status.backend_status.leader == "first"  # status took no lease of its own
    assert f"pending files {len(files)} (" in "\n".join(render_lines(status))
