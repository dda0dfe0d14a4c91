"""The FileIO of ``icefloe status``: local paths through plain Python files, every other
scheme through the FileIO pyiceberg would choose itself.

Why: for a local warehouse pyiceberg picks ``PyArrowFileIO``, whose module imports
``pyarrow.dataset`` and with it pandas, about a third of a second of every ``status`` run
(docs/benchmarks.md), while status only reads metadata JSON and manifests. pyiceberg's
``FsspecFileIO`` avoids that but imports ``requests`` and pyiceberg's REST catalog module
(~0.08 s more); reading a local file needs neither, so local files are opened here. For
object stores nothing changes: ``s3://`` and the rest still get ``PyArrowFileIO`` (fsspec's
``s3fs`` is not an icefloe dependency). pyiceberg reads and writes through
``FileIO.new_input`` and ``new_output`` whatever the implementation, so a scan (the
quarantine table's entries) works through this class too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import cast
from urllib.parse import urlsplit

from pyiceberg.io import (
    PY_IO_IMPL,
    FileIO,
    InputFile,
    InputStream,
    OutputFile,
    OutputStream,
    load_file_io,
)
from pyiceberg.typedef import EMPTY_DICT, Properties

_LOCAL = ("", "file")


def local_path(location: str) -> str:
    """The path of a ``file://`` (or ``file:``) location, or of a plain path, as fsspec's
    local file system reads it: no percent-decoding, and ``?`` or ``#`` are part of the name."""
    for prefix in ("file://", "file:"):
        if location.startswith(prefix):
            return location[len(prefix) :]
    return location


class LocalInputFile(InputFile):
    def __len__(self) -> int:
        return os.path.getsize(local_path(self.location))

    def exists(self) -> bool:
        return os.path.lexists(local_path(self.location))

    def open(self, seekable: bool = True) -> InputStream:
        return cast(InputStream, open(local_path(self.location), "rb"))


class LocalOutputFile(OutputFile):
    def __len__(self) -> int:
        return os.path.getsize(local_path(self.location))

    def exists(self) -> bool:
        return os.path.lexists(local_path(self.location))

    def to_input_file(self) -> InputFile:
        return LocalInputFile(self.location)

    def create(self, overwrite: bool = False) -> OutputStream:
        """A new file (its directory made as needed); ``FileExistsError`` when it exists and
        ``overwrite`` is false."""
        path = local_path(self.location)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        return cast(OutputStream, open(path, "wb" if overwrite else "xb"))


class StatusFileIO(FileIO):
    """Local locations as files (:class:`LocalInputFile`); any other scheme delegated to one
    FileIO per scheme, made on first use."""

    def __init__(self, properties: Properties = EMPTY_DICT) -> None:
        super().__init__(properties)
        self._by_scheme: dict[str, FileIO] = {}

    def _io(self, location: str) -> FileIO | None:
        """The FileIO for a non-local ``location``; None for a local one."""
        scheme = urlsplit(location).scheme.lower()
        if scheme in _LOCAL:
            return None
        io = self._by_scheme.get(scheme)
        if io is None:  # pyiceberg's own choice, as if this class had not been named
            chosen = {k: v for k, v in self.properties.items() if k != PY_IO_IMPL}
            io = self._by_scheme[scheme] = load_file_io(chosen, location)
        return io

    def new_input(self, location: str) -> InputFile:
        io = self._io(location)
        return LocalInputFile(location) if io is None else io.new_input(location)

    def new_output(self, location: str) -> OutputFile:
        io = self._io(location)
        return LocalOutputFile(location) if io is None else io.new_output(location)

    def delete(self, location: str | InputFile | OutputFile) -> None:
        path = location if isinstance(location, str) else location.location
        io = self._io(path)
        if io is None:
            os.remove(local_path(path))
        else:
            io.delete(location)


def status_properties(properties: Mapping[str, str]) -> dict[str, str]:
    """Catalog ``properties`` with :class:`StatusFileIO`, unless they name a FileIO
    (``py-io-impl``) themselves: the operator's choice stands."""
    if PY_IO_IMPL in properties:
        return dict(properties)
    return {**properties, PY_IO_IMPL: f"{__name__}.{StatusFileIO.__name__}"}
