"""The FileIO of ``icefloe status``: local paths through pyiceberg's ``FsspecFileIO``, every
other scheme through the FileIO pyiceberg would choose itself.

Why: for a local warehouse pyiceberg picks ``PyArrowFileIO``, whose module imports
``pyarrow.dataset`` and with it pandas, about a third of a second of every ``status`` run
(docs/benchmarks.md), while status only reads metadata JSON and manifests. ``FsspecFileIO``
reads the same files with fsspec's local file system and imports neither. For object stores
nothing changes: ``s3://`` and the rest still get ``PyArrowFileIO`` (fsspec's ``s3fs`` is not
an icefloe dependency). pyiceberg reads and writes through ``FileIO.new_input`` and
``new_output`` whatever the implementation, so a scan (the quarantine table's entries) works
through this class too.
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import urlsplit

from pyiceberg.io import PY_IO_IMPL, FileIO, InputFile, OutputFile, load_file_io
from pyiceberg.typedef import EMPTY_DICT, Properties

_LOCAL = ("", "file")


class LocalFsspecFileIO(FileIO):
    """Delegates each location to one FileIO per scheme, made on first use."""

    def __init__(self, properties: Properties = EMPTY_DICT) -> None:
        super().__init__(properties)
        self._by_scheme: dict[str, FileIO] = {}

    def _io(self, location: str) -> FileIO:
        scheme = urlsplit(location).scheme.lower()
        io = self._by_scheme.get(scheme)
        if io is None:
            if scheme in _LOCAL:
                from pyiceberg.io.fsspec import FsspecFileIO

                io = FsspecFileIO(self.properties)
            else:  # pyiceberg's own choice, as if this class had not been named
                chosen = {k: v for k, v in self.properties.items() if k != PY_IO_IMPL}
                io = load_file_io(chosen, location)
            self._by_scheme[scheme] = io
        return io

    def new_input(self, location: str) -> InputFile:
        return self._io(location).new_input(location)

    def new_output(self, location: str) -> OutputFile:
        return self._io(location).new_output(location)

    def delete(self, location: str | InputFile | OutputFile) -> None:
        path = location if isinstance(location, str) else location.location
        self._io(path).delete(location)


def status_properties(properties: Mapping[str, str]) -> dict[str, str]:
    """Catalog ``properties`` with :class:`LocalFsspecFileIO`, unless they name a FileIO
    (``py-io-impl``) themselves: the operator's choice stands."""
    if PY_IO_IMPL in properties:
        return dict(properties)
    return {**properties, PY_IO_IMPL: f"{__name__}.{LocalFsspecFileIO.__name__}"}
