"""TaskResultsActor: the broker's store of task statuses and results, as a Ray actor.

One detached, named actor per broker (``raymq.task_results``), on the broker's node,
started by the broker when a task consumer or producer first asks for it and stopped
with the broker. It wraps ``raymq.storage.task_results.TaskResults`` (a SQLite file in
the paging directory) and deletes expired results as it goes; restarted by Ray if it
dies, it opens the same file: nothing it answered is lost.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from raymq.core.tasks import TaskRecord
from raymq.storage.task_results import TaskResults

#: Expired results are deleted at most this often, on a write (seconds).
EXPIRE_PERIOD_SECONDS = 60.0


@ray.remote(num_cpus=0, max_restarts=-1)
class TaskResultsActor:
    """The Ray shell around ``TaskResults`` (one call at a time: SQLite's writer)."""

    def __init__(self, directory: str):
        self.store = TaskResults(directory)
        self._expired_at = time.monotonic()
        self.expired = 0  # results deleted after their TTL

    def pending(self, task_id: str, name: str, created_at: float, ttl_seconds: float) -> None:
        """See ``TaskResults.pending``."""
        self._expire_now_and_then()
        self.store.pending(task_id, name, created_at, ttl_seconds)

    def start(self, task_id: str, name: str, ttl_seconds: float) -> TaskRecord:
        """See ``TaskResults.start``."""
        return self.store.start(task_id, name, ttl_seconds)

    def finish(self, task_id: str, status: str, result: Any = None, **error: str | None) -> None:
        """See ``TaskResults.finish`` (``error``: error_type, error, traceback)."""
        self._expire_now_and_then()
        self.store.finish(task_id, status, result, **error)

    def cancel(self, task_id: str) -> bool:
        """See ``TaskResults.cancel``."""
        return self.store.cancel(task_id)

    def get(self, task_id: str) -> TaskRecord | None:
        """See ``TaskResults.get``."""
        return self.store.get(task_id)

    def counts(self) -> dict[str, int]:
        """See ``TaskResults.counts``."""
        return self.store.counts()

    def _expire_now_and_then(self) -> None:
        now = time.monotonic()
        if now - self._expired_at >= EXPIRE_PERIOD_SECONDS:
            self._expired_at = now
            self.expired += self.store.expire()
