"""What Spark's Python workers freeze after their tasks (icefloe_spark.runtime.workergc)."""

from __future__ import annotations

import gc
import importlib
import sys
import types
from collections.abc import Iterator, Sequence

import pytest

from icefloe_spark.runtime import workergc

pytestmark = pytest.mark.unit


@pytest.fixture
def fresh_worker() -> Iterator[None]:
    """The module as a new worker process has it; this process's collector as it was after."""
    importlib.reload(workergc)
    try:
        yield
    finally:
        gc.unfreeze()
        importlib.reload(workergc)


def unfrozen(objects: Sequence[object]) -> int:
    """How many of ``objects`` a full collection would still walk."""
    walked = {id(o) for o in gc.get_objects()}
    return sum(id(o) in walked for o in objects)


def test_a_later_task_that_imports_more_is_frozen_too(
    fresh_worker: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker whose first task was the source's read (few imports) and a later one the
    sink's write (pyiceberg, the catalog) must not leave what the write loaded to every later
    collection: freezing after the first task only did (found by profiling bench_e2e.py)."""
    first = [[i] for i in range(1000)]
    workergc.freeze_new()  # the first task: a read
    assert unfrozen(first) == 0
    module = types.ModuleType("icefloe_test_loaded_by_a_later_task")
    loaded = [[i] for i in range(1000)]
    module.objects = loaded  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    workergc.freeze_new()  # a later task: a write that imported more
    assert unfrozen(loaded) == 0


def test_a_task_that_imports_nothing_new_collects_nothing(
    fresh_worker: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tasks of a warm worker leave the collecting to PySpark's own after-task collection:
    no second full collection per task."""
    workergc.freeze_new()
    collections: list[int] = []

    def counted(*_: object) -> int:
        collections.append(1)
        return 0

    monkeypatch.setattr(gc, "collect", counted)
    later = [[i] for i in range(100)]
    workergc.freeze_new()
    assert collections == []
    assert unfrozen(later) == len(later)  # a task's own objects are not frozen
