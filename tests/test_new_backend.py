"""`icefloe new-backend NAME` generates a package that is ruff- and mypy-clean, registers its
backend by entry point, and whose wired conformance suite runs and fails with clear "not
implemented" messages until the author writes the backend."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from icefloe.channel import CONTRACT_VERSION
from icefloe.cli.new_backend import core_pin, generate
from icefloe.errors import ConfigError


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    parent = tmp_path_factory.mktemp("gen")
    out = subprocess.run(
        [sys.executable, "-m", "icefloe", "new-backend", "my_store", "--directory", str(parent)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    root = parent / "icefloe-backend-my-store"
    assert str(root) in out.stdout
    return root


def _run(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=root, env=env, timeout=600
    )


def test_generated_package_has_the_entry_point_and_registers_the_backend(package: Path) -> None:
    meta = tomllib.loads((package / "pyproject.toml").read_text())
    assert meta["project"]["entry-points"]["icefloe"] == {
        "my_store": "icefloe_backend_my_store.plugin"
    }
    # the core releases of this contract; the contract declared as a number, not the constant
    assert meta["project"]["dependencies"][0] == f"icefloe-core{core_pin()}"
    assert f"icefloe-core[test]{core_pin()}" in meta["project"]["optional-dependencies"]["test"]
    plugin = (package / "src/icefloe_backend_my_store/plugin.py").read_text()
    assert f"contract={CONTRACT_VERSION}\n" in plugin
    probe = (
        "from icefloe.plugins.manager import new_plugins\n"
        "import icefloe_backend_my_store.plugin as p\n"
        "plugins = new_plugins(autoload=False)\n"
        "plugins.pm.register(p)\n"
        "spec = plugins.backend('my_store')\n"
        f"assert spec.contract == {CONTRACT_VERSION}\n"
        "import pydantic\n"
        "try:\n"
        "    spec.config_model.model_validate({'url': 'x', 'typo': 1})\n"
        "except pydantic.ValidationError:\n"
        "    print('forbids unknown keys')\n"
    )
    out = _run(package, "-c", probe)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "forbids unknown keys"


def test_generated_code_is_ruff_and_mypy_clean(package: Path) -> None:
    for args in (("check", "."), ("format", "--check", ".")):
        out = _run(package, "-m", "ruff", *args)
        assert out.returncode == 0, out.stdout + out.stderr
    out = _run(package, "-m", "mypy", "--strict", "src", "tests")
    assert out.returncode == 0, out.stdout + out.stderr


def test_generated_conformance_suite_runs_and_fails_with_not_implemented(package: Path) -> None:
    junit = package / "junit.xml"
    out = _run(
        package,
        *("-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "icefloe.testing.fixtures"),
        *(f"--junitxml={junit}", "tests"),
    )
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-2000:]
    cases = list(ET.parse(junit).getroot().iter("testcase"))
    assert len(cases) >= 20, out.stdout[-2000:]
    for case in cases:
        failure = case.find("failure")
        assert failure is not None, f"{case.get('name')} passed against a stub"
        text = (failure.get("message") or "") + (failure.text or "")
        assert "icefloe_backend_my_store: " in text, text[:800]
        assert "is not implemented yet" in text, text[:800]


def test_bad_names_and_existing_directories_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a valid backend name"):
        generate("My-Store", tmp_path)
    generate("ok", tmp_path)
    with pytest.raises(ConfigError, match="already exists"):
        generate("ok", tmp_path)


def test_core_pin_is_the_minor_release_line_before_1_0_and_the_major_one_after() -> None:
    assert core_pin("0.2.0") == ">=0.2,<0.3"
    assert core_pin("1.4.2") == ">=1.4,<2"
    assert core_pin("0.0.0+unknown") == ">=0.0,<0.1"
