"""TargetListActor: one Ray actor per consumer, wrapping ``raymq.core.target_list.TargetList``.

Placed by ``raymq.placement`` on the consumer's node so that the delivery batches it
references are read from the local object store without a copy. It is owned by the
process that created the consumer, so it dies with it; the queue actor notices (it pings
consumers it has not heard from) and delivers what it held again.

Its eager loader (``raymq.core.target_list.EagerLoader``, a supervised task) keeps the
direct references filled up to the high watermark: from the PendingCache first, else by
fetching from the queue actor. How it reaches the queue, and follows it when its actor
restarts, dies, moves or is revived, is the link's business
(``raymq.core.target_list_link.TargetListLink``, Ray-free), over the queue as Ray
shows it (``raymq.actors.target_list_link.RayQueueEndpoint``). A failure that persists
(a ``StorageError`` of the queue, a queue actor away longer than a restart takes) is
raised by ``take``, so the consumer's ``receive()`` raises it instead of returning
nothing forever.

Starting: a consumer takes a warm spare (``raymq.placement.spares``) and starts it with
the first request on its DeliveryChannel (``_channel_start``), not a Ray call; the
queue actor's handle is then looked up by name only when needed (the Ray
registration that gives the queue our handle for its death watch waits for the first
delivery, at most ``WATCH_DELAY_SECONDS`` of the link; until then the queue watches the FetchChannel
instead). Each of those costs a new consumer's first message milliseconds here.

Interleaving: ``take``, ``set_budget``, ``set_high_watermark``, ``usage`` and ``stats``
may interleave with the loader at its awaits; ``close`` stops the loader first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from typing import Any

import numpy as np
import pyarrow as pa
import ray
from raymq.actors.target_list_link import RayQueueEndpoint

from raymq import metrics
from raymq.batch import offsets_of
from raymq.core.budget import ConsumerUsage
from raymq.core.link import LinkFault
from raymq.core.supervisor import Supervisor
from raymq.core.target_list import TargetList
from raymq.core.target_list_link import ConsumerSpec, StaleEndpoint, TargetListLink
from raymq.errors import BrokerUnavailable, RayMQError, ray_reason
from raymq.heap import freeze_startup_heap
from raymq.wire.delivery import BY_REFERENCE, DeliveryServer, answer_of
from raymq.wire.fetch import STALE_FETCH_ENDPOINT, InlineDelivery

log = logging.getLogger("raymq.consumer")


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=64)
class TargetListActor:
    """The Ray shell of one consumer's TargetList."""

    def __init__(self):
        # Created blank, as a warm spare (``raymq.placement.spares``): starting a
        # worker process takes most of a second, so a consumer takes a spare already
        # running and ``start`` gives it its queue and settings.
        self._starting = False  # a start under way or done (``start``)
        self.consumer_id = ""
        self.queue = ""
        self.endpoint: RayQueueEndpoint | None = None
        #: The link to the queue (``raymq.core.target_list_link``): a blank one until
        #: ``start``, with its TargetList and eager loader.
        self.link = TargetListLink(ConsumerSpec("", "", 0), None, TargetList(0, 0, 0))
        self._closed = False
        self._closed_event = asyncio.Event()
        self._tasks: Supervisor | None = None
        #: The consumer's receives come over this socket (``raymq.wire.delivery``).
        self._channel: DeliveryServer | None = None
        self.channel_lost_batches = 0  # batches lost with a restarted queue, skipped
        self._listening: asyncio.Future | None = None  # see _listen
        self.started_over = "ray"  # or "delivery channel" (``_channel_start``)
        self._me: Any = None  # this actor's own handle (``_own_handle``)

    @property
    def targets(self) -> TargetList:
        return self.link.targets

    @property
    def loader(self):
        return self.link.loader

    async def ready(self) -> tuple[str, int, str] | None:
        """Once the process is up and its DeliveryChannel listens: the channel's (host,
        port, secret), None if it could not listen. A spare is then warm: a consumer
        connects and starts it over the channel (``_channel_start``)."""
        self._own_handle()
        endpoint = await self._listen()
        freeze_startup_heap()  # no 50-75 ms full collections of it (raymq.heap)
        return endpoint

    def _own_handle(self) -> Any:
        """This actor's handle (for the queue's death watch), asked of Ray once: it
        costs 0.6-0.8 ms here, which a warm spare pays in ``ready``, not in ``start``
        on a new consumer's first message (measured)."""
        if self._me is None:
            self._me = ray.get_runtime_context().current_actor
        return self._me

    async def _listen(self) -> tuple[str, int, str] | None:
        """Open the DeliveryChannel's server, once; its (host, port, secret), None if
        it could not listen (receives then go through Ray calls)."""
        if self._listening is None:
            self._listening = asyncio.ensure_future(self._open_channel())
        return await asyncio.shield(self._listening)

    async def _open_channel(self) -> tuple[str, int, str] | None:
        server = DeliveryServer(
            self._channel_take, self._channel_give_back, "a spare", start=self._channel_start
        )
        try:
            endpoint = await server.start(ray.util.get_node_ip_address())
        except OSError as exc:
            log.warning("TargetList: no delivery channel: %s", exc)
            return None
        self._channel = server
        return endpoint

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
        subscription: str | None = None,
        fetch_endpoint: tuple[str, int, str] | None = None,
        namespace: str | None = None,
        endpoint_cached: bool = False,
    ) -> tuple[str, int, str] | str | None:
        """Become the TargetList of ``consumer_id``: register with the queue (or with
        ``subscription`` of the address ``queue``; it may check our liveness) and start
        eager loading. Returns the (host, port, secret) of this consumer's
        DeliveryChannel, None if it could not listen (receives then go through Ray).

        ``queue_actor``: the queue actor's handle; None when started over the
        DeliveryChannel (``_channel_start``): it is then looked up by name in
        ``namespace`` when first needed. An actor handle among a call's arguments
        delays the call 2-4 ms here (the receiving process looks the actor up before it
        runs the call; measured), and the lookup slows the first fetch alike: over the
        FetchChannel, it waits for the first delivery (``_watched_by_queue``).

        ``fetch_endpoint``: the queue's FetchChannel (``QueueActor.fetch_endpoint``):
        given, we register and fetch over it at once, and our actor handle reaches the
        queue (for its death watch) through Ray in the background; a first Ray call to
        the queue actor costs a new consumer about 10 ms here. ``endpoint_cached``: the
        client remembered it from an earlier consumer; if it does not answer (the queue
        actor was replaced: revived, restarted, a new leader), start does nothing and
        returns ``STALE_FETCH_ENDPOINT``, and the client asks the queue for the current
        one and starts us again.

        ``namespace``: the broker's Ray namespace, where the queue's actor is looked up
        again after it fails (None: asked of Ray while the queue actor lives).
        """
        if self._starting:  # (a start that answered STALE_FETCH_ENDPOINT sets it back)
            raise ValueError(f"consumer {self.consumer_id}: started already")
        if queue_actor is None and namespace is None:
            raise ValueError("start: the broker's namespace is needed to find the queue")
        self._starting = True
        self.queue, self.consumer_id = queue, consumer_id
        spec = ConsumerSpec(queue, consumer_id, prefetch, selector, subscription)
        self.endpoint = RayQueueEndpoint(spec, queue_actor, namespace, self._own_handle())
        targets = TargetList(high_watermark, high_watermark_bytes, pending_cache_bytes)
        self.link = TargetListLink(spec, self.endpoint, targets)
        try:
            registered = await self.link.begin(fetch_endpoint, endpoint_cached)
        except StaleEndpoint as exc:
            log.info("consumer %s: %s", consumer_id, exc)
            self._starting = False  # nothing started: the client starts us again
            return STALE_FETCH_ENDPOINT
        self._tasks = Supervisor(f"consumer {consumer_id} of queue {queue!r}", log)
        self._tasks.spawn("eager loader", self.loader.run)
        self._tasks.spawn("metrics", self._export_metrics)
        endpoint = await self._listen()  # (a warm spare listens already)
        if self._channel is not None:
            self._channel.what = f"consumer {consumer_id} of queue {queue!r}"
        try:
            if registered is not None:
                await self.link.finish_registration(registered)
        except BaseException as exc:
            # Not a consumer after all (a malformed selector, a deleted subscription, the
            # queue's actor gone while registering...).
            self.link.stop()
            await self._tasks.cancel_all()
            if self._channel is not None:
                self._channel.close()
            if isinstance(exc, LinkFault):  # a typed error for the client, not a raw one
                raise BrokerUnavailable(
                    f"consumer {consumer_id}: queue {queue!r} could not register it: {exc}"
                ) from None
            raise
        freeze_startup_heap()  # and what the start imported (the queue's modules)
        return endpoint

    async def _channel_start(self, settings: dict) -> tuple[str, int, str] | str | None:
        """``start`` for the DeliveryChannel (the consumer's first request on it): Ray's
        failures (of the queue's actor, say) become ``BrokerUnavailable``, as the
        client's Ray calls make them."""
        if self._closed:
            raise ValueError(f"consumer {self.consumer_id}: closed")
        self.started_over = "delivery channel"
        fetch_endpoint = settings.pop("fetch_endpoint", None)
        if fetch_endpoint is not None:
            fetch_endpoint = tuple(fetch_endpoint)
        try:
            return await self.start(None, **settings, fetch_endpoint=fetch_endpoint)
        except ray.exceptions.RayTaskError as exc:  # as the client's ``_unwrap``
            if isinstance(exc.cause, RayMQError | TypeError | ValueError):
                raise exc.cause from None
            error = BrokerUnavailable(f"queue {settings.get('queue')!r}: {ray_reason(exc)}")
            raise error from None
        except ray.exceptions.RayError as exc:
            raise BrokerUnavailable(f"queue {settings.get('queue')!r}: {ray_reason(exc)}") from None

    async def _channel_take(
        self, max_messages: int, timeout: float, inline_bytes: int
    ) -> pa.RecordBatch | str | None:
        """``take`` for the DeliveryChannel: the rows themselves (read here, where they
        are local), or ``BY_REFERENCE`` when more than ``inline_bytes`` are ready (the
        client takes them through Ray, without a copy); None if nothing came within
        ``timeout`` seconds. Raises what ``take`` raises."""
        await self.loader.wait(timeout)
        if self.targets.bytes_ahead(max_messages) > inline_bytes:
            return BY_REFERENCE
        entries = self.loader.take_now(max_messages)
        if not entries:
            return None
        self.link.delivered()
        lost = (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError)
        # Deliveries that came over the FetchChannel are here already; others are read
        # from the object store.
        refs = [ref for ref, _, _ in entries if not isinstance(ref, InlineDelivery)]
        read = iter(await asyncio.gather(*refs, return_exceptions=True) if refs else ())
        got = [ref if isinstance(ref, InlineDelivery) else next(read) for ref, _, _ in entries]
        parts = []  # (rows, the IPC stream they came in whole, or None)
        for (_ref, start, n), item in zip(entries, got, strict=True):
            if isinstance(item, lost):  # lost with a restarted queue (comes again)
                self.channel_lost_batches += 1
                continue
            if isinstance(item, BaseException):
                error = BrokerUnavailable(
                    f"queue {self.queue!r}: reading a delivery failed: {ray_reason(item)}"
                )
                raise error from item
            if isinstance(item, InlineDelivery):
                whole = start == 0 and n == item.batch.num_rows
                parts.append((item.batch.slice(start, n), item.stream if whole else None))
            else:
                parts.append((item.slice(start, n), None))
        if not parts:
            return None
        return answer_of(parts)

    async def channel_broke(self, answers_read: int) -> int:
        """The consumer's DeliveryChannel broke with a request under way, after it had
        read ``answers_read`` answers with messages whole: the rows of any answer the
        server wrote beyond those go back to the queue, never received (uncounted);
        returns how many messages."""
        if self._channel is None:
            return 0
        return await self._channel.give_back_unread(answers_read)

    async def _channel_give_back(self, batch: pa.RecordBatch) -> None:
        """Rows taken for a DeliveryChannel answer that could not be written."""
        await self.loader.give_back_taken(offsets_of(batch))

    async def _export_metrics(self) -> None:
        """Every ``metrics.EXPORT_PERIOD_SECONDS`` until closed, set this consumer's
        levels (``raymq.metrics``); its lag is exported by the queue actor."""
        # Not while a new consumer waits for its first message: finding the broker's
        # namespace takes GCS calls (milliseconds of this process's time here).
        await asyncio.sleep(metrics.EXPORT_PERIOD_SECONDS)
        node_id = ray.get_runtime_context().get_node_id()
        broker = ray.get_runtime_context().namespace
        with metrics.guard(f"consumer {self.consumer_id}"):
            broker = await self.endpoint.broker_namespace()
        while not self._closed:
            with metrics.guard(f"consumer {self.consumer_id}"):
                stats = self.targets.stats()
                metrics.export_consumer(self.consumer_id, self.queue, stats, node_id, broker)
            await asyncio.sleep(metrics.EXPORT_PERIOD_SECONDS)

    async def take(self, max_messages: int, timeout: float) -> list[tuple[object, int, int]]:
        """Up to ``max_messages`` as (batch reference, first row, rows), waiting up to
        ``timeout`` seconds for the first. With nothing to hand out, raises
        ``ConsumerClosed`` if the queue closed us, or the loader's persistent error (a
        ``RayMQError`` naming the queue: ``StorageError``, ``BrokerUnavailable``...)."""
        entries = await self.loader.take(max_messages, timeout)
        if entries:
            self.link.delivered()
        # Rows that came inline over the FetchChannel are in this process: put them in
        # the object store for the client (this path is the DeliveryChannel's fallback).
        out = []
        for ref, start, n in entries:
            if isinstance(ref, InlineDelivery):
                ref, start = ray.put(ref.batch.slice(start, n)), 0
            out.append((ref, start, n))
        return out

    async def set_high_watermark(self, messages: int, max_bytes: int) -> int:
        """Change the high watermark; returns how many messages went back to the queue."""
        return await self._give_back(self.targets.set_high_watermark(messages, max_bytes))

    async def set_budget(self, direct_bytes: int, pending_bytes: int) -> int:
        """The MemoryGovernor's budget (bytes of direct references, of PendingCache);
        returns how many messages went back to the queue (as CacheReferences)."""
        return await self._give_back(self.targets.set_budget(direct_bytes, pending_bytes))

    async def _give_back(self, released: np.ndarray) -> int:
        return await self.loader.give_back(released)

    def usage(self) -> ConsumerUsage:
        """Bytes held and wanted, for the MemoryGovernor."""
        return self.targets.usage(self.consumer_id)

    async def stats(self) -> dict:
        """The TargetList's levels, its link's, and the queue's view of this consumer."""
        queue_side = await self.link.queue_side()
        failures = self.loader.failures.stats()
        channel = self._channel
        return {
            "consumer_id": self.consumer_id,
            "queue": self.queue,
            "node_id": ray.get_runtime_context().get_node_id(),
            **self.targets.stats(),
            **queue_side,
            "loader_error": failures.last_error or None,
            "loader_failures": failures.failures,
            "loader_failures_total": failures.failures_total,
            "loader_error_persistent": failures.persistent,
            "task_restarts": 0 if self._tasks is None else self._tasks.restarts,
            "started_over": self.started_over,
            "delivery_channel": channel is not None,
            "delivery_channel_answers": 0 if channel is None else channel.answers,
            "delivery_channel_by_reference": 0 if channel is None else channel.by_reference,
            "delivery_channel_given_back": 0 if channel is None else channel.given_back,
            **dataclasses.asdict(self.link.stats()),
            "stale_fetches_given_back": self.loader.stale_fetches,
        }

    def use_fetch_channel(self, enabled: bool) -> None:
        """Fetch over the FetchChannel (``enabled``, the default) or through Ray calls
        only: the path before it, a baseline for ``bench/latency.py`` and the fallback
        tested. Takes effect from the next fetch."""
        self.link.use_fetch_channel(enabled)

    async def close(self, not_received: np.ndarray | None) -> int:
        """Stop loading and give back everything not acknowledged; returns how many."""
        self._closed = True
        self._closed_event.set()
        self.link.stop()
        if self._channel is not None:
            self._channel.close()
        if self._tasks is not None:  # the loader and the metrics: none left pending at kill
            await self._tasks.cancel_all()
        return await self.link.close(not_received)

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
