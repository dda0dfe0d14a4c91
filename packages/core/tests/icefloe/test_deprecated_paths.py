"""The old import paths of moved names work for one release, each read warning with the new
path (icefloe.convert, icefloe.coordinator, icefloe.writer, icefloe.committer)."""

from __future__ import annotations

import importlib
import re
from types import ModuleType

import pytest

from icefloe import errors, hookspecs
from icefloe.commit import committer
from icefloe.coordination import coordinator, settings, writer
from icefloe.records import conform, converter

# home -> the names icefloe.convert had that now live there
CONVERT = {
    hookspecs: "CASE_INSENSITIVE_KEY INFER_ALL_KEY failing_prefix_end",
    errors: "record_error",
    conform: "conform mapped_names table_name_mapping",
    converter: "CONVERTER_OPTIONS Conversion RecordConverter Rejected TargetTable decode_hint "
    "filter_context kafka_context renamed",
}
MOVED = [
    *[("icefloe.convert", name, home) for home, names in CONVERT.items() for name in names.split()],
    ("icefloe.coordinator", "Coordinator", coordinator),
    ("icefloe.coordinator", "CoordinatorSettings", settings),
    ("icefloe.writer", "WriterClient", writer),
    ("icefloe.committer", "IcebergCommitter", committer),
]


@pytest.mark.parametrize(("old", "name", "home"), MOVED)
def test_old_path_warns_with_the_new_one_and_gives_the_same_object(
    old: str, name: str, home: ModuleType
) -> None:
    module = importlib.import_module(old)
    message = re.escape(f"{old}.{name} moved to {home.__name__}.{name}")
    with pytest.warns(DeprecationWarning, match=message):
        value = getattr(module, name)
    assert value is getattr(home, name)


def test_the_warning_points_at_the_importing_line() -> None:
    with pytest.warns(DeprecationWarning, match=r"icefloe\.commit\.committer") as caught:
        from icefloe.committer import IcebergCommitter  # noqa: F401
    assert caught[0].filename == __file__


def test_a_name_the_old_module_never_had_is_an_attribute_error() -> None:
    module = importlib.import_module("icefloe.writer")
    with pytest.raises(AttributeError, match=r"'icefloe\.writer' has no attribute"):
        _ = module.merge_positions
