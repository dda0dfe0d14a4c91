"""Check the documentation (run by `nox -s docs` and tests/test_docs.py).

* every relative link in README.md, CHANGELOG.md, docs/*.md, docs/backends/*.md and
  packages/*/README.md points at a file that exists;
* in those pages, every code span naming a Python object of the five packages
  (`icefloe.commit.dedupe.CommitBoundary`, `icefloe_spark.runtime.jvm.launch_early()`)
  imports, and every repository path in a code span (`tests/test_docs.py`, a glob, a
  `file.py::test` node id) exists, so a moved or renamed module cannot leave the docs behind;
* every key of icefloe.config.PipelineConfig (dotted, recursively: `coordination.branch`,
  `tables.name`) is documented in docs/configuration.md as `key`, and every key documented
  there in a table row exists;
* every ```toml example in docs/configuration.md and docs/upsert.md is a valid pipeline
  configuration.

Prints each problem and exits non-zero if there is any.
"""

from __future__ import annotations

import functools
import importlib
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
    return [
        ROOT / "README.md",
        ROOT / "CHANGELOG.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "docs" / "backends").glob("*.md")),
        *sorted((ROOT / "packages").glob("*/README.md")),
    ]


def broken_links(path: Path) -> Iterator[str]:
    """Relative links of ``path`` (outside code blocks) whose target does not exist."""
    text = _CODE_BLOCK.sub("", path.read_text())
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # a URL, mailto:, or an anchor in the same page
        file_part = target.split("#", 1)[0]
        if not (path.parent / file_part).exists():
            yield f"{_rel(path)}: broken link {target}"


# The import packages whose dotted names a code span may cite.
PACKAGES = ("icefloe", "icefloe_kafka", "icefloe_postgres", "icefloe_redis", "icefloe_spark")
_SPAN = re.compile(r"`([^`]+)`")
_DOTTED = re.compile(rf"(?:{'|'.join(PACKAGES)})(?:\.[A-Za-z_]\w*)*")
_CALL = re.compile(r"\(.*\)$")
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)
# file names with these endings are taken as repository paths even when their first part is
# not a top-level entry of the repository, so a wrong top-level folder is caught too
_FILE_SUFFIXES = {".py", ".md", ".toml", ".json", ".yaml", ".yml", ".cfg", ".txt"}

# Code spans that look like dotted names or repository paths but are neither.
NOT_NAMES = {
    "icefloe.quarantine": "the default quarantine table (an Iceberg table name)",
    "icefloe.group": "the Kafka header that carries a control record's pipeline name",
}
_GENERATED = "a file of the package `icefloe new-backend NAME` generates, not of this repository"
NOT_PATHS = {
    "src/icefloe_backend_NAME/backend.py": _GENERATED,
    "tests/test_conformance.py": _GENERATED,
}


def code_spans(path: Path) -> list[str]:
    """Inline code spans of ``path`` outside code blocks, a wrapped span joined by spaces."""
    text = _CODE_BLOCK.sub("", path.read_text())
    return [" ".join(span.split()) for span in _SPAN.findall(text)]


def dotted_name(span: str) -> str | None:
    """The dotted name a span is (a trailing call like ``(config)`` dropped), if it is one."""
    name = _CALL.sub("", span)
    if _DOTTED.fullmatch(name) and name not in NOT_NAMES:
        return name
    return None


def unresolved(name: str) -> str | None:
    """Why ``name`` does not import as a module or an attribute of one, or None if it does."""
    parts = name.split(".")
    obj: object = None
    for i, part in enumerate(parts):
        prefix = ".".join(parts[: i + 1])
        if i and hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        if i and not hasattr(obj, "__path__"):  # not a package: no submodule to import
            return f"{'.'.join(parts[:i])} has no attribute {part}"
        try:
            obj = importlib.import_module(prefix)
        except ModuleNotFoundError as exc:
            if exc.name != prefix:
                return f"importing {prefix} failed: {exc}"
            return f"no module {prefix}" if i == 0 else f"{'.'.join(parts[:i])} has no {part}"
        except Exception as exc:  # a module that fails to import is a problem, not a crash
            return f"importing {prefix} failed: {type(exc).__name__}: {exc}"
    return None


@functools.cache
def _top_level() -> frozenset[str]:
    return frozenset(entry.name for entry in ROOT.iterdir())


def repo_paths(span: str) -> Iterator[str]:
    """The words of a span that name a file or directory of the repository: a path relative
    to the root (not a URL, absolute, home, variable or ``<placeholder>`` path) that starts
    at a top-level entry of the repository or names a source or docs file."""
    top = _top_level()
    for word in span.split():
        word = word.strip("\"'(),;:")
        if "/" not in word or _SCHEME.match(word) or word[0] in "/~$" or "<" in word:
            continue
        file_part = word.split("::", 1)[0]
        if word not in NOT_PATHS and (
            file_part.split("/", 1)[0] in top or Path(file_part).suffix in _FILE_SUFFIXES
        ):
            yield word


def missing_path(word: str) -> str | None:
    """Why ``word`` (a path, a glob or a pytest node id) names nothing, or None if it does."""
    file_part, _, test = word.partition("::")
    if any(c in file_part for c in "*?["):
        return None if next(ROOT.glob(file_part.rstrip("/")), None) else "matches no file"
    target = ROOT / file_part
    if not target.exists():
        return "does not exist"
    if test:
        function = test.split("::")[-1].split("[", 1)[0]
        if not re.search(rf"^\s*(?:async )?def {re.escape(function)}\(", target.read_text(), re.M):
            return f"has no test {function}"
    return None


def reference_problems(path: Path) -> Iterator[str]:
    """Dotted names of the five packages that do not import and repository paths that do not
    exist, in ``path``'s code spans."""
    rel = _rel(path)
    for span in code_spans(path):
        name = dotted_name(span)
        if name is not None:
            why = unresolved(name)
            if why:
                yield f"{rel}: `{span}` does not resolve ({why})"
            continue
        for word in repo_paths(span):
            why = missing_path(word)
            if why:
                yield f"{rel}: path `{word}` {why}"


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
    found += [p for path in markdown_files() for p in reference_problems(path)]
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
