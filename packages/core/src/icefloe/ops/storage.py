"""``icefloe doctor``'s storage check: the warehouse (and every existing table's data location)
can be written, read and deleted with the FileIO settings the catalog is configured with.

Why: a catalog can answer while its object store refuses the credentials (another secret,
no write permission on the prefix, a wrong endpoint); ``run`` would then fail at the first
batch, in a Spark task. The probe writes one small object under each location, reads it back
and deletes it, as writers, the coordinator and ``maintain`` do. A failure names the catalog
property to check, not only the store's error code.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping

from pyiceberg.catalog import Catalog
from pyiceberg.io import load_file_io

#: Where a probe object goes, under the location checked (deleted right after).
PROBE_PREFIX = ".icefloe-doctor-"

# (what the store says, the property to check, why): S3 error codes as pyarrow and boto name them
_S3_CAUSES: tuple[tuple[tuple[str, ...], tuple[str, ...], str], ...] = (
    (
        ("SIGNATURE_DOES_NOT_MATCH", "SignatureDoesNotMatch"),
        ("s3.secret-access-key", "client.secret-access-key"),
        "the store rejects the request signature: the secret does not belong to the key id",
    ),
    (
        ("INVALID_ACCESS_KEY_ID", "InvalidAccessKeyId"),
        ("s3.access-key-id", "client.access-key-id"),
        "the store does not know this access key id",
    ),
    (
        ("ACCESS_DENIED", "AccessDenied", "access denied"),
        ("s3.access-key-id", "client.access-key-id"),
        "the key's user may not read, write or delete objects there",
    ),
    (
        ("NO_SUCH_BUCKET", "NoSuchBucket"),
        ("warehouse",),
        "the bucket does not exist",
    ),
    (
        ("NETWORK_CONNECTION", "Could not resolve", "Couldn't connect", "Connection refused"),
        ("s3.endpoint",),
        "the store cannot be reached",
    ),
)


def probe_location(catalog: Catalog, location: str) -> str:
    """Write, read back and delete one object under ``location`` with the catalog's FileIO
    settings; returns what was checked. Raises :class:`StorageError` naming the property to
    check when the store refuses."""
    io = load_file_io(dict(catalog.properties), location)
    path = f"{location.rstrip('/')}/{PROBE_PREFIX}{uuid.uuid4().hex[:12]}"
    body = b"icefloe doctor"
    try:
        with io.new_output(path).create(overwrite=True) as out:
            out.write(body)
        with io.new_input(path).open() as f:
            if f.read() != body:
                raise OSError(f"{path} read back other bytes than were written")
        io.delete(path)
    except Exception as exc:
        raise StorageError(location, exc, catalog.properties) from None  # message has it
    return f"{location}: written, read and deleted"


class StorageError(Exception):
    """The store refused a probe; the message names the catalog property to check."""

    def __init__(self, location: str, cause: BaseException, properties: Mapping[str, str]):
        super().__init__(f"cannot write to {location}: {hint(str(cause), properties)}")


def hint(error: str, properties: Mapping[str, str]) -> str:
    """What to check for a store's ``error``: the catalog property (as configured, or the
    first spelling pyiceberg reads) and why, then the store's own words."""
    text = " ".join(error.split())
    for codes, keys, why in _S3_CAUSES:
        if any(code.lower() in text.lower() for code in codes):
            key = next((k for k in keys if k in properties), keys[0])
            unset = "" if key in properties else " (not set: the environment's default is used)"
            return f"check catalog property {key}{unset}: {why} ({text})"
    return f"check the catalog's FileIO properties (s3.*, gcs.*, adls.*...) ({text})"


def storage_locations(catalog: Catalog, tables: Mapping[str, bool]) -> list[str]:
    """Where the pipeline writes: the data location of every existing table of ``tables``
    (name -> exists), and the catalog's warehouse when it is a URL and some table does not
    exist yet (``run`` creates it there). Deduplicated, in order."""
    from pyiceberg.table import TableProperties

    out: list[str] = []
    for name, exists in tables.items():
        if exists:
            table = catalog.load_table(name)
            data = table.properties.get(TableProperties.WRITE_DATA_PATH)
            out.append(data or f"{table.location().rstrip('/')}/data")
    warehouse = catalog.properties.get("warehouse", "")
    if "://" in warehouse and not all(tables.values()):
        out.append(warehouse)
    return list(dict.fromkeys(out))
