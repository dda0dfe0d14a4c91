"""The documentation checker (`nox -s docs`) passes, and it does catch what it claims to."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "docs" / "check_docs.py"


@pytest.fixture(scope="module")
def check_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_docs", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_check_passes() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().endswith("docs ok")


def test_config_keys_are_dotted_and_recursive(check_docs: ModuleType) -> None:
    keys = check_docs.config_keys()
    for key in ("name", "coordination.commit_interval_s", "tables.name", "source.kafka"):
        assert key in keys
    assert "catalog.properties" in keys
    assert len(keys) == len(set(keys))


def test_checker_reports_missing_stale_and_invalid(check_docs: ModuleType, tmp_path: Path) -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    doc = tmp_path / "configuration.md"
    doc.write_text(
        text.replace("`coordination.branch`", "`coordination.brnch`")
        + "\n```toml\nname = 'x'\n```\n"
        + "\n[gone](nowhere.md) [web](https://example.com) [here](#secrets)\n"
    )
    found = list(check_docs.config_doc_problems(doc))
    assert any("`coordination.branch` is not documented" in p for p in found), found
    assert any("`coordination.brnch`, which is not a configuration key" in p for p in found)
    assert any("is not a valid configuration" in p and "source" in p for p in found), found
    links = list(check_docs.broken_links(doc))
    assert f"{doc}: broken link nowhere.md" in links
    assert not [link for link in links if "example.com" in link or "#secrets" in link]
