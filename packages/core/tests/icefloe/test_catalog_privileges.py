"""The SQL catalog's least privilege (docs/operations.md): pyiceberg's ``SqlCatalog`` on the
real PostgreSQL, used by a login role with a password holding only
:func:`icefloe.ops.permissions.sql_catalog_grants` on catalog tables another role created; a
real coordinator commits through it, creates a table and its namespace, the quarantine table,
and every one of those grants is needed. (The machine's server trusts local connections, so the
password is sent but not checked; the privileges are.)"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping

import pytest
from pyiceberg.catalog import Catalog, load_catalog
from pyiceberg.catalog.sql import SqlCatalog
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from icefloe.commit.quarantine import Quarantine
from icefloe.coordination.coordinator import CoordinatorSettings
from icefloe.ops.permissions import SQL_CATALOG_PRIVILEGES, sql_catalog_grants
from icefloe.testing.fixtures import (
    POSTGRES_ADMIN_DSN,
    catalog_warehouse,
    data_file_ids,
    postgres_catalog_properties,
    postgres_url,
)
from icefloe.testing.harness import Pipe, RowSource, lead, wait_pending
from icefloe.testing.memory import MemoryBackend, MemoryServer

__all__ = ["catalog_warehouse", "postgres_catalog_properties"]  # fixtures, used below

CATALOG = "pg"
PASSWORD = "catalog-role-secret"


@pytest.fixture
def catalog_role(postgres_catalog_properties: Mapping[str, str]) -> Iterator[str]:
    """A login role with a password and no privilege in the catalog's database yet, whose
    catalog tables the admin created (as a catalog's first start does)."""
    SqlCatalog(CATALOG, **postgres_catalog_properties).engine.dispose()  # creates the tables
    role = f"icefloe_catalog_{uuid.uuid4().hex[:8]}"
    admin = create_engine(postgres_url(POSTGRES_ADMIN_DSN), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE ROLE {role} LOGIN PASSWORD '{PASSWORD}'"))
    try:
        yield role
    finally:
        grant(postgres_catalog_properties, [f"DROP OWNED BY {role}"])  # its grants
        with admin.connect() as conn:
            conn.execute(text(f"DROP ROLE {role}"))
        admin.dispose()


def grant(properties: Mapping[str, str], statements: list[str]) -> None:
    """Run ``statements`` in the catalog's database as the admin (the tables' owner)."""
    engine = create_engine(properties["uri"], isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        for statement in statements:
            conn.execute(text(statement))
    engine.dispose()


def as_role(properties: Mapping[str, str], role: str) -> Catalog:
    uri = make_url(properties["uri"]).set(username=role, password=PASSWORD)
    return load_catalog(CATALOG, **{**properties, "uri": uri.render_as_string(False)})


def run_pipeline(catalog: Catalog, memory_server: MemoryServer) -> tuple[list[int], list[int]]:
    """Create a table (and its namespace), commit two batches to it through a real
    coordinator, create the quarantine table: every catalog call a pipeline makes."""
    group_id = f"cat-{uuid.uuid4().hex[:8]}"
    source = RowSource.create(catalog, ["db.rows"], rows_per_table=5)
    settings = CoordinatorSettings(3600.0, 30.0)
    pipe = Pipe.open(
        MemoryBackend(memory_server, group_id, 1.0), catalog, group_id, source, settings
    )
    try:
        coordinator = pipe.coordinator("c1")
        try:
            lead(coordinator)
            for seq in range(2):
                wait_pending(coordinator, source.publish(pipe.writer, seq).file_count)
                result = coordinator.commit_now()
                assert not result.failed, result.failed
        finally:
            coordinator.close()
    finally:
        pipe.writer.close()
    Quarantine(catalog, settings.quarantine_table).list(group_id)
    return sorted(data_file_ids(catalog.load_table("db.rows"))), sorted(source.expected["db.rows"])


def test_a_role_with_only_the_documented_grants_runs_a_pipeline(
    postgres_catalog_properties: Mapping[str, str], catalog_role: str, memory_server: MemoryServer
) -> None:
    grant(postgres_catalog_properties, sql_catalog_grants(catalog_role))
    ids, expected = run_pipeline(as_role(postgres_catalog_properties, catalog_role), memory_server)
    assert ids == expected
    assert len(ids) == 10


@pytest.mark.parametrize(
    ("table", "privilege"),
    [(t, p) for t, ps in SQL_CATALOG_PRIVILEGES.items() for p in ps],
)
def test_every_catalog_grant_is_needed(
    postgres_catalog_properties: Mapping[str, str],
    catalog_role: str,
    memory_server: MemoryServer,
    table: str,
    privilege: str,
) -> None:
    grant(postgres_catalog_properties, sql_catalog_grants(catalog_role))
    grant(postgres_catalog_properties, [f'REVOKE {privilege} ON "{table}" FROM {catalog_role}'])
    with pytest.raises(Exception, match="permission denied") as failed:
        run_pipeline(as_role(postgres_catalog_properties, catalog_role), memory_server)
    assert table in str(failed.value)
