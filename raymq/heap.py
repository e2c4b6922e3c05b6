"""A broker process's start-up heap, kept out of Python's full collections.

After its imports a queue actor's process holds a few hundred thousand objects of Ray,
pyarrow, numpy and RayMQ that live as long as the process. A full (generation 2)
collection walks all of them: 50-75 ms on these machines (measured with
``gc.callbacks``), during which the process serves nothing. One such pause in a queue
actor stalls every send and delivery of the queue for its length: at 1,000 msg/s that
alone is the p99 of a 4-second run. ``gc.freeze`` moves the objects alive at the call
into a permanent generation that collections skip; objects made later are collected as
before. It costs no time (it links two lists), so it is called again after each start
that imported more. ``gc.get_freeze_count`` is not free: it walks the permanent
generation, 7 ms for a TargetList's 78,000 objects (measured; it was a new consumer's
largest cost), so it is left to tests.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Move every object tracked now into the collector's permanent generation (so full
    collections no longer walk them). Call it once a process's imports and start are
    done."""
    gc.freeze()


__all__ = ["freeze_startup_heap"]
