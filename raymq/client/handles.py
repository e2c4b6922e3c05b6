"""Handles of a queue, an address and a subscription: send, consume, inspect.

Every call of a handle reaches the queue's current actor through its ``QueueLink``
(``raymq.core.link``): this module gives it Ray as transport and the broker as
locator."""

from __future__ import annotations

import asyncio
import datetime
import functools
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import ray

from raymq.batch import (
    MessageBatch,
    check_size,
    check_sizes,
)
from raymq.client import calls
from raymq.client.calls import _FAULTS, _call, _reason, _unwrap
from raymq.client.consumer import Consumer
from raymq.client.messages import Message, _check_count, _messages
from raymq.client.producer import MAX_BATCH_BYTES, Producer, ProducerStats
from raymq.client.send_channels import _send_channel, _send_channel_soon
from raymq.config import BrokerConfig, check_priority, check_ttl
from raymq.core.duplicate_ids import (
    DUPLICATE_ID_PROPERTY,
    check_message_id,
    check_message_ids,
    with_message_ids,
)
from raymq.core.expiry import EXPIRATION_PROPERTY, expiration_ms
from raymq.core.link import Fault, LinkFault, QueueLink
from raymq.core.priority import PRIORITY_PROPERTY
from raymq.core.schedule import SCHEDULED_PROPERTY, delivery_time
from raymq.errors import (
    BrokerUnavailable,
    NotLeader,
    RayMQError,
    SelectorError,
    SubscriptionNotFound,
)
from raymq.properties import encode_properties, validate_properties
from raymq.ray_faults import ActorNotFound, fault_of, submit
from raymq.selector import Selector
from raymq.wire.errors import WireBroken
from raymq.wire.send import SendChannel


class BrokerOfQueue(Protocol):
    """What a queue handle uses of its broker's (``raymq.client.broker.Broker``): named
    here so that this module does not import the broker's."""

    config: BrokerConfig
    namespace: str
    _actor: Any


_log = logging.getLogger("raymq.client")


