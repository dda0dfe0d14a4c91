"""The least privilege icefloe needs on the object store holding the warehouse: the S3 actions
of each kind of process, and an IAM policy granting exactly them on the warehouse prefix
(docs/operations.md shows it; ``tests/icefloe/test_least_privilege.py`` runs writers, a
coordinator and ``icefloe maintain`` as users holding only these, so an action missing here
fails a test).

Where the actions come from: pyiceberg's FileIO reads table metadata, manifests and Parquet
footers (``GetObject``, also behind ``HeadObject``) and writes data, delete, manifest and
metadata files (``PutObject``); the coordinator deletes merged originals, applied key files
and manifests of a failed attempt (``DeleteObject``); ``icefloe maintain`` lists the table's
location to find orphans (``ListBucket``, for the prefix only) and deletes them. Whoever
writes metadata (commits, creates tables) lists too: pyiceberg checks that a new metadata
file does not exist yet, and pyarrow, behind the FileIO, tells a missing object from a
"directory" by listing its name as a prefix. pyarrow also keeps an emptied "directory"
visible after a delete by writing a ``prefix/`` marker, so whoever deletes writes.
"""

from __future__ import annotations

from typing import Any, Literal

Role = Literal["writer", "creator", "coordinator", "maintain", "doctor"]

_READ_WRITE = ("s3:GetObject", "s3:PutObject")
#: the object actions of each process, on ``<warehouse prefix>/*``
OBJECT_ACTIONS: dict[Role, tuple[str, ...]] = {
    "writer": _READ_WRITE,  # loads the table, writes Parquet files under data/
    # creates tables: a JSON ``auto_create`` table is created by a write task (an executor)
    "creator": _READ_WRITE,
    "coordinator": (*_READ_WRITE, "s3:DeleteObject"),
    "maintain": (*_READ_WRITE, "s3:DeleteObject"),  # expiry commits metadata too
    "doctor": (*_READ_WRITE, "s3:DeleteObject"),  # its probe object: write, read, delete
}
#: the processes that list the prefix (``s3:ListBucket`` on the bucket, prefix-conditioned)
#: (the doctor too: after deleting its probe, pyarrow reads the parent's "directory" marker,
#: which AWS answers with 403 instead of 404 without ``ListBucket``; moto answers 404)
LISTS: frozenset[Role] = frozenset({"creator", "coordinator", "maintain", "doctor"})


def s3_policy(
    warehouse: str, roles: tuple[Role, ...] = ("coordinator", "maintain")
) -> dict[str, Any]:
    """An IAM policy allowing what ``roles`` need under ``warehouse`` (``s3://bucket/prefix``,
    ``s3a://`` too) and nothing else: no bucket creation, no other prefix, no ACL or policy
    actions. Give writers (Spark executors) ``("writer",)`` (``("writer", "creator")`` when
    they create tables: JSON ``auto_create``), the driver's coordinator ``("coordinator",)``
    (it also creates tables), the operator running ``icefloe maintain`` ``("maintain",)``."""
    bucket, _, prefix = warehouse.split("://", 1)[1].partition("/")
    prefix = prefix.strip("/")
    objects = f"arn:aws:s3:::{bucket}/{prefix}/*" if prefix else f"arn:aws:s3:::{bucket}/*"
    actions = sorted({a for r in roles for a in OBJECT_ACTIONS[r]})
    statements: list[dict[str, Any]] = [
        {"Sid": "IcefloeObjects", "Effect": "Allow", "Action": actions, "Resource": objects}
    ]
    if LISTS.intersection(roles):
        listing: dict[str, Any] = {
            "Sid": "IcefloeList",
            "Effect": "Allow",
            "Action": ["s3:ListBucket"],
            "Resource": f"arn:aws:s3:::{bucket}",
        }
        if prefix:
            listing["Condition"] = {"StringLike": {"s3:prefix": [prefix, f"{prefix}/*"]}}
        statements.append(listing)
    return {"Version": "2012-10-17", "Statement": statements}


#: per table of pyiceberg's ``SqlCatalog``, what a pipeline's catalog calls do to it: load
#: (``SELECT``), commit (``UPDATE ... WHERE metadata_location = <the one loaded>``), create
#: tables and namespaces (``INSERT``: auto-created tables, the dead-letter and quarantine
#: tables). icefloe drops no table or namespace and sets no namespace property: no ``DELETE``.
SQL_CATALOG_PRIVILEGES: dict[str, tuple[str, ...]] = {
    "iceberg_tables": ("SELECT", "INSERT", "UPDATE"),
    "iceberg_namespace_properties": ("SELECT", "INSERT"),
}


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def sql_catalog_grants(role: str, schema: str = "public") -> list[str]:
    """The statements (run by the catalog tables' owner) that let ``role`` use a pyiceberg
    ``SqlCatalog`` on PostgreSQL whose tables exist in ``schema``, and nothing more. The first
    start of a catalog creates the tables, which needs ``CREATE`` on the schema: do it once
    as the owner (or create them with ``SqlCatalog(...).create_tables()``)."""
    out = [f"GRANT USAGE ON SCHEMA {_quoted(schema)} TO {_quoted(role)};"]
    for table, privileges in SQL_CATALOG_PRIVILEGES.items():
        target = f"{_quoted(schema)}.{_quoted(table)}"
        out.append(f"GRANT {', '.join(privileges)} ON {target} TO {_quoted(role)};")
    return out
