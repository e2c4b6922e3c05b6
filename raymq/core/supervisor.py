"""Supervisor: an actor's long-lived asyncio tasks never die from an exception.

A task that raises is logged with its owner (the queue or consumer), counted and started
again after a backoff; the count and the last error show in the owner's statistics. Only
cancellation ends a supervised task (the owner closing).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

#: First and longest wait before a task that raised is started again (seconds).
RESTART_BACKOFF_SECONDS = 0.1
RESTART_BACKOFF_MAX_SECONDS = 5.0
#: ``cancel_all`` cancels a task that has not ended again this often (seconds), this
#: many times at most, then gives up on it (logged). A cancel can be lost: in Python
#: 3.11 ``asyncio.wait_for`` returns a result that arrived as it was cancelled
#: (CPython gh-86296), and the task goes on; waiting for it held a queue's close, and
#: the broker's stop, for ever.
CANCEL_AGAIN_SECONDS = 0.1
CANCEL_ATTEMPTS = 50


@dataclass(frozen=True)
class SupervisorStats:
    """Restarts of an owner's tasks (counts) and the last error, ``""`` if none."""

    task_restarts: int
    last_task_error: str


class Supervisor:
    """Runs an owner's long-lived tasks, restarting any that raises."""

    def __init__(self, owner: str, log: logging.Logger):
        """``owner`` names what the tasks belong to in logs (``"queue 'orders'"``)."""
        self.owner = owner
        self._log = log
        self._tasks: dict[str, asyncio.Task] = {}
        self.restarts = 0
        self.last_error = ""

    def spawn(self, name: str, run: Callable[[], Awaitable[None]]) -> asyncio.Task:
        """Start ``run()`` as task ``name`` on the running loop; if it raises, log and
        count it and call ``run()`` again after a backoff. A ``run()`` that returns is
        done."""
        task = asyncio.get_running_loop().create_task(self._keep(name, run))
        self._tasks[name] = task
        return task

    async def _keep(self, name: str, run: Callable[[], Awaitable[None]]) -> None:
        backoff = RESTART_BACKOFF_SECONDS
        while True:
            try:
                await run()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.restarts += 1
                self.last_error = f"{name}: {exc!r}"
                self._log.exception(
                    "%s: task %s failed (restart %d in %.1f s)",
                    self.owner,
                    name,
                    self.restarts,
                    backoff,
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, RESTART_BACKOFF_MAX_SECONDS)

    async def cancel_all(self) -> None:
        """Cancel every task and wait until they ended; one that goes on is cancelled
        again every ``CANCEL_AGAIN_SECONDS``, and left (logged) after
        ``CANCEL_ATTEMPTS``."""
        names = {task: name for name, task in self._tasks.items()}
        pending, self._tasks = set(names), {}
        for _ in range(CANCEL_ATTEMPTS):
            if not pending:
                return
            for task in pending:
                task.cancel()
            done, pending = await asyncio.wait(pending, timeout=CANCEL_AGAIN_SECONDS)
            for task in done:  # retrieved: an error is no "never retrieved" warning
                if not task.cancelled():
                    task.exception()
        if not pending:
            return
        self._log.error(
            "%s: tasks %s still running after %d cancels; left behind",
            self.owner,
            sorted(names[t] for t in pending),
            CANCEL_ATTEMPTS,
        )

    def stats(self) -> SupervisorStats:
        """Restarts so far and the last error."""
        return SupervisorStats(self.restarts, self.last_error)


__all__ = ["Supervisor", "SupervisorStats"]