class Queue:
    """Handle of one queue: send, consume, inspect."""

    #: The address subscription this handle consumes from (None: a queue).
    subscription_name: str | None = None

    def __init__(self, broker: BrokerOfQueue, name: str, actor):
        self.broker = broker
        self.name = name
        #: The name of the actor's queue or address (what a TargetList finds it by).
        self.actor_name = name
        #: How this handle reaches the queue's current actor (``raymq.core.link``).
        self._link = QueueLink(
            f"queue {name!r}",
            actor,
            _RAY_TRANSPORT,
            _BrokerLocator(self),
            grace_seconds=lambda: calls.RESTART_GRACE_SECONDS,
        )
        #: Open consumers made through this handle: ``stats`` and ``browse`` send their
        #: pipelined acks first, so a handle reads its own acks.
        self._consumers: weakref.WeakSet[Consumer] = weakref.WeakSet()
        self._producer_lock = threading.Lock()
        #: (actor id, endpoint) of the queue actor's FetchChannel (``_fetch_endpoint``).
        self._fetch_endpoint_of: tuple[str, tuple[str, int, str]] | None = None

    def __repr__(self) -> str:
        return f"Queue({self.name!r})"

    @property
    def _actor(self):
        """The queue's actor, as this handle last found it (a replicated queue's
        leader; a revived queue's new actor)."""
        return self._link.handle

    def _check_body(self, body: object) -> bytes:
        if not isinstance(body, bytes | bytearray | memoryview):
            raise TypeError(
                f"body for queue {self.name!r} must be bytes, not {type(body).__name__}"
            )
        check_size(len(body), self.broker.config.max_message_size, self.name)
        return bytes(body)

    def _encode_one(
        self, body: object, properties: Mapping[str, Any] | None
    ) -> tuple[bytes, bytes]:
        """One message checked and encoded: (body, msgpack properties or ``b""``).
        ``TypeError``, ``MessageTooLarge`` (body and properties count toward
        ``max_message_size``, as the queue counts them) or ``InvalidProperties``."""
        body = self._check_body(body)
        if properties is None:
            return body, b""
        props = encode_properties(
            validate_properties(properties, where=f"message for queue {self.name!r}")
        )
        check_size(len(body) + len(props), self.broker.config.max_message_size, self.name)
        return body, props

    #: This handle's pipelined sends (``send(wait=False)``), made on first use.
    _producer: Producer | None = None

    def send(
        self,
        body: bytes,
        properties: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,
        wait: bool = True,
        message_id: str | None = None,
        ttl: float | None = None,
        deliver_at: float | datetime.datetime | None = None,
        delay: float | None = None,
        priority: int | None = None,
    ) -> Any:
        """Send one message; returns its offset once it is durable (``wait=False``: a
        ``SendFuture`` of it at once).

        ``message_id`` (a str of up to 256 bytes, carried as the ``_AMQ_DUPL_ID``
        property): if the queue stored a message with this id within its
        ``dedup_window_s``, this one is not stored and the first one's offset comes
        back, so a send repeated after a lost answer stores the message once. Such a
        send waits for its answer (``wait`` is ignored), after this handle's pipelined
        sends; concurrent ones from a process's threads still share a commit.

        Both modes go through this handle's producer (``raymq.client.producer``): the message
        joins its open batch, which travels over this process's SendChannel to the queue
        actor (a socket, see ``raymq.wire.send``), else through a Ray call. A batch
        leaves at once when none is in flight, else when the one in flight is answered:
        sends from many threads of one process then share one frame, one write and one
        fsync. At the queue's ``max_size_bytes``: PAGE stores it anyway, DROP drops it
        (returns None), FAIL raises ``AddressFull``, BLOCK waits for room up to
        ``timeout`` seconds (None: for ever), then raises ``AddressFull``. A broken
        channel or a moved leader does not reach the caller: the send goes again
        through Ray (at-least-once).

        ``wait=False`` pipelines: ``SendFuture.result()`` gives the offset (None:
        DROPped) or raises the error once the queue has the batch durable. ``send``
        then blocks only while ``MAX_IN_FLIGHT_MESSAGES`` messages or
        ``MAX_IN_FLIGHT_BYTES`` bytes are unanswered; ``flush()`` waits for all and
        raises the first failure (a waiting send raises its own instead). A handle's
        messages are stored in the order sent, waiting or not. Bad input (type, size,
        properties) raises here, at once, in both modes.

        A message's lifetime (README, "Message expiry", "Scheduled delivery",
        "Priorities"): ``ttl`` seconds to live (None: the queue's ``default_ttl_s``),
        never delivered after; ``deliver_at`` (epoch seconds or a ``datetime``) or
        ``delay`` (seconds from now), never delivered before; ``priority`` (0 to 255),
        delivered first by a queue with a higher ``max_priority``. They travel as its
        ``RayMQExpiration``, ``RayMQScheduledDelivery`` (ms since the epoch, by this
        process's clock) and ``RayMQPriority`` properties.
        """
        properties = self._with_times(properties, ttl, deliver_at, delay, priority)
        if message_id is not None:
            return self._send_with_id(body, properties, message_id, timeout)
        body, props = self._encode_one(body, properties)
        producer = self._producer or self._make_producer()
        if not wait:
            return producer.send(body, props, timeout)
        return producer.send(body, props, timeout, waited=True).result()

    def _times(
        self, ttl: object, deliver_at: object, delay: object, priority: object = None
    ) -> dict[str, int]:
        """The lifetime properties of a message sent now with ``ttl`` seconds to live, a
        delivery time (``deliver_at`` or ``delay``) and a ``priority``;
        ``InvalidSetting`` if bad."""
        where = f"a message for queue {self.name!r}"
        check_ttl(ttl, where)
        check_priority(priority, where)
        now = time.time()
        times = {} if ttl is None else {EXPIRATION_PROPERTY: expiration_ms(ttl, now)}
        at = delivery_time(deliver_at, delay, now, where)
        if at is not None:
            times[SCHEDULED_PROPERTY] = at
        if priority:
            times[PRIORITY_PROPERTY] = priority
        return times

    def _with_times(self, properties, ttl, deliver_at, delay, priority) -> Any:
        """``properties`` with a message's lifetime properties (as they are if none)."""
        if ttl is None and deliver_at is None and delay is None and priority is None:
            return properties  # a plain send: no checks, no clock read (its hot path)
        times = self._times(ttl, deliver_at, delay, priority)
        return {**(properties or {}), **times} if times else properties

    def _pack(
        self, bodies, properties, ttl=None, deliver_at=None, delay=None, priority=None
    ) -> MessageBatch:
        """The messages checked and encoded as one batch, each with ``ttl`` seconds to
        live, a delivery time and a priority if given."""
        times = self._times(ttl, deliver_at, delay, priority)
        batch = self._pack_checked(bodies, properties)
        for name, value in times.items():
            batch = batch.with_property(name, value, keep_existing=False)
        return batch

    def _pack_checked(self, bodies, properties) -> MessageBatch:
        limit = self.broker.config.max_message_size
        if isinstance(bodies, pa.Table | pa.RecordBatch):
            if properties is not None:
                raise TypeError("properties come from the Arrow columns; pass properties=None")
            batch = MessageBatch.from_arrow(bodies, max_message_size=limit, queue=self.name)
        else:
            batch = MessageBatch.from_bodies(
                bodies, properties, max_message_size=limit, queue=self.name
            )
        if len(batch.prop_data):  # the queue counts properties toward max_message_size too
            check_sizes(batch.body_sizes() + np.diff(batch.prop_offsets), limit, self.name)
        return batch

    def send_batch(
        self,
        bodies: Sequence[bytes] | pa.Table | pa.RecordBatch,
        properties: Sequence[Mapping | None] | Mapping | None = None,
        *,
        timeout: float | None = None,
        message_ids: Sequence[str | None] | None = None,
        ttl: float | None = None,
        deliver_at: float | datetime.datetime | None = None,
        delay: float | None = None,
        priority: int | None = None,
    ) -> list[int]:
        """Send many messages in one write and one fsync; returns their offsets.

        ``bodies`` is a list of bytes (``properties`` then one dict for all, or one per
        message) or an Arrow table with a ``body`` column whose other columns are
        properties. At ``max_size_bytes`` the queue's policy applies as for ``send``:
        DROP stores the first messages that fit (fewer offsets come back), FAIL stores
        none, BLOCK waits up to ``timeout`` seconds for room for all of them.
        ``message_ids``: one producer id (or None) per message, as ``send``'s
        ``message_id``: a message already stored under its id is not stored again (its
        offset is the first one's); the call goes by Ray. ``ttl``, ``deliver_at``,
        ``delay`` and ``priority`` apply to every message, as ``send``'s.
        """
        times = (ttl, deliver_at, delay, priority)
        if message_ids is not None:
            return self._send_batch_ids(bodies, properties, message_ids, timeout, times)
        batch = self._pack(bodies, properties, *times)
        if self._producer is not None and self._producer.busy():
            self._producer.drain()  # earlier sends of this handle go first: order
        channel = (
            _send_channel(self) if batch.nbytes <= self.broker.config.max_message_size else None
        )
        lost = None  # the channel broke mid-send: the first try may be stored
        if channel is not None:  # larger batches exceed its frame limit: Ray carries them
            try:
                first, count = channel.send_batch(batch, timeout)
                return list(range(first, first + count))
            except WireBroken as exc:  # as in ``send``: Ray calls follow a restart
                lost = exc
            except NotLeader:  # refused: a Ray call follows the new leader
                pass
        try:
            first, count = self._invoke("send_batch", batch, timeout, answer_seconds=timeout)
        except RayMQError as exc:
            raise calls.resent_refusal(exc, lost, self.name) from None
        return list(range(first, first + count))

    def _send_with_id(
        self, body: object, properties: Mapping[str, Any] | None, mid: object, timeout
    ) -> int | None:
        """``send`` with a producer id: over the send channel as one message (the
        queue answers it with its own offset, or its first copy's), else, or when the
        channel broke under it, by a Ray call (a resend is deduplicated too)."""
        mid = check_message_id(mid, self.name)
        body, props = self._encode_one(body, {**(properties or {}), DUPLICATE_ID_PROPERTY: mid})
        if self._producer is not None and self._producer.busy():
            self._producer.drain()  # earlier sends of this handle go first: order
        channel = _send_channel(self)
        if channel is not None:
            try:
                return channel.send(body, props, timeout)
            except (WireBroken, NotLeader):  # a Ray call follows a restart or a new leader
                pass
        batch = MessageBatch.from_encoded([body], [props])
        got = self._invoke("send_batch_ids", batch, [mid], timeout, answer_seconds=timeout)
        return got[0]

    def _send_batch_ids(
        self,
        bodies,
        properties,
        message_ids: Sequence[str | None],
        timeout: float | None,
        times: tuple = (None, None, None, None),
    ) -> list[int]:
        """``send_batch`` with producer ids: each stamped into its message's
        ``_AMQ_DUPL_ID`` property, the batch sent by a Ray call (a resend after a
        restart is deduplicated too)."""
        n = bodies.num_rows if isinstance(bodies, pa.Table | pa.RecordBatch) else len(bodies)
        ids = check_message_ids(message_ids, n, self.name)
        batch = self._pack(*with_message_ids(bodies, properties, ids), *times)
        if self._producer is not None and self._producer.busy():
            self._producer.drain()  # earlier sends of this handle go first: order
        offsets = self._invoke("send_batch_ids", batch, ids, timeout, answer_seconds=timeout)
        # As send_batch under DROP: the offsets of the first messages stored.
        return list(itertools.takewhile(lambda o: o is not None, offsets))

    async def send_async(
        self,
        body: bytes,
        properties: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,
        ttl: float | None = None,
        deliver_at: float | datetime.datetime | None = None,
        delay: float | None = None,
        priority: int | None = None,
    ) -> int | None:
        """``send`` for asyncio code: over the send channel (concurrent tasks' sends
        share the queue's group commits), awaiting the answer without blocking the event
        loop; through a Ray call when the queue has no channel or it broke. Behind this
        handle's unanswered ``send``s it joins them instead (from a worker thread): a
        handle's messages are stored in the order sent. ``ttl``, ``deliver_at``,
        ``delay`` and ``priority`` as ``send``'s."""
        body, props = self._encode_one(
            body, self._with_times(properties, ttl, deliver_at, delay, priority)
        )
        producer = self._producer
        if producer is not None and producer.busy():
            return await asyncio.to_thread(
                lambda: producer.send(body, props, timeout, waited=True).result()
            )
        channel = await self._send_channel_async()
        lost = None
        if channel is not None:
            try:
                return await channel.send_async(body, props, timeout)
            except WireBroken as exc:  # as in ``send``: a Ray call follows a restart
                lost = exc
            except NotLeader:  # refused: a Ray call follows the new leader
                pass
        batch = MessageBatch.from_encoded([body], [props])
        first, count = await self._send_batch_by_ray(batch, timeout, lost)
        return first if count else None

    async def send_batch_async(
        self,
        bodies,
        properties=None,
        *,
        timeout: float | None = None,
        ttl: float | None = None,
        deliver_at: float | datetime.datetime | None = None,
        delay: float | None = None,
        priority: int | None = None,
    ) -> list[int]:
        """``send_batch`` for asyncio code: over the send channel as ``send_batch``,
        awaiting without blocking the event loop; else through a Ray call. This handle's
        unanswered ``send``s are waited for first (in a worker thread): the order.
        ``ttl``, ``deliver_at``, ``delay`` and ``priority`` as ``send_batch``'s."""
        batch = self._pack(bodies, properties, ttl, deliver_at, delay, priority)
        producer = self._producer
        if producer is not None and producer.busy():
            await asyncio.to_thread(producer.drain)
        lost = None
        if batch.nbytes <= self.broker.config.max_message_size:
            channel = await self._send_channel_async()
            if channel is not None:
                try:
                    first, count = await channel.send_batch_async(batch, timeout)
                    return list(range(first, first + count))
                except WireBroken as exc:  # as in ``send_batch``
                    lost = exc
                except NotLeader:
                    pass
        first, count = await self._send_batch_by_ray(batch, timeout, lost)
        return list(range(first, first + count))

    async def _send_batch_by_ray(
        self, batch: MessageBatch, timeout: float | None, lost: BaseException | None = None
    ):
        """The async sends' Ray path, as the blocking sends' (``_invoke``: it follows a
        revived or moved queue and waits out a restart), in a worker thread. ``lost``:
        the channel broke mid-send (``calls.resent_refusal``)."""
        try:
            return await asyncio.to_thread(
                functools.partial(
                    self._invoke, "send_batch", batch, timeout, answer_seconds=timeout
                )
            )
        except RayMQError as exc:
            raise calls.resent_refusal(exc, lost, self.name) from None

    async def _send_channel_async(self) -> SendChannel | None:
        """``_send_channel`` without blocking the event loop: opening one (a Ray call
        and a connect) runs in a worker thread."""
        channel = _send_channel(self, connect=False)
        if channel is None:
            channel = await asyncio.to_thread(_send_channel, self)
        return channel

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every pipelined send (``send(wait=False)``) of this handle is
        answered: stored durably, DROPped or failed.

        Raises ``TimeoutError`` after ``timeout`` seconds (None: no limit), and then the
        first error of a pipelined send that failed since the last flush (its class,
        e.g. ``AddressFull``, saying how many failed): a fire-and-forget producer learns
        of a lost message here at the latest.
        """
        if self._producer is not None:
            self._producer.flush(timeout)

    def producer_stats(self) -> ProducerStats | None:
        """Counts of this handle's pipelined sends (None: it made none)."""
        return None if self._producer is None else self._producer.stats()

    def _make_producer(self) -> Producer:
        with self._producer_lock:  # one per handle, even when threads race here
            if self._producer is None:
                self._producer = Producer(
                    self.name,
                    lambda: _send_channel(self),
                    lambda batch, timeout: self._invoke(
                        "send_batch", batch, timeout, answer_seconds=timeout
                    ),
                    # The channel refuses frames over max_message_size (and framing).
                    max_batch_bytes=min(MAX_BATCH_BYTES, self.broker.config.max_message_size),
                )
            return self._producer

    def consumer(
        self,
        selector: str | None = None,
        prefetch: int = 10_000,
        *,
        high_watermark: int | None = None,
        high_watermark_bytes: int = 64 * 2**20,
        pending_cache_bytes: int = 16 * 2**20,
        node_id: str | None = None,
    ) -> Consumer:
        """A consumer (a TargetList actor near it) holding at most ``prefetch``
        unacknowledged messages.

        ``selector`` is a JMS message selector over properties and the headers
        ``RayMQOffset``, ``JMSTimestamp`` (ms) and ``JMSXDeliveryCount``; a malformed one
        raises ``SelectorError`` here. ``high_watermark`` (messages, default
        ``prefetch``) and ``high_watermark_bytes`` bound the direct references the
        eager loader keeps; ``pending_cache_bytes`` bounds the PendingCache.
        """
        if selector is not None:
            if not isinstance(selector, str):
                raise TypeError(f"selector must be a str, not {type(selector).__name__}")
            try:
                Selector(selector)
            except SelectorError as exc:
                raise SelectorError(f"queue {self.name!r}: {exc}") from None
        _check_count("prefetch", prefetch)
        high = prefetch if high_watermark is None else high_watermark
        _check_count("high_watermark", high)
        _check_count("high_watermark_bytes", high_watermark_bytes)
        _check_count("pending_cache_bytes", pending_cache_bytes, minimum=0)
        return Consumer(
            self, prefetch, selector, high, high_watermark_bytes, pending_cache_bytes, node_id
        )

    def browse(self, selector: str | None = None, batch_size: int = 1000) -> Iterator[Message]:
        """Every unacknowledged message (paged ones included) in offset order, optionally
        those ``selector`` selects, without consuming or changing anything."""
        if selector is not None:
            Selector(selector)
        _check_count("batch_size", batch_size)
        self._flush_acks()
        pos = 0
        while True:
            batch, pos = self._invoke("browse", pos, batch_size, selector, self.subscription_name)
            yield from _messages(batch)
            if batch.num_rows < batch_size:  # the queue walks to its end before stopping short
                return

    def stats(self) -> dict[str, Any]:
        """Depth, bytes in memory and on disk, segment files, consumers and rates."""
        self._flush_acks()
        return self._invoke("stats", self.subscription_name).to_dict()

    def _ack_channel(self) -> SendChannel | None:
        """The SendChannel for a consumer's pipelined acks, without waiting
        (``_send_channel_soon``)."""
        return _send_channel_soon(self)

    def _fetch_endpoint(self, fresh: bool = False) -> tuple[tuple[str, int, str] | None, bool]:
        """The queue actor's FetchChannel (host, port, secret) for a new consumer's
        TargetList, and whether it is the one remembered from an earlier consumer of
        this handle (a Ray call saved: 2-3 ms of a new consumer's first message here).
        ``fresh``, or none remembered: asked through ``_invoke``, so that this handle
        follows the queue to its current actor first. None if it has none or could not
        be asked (the TargetList then registers through Ray, which raises the typed
        error)."""
        remembered = self._fetch_endpoint_of
        if not fresh and remembered is not None and remembered[0] == self._actor._actor_id.hex():
            return remembered[1], True
        try:
            endpoint = self._invoke("fetch_endpoint")
        except RayMQError as exc:
            _log.info("queue %r: no fetch channel endpoint: %s", self.name, exc)
            return None, False
        if endpoint is not None:
            self._fetch_endpoint_of = (self._actor._actor_id.hex(), tuple(endpoint))
        return endpoint, False

    def _flush_acks(self) -> None:
        """Make the pipelined acks of this handle's open consumers durable first
        (waiting at most ``raymq.acks.ACK_ANSWER_SECONDS``). An ack's error is left for
        the consumer's own next ``flush``/``ack``/``close``, which raises it: stats() and
        browse() neither raise nor swallow another consumer's error."""
        for consumer in list(self._consumers):
            consumer._acks.flush(raise_errors=False)

    def _invoke(self, method: str, *args, answer_seconds: float | None = -1.0) -> Any:
        """Call the queue actor's ``method``; follows the queue to its current actor
        (restarted, failed over, revived) or raises a typed error naming it
        (``raymq.core.link.QueueLink.call``, which says what ``answer_seconds`` is)."""
        return self._link.call(method, *args, answer_seconds=answer_seconds)

    def _follow(self, failed) -> None:
        """``failed`` (an actor of this queue) failed a call made outside ``_invoke``
        (a pipelined ack): the next calls go to the queue's current actor."""
        self._link.follow(failed)


