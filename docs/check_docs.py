"""Check the documentation (run by `nox -s docs` and tests/test_docs.py).

* every relative link in README.md and docs/*.md points at a file that exists;
* every key of icefloe.config.PipelineConfig (dotted, recursively: `coordination.branch`,
  `tables.name`) is documented in docs/configuration.md as `key`, and every key documented
  there in a table row exists;
* every ```toml example in docs/configuration.md and docs/upsert.md is a valid pipeline
  configuration.

Prints each problem and exits non-zero if there is any.
"""

from __future__ import annotations

import re
import sys
import tomllib
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from icefloe.config import PipelineConfig, config_from_dict
from icefloe.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
CONFIG_DOC = ROOT / "docs" / "configuration.md"
_LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_CODE_BLOCK = re.compile(r"```.*?```", re.S)
_ROW_KEY = re.compile(r"^\|\s*`([a-z_][a-z0-9_.<>]*)`\s*\|", re.M)
_TOML_BLOCK = re.compile(r"```toml\n(.*?)```", re.S)


def _rel(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def broken_links(path: Path) -> Iterator[str]:
    """Relative links of ``path`` (outside code blocks) whose target does not exist."""
    text = _CODE_BLOCK.sub("", path.read_text())
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # a URL, mailto:, or an anchor in the same page
        file_part = target.split("#", 1)[0]
        if not (path.parent / file_part).exists():
            yield f"{_rel(path)}: broken link {target}"


def _models_in(annotation: Any) -> Iterator[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
        return
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is not None:
        for arg in typing.get_args(annotation):
            yield from _models_in(arg)


def config_keys(model: type[BaseModel] = PipelineConfig, prefix: str = "") -> list[str]:
    """Every field of ``model`` and its sub-models as dotted keys (list items share the list's
    key: ``tables.name``)."""
    keys = []
    for name, info in model.model_fields.items():
        key = prefix + name
        keys.append(key)
        for sub in _models_in(info.annotation):
            keys.extend(config_keys(sub, key + "."))
    return keys


def config_doc_problems(doc: Path = CONFIG_DOC) -> Iterator[str]:
    """Undocumented keys, documented keys that do not exist, invalid TOML examples."""
    text = doc.read_text()
    rel = _rel(doc)
    known = config_keys()
    for key in known:
        if f"`{key}`" not in text:
            yield f"{rel}: configuration key `{key}` is not documented"
    for key in _ROW_KEY.findall(text):
        if key not in known and "<" not in key:
            yield f"{rel}: documents `{key}`, which is not a configuration key"
    yield from example_problems(doc)


# other pages whose ```toml examples must be valid pipeline configurations too
EXAMPLE_DOCS = (ROOT / "docs" / "upsert.md",)


def example_problems(doc: Path) -> Iterator[str]:
    """Invalid TOML examples of ``doc``."""
    for i, block in enumerate(_TOML_BLOCK.findall(doc.read_text()), 1):
        try:
            config_from_dict(tomllib.loads(block))
        except (tomllib.TOMLDecodeError, ConfigError) as exc:
            yield f"{_rel(doc)}: TOML example {i} is not a valid configuration: {exc}"


def problems() -> list[str]:
    found = [p for path in markdown_files() for p in broken_links(path)]
    for doc in EXAMPLE_DOCS:
        if doc.exists():
            found.extend(example_problems(doc))
    if CONFIG_DOC.exists():
        found.extend(config_doc_problems())
    else:
        found.append(f"{_rel(CONFIG_DOC)} is missing")
    return found


def main() -> int:
    found = problems()
    for p in found:
        print(p)
    print(f"{len(found)} problem(s)" if found else "docs ok")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
