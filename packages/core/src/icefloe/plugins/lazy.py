"""Lazy package attributes (PEP 562) for plugin packages.

Every CLI command loads every installed plugin through its entry point, which imports the
plugin's package; a backend package that imported its client library on import (psycopg's
pool, redis-py's asyncio client) made `icefloe status` on a Redis pipeline pay for PostgreSQL.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_exports(package: str, sources: Mapping[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` that imports ``name`` from ``sources[name]`` on first use."""

    def __getattr__(name: str) -> object:  # noqa: N807 (the name PEP 562 looks up)
        module = sources.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__
