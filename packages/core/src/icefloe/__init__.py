"""icefloe: exactly-once, centrally coordinated commits of streaming data into Apache Iceberg."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("icefloe-core")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without install
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
