"""TaskResultsActor: the broker's store of task statuses and results, as a Ray actor.

One detached, named actor per broker (``raymq.task_results``), on the broker's node,
started by the broker when a task consumer or producer first asks for it and ended with
the broker. It wraps ``raymq.storage.task_results.TaskResults`` (a SQLite file in
``<paging_directory>/.tasks``). Calls that arrive while a commit is under way wait for
the next one and share it (group commit: one fsync for all, as the queue's own writer
does); each is answered once its commit is on disk. Expired results are deleted as it
goes. Restarted by Ray if it dies, it opens the same file: nothing it answered is lost.

A task's start and finish, a replica's two calls for every task, come over the wire's
results protocol (``raymq.wire.results``, served from ``results_endpoint``) rather than
as Ray calls, which cost ten times the CPU; the rest are Ray calls.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import ray

from raymq.core.tasks import BATCHED, StoreLocation, TaskRecord
from raymq.errors import InvalidSetting
from raymq.storage.task_results import TASKS_DIRECTORY, TaskResults
from raymq.wire.client import Endpoint
from raymq.wire.results import ResultsServer

#: Expired results are deleted at most this often (seconds).
EXPIRE_PERIOD_SECONDS = 60.0


@ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=1000)
class TaskResultsActor:
    """The Ray shell around ``TaskResults``: calls gathered into shared commits."""

    def __init__(self, paging_directory: str):
        self.store = TaskResults(os.path.join(paging_directory, TASKS_DIRECTORY))
        self._waiting: list[tuple[str, tuple, asyncio.Future]] = []
        self._committing: asyncio.Task | None = None
        self._expired_at = time.monotonic()
        self.expired = 0  # results deleted after their TTL
        self.commits = 0  # transactions (fsyncs)
        self.calls = 0  # calls they carried
        self._results: ResultsServer | None = None  # the results protocol, once asked for
        self._endpoint: Endpoint | None = None
        self._listening: asyncio.Lock | None = None

    async def start(self, task_id: str, name: str, ttl_seconds: float) -> TaskRecord:
        """See ``TaskResults.start``."""
        return await self._call("start", (task_id, name, ttl_seconds))

    async def finish(self, task_id: str, name: str, ttl_seconds: float, status: str, *rest: Any):
        """See ``TaskResults.finish`` (``rest``: result, error type, error, traceback)."""
        return await self._call("finish", (task_id, name, ttl_seconds, status, *rest))

    async def cancel(self, task_id: str, ttl_seconds: float) -> bool:
        """See ``TaskResults.cancel``."""
        return await self._call("cancel", (task_id, ttl_seconds))

    async def get(self, task_id: str) -> TaskRecord | None:
        """See ``TaskResults.get``."""
        return await self._call("get", (task_id,))

    def locate(self) -> StoreLocation:
        """Where the store is: this node, the file's absolute path, its id (for
        ``raymq.serve.status_reads``, which reads it directly on this node)."""
        node_id = ray.get_runtime_context().get_node_id()
        return StoreLocation(node_id, os.path.abspath(self.store.path), self.store.store_id)

    async def counts(self) -> dict[str, Any]:
        """See ``TaskResults.counts``; with this actor's commits, calls and expired, and
        the calls that came over the wire (``wire_calls``)."""
        counts = await self._call("counts", ())
        wire = 0 if self._results is None else self._results.requests
        return {
            **counts,
            "commits": self.commits,
            "calls": self.calls,
            "expired": self.expired,
            "wire_calls": wire,
        }

    async def results_endpoint(self) -> Endpoint:
        """Where the results protocol is served: (host, port, secret), listening from
        the first time it is asked for."""
        if self._listening is None:
            self._listening = asyncio.Lock()
        async with self._listening:  # (two first callers: one server)
            if self._endpoint is None:
                server = ResultsServer(self._call)
                self._endpoint = await server.start(ray.util.get_node_ip_address())
                self._results = server
        return self._endpoint

    async def batch(self, calls: list[tuple[str, tuple]]) -> list[Any]:
        """Several calls (``raymq.core.call_batcher``), answered together: each one's
        answer, or its exception as a value. Only ``BATCHED`` calls may be batched."""
        for name, _ in calls:
            if name not in BATCHED:
                raise InvalidSetting(f"task results: {name!r} cannot be batched")
        return await asyncio.gather(
            *(self._call(name, tuple(args)) for name, args in calls), return_exceptions=True
        )

    async def _call(self, name: str, args: tuple) -> Any:
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((name, args, future))
        if self._committing is None or self._committing.done():
            self._committing = asyncio.ensure_future(self._commit_all())
        answer = await future
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def _commit_all(self) -> None:
        """Commit what waits, in batches, until nothing does."""
        while self._waiting:
            batch, self._waiting = self._waiting, []
            calls = [(name, args) for name, args, _ in batch]
            now = time.monotonic()
            if now - self._expired_at >= EXPIRE_PERIOD_SECONDS:
                self._expired_at = now
                calls.append(("expire", ()))
            try:  # (SQLite off the event loop: calls keep arriving meanwhile)
                answers = await asyncio.to_thread(self.store.apply, calls)
            except Exception as exc:  # noqa: BLE001 - the file failed: every caller hears
                answers = [exc] * len(calls)
            self.commits += 1
            self.calls += len(batch)
            if len(answers) > len(batch) and isinstance(answers[-1], int):
                self.expired += answers[-1]
            for (_, _, future), answer in zip(batch, answers, strict=False):
                if not future.done():
                    future.set_result(answer)
