"""ReadLeaseActor: the driver's stand-in for a ``raymq.data.QueueReader``'s lease.

Not detached: Ray ends it with the driver (or job) that made it, however that ends.
The queue actor watches it as it watches a TargetList (``until_closed`` kept pending,
``ping`` when silent), so a reader whose driver died gives back what it held without
anyone calling ``abort()``. Read tasks report here which offsets they read, so that
``commit()`` acknowledges exactly those, whatever Ray Data retried or left unread.
"""

from __future__ import annotations

import asyncio

import numpy as np
import ray


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=1000)
class ReadLeaseActor:
    """Liveness of one reader, and the offsets its read tasks read."""

    def __init__(self) -> None:
        self._closed = asyncio.Event()
        self._read: list[np.ndarray] = []

    def ping(self) -> bool:
        """Liveness check by the queue actor."""
        return True

    async def until_closed(self) -> None:
        """Returns when the reader commits or aborts; fails when this actor dies."""
        await self._closed.wait()

    def read(self, offsets: np.ndarray) -> None:
        """A read task read these offsets (again, if Ray Data retried it)."""
        self._read.append(np.asarray(offsets, dtype=np.int64))

    def read_offsets(self) -> np.ndarray:
        """Every offset read so far, sorted, once each."""
        if not self._read:
            return np.zeros(0, np.int64)
        return np.unique(np.concatenate(self._read))

    def close(self) -> None:
        """The reader committed or aborted: the queue stops watching."""
        self._closed.set()
