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

import pyarrow.fs as pafs
from pyiceberg.catalog import Catalog
from pyiceberg.io import FileIO, load_file_io

#: Where a probe object goes, under the location checked (deleted right after).
PROBE_PREFIX = ".icefloe-doctor-"

_SECRET = ("s3.secret-access-key", "client.secret-access-key")
_KEY_ID = ("s3.access-key-id", "client.access-key-id")
# (what the store says, the properties to check (each: its spellings), why): S3 error codes
# as pyarrow and boto name them
_S3_CAUSES: tuple[tuple[tuple[str, ...], tuple[tuple[str, ...], ...], str], ...] = (
    (
        ("SIGNATURE_DOES_NOT_MATCH", "SignatureDoesNotMatch"),
        (_SECRET,),
        "the store rejects the request signature: the secret does not belong to the key id",
    ),
    (
        ("INVALID_ACCESS_KEY_ID", "InvalidAccessKeyId"),
        (_KEY_ID,),
        "the store does not know this access key id",
    ),
    (
        ("ACCESS_DENIED", "AccessDenied", "access denied"),
        (_KEY_ID, _SECRET),
        "the store refuses the request: a wrong secret (a HEAD request's answer has no body "
        "to say so), or the key's user may not read, write or delete objects there",
    ),
    (("NO_SUCH_BUCKET", "NoSuchBucket"), (("warehouse",),), "the bucket does not exist"),
    (
        ("NETWORK_CONNECTION", "Could not resolve", "Couldn't connect", "Connection refused"),
        (("s3.endpoint",),),
        "the store cannot be reached",
    ),
)


def location_filesystem(
    location: str, properties: Mapping[str, str] | None = None, io: FileIO | None = None
) -> tuple[pafs.FileSystem, str]:
    """The pyarrow file system pyiceberg's FileIO uses for ``location`` (``io``, or one made
    from the catalog ``properties``: ``s3.endpoint``, credentials, region...; ``s3a://`` and
    ``s3n://`` are S3), and the location as that file system names it (``bucket/prefix`` on
    object stores). ``pyarrow.fs.FileSystem.from_uri`` would use the environment's defaults
    (AWS's endpoint and credentials) and knows no ``s3a://``. Raises ValueError for a scheme
    no file system serves."""
    from pyiceberg.io.pyarrow import PyArrowFileIO

    if io is None:
        io = load_file_io(dict(properties or {}), location)
    if not isinstance(io, PyArrowFileIO):  # e.g. FsspecFileIO: pyarrow's own lookup
        fs, path = pafs.FileSystem.from_uri(location)
        return fs, str(path)
    scheme, netloc, path = io.parse_location(location)
    return io.fs_by_scheme(scheme, netloc), path


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
        text = " ".join(str(cause).split())
        known = hint(text, properties)
        unknown = f"check the catalog's FileIO properties (s3.*, gcs.*, adls.*...) ({text})"
        super().__init__(f"cannot write to {location}: {known or unknown}")


def hint(error: str, properties: Mapping[str, str]) -> str | None:
    """What to check for a store's ``error``: the catalog property (as configured, or the
    first spelling pyiceberg reads) and why, then the store's own words; None for an error
    that names no known cause."""
    text = " ".join(error.split())
    for codes, names, why in _S3_CAUSES:
        if any(code.lower() in text.lower() for code in codes):
            keys = [
                next((k for k in spellings if k in properties), spellings[0]) for spellings in names
            ]
            unset = [k for k in keys if k not in properties]
            default = f" ({', '.join(unset)} not set: the environment's default is used)"
            word = "property" if len(keys) == 1 else "properties"
            shown = " and ".join(keys) + (default if unset else "")
            return f"check catalog {word} {shown}: {why} ({text})"
    return None


def storage_locations(catalog: Catalog, tables: Mapping[str, bool | None]) -> list[str]:
    """Where the pipeline writes: the data location of every existing table of ``tables``
    (name -> exists, None when unknown: the catalog could not say), and the catalog's
    warehouse when it is a URL and some table is not known to exist (``run`` creates it
    there). Deduplicated, in order."""
    from pyiceberg.table import TableProperties

    out: list[str] = []
    for name, exists in tables.items():
        if exists:
            table = catalog.load_table(name)
            data = table.properties.get(TableProperties.WRITE_DATA_PATH)
            out.append(data or f"{table.location().rstrip('/')}/data")
    warehouse = catalog.properties.get("warehouse", "")
    if "://" in warehouse and not all(tables.values()):  # None and False alike
        out.append(warehouse)
    return list(dict.fromkeys(out))
