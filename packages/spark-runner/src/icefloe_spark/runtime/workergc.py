"""Keep Spark's per-task garbage collection from walking everything a Python worker imported.

PySpark's worker daemon runs a full ``gc.collect()`` after every task of a reused worker. Once
a worker has imported pyarrow, pyiceberg, pandas and icefloe and loaded a catalog, it holds
about 200,000 tracked objects, and each of those collections walks them all: 0.1-0.3 s of CPU
per task here, as much as the task's own reading, decoding and writing of 25,000 records.
Moving what the first task left alive (modules, the catalog, pooled consumers) into the
permanent generation with :func:`gc.freeze` takes it out of every later walk; garbage that
later tasks make is still collected as before.
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_frozen = False


def freeze_once() -> None:
    """After a worker's first task: collect its garbage, then freeze what is left."""
    global _frozen
    with _lock:
        if _frozen:
            return
        gc.collect()
        gc.freeze()
        _frozen = True