class _RayTransport:
    """``QueueLink``'s transport: one Ray actor call, Ray's failures as ``LinkFault``."""

    def call(self, handle: Any, method: str, args: tuple, timeout: float | None) -> Any:
        """``method(*args)`` on ``handle`` (``raymq.core.link.Transport``)."""
        try:
            return ray.get(submit(getattr(handle, method), *args), timeout=timeout)
        except ray.exceptions.RayTaskError as exc:  # (first: it is an instance of its cause)
            if isinstance(exc.cause, _FAULTS):  # an actor it called restarts or died
                raise LinkFault(fault_of(exc.cause), _reason(exc.cause)) from None
            raise _unwrap(exc) from None
        except ray.exceptions.GetTimeoutError:
            # Not cancelled: a call half done in the queue (a send in its group commit)
            # is left to finish; the link reports its outcome as unknown.
            raise LinkFault(Fault.SILENT, f"no answer in {timeout:g} s") from None
        except ActorNotFound as exc:  # (first: one of _FAULTS) never comes back
            raise LinkFault(Fault.GONE, _reason(exc), final=True) from None
        except _FAULTS as exc:
            raise LinkFault(fault_of(exc), _reason(exc)) from None


_RAY_TRANSPORT = _RayTransport()


class _BrokerLocator:
    """``QueueLink``'s locator: the broker names a queue's current actor."""

    def __init__(self, queue: Queue):
        self._queue = weakref.ref(queue)

    def locate(self, failed: Any) -> Any:
        """The broker checks a leader suspected this way (fails over), revives a
        hibernated queue, and names the queue's actor (``raymq.core.link.Locator``)."""
        queue = self._queue()
        if queue is None:
            raise BrokerUnavailable("the queue handle was dropped")
        broker = queue.broker._actor
        name = queue.actor_name
        _call(broker.suspect_leader, name, failed._actor_id.hex(), retry=False)
        return _call(broker.get_queue, name, retry=False)


