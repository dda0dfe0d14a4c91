"""The object-store permissions of docs/operations.md, enforced: writers, the coordinator and
``icefloe maintain`` each run as an IAM user holding only :func:`icefloe.ops.permissions.s3_policy`
for its role, on moto's S3 server (which checks every request's action and resource against
the user's policy; it ignores the ``s3:prefix`` condition of ``ListBucket``). Real
coordinator, writer client, SQLite catalog and Parquet files; rows counted by pyarrow as the
bucket's unrestricted user (:meth:`S3Store.read_ids`). The docs show the policy and the SQL
catalog grants the code defines."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pytest
from pyiceberg.catalog import Catalog, load_catalog
from pyiceberg.io.pyarrow import schema_to_pyarrow

from icefloe.commit.policy import TablePolicies, TablePolicy
from icefloe.config import config_from_dict
from icefloe.coordination.coordinator import CoordinatorSettings
from icefloe.coordination.settings import CycleResult
from icefloe.errors import MaintenanceError
from icefloe.ops.maintenance import OrphanResult, expire_snapshots, maintain, remove_orphan_files
from icefloe.ops.permissions import OBJECT_ACTIONS, Role, s3_policy, sql_catalog_grants
from icefloe.testing.fixtures import create_rows_table, write_rows
from icefloe.testing.harness import Pipe, RowSource, lead, wait_pending
from icefloe.testing.memory import (
    MemoryBackend,
    MemoryServer,
    memory_backend_options,
    serve_memory_server,
)
from icefloe.testing.objectstore import S3Store, doctor_storage

MERGED, PLAIN = "db.merged", "db.plain"
OPERATIONS_MD = Path(__file__).resolve().parents[4] / "docs" / "operations.md"
CATALOG = "s3test"  # a SqlCatalog's tables belong to its name: every user's catalog shares it


@dataclass
class Users:
    """One catalog per process, each with the keys of a user allowed only its role."""

    store: S3Store
    properties: Mapping[str, str]

    def user(self, *roles: Role, drop: str | None = None) -> S3Store:
        """A user holding ``s3_policy`` for ``roles``, less action ``drop``."""
        policy = s3_policy(self.properties["warehouse"], roles)
        for statement in policy["Statement"]:
            statement["Action"] = [a for a in statement["Action"] if a != drop]
        policy["Statement"] = [st for st in policy["Statement"] if st["Action"]]
        return self.store.as_user_with(policy)

    def properties_of(self, user: S3Store) -> dict[str, str]:
        """The catalog's properties with ``user``'s keys."""
        return {**self.properties, **user.file_io_properties()}

    def catalog(self, *roles: Role, drop: str | None = None) -> Catalog:
        """The catalog as :meth:`user`."""
        return load_catalog(CATALOG, **self.properties_of(self.user(*roles, drop=drop)))


@pytest.fixture
def users(s3_store: S3Store, s3_catalog_properties: Mapping[str, str]) -> Users:
    return Users(s3_store, s3_catalog_properties)


@pytest.fixture
def owner(s3_catalog_properties: Mapping[str, str]) -> Catalog:
    """The unrestricted user: creates the tables (a deployment step, not a pipeline's)."""
    catalog = load_catalog(CATALOG, **s3_catalog_properties)
    for t in (MERGED, PLAIN):
        create_rows_table(catalog, t)
    return catalog


def open_pipe(memory_server: MemoryServer, users: Users, coordinator: Catalog) -> Pipe:
    """A pipeline whose writer writes as a ``writer`` user and commits through ``coordinator``."""
    group_id = f"lp-{uuid.uuid4().hex[:8]}"
    source = RowSource(users.catalog("writer"), [MERGED, PLAIN], rows_per_table=10)
    policies = TablePolicies(TablePolicy(), {MERGED: TablePolicy(merge_small_files=True)})
    settings = CoordinatorSettings(3600.0, 30.0, policies=policies)
    backend = MemoryBackend(memory_server, group_id, 1.0)
    return Pipe.open(backend, coordinator, group_id, source, settings)


@pytest.fixture
def pipe(memory_server: MemoryServer, users: Users, owner: Catalog) -> Iterator[Pipe]:
    p = open_pipe(memory_server, users, users.catalog("coordinator"))
    yield p
    p.writer.close()


def data_objects(store: S3Store, catalog: Catalog, table: str) -> set[str]:
    """Every object under the table's data directory (no directory marker)."""
    location = catalog.load_table(table).location()
    bucket = location.removeprefix("s3://").split("/", 1)[0]
    return {f"s3://{bucket}/{k}" for k in store.keys(f"{location}/data/") if not k.endswith("/")}


def live_files(catalog: Catalog, table: str) -> set[str]:
    return {t.file.file_path for t in catalog.load_table(table).scan().plan_files()}


def publish_batches(pipe: Pipe, wait: Callable[[int], None] = lambda files: None) -> set[str]:
    """Three small batches; the published files (``wait``: run after each, with its count)."""
    published: set[str] = set()
    for seq in range(3):
        batch = pipe.source.publish(pipe.writer, seq)
        published.update(m.path for ms in batch.files.values() for m in ms)
        wait(batch.file_count)
    return published


def commit_batches(pipe: Pipe) -> tuple[CycleResult, set[str]]:
    """Three small batches, committed in one cycle; the result and the published files."""
    coordinator = pipe.coordinator("c1")
    try:
        lead(coordinator)
        published = publish_batches(pipe, lambda files: wait_pending(coordinator, files))
        return coordinator.commit_now(), published
    finally:
        coordinator.close()


def commit_three_batches(pipe: Pipe) -> None:
    """:func:`commit_batches`, which succeed: MERGED's three files are merged into one."""
    result, _ = commit_batches(pipe)
    assert not result.failed, result.failed
    merged = next(r for r in result.tables if r.table == MERGED)
    assert (merged.data_files, merged.added_files) == (3, 1)


def expire_and_remove(catalog: Catalog, table: str, older_than_ms: int) -> OrphanResult:
    """What ``icefloe maintain`` does to a table: expire snapshots, then delete orphans."""
    expire_snapshots(catalog.load_table(table), older_than_ms, retain_last=1)
    return remove_orphan_files(catalog.load_table(table), older_than_ms)


def test_each_process_runs_with_exactly_its_documented_actions(
    pipe: Pipe, users: Users, owner: Catalog, s3_store: S3Store
) -> None:
    commit_three_batches(pipe)
    # the coordinator deleted the merged originals: nothing but live files is left
    assert data_objects(s3_store, owner, MERGED) == live_files(owner, MERGED)

    [stray] = write_rows(pipe.source.catalog.load_table(PLAIN), [99_999], "crashed-task", 0)
    soon_ms = int(time.time() * 1000) + 60_000  # every object counts as old
    orphans = expire_and_remove(users.catalog("maintain"), PLAIN, soon_ms)
    assert orphans.deleted == (stray.path.removeprefix("s3://"),)
    assert data_objects(s3_store, owner, PLAIN) == live_files(owner, PLAIN)
    for t in (MERGED, PLAIN):
        assert s3_store.read_ids(owner.load_table(t)) == sorted(pipe.source.expected[t])


def test_a_writer_may_not_delete_and_no_role_may_leave_the_warehouse(
    users: Users, owner: Catalog, s3_store: S3Store
) -> None:
    """The policies are narrower than "s3:*": the check above proves they suffice, this one
    that moto enforces them (a writer cannot delete; nobody writes outside the prefix)."""
    writer = users.catalog("writer")
    [written] = write_rows(writer.load_table(PLAIN), [1], "w", 0)
    with pytest.raises(OSError, match="ACCESS_DENIED"):
        writer.load_table(PLAIN).io.delete(written.path)
    bucket = owner.load_table(PLAIN).location().removeprefix("s3://").split("/", 1)[0]
    with pytest.raises(OSError, match="ACCESS_DENIED"):
        users.catalog(*OBJECT_ACTIONS).load_table(PLAIN).io.new_output(
            f"s3://{bucket}/elsewhere/x"
        ).create().write(b"x")
    assert written.path in data_objects(s3_store, owner, PLAIN)


def test_without_delete_the_coordinator_commits_and_leaves_merged_originals_to_maintain(
    memory_server: MemoryServer, users: Users, owner: Catalog, s3_store: S3Store
) -> None:
    """DeleteObject missing: the commit lands all the same (deleting merged originals comes
    after it); the originals stay as orphans, which ``icefloe maintain`` deletes."""
    pipe = open_pipe(memory_server, users, users.catalog("coordinator", drop="s3:DeleteObject"))
    try:
        commit_three_batches(pipe)
    finally:
        pipe.writer.close()
    left = data_objects(s3_store, owner, MERGED) - live_files(owner, MERGED)
    assert len(left) == 3  # the merged originals
    assert s3_store.read_ids(owner.load_table(MERGED)) == sorted(pipe.source.expected[MERGED])

    soon_ms = int(time.time() * 1000) + 60_000
    orphans = remove_orphan_files(users.catalog("maintain").load_table(MERGED), soon_ms)
    assert {f"s3://{p}" for p in orphans.deleted} == left
    assert data_objects(s3_store, owner, MERGED) == live_files(owner, MERGED)


def test_without_delete_maintain_fails_naming_the_refused_request_and_deletes_nothing(
    users: Users, owner: Catalog, s3_store: S3Store
) -> None:
    table = owner.load_table(PLAIN)
    row = {"id": 1, "writer": "o", "batch_seq": 0}
    table.append(pa.Table.from_pylist([row], schema_to_pyarrow(table.schema())))
    [stray] = write_rows(users.catalog("writer").load_table(PLAIN), [2], "crashed-task", 0)
    soon_ms = int(time.time() * 1000) + 60_000
    maintainer = users.catalog("maintain", drop="s3:DeleteObject")
    with pytest.raises(OSError, match="ACCESS_DENIED during DeleteObject"):
        remove_orphan_files(maintainer.load_table(PLAIN), soon_ms)
    assert data_objects(s3_store, owner, PLAIN) == live_files(owner, PLAIN) | {stray.path}
    assert s3_store.read_ids(owner.load_table(PLAIN)) == [1]


def needed(role: Role) -> list[str]:
    """Every action ``s3_policy`` grants ``role``."""
    return sorted({a for st in s3_policy("s3://b/wh", (role,))["Statement"] for a in st["Action"]})


@pytest.mark.parametrize("action", [a for a in needed("coordinator") if a != "s3:DeleteObject"])
def test_the_coordinator_needs_each_of_its_actions(
    memory_server: MemoryServer, users: Users, owner: Catalog, s3_store: S3Store, action: str
) -> None:
    """Without any one action the coordinator cannot lead: its first write, the fence it
    raises in the quarantine table (a table of the warehouse like the others) before it reads
    anything, fails naming the denied request, and nothing is lost (the published files
    stay); DeleteObject is needed only after the commit (test above). Without ListBucket,
    pyarrow cannot tell a missing metadata file from a directory."""
    pipe = open_pipe(memory_server, users, users.catalog("coordinator", drop=action))
    coordinator = pipe.coordinator("c1")
    try:
        published = publish_batches(pipe)
        with pytest.raises(OSError, match="ACCESS_DENIED") as denied:
            lead(coordinator)
    finally:
        coordinator.close()
        pipe.writer.close()
    assert "quarantine" in str(denied.value)
    assert not coordinator.is_leader
    assert live_files(owner, MERGED) == live_files(owner, PLAIN) == set()
    kept = data_objects(s3_store, owner, MERGED) | data_objects(s3_store, owner, PLAIN)
    assert published <= kept


@pytest.mark.parametrize("action", needed("writer"))
def test_a_writer_needs_each_of_its_actions(users: Users, owner: Catalog, action: str) -> None:
    with pytest.raises(OSError, match="ACCESS_DENIED"):
        write_rows(users.catalog("writer", drop=action).load_table(PLAIN), [1], "w", 0)


@pytest.mark.parametrize("action", needed("maintain"))
def test_maintain_needs_each_of_its_actions(
    users: Users, owner: Catalog, s3_store: S3Store, action: str
) -> None:
    write_rows(users.catalog("writer").load_table(PLAIN), [2], "crashed-task", 0)
    soon_ms = int(time.time() * 1000) + 60_000
    maintainer = users.catalog("maintain", drop=action)
    with pytest.raises(OSError, match="ACCESS_DENIED"):
        expire_and_remove(maintainer, PLAIN, soon_ms)


def test_a_writer_that_creates_tables_needs_the_listing(users: Users) -> None:
    """A JSON ``auto_create`` table is created by a write task: writing its first metadata
    file lists the prefix (pyiceberg checks that the file does not exist yet)."""
    with pytest.raises(OSError, match="ACCESS_DENIED during ListObjectsV2"):
        create_rows_table(users.catalog("writer"), "db.created")
    created = create_rows_table(users.catalog("writer", "creator"), "db.created")
    [written] = write_rows(created, [1], "w", 0)
    assert written.path.startswith(created.location())


def test_the_policy_covers_the_warehouse_prefix_only() -> None:
    """``s3a://`` and a trailing slash name the same prefix; a bucket-wide warehouse has no
    prefix condition; writers get no listing and no delete."""
    writer = s3_policy("s3a://b/wh/", ("writer",))
    assert writer["Statement"] == [
        {
            "Sid": "IcefloeObjects",
            "Effect": "Allow",
            "Action": ["s3:GetObject", "s3:PutObject"],
            "Resource": "arn:aws:s3:::b/wh/*",
        }
    ]
    whole = s3_policy("s3://b", ("maintain",))["Statement"]
    assert [st["Resource"] for st in whole] == ["arn:aws:s3:::b/*", "arn:aws:s3:::b"]
    assert "Condition" not in whole[1]


def test_the_docs_show_the_policy_and_grants_the_code_defines() -> None:
    text = OPERATIONS_MD.read_text()
    section = text[text.index("### Object store (S3)") : text.index("## Moving, resetting")]
    shown = json.loads(section.split("```json\n", 1)[1].split("```", 1)[0])
    assert shown == s3_policy("s3://my-bucket/warehouse", ("coordinator", "maintain"))
    sql = section.split("```sql\n", 1)[1].split("```", 1)[0]
    assert sql.splitlines() == sql_catalog_grants("icefloe_catalog")


# not ListBucket: moto answers a read of the missing "directory" marker after the probe's
# delete with 404 without it (AWS: 403, which is why the policy has it)
@pytest.mark.parametrize("action", [None, *(a for a in needed("doctor") if a != "s3:ListBucket")])
def test_doctor_probes_the_store_with_exactly_its_actions(
    users: Users, owner: Catalog, action: str | None
) -> None:
    """``icefloe doctor`` as a ``doctor`` user: the table and both probes pass; without any
    one of its actions, a line fails."""
    user = users.user("doctor", drop=action)
    lines = doctor_storage(users.properties_of(user), [PLAIN, "db.gone"])
    statuses = [status for status, _ in lines]
    if action is None:  # the table, its data location, the warehouse
        assert statuses == ["ok", "ok", "ok"], lines
    else:
        assert "fail" in statuses, lines
        assert all("ACCESS_DENIED" in d for s, d in lines if s == "fail"), lines


@pytest.mark.usefixtures("memory_plugins")
def test_icefloe_maintain_without_delete_says_what_to_check_in_one_error(
    users: Users, owner: Catalog, s3_store: S3Store
) -> None:
    """``icefloe maintain`` (the command's function, on a served channel) stops with an
    icefloe error (one clean line from the CLI, exit 2) naming the table, the step and the
    catalog properties, instead of pyarrow's OSError and a traceback."""
    [stray] = write_rows(users.catalog("writer").load_table(PLAIN), [2], "crashed-task", 0)
    props = users.properties_of(users.user("maintain", drop="s3:DeleteObject"))
    with serve_memory_server() as (_, address):
        config = config_from_dict(
            {
                "name": "lp",
                "source": {"topics": ["t"]},
                "tables": [{"name": PLAIN}],
                "catalog": {"name": CATALOG, "properties": props},
                "coordination": {"backend": "memory", "memory": memory_backend_options(address)},
            }
        )
        with pytest.raises(MaintenanceError) as failed:
            maintain(config, (), 0.0, 1, 0.0)
    said = str(failed.value)
    assert said.startswith(f"table {PLAIN}: deleting orphan files stopped: "), said
    assert "check catalog properties s3.access-key-id and s3.secret-access-key" in said
    assert "ACCESS_DENIED during DeleteObject" in said
    assert props["s3.secret-access-key"] not in said
    assert stray.path in data_objects(s3_store, owner, PLAIN)
