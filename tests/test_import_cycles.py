"""tools/import_cycles.py finds every cycle, also one that only an import inside a function or
under ``if TYPE_CHECKING:`` closes, and passes a tree without one."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "import_cycles.py"


@pytest.fixture(scope="module")
def tool() -> dict[str, Any]:
    """The script's functions (run under another name than ``__main__``: main() does not run)."""
    return runpy.run_path(str(SCRIPT))


def test_components_of_several_modules_or_a_self_import(tool: dict[str, Any]) -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}, "f": {"d"}}
    assert tool["strongly_connected"](edges) == [["a", "b", "c"], ["e"]]
    assert tool["strongly_connected"]({"a": {"b"}, "b": set()}) == []


def test_deferred_and_type_checking_imports_count(
    tool: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "cyclic_example"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from cyclic_example import b\n"
    )
    (package / "b.py").write_text("def f() -> None:\n    from cyclic_example import a\n")
    (package / "c.py").write_text("from cyclic_example import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "cyclic_example", raising=False)
    cycles, _, _ = tool["import_cycles"]("cyclic_example")
    assert cycles == [["cyclic_example.a", "cyclic_example.b"]]