class Address(Queue):
    """Handle of one address: send as to a queue (same calls, same errors, same send
    channel); consume from its subscriptions."""

    def __repr__(self) -> str:
        return f"Address({self.name!r})"

    def create_subscription(
        self,
        name: str,
        *,
        selector: str | None = None,
        start: str | int | datetime.datetime = "latest",
        max_delivery_attempts: int | None = None,
        dead_letter_queue: str | None = None,
    ) -> Subscription:
        """Bind a subscription (or return it, if it exists with equal settings): a
        queue of its own over the address's one stored copy.

        ``selector`` is a filter applied when a message is routed to it (a consumer's
        selector applies on top); ``start`` is ``"latest"`` (from the next message sent),
        ``"earliest"`` (from the oldest message the address still stores: with its
        retention, acknowledged ones too), an offset, or a ``datetime`` (the first
        message stored then or later; README, "Retention and replay"). Dead
        letters go to ``dead_letter_queue`` (default ``f"{address}.{name}.DLQ"``).
        Raises ``SubscriptionExists``, ``SelectorError``, ``InvalidQueueName`` or
        ``InvalidSetting``.
        """
        self._invoke(
            "create_subscription",
            name,
            selector,
            start,
            max_delivery_attempts,
            dead_letter_queue,
        )
        return Subscription(self, name)

    def subscription(self, name: str) -> Subscription:  # type: ignore[override]
        """The handle of an existing subscription; ``SubscriptionNotFound`` if none."""
        if name not in self.subscriptions():
            raise SubscriptionNotFound(f"address {self.name!r} has no subscription {name!r}")
        return Subscription(self, name)

    def subscriptions(self) -> list[str]:
        """Names of the address's subscriptions, in the order they were created."""
        return [spec.name for spec in self._invoke("list_subscriptions")]

    def delete_subscription(self, name: str) -> None:
        """Unbind a subscription: its consumers are closed, its hold on every stored
        message is released."""
        self._invoke("delete_subscription", name)

    def consumer(self, *args, **kwargs) -> Consumer:
        """Addresses are consumed through their subscriptions."""
        raise TypeError(
            f"address {self.name!r} is consumed through a subscription:"
            " address.subscription(name).consumer()"
        )

    def browse(self, *args, **kwargs) -> Iterator[Message]:
        """Addresses are browsed through their subscriptions."""
        raise TypeError(
            f"address {self.name!r} is browsed through a subscription:"
            " address.subscription(name).browse()"
        )

    def stats(self) -> dict[str, Any]:
        """The address's statistics (its depth counts what any subscription still
        needs) and each subscription's lag (messages it has not acknowledged)."""
        self._flush_acks()
        out = self._invoke("stats").to_dict()
        out["subscriptions"] = self._invoke("subscription_depths")
        return out


