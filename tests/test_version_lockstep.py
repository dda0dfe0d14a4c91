"""One version for all five distributions: the root VERSION file is the single source."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path
from typing import Any

import icefloe

ROOT = Path(__file__).resolve().parent.parent
VERSION = (ROOT / "VERSION").read_text().strip()
PYPROJECTS = sorted(ROOT.glob("packages/*/pyproject.toml"))
_PIN = re.compile(r"^(icefloe-[a-z-]+)(\[[^\]]*\])?\s*(==|>=|~=|<=|!=|>|<)?\s*([^;\s]*)")


def _requirements(project: dict[str, Any]) -> list[str]:
    reqs = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        reqs.extend(extra)
    return reqs


def test_there_are_five_packages() -> None:
    assert len(PYPROJECTS) == 5, PYPROJECTS


def test_every_package_has_the_root_version() -> None:
    versions = {
        p.parent.name: tomllib.loads(p.read_text())["project"]["version"] for p in PYPROJECTS
    }
    assert versions == dict.fromkeys(versions, VERSION)


def test_every_internal_dependency_is_pinned_to_the_root_version() -> None:
    pins = []
    for path in PYPROJECTS:
        for req in _requirements(tomllib.loads(path.read_text())["project"]):
            m = _PIN.match(req)
            if m:
                pins.append((path.parent.name, req))
                assert (m[3], m[4]) == ("==", VERSION), f"{path.parent.name}: {req!r}"
    assert len(pins) >= 4, pins  # every backend and the runner pin core


def test_installed_version_is_the_root_version() -> None:
    assert icefloe.__version__ == VERSION


def test_bump_tool_leaves_a_lockstep_tree_unchanged_and_rewrites_every_pin() -> None:
    spec = importlib.util.spec_from_file_location("bump_version", ROOT / "tools/bump_version.py")
    assert spec is not None
    assert spec.loader is not None
    bump = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bump)
    for path in PYPROJECTS:
        text = path.read_text()
        assert bump.rewrite(text, VERSION) == text, path
        bumped = tomllib.loads(bump.rewrite(text, "9.8.7"))["project"]
        assert bumped["version"] == "9.8.7"
        for req in _requirements(bumped):
            m = _PIN.match(req)
            assert m is None or m[4] == "9.8.7", req


# --------------------------------------------------------------------------- the changelog

CHANGELOG = (ROOT / "CHANGELOG.md").read_text()
BACKEND_AUTHORS = (ROOT / "docs" / "backend-authors.md").read_text()


def _releases() -> dict[str, str]:
    """Release heading (``0.2.0``) -> its section of CHANGELOG.md."""
    parts = re.split(r"(?m)^## \[([^\]]+)\].*$", CHANGELOG)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_the_changelog_has_the_version_and_a_section_for_backend_authors_per_release() -> None:
    releases = _releases()
    assert VERSION in releases, "CHANGELOG.md has no section for the version in VERSION"
    for version, text in releases.items():
        if version != "Unreleased":
            assert "### For backend authors" in text, version


def test_the_release_names_the_contract_it_ships_and_each_contract_has_an_upgrade_guide() -> None:
    """Core's version moves with the backend contract: the release of VERSION states the
    contract icefloe.channel defines, and the section every refusal points to exists."""
    from icefloe.channel import CONTRACT_CHANGES, CONTRACT_VERSION, upgrade_section

    assert f"Backend contract **{CONTRACT_VERSION}**" in _releases()[VERSION]
    headings = {
        re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
        for h in re.findall(r"(?m)^#+ (.+)$", BACKEND_AUTHORS)
    }
    for version in CONTRACT_CHANGES:
        anchor = upgrade_section(version).split("#", 1)[1]
        assert anchor in headings, f"docs/backend-authors.md lacks #{anchor}"
    assert set(CONTRACT_CHANGES) == set(range(2, CONTRACT_VERSION + 1))
