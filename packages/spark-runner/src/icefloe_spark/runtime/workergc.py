"""Keep Spark's per-task garbage collection from walking everything a Python worker imported.

PySpark's worker daemon runs a full ``gc.collect()`` after every task of a reused worker. Once
a worker has imported pyarrow, pyiceberg, pandas and icefloe and loaded a catalog, it holds
about 200,000 tracked objects, and each of those collections walks them all: 0.1-0.3 s of CPU
per task here, as much as the task's own reading, decoding and writing of 25,000 records.
Moving what a task left alive (modules, the catalog, pooled consumers) into the permanent
generation with :func:`gc.freeze` takes it out of every later walk; garbage that later tasks
make is still collected as before.

Not only after a worker's first task: one worker runs tasks of both kinds, the source's read
(which imports little) and the sink's write (pyiceberg, the catalog's SQLAlchemy: ~78,000 more
long-lived objects). Freezing only after the first task left a worker that began with a read
walking the write's objects after every later task (40-50 ms each, measured in the workers of
a ``benchmarks/bench_e2e.py`` run). So a task freezes again whenever modules were imported
since the last freeze: imports are what make the long-lived objects, and counting modules
costs nothing.
"""

from __future__ import annotations

import gc
import sys
import threading

_lock = threading.Lock()
_modules_at_freeze = 0


def freeze_new() -> None:
    """After a task: if modules were imported since the last freeze (always after the first
    task), collect the garbage, then freeze what is left."""
    global _modules_at_freeze
    with _lock:
        if len(sys.modules) == _modules_at_freeze:
            return
        gc.collect()
        gc.freeze()
        _modules_at_freeze = len(sys.modules)
