"""An S3-compatible object store for tests: moto's server mode, a real HTTP S3 API on a
loopback port (no MinIO or other S3 server installs here; ``moto[server]`` is in core's
``test`` extra).

How the tests start it: the session fixture :func:`s3_store` runs ``python -m
icefloe.testing.s3server`` in a child process (its own interpreter, so the server's request
handling does not share the test's GIL), which starts ``moto.server.ThreadedMotoServer`` on
127.0.0.1, port 0, and prints the port it got. Signatures are checked: the child runs with
``INITIAL_NO_AUTH_ACTION_COUNT`` = :data:`SETUP_REQUESTS`, so only the IAM calls that create
the test's user go unauthenticated, and every S3 request after them must be signed with that
user's key (a wrong ``s3.secret-access-key`` fails as on AWS). Listings come in pages of
:data:`PAGE_SIZE` keys, so paging is exercised by every listing longer than that.

Catalog properties are built generically, so any catalog can be combined with the store:
``{**catalog_props, **store.warehouse_properties(store.new_warehouse())}``.
:func:`s3_catalog_properties` does that for a private SQLite catalog.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyiceberg.io.pyarrow import schema_to_pyarrow
from pyiceberg.manifest import DataFileContent
from pyiceberg.table import Table

#: Requests moto serves before it checks signatures: the IAM calls of :func:`running_s3_store`.
SETUP_REQUESTS = 3
REGION = "us-east-1"
#: Keys per listing page (S3 returns up to 1000; a client must follow the continuation token
#: whenever the answer is truncated, so the test server pages early to make every listing
#: of more than this many keys take several requests).
PAGE_SIZE = 50
_USER = "icefloe-test"
#: What the test user may do: everything in S3, and create the users of least-privilege
#: tests (:meth:`S3Store.as_user_with`).
ALLOW_S3 = {
    "Version": "2012-10-17",
    "Statement": [
        {"Effect": "Allow", "Action": "s3:*", "Resource": "*"},
        {
            "Effect": "Allow",
            "Action": ["iam:CreateUser", "iam:PutUserPolicy", "iam:CreateAccessKey"],
            "Resource": "*",
        },
    ],
}


@dataclass(frozen=True)
class S3Store:
    """A running S3-compatible server and the credentials of a user allowed to use it."""

    endpoint: str
    access_key_id: str
    secret_access_key: str = field(repr=False)
    region: str = REGION

    def file_io_properties(self) -> dict[str, str]:
        """pyiceberg's FileIO properties (PyArrowFileIO) for this store."""
        return {
            "s3.endpoint": self.endpoint,
            "s3.access-key-id": self.access_key_id,
            "s3.secret-access-key": self.secret_access_key,
            "s3.region": self.region,
        }

    def warehouse_properties(self, warehouse: str) -> dict[str, str]:
        """Catalog properties putting the warehouse at ``warehouse`` (``s3://bucket/prefix``)
        on this store: add them to any catalog's own (``uri``, ``type``...)."""
        return {"warehouse": warehouse, **self.file_io_properties()}

    def as_user_with(self, policy: Mapping[str, Any]) -> S3Store:
        """The same store as a new IAM user allowed only ``policy`` (moto checks each S3
        request's action and resource against it; it does not evaluate ``Condition``)."""
        import boto3

        iam = boto3.client(
            "iam",
            endpoint_url=self.endpoint,
            region_name=self.region,
            aws_access_key_id=self.access_key_id,
            aws_secret_access_key=self.secret_access_key,
        )
        user = f"icefloe-{uuid.uuid4().hex[:12]}"
        iam.create_user(UserName=user)
        iam.put_user_policy(UserName=user, PolicyName="p", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName=user)["AccessKey"]
        return S3Store(self.endpoint, key["AccessKeyId"], key["SecretAccessKey"], self.region)

    def client(self) -> Any:
        """A boto3 S3 client as the test user (to look at the store beside pyiceberg)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=self.region,
            aws_access_key_id=self.access_key_id,
            aws_secret_access_key=self.secret_access_key,
        )

    def new_bucket(self) -> str:
        """Create a bucket of its own for a test; returns its name."""
        bucket = f"icefloe-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=bucket)
        return bucket

    def new_warehouse(self) -> str:
        """``s3://<a new bucket>/wh``."""
        return f"s3://{self.new_bucket()}/wh"

    def keys(self, url: str) -> list[str]:
        """Every object key under ``s3://bucket/prefix``, listed page by page."""
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        pages = (
            self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        )
        return [o["Key"] for page in pages for o in page.get("Contents", [])]

    def filesystem(self) -> Any:
        """A pyarrow S3 file system of its own (not the table's FileIO) on this store."""
        from pyarrow import fs

        return fs.S3FileSystem(
            endpoint_override=self.endpoint.removeprefix("http://"),
            scheme="http",
            access_key=self.access_key_id,
            secret_key=self.secret_access_key,
            region=self.region,
        )

    def read_table(self, table: Table) -> pa.Table:
        """Every live row of ``table``, read by pyarrow over this store: pyiceberg only plans
        which files are live; the Parquet data and position delete files are read and applied
        here, not by pyiceberg's reader or icefloe's."""
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        fs = self.filesystem()
        parts = [pa.Table.from_pylist([], schema_to_pyarrow(table.schema()))]
        for task in table.scan().plan_files():
            data = pq.read_table(_key(task.file.file_path), filesystem=fs)
            dead: set[int] = set()
            for d in task.delete_files:
                assert d.content == DataFileContent.POSITION_DELETES, d.file_path
                deletes = pq.read_table(_key(d.file_path), filesystem=fs)
                mine = pc.equal(deletes["file_path"], task.file.file_path)
                dead.update(deletes.filter(mine)["pos"].to_pylist())
            keep = pa.array([i not in dead for i in range(data.num_rows)], pa.bool_())
            parts.append(data.filter(keep).select(parts[0].column_names))
        return pa.concat_tables(parts, promote_options="permissive")

    def read_ids(self, table: Table, column: str = "id") -> list[int]:
        """``column`` of every live row (:meth:`read_table`), sorted, duplicates kept."""
        return sorted(int(v) for v in self.read_table(table)[column].to_pylist())


