"""TargetListActor: one Ray actor per consumer, wrapping ``raymq.core.target_list.TargetList``.

Placed by ``raymq.placement`` on the consumer's node so that the delivery batches it
references are read from the local object store without a copy. It is owned by the
process that created the consumer, so it dies with it; the queue actor notices (it pings
consumers it has not heard from) and delivers what it held again.

Its eager loader keeps the direct references filled up to the high watermark: from the
PendingCache first, else by fetching from the queue actor, whose batches it owns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

import numpy as np
import ray
from raymq.actors.queue_actor import queue_actor_name

from raymq import metrics
from raymq.core.supervisor import Supervisor
from raymq.core.target_list import DirectEntry, TargetList
from raymq.errors import ConsumerClosed

log = logging.getLogger("raymq.consumer")

#: Longest one fetch waits in the queue actor (seconds); the loader simply asks again.
LOADER_POLL_SECONDS = 1.0
#: Wait before the loader asks again after an unexpected error (seconds).
LOADER_ERROR_BACKOFF_SECONDS = 1.0
#: How long ``close`` keeps asking a restarting queue actor (seconds).
CLOSE_RETRY_SECONDS = 30.0


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=64)
class TargetListActor:
    """The Ray shell of one consumer's TargetList."""

    def __init__(self):
        # Created blank, as a warm spare (``raymq.placement.spares``): starting a
        # worker process takes most of a second, so a consumer takes a spare already
        # running and ``start`` gives it its queue and settings.
        self.queue_actor = None
        self.queue = ""
        self.consumer_id = ""
        self.prefetch = 0
        self.selector: str | None = None
        self.targets = TargetList(0, 0, 0)
        self._filled = asyncio.Event()
        self._space = asyncio.Event()
        self._loader: asyncio.Task | None = None
        self._metrics: asyncio.Task | None = None
        self._closed = False
        self._closed_event = asyncio.Event()
        self.loader_error: str | None = None
        self._refused: ConsumerClosed | None = None
        self._tasks: Supervisor | None = None
        #: The loader's fetch under way (its small (offsets, bytes) result), if any.
        self._in_flight = None

    def ready(self) -> bool:
        """True once the process is up (a spare is warm)."""
        return True

    async def start(
        self,
        queue_actor,
        queue: str,
        consumer_id: str,
        prefetch: int,
        selector: str | None,
        high_watermark: int,
        high_watermark_bytes: int,
        pending_cache_bytes: int,
    ) -> None:
        """Become the TargetList of ``consumer_id``: register with the queue (it may
        check our liveness) and start eager loading."""
        self.queue_actor = queue_actor
        self.queue = queue
        self.consumer_id = consumer_id
        self.prefetch = prefetch
        self.selector = selector
        self.targets = TargetList(high_watermark, high_watermark_bytes, pending_cache_bytes)
        await self._register()
        self._tasks = Supervisor(f"consumer {consumer_id} of queue {queue!r}", log)
        self._loader = self._tasks.spawn("eager loader", self._eager_load)
        self._metrics = self._tasks.spawn("metrics", self._export_metrics)

    async def _register(self) -> None:
        """Register with the queue actor, handing it this actor's handle: it watches
        for our death to deliver again what we held."""
        me = ray.get_runtime_context().current_actor
        await self.queue_actor.register_consumer.remote(
            self.consumer_id, self.prefetch, self.selector, me
        )

    async def _export_metrics(self) -> None:
        """Every ``metrics.EXPORT_PERIOD_SECONDS`` until closed, set this consumer's
        levels (``raymq.metrics``); its lag is exported by the queue actor."""
        node_id = ray.get_runtime_context().get_node_id()
        broker = ray.get_runtime_context().namespace
        with metrics.guard(f"consumer {self.consumer_id}"):
            queue_id = self.queue_actor._actor_id.hex()
            name = queue_actor_name(self.queue)
            broker = await asyncio.to_thread(metrics.broker_of, name, queue_id)
        while not self._closed:
            with metrics.guard(f"consumer {self.consumer_id}"):
                stats = self.targets.stats()
                metrics.export_consumer(self.consumer_id, self.queue, stats, node_id, broker)
            await asyncio.sleep(metrics.EXPORT_PERIOD_SECONDS)

    async def _eager_load(self) -> None:
        """Raise the watermark toward the high watermark, forever."""
        while not self._closed:
            room = self.targets.room()
            if room <= 0:
                self._space.clear()
                await self._space.wait()
                continue
            if self.targets.load_from_pending():
                self._filled.set()
                continue
            try:
                if self.loader_error is not None:
                    # The queue actor restarted: register again so that it watches us.
                    await self._register()
                meta_ref, batch_ref = self.queue_actor.fetch_batch.options(num_returns=2).remote(
                    self.consumer_id, room, LOADER_POLL_SECONDS, self.prefetch, self.selector
                )
                self._in_flight = meta_ref
                offsets, nbytes = await meta_ref
                self._in_flight = None
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                self.loader_error = f"queue {self.queue!r} unavailable: {exc}"
                await asyncio.sleep(0.5)  # the queue actor restarts; ask again
                continue
            except ray.exceptions.RayTaskError as exc:
                if isinstance(exc.cause, ConsumerClosed):
                    self._refused = exc.cause  # the queue closed us: say so to receive()
                    self._filled.set()
                    return
                # Never let the loader die silently: log, show in stats, ask again.
                self.loader_error = f"queue {self.queue!r}: {exc.cause!r}"
                log.warning("consumer %s: fetch failed: %s", self.consumer_id, self.loader_error)
                await asyncio.sleep(LOADER_ERROR_BACKOFF_SECONDS)
                continue
            self.loader_error = None
            if len(offsets):
                self.targets.loaded(DirectEntry(batch_ref, offsets, nbytes))
                self._filled.set()

    async def take(self, max_messages: int, timeout: float) -> list[tuple[object, int, int]]:
        """Up to ``max_messages`` as (batch reference, first row, rows), waiting up to
        ``timeout`` seconds for the first."""
        if not self.targets.direct and self._refused is None:
            self._filled.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._filled.wait(), max(timeout, 0.0))
        out = self.targets.take(max_messages)
        if not out and self._refused is not None:
            raise self._refused
        if out:
            self._space.set()
        return out

    async def set_high_watermark(self, messages: int, max_bytes: int) -> int:
        """Change the high watermark; returns how many messages went back to the queue."""
        return await self._give_back(self.targets.set_high_watermark(messages, max_bytes))

    async def set_budget(self, direct_bytes: int, pending_bytes: int) -> int:
        """The MemoryGovernor's budget (bytes of direct references, of PendingCache);
        returns how many messages went back to the queue (as CacheReferences)."""
        return await self._give_back(self.targets.set_budget(direct_bytes, pending_bytes))

    async def _give_back(self, released: np.ndarray) -> int:
        if len(released):
            await self.queue_actor.give_back.remote(self.consumer_id, released)
        self._space.set()
        return len(released)

    def usage(self) -> dict:
        """Bytes held and wanted, for the MemoryGovernor."""
        return {"consumer_id": self.consumer_id, **self.targets.usage()}

    async def stats(self) -> dict:
        """The TargetList's levels and the queue's view of this consumer."""
        queue_side = await self.queue_actor.consumer_stats.remote(self.consumer_id)
        return {
            "consumer_id": self.consumer_id,
            "queue": self.queue,
            "node_id": ray.get_runtime_context().get_node_id(),
            **self.targets.stats(),
            **queue_side,
            "loader_error": self.loader_error,
            "task_restarts": 0 if self._tasks is None else self._tasks.restarts,
        }

    async def close(self, not_received: np.ndarray | None) -> int:
        """Stop loading and give back everything not acknowledged; returns how many."""
        self._closed = True
        self._closed_event.set()
        if self._loader is not None:
            self._loader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._loader
        rest = self.targets.drain()
        fetched = await self._unreceived_fetch()
        if len(fetched):  # taken for us by the queue, never seen by the application
            rest = np.concatenate([rest, fetched])
        if not_received is not None and len(not_received):
            rest = np.concatenate([np.asarray(not_received, dtype=np.int64), rest])
        deadline = time.monotonic() + CLOSE_RETRY_SECONDS
        while True:
            try:
                return await self.queue_actor.close_consumer.remote(self.consumer_id, rest)
            except ray.exceptions.ActorUnavailableError:
                # Cut by a restart of the queue actor: ask the restarted one (it forgot
                # what we held, so this only unregisters us).
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
            except ray.exceptions.RayActorError:
                return 0  # the queue is gone for good (deleted): nothing to give back

    async def _unreceived_fetch(self) -> np.ndarray:
        """Offsets of the fetch the loader had under way when it was cancelled: the queue
        counts them as held by us, so they are given back as not received (else their
        delivery count would rise without any application having seen them)."""
        ref, self._in_flight = self._in_flight, None
        if ref is None:
            return np.zeros(0, dtype=np.int64)
        try:
            offsets, _nbytes = await asyncio.wait_for(ref, LOADER_POLL_SECONDS + 5.0)
        except Exception:  # the queue restarted or is slow: it forgot or counts them
            return np.zeros(0, dtype=np.int64)
        return np.asarray(offsets, dtype=np.int64)

    def ping(self) -> bool:
        """Liveness check by the queue actor."""
        return True

    async def until_closed(self) -> None:
        """Returns when the consumer closes. The queue actor keeps one call pending: Ray
        fails it the moment this actor dies, which is how the queue learns of it."""
        await self._closed_event.wait()

    def pid(self) -> int:
        """This actor's process id (benchmarks sample its memory)."""
        return os.getpid()