class Subscription(Queue):
    """Handle of one subscription of an address: a queue for its consumers (consume,
    browse, stats as a queue's); messages are sent to its address."""

    def __init__(self, address: Address, name: str):
        super().__init__(address.broker, f"{address.name}/{name}", address._actor)
        self.address = address
        self.subscription_name = name
        self.actor_name = address.name

    def __repr__(self) -> str:
        return f"Subscription({self.address.name!r}, {self.subscription_name!r})"

    def _refuse_send(self, *args, **kwargs):
        raise TypeError(
            f"subscription {self.name!r} receives what is sent to its address:"
            f" send to address {self.address.name!r}"
        )

    send = send_batch = _refuse_send

    async def send_async(self, *args, **kwargs):
        """Messages are sent to the address, not to one of its subscriptions."""
        self._refuse_send()

    send_batch_async = send_async

    def seek(self, position: str | int | datetime.datetime) -> int:
        """Deliver from ``position`` on: an offset, a ``datetime`` (the first message
        stored then or later, found by the segments' time index), ``"earliest"`` or
        ``"latest"``. What it acknowledged from there on comes again, as far as the
        address still stores it (its retention keeps acknowledged messages); what lies
        before counts as acknowledged. Its consumers keep what they hold (ack it as
        usual). Returns the offset it starts at now, once that is durable; raises
        ``InvalidSetting`` for a bad position."""
        self._flush_acks()  # acks of this process first: they would undo a seek back
        return self._invoke("seek", self.subscription_name, position)