def _key(url: str) -> str:
    """``bucket/key`` of an ``s3://`` (or ``s3a://``) URL, as pyarrow names objects."""
    return url.split("://", 1)[1]


@contextmanager
def running_s3_store() -> Iterator[S3Store]:
    """Start moto's S3 server in a child process with a user and its key; stop it after."""
    import boto3

    env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT=str(SETUP_REQUESTS))
    proc = subprocess.Popen(
        [sys.executable, "-m", "icefloe.testing.s3server", str(PAGE_SIZE)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.strip().isdigit():
            raise RuntimeError(
                f"moto's S3 server did not start (status {proc.poll()}): is moto[server] "
                "installed (core's test extra)? `python -m icefloe.testing.s3server 50` shows why"
            )
        endpoint = f"http://127.0.0.1:{int(line)}"
        iam = boto3.client(
            "iam",
            endpoint_url=endpoint,
            region_name=REGION,
            aws_access_key_id="setup",
            aws_secret_access_key="setup",
        )
        iam.create_user(UserName=_USER)
        iam.put_user_policy(UserName=_USER, PolicyName="s3", PolicyDocument=json.dumps(ALLOW_S3))
        key = iam.create_access_key(UserName=_USER)["AccessKey"]
        yield S3Store(endpoint, key["AccessKeyId"], key["SecretAccessKey"])
    finally:
        if proc.stdin is not None:
            proc.stdin.close()  # the child serves until its stdin closes
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def s3_sqlite_catalog_properties(store: S3Store, path: Path) -> dict[str, str]:
    """A private SQLite SqlCatalog in ``path`` whose warehouse is a new bucket on ``store``."""
    from icefloe.testing.fixtures import sqlite_catalog_properties

    catalog = sqlite_catalog_properties(path)
    return {"type": "sql", **catalog, **store.warehouse_properties(store.new_warehouse())}


def doctor_storage(properties: Mapping[str, str], tables: list[str]) -> list[tuple[str, str]]:
    """``icefloe doctor``'s lines (status, detail) for the first of ``tables`` and for the
    storage probes, for a pipeline over ``tables`` on the catalog of ``properties`` (named
    ``s3test``)."""
    from icefloe.config import config_from_dict
    from icefloe.ops.doctor import catalog_checks

    config = config_from_dict(
        {
            "name": "p",
            "source": {"topics": ["t"]},
            "catalog": {"name": "s3test", "properties": dict(properties)},
            "tables": [{"name": t} for t in tables],
        }
    )
    checks = catalog_checks(config)
    return [
        (c.status, c.detail)
        for c in checks
        if c.name in (f"table {tables[0]}", "storage") or c.name.startswith("storage ")
    ]


@pytest.fixture(scope="session")
def s3_store() -> Iterator[S3Store]:
    """moto's S3 server for the whole session (signatures checked; see the module doc)."""
    with running_s3_store() as store:
        yield store


@pytest.fixture
def s3_catalog_properties(s3_store: S3Store, tmp_path: Path) -> Mapping[str, str]:
    """A private SqlCatalog (SQLite) with its warehouse in a bucket of its own on moto."""
    return s3_sqlite_catalog_properties(s3_store, tmp_path / "iceberg")
