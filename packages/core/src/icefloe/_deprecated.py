"""Old import paths of moved names, kept for one release (``icefloe.convert``,
``icefloe.coordinator``, ``icefloe.writer``, ``icefloe.committer``): each is a module whose
``__getattr__`` hands out the names from their new homes with a DeprecationWarning, so
third-party code keeps working and is told where to import from."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from types import ModuleType
from typing import Any


def moved_attribute(old: str, name: str, homes: Mapping[str, ModuleType]) -> Any:
    """``name`` of the old module ``old``, taken from its home in ``homes`` with a
    DeprecationWarning that names the new path (reported at the line that read it); an
    AttributeError for a name the old module never had."""
    home = homes.get(name)
    if home is None:
        raise AttributeError(f"module {old!r} has no attribute {name!r}")
    warnings.warn(
        f"{old}.{name} moved to {home.__name__}.{name}: import it from there "
        f"({old} is removed in the next release)",
        DeprecationWarning,
        stacklevel=3,  # past this function and the old module's __getattr__
    )
    return getattr(home, name)
