"""The client API: ``connect()``, and handles for the broker, queues and consumers.

Usable from a driver, a Ray task, an actor or a ``ray job submit`` job. Every call to
a broker actor goes through ``_call``, which turns Ray's wrapped errors back into the
typed errors of ``raymq.errors`` and retries while a restarting actor comes back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import repeat
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import ray

from raymq import acks, delivery_channel
from raymq.acks import AckPipeline
from raymq.batch import (
    EMPTY_DELIVERY,
    MessageBatch,
    check_size,
    check_sizes,
    warm_arrow_conversions,
)
from raymq.config import (
    STOP_SECONDS,
    BrokerConfig,
    QueueConfig,
    apply_ray_env_defaults,
    validate_queue_name,
)
from raymq.delivery_channel import BY_REFERENCE, INLINE_BYTES, DeliveryChannel
from raymq.delivery_channel import ChannelBroken as DeliveryBroken
from raymq.errors import (
    BrokerUnavailable,
    ConsumerClosed,
    InvalidAck,
    InvalidSetting,
    NotLeader,
    QueueNotFound,
    RayMQError,
    SelectorError,
    SubscriptionNotFound,
)
from raymq.fetch_channel import STALE_FETCH_ENDPOINT
from raymq.producer import MAX_BATCH_BYTES, Producer, ProducerStats
from raymq.properties import decode_properties, encode_properties, validate_properties
from raymq.selector import Selector
from raymq.send_channel import ChannelBroken, SendChannel

_log = logging.getLogger("raymq.client")

#: How long a call keeps retrying while an actor restarts (seconds).
RESTART_GRACE_SECONDS = 60.0
#: Messages ``for message in consumer`` takes from the buffer at a time: each chunk has
#: a fixed cost (Arrow column conversions) worth about 50-100 ns a message at 256.
ITER_CHUNK_MESSAGES = 1024
#: Fewest messages a receive asks the DeliveryChannel for: one round trip brings a
#: few receive()s' worth, and a deep queue's first message does not wait for a
#: prefetch's worth to be read into this process (messages).
CHANNEL_TAKE_MESSAGES = 128
_RETRYABLE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


def _unwrap(exc: BaseException) -> BaseException:
    """The typed error inside a RayTaskError; ``BrokerUnavailable`` where the actor
    called (or one it called) was unavailable."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, RayMQError | TypeError | ValueError):
        return cause
    if isinstance(cause, _RETRYABLE):
        return BrokerUnavailable(f"actor unavailable: {cause}")
    return exc


def _call(
    method,
    *args,
    retry: bool = True,
    refresh: Callable[[], Any] | None = None,
    about: str | None = None,
    **kwargs,
) -> Any:
    """Call an actor method and wait; typed errors unwrapped, restarts waited out.

    ``refresh`` gives the method again on a new actor when this one is unavailable or
    answers ``NotLeader`` (a replicated queue's leader moved): the call goes there.
    ``about`` names what the actor serves in the ``BrokerUnavailable`` raised when it
    cannot be reached ("queue 'orders'", say).
    """
    deadline = time.monotonic() + RESTART_GRACE_SECONDS
    delay = 0.05
    while True:
        try:
            try:
                return ray.get(method.remote(*args, **kwargs))
            except ray.exceptions.RayTaskError as exc:
                if isinstance(exc.cause, NotLeader) and refresh is not None:
                    raise exc.cause from None
                if not isinstance(exc.cause, _RETRYABLE):
                    raise _unwrap(exc) from None
                raise exc.cause from None  # an actor it called restarts: wait as for ours
        except (*_RETRYABLE, NotLeader) as exc:
            if not retry or time.monotonic() > deadline:
                if isinstance(exc, NotLeader):
                    raise
                what = "actor unavailable" if about is None else f"{about}: actor unavailable"
                raise BrokerUnavailable(f"{what}: {exc}") from exc
            if refresh is not None:
                method = refresh()
                delay = min(delay, 0.2)
            time.sleep(delay)
            delay = min(delay * 2, 1.0)


def connect(
    address: str | None = None,
    namespace: str = "raymq",
    *,
    create: bool = True,
    **broker_config: Any,
) -> Broker:
    """Join (or start) Ray and the broker of ``namespace``; returns a ``Broker``.

    ``address`` None joins a running cluster if one is found, else starts an embedded
    local Ray; ``"auto"`` requires a running cluster. ``broker_config`` are the settings
    of ``raymq.config.BrokerConfig`` (``paging_directory``, ``max_message_size``, ...);
    they apply when this call creates the broker, and must match a running one.
    ``create=False`` only joins a running broker (``BrokerUnavailable`` if none).
    """
    from raymq.actors.broker_actor import BROKER_ACTOR_NAME, BrokerActor
    from raymq.actors.governor_actor import GOVERNOR_ACTOR_NAME, MemoryGovernorActor
    from raymq.placement import spares
    from raymq.placement.nodes import current_node_id, pinned_to

    config = BrokerConfig.from_kwargs(**broker_config)
    if not ray.is_initialized():
        apply_ray_env_defaults()
        try:
            ray.init(
                address=address, namespace=namespace, log_to_driver=False, configure_logging=False
            )
        except ConnectionError as exc:
            raise BrokerUnavailable(f"cannot reach Ray at {address!r}: {exc}") from exc
    if not create:
        try:
            ray.get_actor(BROKER_ACTOR_NAME, namespace=namespace)
        except ValueError:
            raise BrokerUnavailable(
                f"no RayMQ broker in namespace {namespace!r} on this Ray cluster;"
                " start one with `raymq start`"
            ) from None

    def here(actor_class, name: str):
        """``actor_class``'s detached actor ``name`` on this node, made if missing."""
        return actor_class.options(
            name=name,
            namespace=namespace,
            lifetime="detached",
            get_if_exists=True,
            scheduling_strategy=pinned_to(current_node_id()),
        )

    actor = here(BrokerActor, BROKER_ACTOR_NAME).remote(config, namespace)

    def again():  # a broker just stopped (killed) keeps its name a moment: ask anew
        nonlocal actor
        actor = here(BrokerActor, BROKER_ACTOR_NAME).remote(config, namespace)
        return actor.config

    running: BrokerConfig = _call(actor.config, refresh=again, about="the broker")
    if broker_config and running != config:
        raise InvalidSetting(f"broker in namespace {namespace!r} runs with {running}, not {config}")
    spares.warm(current_node_id())  # the first consumer need not wait for a process
    warm_arrow_conversions()  # nor its first receive for pyarrow's lazy imports
    governor = here(MemoryGovernorActor, GOVERNOR_ACTOR_NAME).remote(running, namespace)
    return Broker(actor, running, namespace, governor)


class Broker:
    """Handle of a running broker: create, find, delete and inspect queues."""

    def __init__(self, actor, config: BrokerConfig, namespace: str, governor=None):
        self._actor = actor
        self._governor = governor
        self.config = config
        self.namespace = namespace
        self._shut_down = False

    def create_queue(
        self,
        name: str,
        *,
        durable: bool = True,
        max_size_bytes: int = -1,
        page_size_bytes: int = 10 * 2**20,
        address_full_policy: str = "PAGE",
        page_max_cache_size: int = 5,
        max_delivery_attempts: int | None = None,
        dead_letter_queue: str | None = None,
        node_id: str | None = None,
        replicas: int = 1,
        min_insync_replicas: int | None = None,
    ) -> Queue:
        """Create a queue, or return it if it exists with equal settings.

        A message delivered ``max_delivery_attempts`` times (None: no limit) and given
        back again goes to ``dead_letter_queue`` (default ``f"{name}.DLQ"``, created
        when first needed with this queue's durability) instead of a further delivery.
        ``replicas`` (2 or 3) keeps that many copies of the queue's files, each on its
        own node: a send is answered once ``min_insync_replicas`` of them (default all
        of 2, 2 of 3) have it durably, and the queue survives the loss of its leader's
        node (README, "Failure model"). Raises ``QueueExists`` for different settings,
        ``InvalidQueueName``, ``InvalidSetting`` or ``TypeError`` for bad arguments,
        ``BrokerUnavailable`` if there are fewer alive nodes than replicas (nothing is
        created then).
        """
        cfg = QueueConfig(
            name,
            durable,
            max_size_bytes,
            page_size_bytes,
            address_full_policy,
            page_max_cache_size,
            max_delivery_attempts,
            dead_letter_queue,
            replicas=replicas,
            min_insync_replicas=min_insync_replicas,
        )
        handle = _call(self._actor.create_queue, cfg, node_id)
        return Queue(self, name, handle)

    def get_queue(self, name: str) -> Queue:
        """The handle of an existing queue; ``QueueNotFound`` if there is none."""
        validate_queue_name(name)
        return Queue(self, name, _call(self._actor.get_queue, name))

    def create_address(
        self,
        name: str,
        *,
        durable: bool = True,
        max_size_bytes: int = -1,
        page_size_bytes: int = 10 * 2**20,
        address_full_policy: str = "PAGE",
        page_max_cache_size: int = 5,
        node_id: str | None = None,
    ) -> Address:
        """Create an address (Artemis's multicast address), or return it if it exists
        with equal settings: a message sent to it is stored once and delivered to each
        of its subscriptions (``Address.create_subscription``).

        ``max_size_bytes`` and ``address_full_policy`` apply to what any subscription
        still needs. Raises as ``create_queue`` does (``QueueExists`` when a queue or an
        address of that name exists with other settings).
        """
        cfg = QueueConfig(
            name,
            durable,
            max_size_bytes,
            page_size_bytes,
            address_full_policy,
            page_max_cache_size,
            address=True,
        )
        return Address(self, name, _call(self._actor.create_queue, cfg, node_id))

    def get_address(self, name: str) -> Address:
        """The handle of an existing address; ``QueueNotFound`` if there is none."""
        validate_queue_name(name)
        if name not in self.list_addresses():
            raise QueueNotFound(f"address {name!r} does not exist")
        return Address(self, name, _call(self._actor.get_queue, name))

    def delete_address(self, name: str) -> None:
        """Delete an address with its subscriptions, messages and files."""
        validate_queue_name(name)
        if name not in self.list_addresses():
            raise QueueNotFound(f"address {name!r} does not exist")
        _call(self._actor.delete_queue, name)

    def list_addresses(self) -> list[str]:
        """Names of the broker's addresses."""
        return _call(self._actor.list_addresses)

    def delete_queue(self, name: str) -> None:
        """Delete a queue with its messages and files."""
        validate_queue_name(name)
        _call(self._actor.delete_queue, name)

    def list_queues(self) -> list[str]:
        """Names of the broker's queues (not its addresses)."""
        return _call(self._actor.list_queues)

    def queue_nodes(self) -> dict[str, str]:
        """The node id each queue (its actor and files) lives on, by queue name."""
        return _call(self._actor.queue_nodes)

    def stats(self) -> dict[str, dict]:
        """Each queue's (and address's) statistics as a dict, by name, with its
        ``"state"``: "active", "replicated", or "hibernated" (its actor is not running,
        and is not started for this: its entry then holds only ``name`` and
        ``state``)."""
        states: dict[str, str] = _call(self._actor.queue_states)
        running = [n for n, state in states.items() if state != "hibernated"]
        handles = [_call(self._actor.get_queue, n) for n in running]
        out = {n: {"name": n, "state": state} for n, state in states.items()}
        for n, s in zip(running, ray.get([h.stats.remote() for h in handles]), strict=True):
            out[n] = {**s.to_dict(), "state": states[n]}
        return out

    def hibernation_stats(self) -> dict[str, Any]:
        """Hibernation of idle queues: the settings, running queue actors per node,
        the hibernated queues, and counts of hibernations and revivals
        (``raymq.core.hibernation.HibernationStats`` as a dict)."""
        return _call(self._actor.hibernation_stats).to_dict()

    def set_hibernation(
        self,
        max_active_queues: int | None = 32,
        hibernate_after_seconds: float | None = 300.0,
    ) -> None:
        """Set how many queue actors may run per node (None: no cap) and after how many
        idle seconds a queue hibernates (None: only to make room), until the broker
        actor restarts. A hibernated queue's files stay; the next call to it starts its
        actor again (a delay of about a process start), through any handle."""
        from raymq.core.hibernation import HibernationSettings

        HibernationSettings(max_active_queues, hibernate_after_seconds)  # checked here
        _call(self._actor.set_hibernation, max_active_queues, hibernate_after_seconds)

    def hibernate(self, name: str) -> bool:
        """Hibernate queue ``name`` now if it is idle; True if it did (False: busy,
        replicated, or not running). ``QueueNotFound`` if there is no such queue."""
        validate_queue_name(name)
        return _call(self._actor.hibernate, name)

    def governor_stats(self) -> dict[str, Any]:
        """The MemoryGovernor: threshold, per-node thresholds, each queue's budget split
        into its linked caches, the usage it was computed from, rounds so far."""
        return _call(self._governor.stats)

    def rebalance(self) -> dict[str, Any]:
        """Run a MemoryGovernor round now (it also runs every ``housekeeping_period``);
        returns the plan."""
        return _call(self._governor.rebalance)

    def shutdown(self, timeout: float = STOP_SECONDS) -> None:
        """Stop the broker's actors, keeping every queue's files. Each queue has
        ``timeout`` seconds to flush and close; one that takes longer (a paused process,
        a leader waiting for replicas) is ended all the same, and the acks it had not
        written are lost: those messages are delivered again."""
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ValueError(f"shutdown: timeout must be seconds > 0, not {timeout!r}")
        if self._shut_down:
            return
        self._shut_down = True
        try:
            if self._governor is not None:
                ray.kill(self._governor, no_restart=True)
            _call(self._actor.stop_queues, timeout, retry=False)
        finally:
            ray.kill(self._actor, no_restart=True)


#: Seconds before a process tries again to open a queue's SendChannel after it failed
#: to connect (a channel that broke after working is opened again at once).
CHANNEL_RETRY_SECONDS = 30.0
_channels_lock = threading.Lock()
#: (job id, queue actor id) -> this process's SendChannel, the monotonic time to try
#: connecting again, or None while a thread is connecting.
_channels: dict[tuple[str, str], SendChannel | float | None] = {}


def _send_channel(queue: Queue, *, connect: bool = True) -> SendChannel | None:
    """This process's SendChannel to ``queue``'s actor, opened on first use; None when
    the queue has none, it is being opened, or opening it failed lately (single sends
    then go through Ray calls). ``connect=False``: only a channel open already (no
    blocking call: asyncio code opens one in a worker thread)."""
    key = (ray.get_runtime_context().get_job_id(), queue._actor._actor_id.hex())
    with _channels_lock:
        got = _channels.get(key, 0.0)
        if isinstance(got, SendChannel) and got.broken is None:
            return got
        if not connect or got is None or (isinstance(got, float) and time.monotonic() < got):
            return None
        _channels[key] = None  # this thread connects; the others use Ray meanwhile
    channel: SendChannel | None = None
    try:
        endpoint = queue._invoke("send_endpoint")  # follows a revived queue's new actor
        if endpoint is not None:
            channel = SendChannel(*endpoint, queue=queue.name)
    except Exception as exc:  # unreachable port, refused, the actor gone...: whatever it
        # is, Ray carries the sends, and the key must not stay None (connecting) for good
        _log.info("queue %r: no send channel: %r", queue.name, exc)
        channel = None
    new_key = (key[0], queue._actor._actor_id.hex())
    with _channels_lock:
        _channels[key] = channel or time.monotonic() + CHANNEL_RETRY_SECONDS
        _channels[new_key] = _channels[key]  # the queue's actor after a revival
    return channel


class Queue:
    """Handle of one queue: send, consume, inspect."""

    #: The address subscription this handle consumes from (None: a queue).
    subscription_name: str | None = None

    def __init__(self, broker: Broker, name: str, actor):
        self.broker = broker
        self.name = name
        #: The name of the actor's queue or address (what a TargetList finds it by).
        self.actor_name = name
        self._actor = actor
        #: Open consumers made through this handle: ``stats`` and ``browse`` send their
        #: pipelined acks first, so a handle reads its own acks.
        self._consumers: weakref.WeakSet[Consumer] = weakref.WeakSet()
        self._producer_lock = threading.Lock()
        #: (actor id, endpoint) of the queue actor's FetchChannel (``_fetch_endpoint``).
        self._fetch_endpoint_of: tuple[str, tuple[str, int, str]] | None = None

    def __repr__(self) -> str:
        return f"Queue({self.name!r})"

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
    ) -> Any:
        """Send one message; returns its offset once it is durable (``wait=False``: a
        ``SendFuture`` of it at once).

        Both modes go through this handle's producer (``raymq.producer``): the message
        joins its open batch, which travels over this process's SendChannel to the queue
        actor (a socket, see ``raymq.send_channel``), else through a Ray call. A batch
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
        """
        body, props = self._encode_one(body, properties)
        producer = self._producer or self._make_producer()
        if not wait:
            return producer.send(body, props, timeout)
        return producer.send(body, props, timeout, waited=True).result()

    def _pack(self, bodies, properties) -> MessageBatch:
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
    ) -> list[int]:
        """Send many messages in one write and one fsync; returns their offsets.

        ``bodies`` is a list of bytes (``properties`` then one dict for all, or one per
        message) or an Arrow table with a ``body`` column whose other columns are
        properties. At ``max_size_bytes`` the queue's policy applies as for ``send``:
        DROP stores the first messages that fit (fewer offsets come back), FAIL stores
        none, BLOCK waits up to ``timeout`` seconds for room for all of them.
        """
        batch = self._pack(bodies, properties)
        if self._producer is not None and self._producer.busy():
            self._producer.drain()  # earlier sends of this handle go first: order
        channel = (
            _send_channel(self) if batch.nbytes <= self.broker.config.max_message_size else None
        )
        if channel is not None:  # larger batches exceed its frame limit: Ray carries them
            try:
                first, count = channel.send_batch(batch, timeout)
                return list(range(first, first + count))
            except (ChannelBroken, NotLeader):
                pass  # as in ``send``: Ray calls follow a restart or a new leader
        first, count = self._invoke("send_batch", batch, timeout)
        return list(range(first, first + count))

    async def send_async(
        self,
        body: bytes,
        properties: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,
    ) -> int | None:
        """``send`` for asyncio code: over the send channel (concurrent tasks' sends
        share the queue's group commits), awaiting the answer without blocking the event
        loop; through a Ray call when the queue has no channel or it broke. Behind this
        handle's unanswered ``send``s it joins them instead (from a worker thread): a
        handle's messages are stored in the order sent."""
        body, props = self._encode_one(body, properties)
        producer = self._producer
        if producer is not None and producer.busy():
            return await asyncio.to_thread(
                lambda: producer.send(body, props, timeout, waited=True).result()
            )
        channel = await self._send_channel_async()
        if channel is not None:
            try:
                return await channel.send_async(body, props, timeout)
            except (ChannelBroken, NotLeader):
                pass  # as in ``send``: a Ray call follows a restart or a new leader
        batch = MessageBatch.from_encoded([body], [props])
        first, count = await self._send_batch_by_ray(batch, timeout)
        return first if count else None

    async def send_batch_async(
        self, bodies, properties=None, *, timeout: float | None = None
    ) -> list[int]:
        """``send_batch`` for asyncio code: over the send channel as ``send_batch``,
        awaiting without blocking the event loop; else through a Ray call. This handle's
        unanswered ``send``s are waited for first (in a worker thread): the order."""
        batch = self._pack(bodies, properties)
        producer = self._producer
        if producer is not None and producer.busy():
            await asyncio.to_thread(producer.drain)
        if batch.nbytes <= self.broker.config.max_message_size:
            channel = await self._send_channel_async()
            if channel is not None:
                try:
                    first, count = await channel.send_batch_async(batch, timeout)
                    return list(range(first, first + count))
                except (ChannelBroken, NotLeader):
                    pass  # as in ``send_batch``
        first, count = await self._send_batch_by_ray(batch, timeout)
        return list(range(first, first + count))

    async def _send_batch_by_ray(self, batch: MessageBatch, timeout: float | None):
        """The async sends' Ray path, as the blocking sends' (``_invoke``: it follows a
        revived or moved queue and waits out a restart), in a worker thread."""
        return await asyncio.to_thread(self._invoke, "send_batch", batch, timeout)

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
                    lambda batch, timeout: self._invoke("send_batch", batch, timeout),
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

    def _invoke(self, method: str, *args) -> Any:
        """Call the queue actor's ``method`` (``_call``), following a replicated
        queue's leader to its new actor when it moves."""
        return _call(
            getattr(self._actor, method),
            *args,
            refresh=lambda: self._refresh(method),
            about=f"queue {self.name!r}",
        )

    def _refresh(self, method: str):
        """The queue's current actor, asked of the broker, as ``method``: a replicated
        queue's leader (the broker checks one that does not answer, and fails over);
        an unreplicated queue's actor, revived if it hibernated (one restarting in
        place after a crash is the same actor: the broker waits for it)."""
        old = self._actor
        try:
            actor_id = old._actor_id.hex()
            _call(self.broker._actor.suspect_leader, self.actor_name, actor_id, retry=False)
            self._actor = _call(self.broker._actor.get_queue, self.actor_name, retry=False)
        except RayMQError:  # the broker restarts, say: the old one again, later
            pass
        return getattr(self._actor, method)


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
        start: str = "latest",
        max_delivery_attempts: int | None = None,
        dead_letter_queue: str | None = None,
    ) -> Subscription:
        """Bind a subscription (or return it, if it exists with equal settings): a
        queue of its own over the address's one stored copy.

        ``selector`` is a filter applied when a message is routed to it (a consumer's
        selector applies on top); ``start`` is ``"latest"`` (from the next message sent)
        or ``"earliest"`` (from the oldest message the address still stores). Dead
        letters go to ``dead_letter_queue`` (default ``f"{address}.{name}.DLQ"``).
        Raises ``SubscriptionExists``, ``SelectorError``, ``InvalidQueueName`` or
        ``InvalidSetting``.
        """
        _call(
            self._actor.create_subscription,
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
        _call(self._actor.delete_subscription, name)

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


class Message(NamedTuple):
    """One delivered message.

    A named tuple: ``receive`` makes one per message, and a tuple is the cheapest
    Python object to make (about 0.3 µs against 0.6 µs for a slotted class, 4 µs for
    the dataclass this was), which kept ``receive()`` at a quarter of ``receive_batch``.
    """

    offset: int
    body: bytes
    delivery_count: int
    #: Seconds since the epoch when the queue stored the message.
    timestamp: float
    #: The properties as stored (a msgpack map; ``b""`` for none).
    raw_properties: bytes = b""

    @property
    def properties(self) -> dict[str, Any]:
        """The message's properties, decoded from ``raw_properties`` on each access."""
        return decode_properties(self.raw_properties)


class Messages(Sequence):
    """What ``receive`` returns: a sequence of ``Message`` (``len``, index, slice,
    iterate, ``==`` and ``+`` with lists; ``list(messages)`` for a list) over the
    received rows.

    Each ``Message`` is made when it is reached (iterating, indexing), not all up front,
    and is not kept: a message the application drops is freed at once. A list of 1,000
    live tuples cost more than making them (Python's garbage collector walked them and,
    as they outlived its youngest generation, the whole heap every few thousand
    messages). ``consumer.ack(messages)`` of the sequence (or a slice of it) takes the
    offsets column as one array, with no work per message."""

    __slots__ = ("_batch", "_columns_cache")

    def __init__(self, batch: pa.RecordBatch | None = None):
        self._batch = batch if batch is not None and batch.num_rows else None
        self._columns_cache: tuple[list, ...] | None = None

    @property
    def offsets(self) -> np.ndarray:
        """The messages' offsets, in order (int64; a view of the received rows)."""
        if self._batch is None:
            return np.zeros(0, dtype=np.int64)
        return np.asarray(self._batch.column("offset").to_numpy(), dtype=np.int64)

    def _columns(self) -> tuple[list, ...]:
        """The rows as Python values, column by column: made once, on first use.

        Column by column: ``RecordBatch.to_pydict`` made a ``datetime`` of every
        timestamp, 4 ms per 1,000 messages, more than receiving them."""
        cols = self._columns_cache
        if cols is None:
            b = self._batch
            if b is None:
                cols = ([], [], [], [], [])
            else:
                # Microseconds as int64 without a compute kernel (a fixed cost per call).
                micros = b.column("timestamp").to_numpy().view(np.int64)
                cols = (
                    b.column("offset").to_numpy().tolist(),
                    b.column("body").to_pylist(),
                    b.column("delivery_count").to_numpy().tolist(),
                    (micros / 1e6).tolist(),
                    # Arrow's C++ conversion: mostly b"" each, made faster than to_pylist.
                    b.column("properties").to_numpy(zero_copy_only=False).tolist(),
                )
            self._columns_cache = cols
        return cols

    def __len__(self) -> int:
        return 0 if self._batch is None else self._batch.num_rows

    def __iter__(self) -> Iterator[Message]:
        # map and zip run in C: no Python code per message.
        return map(_new_tuple, repeat(Message), zip(*self._columns(), strict=True))

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step == 1:
                n = max(stop - start, 0)
                return Messages(None if self._batch is None else self._batch.slice(start, n))
            return [self[i] for i in range(start, stop, step)]
        offsets, bodies, counts, seconds, props = self._columns()
        return _new_tuple(
            Message, (offsets[index], bodies[index], counts[index], seconds[index], props[index])
        )

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Messages | list | tuple):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # compared by value, as a list

    def __add__(self, other: Iterable[Message]) -> list[Message]:
        """A list of both (``got += consumer.receive(...)`` rebinds to a list)."""
        return [*self, *other]

    def __radd__(self, other: Iterable[Message]) -> list[Message]:
        return [*other, *self]

    def __repr__(self) -> str:
        return f"Messages({list(self)!r})"

    def __reduce__(self):
        return Messages, (self._batch,)


_new_tuple = tuple.__new__  # makes a Message from a row tuple without NamedTuple's checks

#: Longest ``Consumer.close`` waits for its TargetList to give back what it held
#: (seconds); past it the TargetList is killed, and the queue, watching it, delivers
#: again what it held.
CLOSE_TIMEOUT_SECONDS = 60.0
#: Longest an async receive waits, in the receive thread, for the one before it to be
#: settled (its caller resumed, or its rows put back): only a loop that stopped with
#: that caller suspended takes this long (seconds).
SETTLE_WAIT_SECONDS = 30.0


class Consumer:
    """Receives messages of one queue through its TargetList actor; usable as a context
    manager (closes on exit). Acks go straight to the queue actor.

    Thread-safe: ``close`` from another thread ends a receive waiting there
    (``ConsumerClosed``) and a ``for message in consumer`` loop.
    """

    def __init__(
        self,
        queue: Queue,
        prefetch: int,
        selector: str | None = None,
        high_watermark: int | None = None,
        high_watermark_bytes: int = 64 * 2**20,
        pending_cache_bytes: int = 16 * 2**20,
        node_id: str | None = None,
    ):
        from raymq.placement import spares
        from raymq.placement.nodes import near

        self.queue = queue
        self.prefetch = prefetch
        self.selector = selector
        self.consumer_id = uuid.uuid4().hex
        self._subscription = queue.subscription_name
        self._buffer: pa.RecordBatch | None = None  # taken from the TargetList, not yet handed out
        #: Guards ``_buffer`` (receives in several threads, receive_async's thread, close).
        self._buffer_lock = threading.Lock()
        self._closed = False
        # ack(wait=False): gathered, one call per half prefetch. Each call costs the
        # queue actor a Ray call and an fdatasync of its ack record: capped at 1,000
        # offsets (fb9e006), a tuned receive_batch(1000) consumer made 5x the calls,
        # queue actor CPU 1.5 -> 2.0 µs and client 0.6 -> 0.9 µs a message (measured).
        self._acks = AckPipeline(
            self._send_ack_call,
            self._check_ack_call,
            max(prefetch // 2, 1),
            what=f"queue {queue.name!r}",
        )
        self._ack_singles = self._acks._singles  # ack(message) appends here (never replaced)
        queue._consumers.add(self)  # its stats() and browse() see our acks
        #: Pipelined acks whose call failed with the queue's actor, or that the queue
        #: had not answered when the consumer closed (see ``ack``).
        self.acks_lost = 0
        #: Failures of ``close`` giving back what the TargetList held (logged; the
        #: TargetList is killed anyway, and the queue delivers its messages again).
        self.close_failures = 0
        # Asked first: it also follows an old handle to its queue's current actor (a
        # revived hibernated queue), and the TargetList then needs no first Ray call.
        fetch_endpoint, cached = queue._fetch_endpoint()
        node = near(node_id).node_id
        self.target_list, spare_channel = spares.take(node)
        warm_arrow_conversions()  # a process that did not connect() (once per process)
        self._channel: DeliveryChannel | None = None  # receives over a socket, if it opens
        self.delivery_channel_failures = 0  # channels that broke or did not open: Ray then
        #: The TargetList answered "by reference" last: more than the channel sends inline
        #: was ready (a deep queue). Fills then ask through Ray at once, as the channel
        #: would only answer that again (see ``_take_from_target_list``).
        self._by_reference = False
        #: Channel breaks whose unread answer could not be given back (``_channel_broke``).
        self.delivery_channel_unread = 0
        #: receive_async's thread: one per consumer, so a receive waiting for messages
        #: holds no thread of the loop's default pool; it runs the takes in order.
        self._receiver: concurrent.futures.ThreadPoolExecutor | None = None
        self._async_takes = 0  # takes under way in that thread (or not settled yet)
        #: Set once the latest async take's rows are settled: handed to its caller, or
        #: back in the buffer (its caller was cancelled). The next take waits for it.
        self._async_settled: threading.Event | None = None
        #: Set at this consumer's first answer from its TargetList, or its close: the
        #: next spare starts then (``spares.warm``).
        self._first_answer = threading.Event()
        settings = {  # ``TargetListActor.start``'s, by name
            "queue": queue.actor_name,
            "consumer_id": self.consumer_id,
            "prefetch": prefetch,
            "selector": selector,
            "high_watermark": prefetch if high_watermark is None else high_watermark,
            "high_watermark_bytes": high_watermark_bytes,
            "pending_cache_bytes": pending_cache_bytes,
            "subscription": queue.subscription_name,
            "namespace": queue.broker.namespace,
        }
        try:
            if spare_channel is not None and delivery_channel.USE_CHANNEL:
                # Started over its channel, not by a Ray call (``raymq.delivery_channel``).
                try:
                    self._channel = DeliveryChannel(*spare_channel, queue.name)
                except DeliveryBroken as exc:  # the spare died since it was up, say
                    _log.warning(
                        "queue %r: a new TargetList for consumer %s: %s",
                        queue.name,
                        self.consumer_id,
                        exc,
                    )
                    with contextlib.suppress(Exception):
                        ray.kill(self.target_list, no_restart=True)
                    self.target_list, _ = spares.take(node)  # a new one (none is warm)
                    spare_channel = None  # its channel: once Ray started it
            endpoint = self._start(fetch_endpoint, cached, settings)
            if endpoint == STALE_FETCH_ENDPOINT:  # the queue's actor was replaced
                fetch_endpoint, _ = queue._fetch_endpoint(fresh=True)
                endpoint = self._start(fetch_endpoint, False, settings)
        except BaseException:
            if self._channel is not None:
                self._channel.close()
                self._channel = None
            with contextlib.suppress(Exception):  # never a consumer's: not a spare again
                ray.kill(self.target_list, no_restart=True)
            spares.warm(node)
            raise
        connect = spare_channel is None and delivery_channel.USE_CHANNEL  # (not tried yet)
        if self._channel is None and endpoint is not None and connect:
            try:
                self._channel = DeliveryChannel(*endpoint, queue.name)
            except DeliveryBroken as exc:
                self._channel_broke(exc)
        # The next consumer's spare: once this one has its first answer, not before.
        spares.warm(node, after=self._first_answer)

    def _start(
        self, fetch_endpoint: tuple[str, int, str] | None, cached: bool, settings: dict
    ) -> tuple[str, int, str] | str | None:
        """``TargetListActor.start`` with ``settings``, over the DeliveryChannel if it
        is connected, else by a Ray call: its DeliveryChannel, None, or
        ``STALE_FETCH_ENDPOINT`` (a ``cached`` endpoint that failed: nothing started)."""
        named = {**settings, "fetch_endpoint": fetch_endpoint, "endpoint_cached": cached}
        if self._channel is None:
            return _call(
                self.target_list.start, self.queue._actor, **named, retry=False, about=self._about
            )
        try:
            return self._channel.start(named, CLOSE_TIMEOUT_SECONDS)
        except DeliveryBroken as exc:  # it may have started or not: not ours to use
            raise BrokerUnavailable(
                f"queue {self.queue.name!r}: consumer {self.consumer_id}: its TargetList"
                f" did not start: {exc}"
            ) from exc

    def _channel_broke(self, exc: DeliveryBroken, channel: DeliveryChannel | None = None) -> None:
        """The DeliveryChannel failed: receive through Ray from now on (counted, logged).

        If it broke with a request under way, the TargetList may have written rows this
        client never read: it is asked to give back the rows of any answer it wrote
        beyond the ``answers_read`` this client read whole (``channel_broke``), so the
        queue delivers them again rather than holding them (and this consumer's
        prefetch credit) until the consumer closes. Counted in
        ``delivery_channel_unread`` when that fails (logged; close gives them back)."""
        self._channel = None
        if self._closed:  # close() shut it: not a failure
            return
        self.delivery_channel_failures += 1
        _log.warning("consumer %s: receiving through Ray calls: %s", self.consumer_id, exc)
        if not exc.answer_pending or channel is None:
            return
        try:
            ref = self.target_list.channel_broke.remote(channel.answers_read)
            ray.get(ref, timeout=CLOSE_TIMEOUT_SECONDS)
        except Exception as exc2:  # noqa: BLE001 - held until close, which gives them back
            self.delivery_channel_unread += 1
            _log.warning(
                "queue %r: consumer %s: an answer of its broken delivery channel may stay"
                " held until the consumer closes: %r",
                self.queue.name,
                self.consumer_id,
                exc2,
            )

    def __enter__(self) -> Consumer:
        return self

    @property
    def _about(self) -> str:
        """This consumer, as errors name it."""
        return f"queue {self.queue.name!r}: consumer {self.consumer_id[:8]}"

    @property
    def _actor(self):
        """The queue's actor (a replicated queue's current leader, as the queue handle
        last found it)."""
        return self.queue._actor

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise self._closed_error()

    def _closed_error(self) -> ConsumerClosed:
        return ConsumerClosed(f"consumer {self.consumer_id} of queue {self.queue.name!r} is closed")

    def _fill(self, timeout: float | None, want: int = 1) -> pa.RecordBatch | None:
        """Messages from the TargetList for a receive of ``want``, waiting up to
        ``timeout`` seconds (None: until some come, or the consumer is closed: then
        ``ConsumerClosed``)."""
        self._send_acks()  # the credit they return lets the TargetList load more
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._closed:  # by another thread: its receive ends here
                raise self._closed_error()
            wait = 1.0 if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                batch = self._take_batch(wait, want)
            except RayMQError as exc:
                if self._closed:  # the TargetList went with the close
                    raise self._closed_error() from exc
                raise
            if batch is not None or (deadline is not None and time.monotonic() >= deadline):
                return batch

    async def receive_async(self, max_messages: int = 1, timeout: float | None = None) -> Messages:
        """``receive`` for asyncio code (Ray Serve deployments, async actors): up to
        ``max_messages`` messages, waiting up to ``timeout`` seconds (None: until some
        arrive) without blocking the event loop. Cancelled while waiting, what it took
        meanwhile stays in this consumer's buffer for the next receive (not lost)."""
        batch = await self._take_async(max_messages, timeout)
        return Messages() if batch is None else _messages(batch)

    async def receive_batch_async(
        self, max_messages: int, timeout: float | None = None
    ) -> pa.RecordBatch:
        """``receive_batch`` for asyncio code, as ``receive_async``: up to
        ``max_messages`` as one Arrow RecordBatch, empty if none came within ``timeout``
        seconds."""
        batch = await self._take_async(max_messages, timeout)
        return batch if batch is not None else EMPTY_DELIVERY

    def __aiter__(self) -> Consumer:
        """``async for message in consumer``: messages one at a time as they arrive,
        until the consumer is closed; ack each or they are delivered again."""
        return self

    async def __anext__(self) -> Message:
        while True:
            try:
                got = await self.receive_async(1, None)
            except ConsumerClosed:
                raise StopAsyncIteration from None
            if got:
                return got[0]

    async def _take_async(self, max_messages: int, timeout: float | None) -> pa.RecordBatch | None:
        """``_take`` off the event loop: from the buffer at once when it holds messages
        (slicing it does not block), else in this consumer's receive thread.

        Rows of a take whose caller was cancelled go back to the front of the buffer
        before any later receive slices it: in the receive thread if the cancel came
        first, else on the loop's thread (``_settle``). A later take waits in the receive
        thread until the one before it is settled (its rows handed to its caller or put
        back), and ``_async_takes`` stays raised until then, which keeps later receives
        off the buffer's fast path."""
        if self._buffer is not None and not self._async_takes:
            # Never _take here: emptied by another thread meanwhile, it would fetch on
            # the event loop's thread.
            batch = self._take_buffered(max_messages)
            if batch is not None:
                return batch
        self._check_open()
        if self._receiver is None:
            self._receiver = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"raymq-consumer-{self.consumer_id[:8]}"
            )
        abandoned = threading.Event()
        before, settled = self._async_settled, threading.Event()
        self._async_settled = settled

        def take() -> pa.RecordBatch | None:
            if before is not None and not before.wait(SETTLE_WAIT_SECONDS):
                # Its loop stopped before the earlier take's caller resumed: go on.
                _log.warning("consumer %s: an async receive never settled", self.consumer_id)
            batch = self._take(max_messages, timeout)
            if abandoned.is_set() and batch is not None:
                self._unget(batch)  # its caller was cancelled: the next receive has it
                return None
            return batch

        self._async_takes += 1
        fut = asyncio.get_running_loop().run_in_executor(self._receiver, take)
        try:
            batch = await asyncio.shield(fut)
        except asyncio.CancelledError:
            abandoned.set()
            if fut.done():  # finished before the cancel reached us: its rows come back
                self._settle(settled, fut)
            else:
                fut.add_done_callback(functools.partial(self._settle, settled))
            raise
        except BaseException:
            self._async_takes -= 1
            settled.set()
            raise
        self._async_takes -= 1
        settled.set()
        return batch

    def _settle(self, settled: threading.Event, fut: asyncio.Future) -> None:
        """An abandoned async take finished: its rows (if it kept any) go back to the
        front of the buffer; then later receives may slice the buffer again."""
        try:
            if not fut.cancelled() and fut.exception() is None and fut.result() is not None:
                self._unget(fut.result())
        finally:
            self._async_takes -= 1
            settled.set()

    def _take_batch(self, wait: float, want: int = 1) -> pa.RecordBatch | None:
        """Messages from the TargetList for a receive of ``want``, waiting up to
        ``wait`` seconds for the first; None if none came. Over the DeliveryChannel
        (one socket round trip, at least ``CHANNEL_TAKE_MESSAGES`` asked for, the rows
        inline), unless it is broken or more than it sends inline is ready for the
        receive: then a prefetch's worth through Ray (references read without a copy
        from the object store), and so for the next fills until one brings no more
        than the channel sends inline."""
        try:
            return self._take_from_target_list(wait, want)
        finally:
            self._first_answer.set()

    def _take_from_target_list(self, wait: float, want: int) -> pa.RecordBatch | None:
        channel = self._channel
        # On a deep queue every channel request was answered "by reference", a socket
        # round trip on each fill before the Ray call that brings the rows: they go
        # straight to that call until it brings no more than the channel sends inline.
        if channel is not None and not self._by_reference:
            try:
                got = channel.take(min(max(want, CHANNEL_TAKE_MESSAGES), self.prefetch), wait)
            except DeliveryBroken as exc:
                self._channel_broke(exc, channel)  # the Ray call below raises the typed error
                if self._closed:
                    raise self._closed_error() from None
            else:
                if got is not BY_REFERENCE:
                    return got if got is not None and got.num_rows else None
                wait = 0.0  # BY_REFERENCE: they are ready
                self._by_reference = True
        entries = _call(self.target_list.take, self.prefetch, wait, retry=False, about=self._about)
        parts = []
        for (_ref, start, n), batch in zip(
            entries, _get_batches([e[0] for e in entries]), strict=True
        ):
            if batch is not None:  # None: lost with a restarted queue (comes again)
                parts.append(batch.slice(start, n))
        got = None if not parts else parts[0] if len(parts) == 1 else pa.concat_batches(parts)
        if got is None or got.nbytes <= INLINE_BYTES:
            self._by_reference = False  # caught up: the channel's inline answers again
        return got

    def _take_buffered(self, max_messages: int) -> pa.RecordBatch | None:
        """Up to ``max_messages`` from the buffer, never waiting (None: it is empty)."""
        if self._closed:
            raise self._closed_error()
        if isinstance(max_messages, bool) or not isinstance(max_messages, int) or max_messages < 1:
            raise InvalidSetting(f"max_messages={max_messages!r} must be an int >= 1")
        with self._buffer_lock:
            buffer = self._buffer
            return None if buffer is None else self._slice(buffer, max_messages)

    def _take(self, max_messages: int, timeout: float | None) -> pa.RecordBatch | None:
        batch = self._take_buffered(max_messages)
        if batch is not None:
            return batch
        batch = self._fill(timeout, max_messages)  # waits: not under the lock
        if batch is None:
            return None
        with self._buffer_lock:
            if self._closed:  # the queue redelivers them: close released what we hold
                raise self._closed_error()
            if self._buffer is not None:  # another receive (or a give-back) filled it
                batch = pa.concat_batches([self._buffer, batch])
            return self._slice(batch, max_messages)

    def _slice(self, buffer: pa.RecordBatch, max_messages: int) -> pa.RecordBatch:
        """The first ``max_messages`` of ``buffer``; the rest stays buffered (under
        ``_buffer_lock``)."""
        if buffer.num_rows <= max_messages:
            self._buffer = None
            return buffer
        self._buffer = buffer.slice(max_messages)
        return buffer.slice(0, max_messages)

    def receive(self, max_messages: int = 1, timeout: float | None = None) -> Messages:
        """Up to ``max_messages`` messages, waiting up to ``timeout`` seconds (None:
        until some come; ``ConsumerClosed`` if the consumer is closed meanwhile).

        Returns a ``Messages`` sequence (a list's reading operations; each
        ``Message`` made as it is reached); ``ack`` of it costs no work per message.
        """
        batch = self._take(max_messages, timeout)
        return Messages() if batch is None else _messages(batch)

    def __iter__(self) -> Iterator[Message]:
        """Messages one at a time as they arrive, until the consumer is closed (from
        another thread too); ack each (``consumer.ack(message)``, pipelined) or they are
        delivered again.

        Taken from the TargetList in chunks; leaving the loop early hands the rest of a
        chunk back to this consumer's buffer, not received.
        """
        while True:
            try:
                batch = self._take(ITER_CHUNK_MESSAGES, None)
            except ConsumerClosed:
                return
            if batch is None:
                continue
            messages = iter(Messages(batch))
            for message in messages:
                if self._closed:
                    return
                try:
                    yield message
                except GeneratorExit:  # the loop was left: the rest stays ours, in order
                    rest = sum(1 for _ in messages)
                    self._unget(batch.slice(batch.num_rows - rest))
                    raise

    def _unget(self, rows: pa.RecordBatch) -> None:
        """Put rows taken but not handed out back in front of the buffer."""
        if not rows.num_rows:
            return
        with self._buffer_lock:
            if self._closed:
                return
            self._buffer = rows if self._buffer is None else pa.concat_batches([rows, self._buffer])

    def receive_batch(self, max_messages: int, timeout: float | None = None) -> pa.RecordBatch:
        """Up to ``max_messages`` as one Arrow RecordBatch read from the object store.

        Columns: offset, timestamp, delivery_count, body, properties (msgpack). Empty
        when nothing arrived within ``timeout`` seconds.
        """
        batch = self._take(max_messages, timeout)
        return batch if batch is not None else EMPTY_DELIVERY

    def ack(
        self,
        messages: Message | int | Iterable | pa.RecordBatch | pa.Table,
        *,
        wait: bool = False,
    ) -> int | None:
        """Acknowledge messages (``Message`` objects, offsets, or a received batch).

        By default the ack is pipelined, as AMQP's are: it returns None at once and goes
        out with others as one call and one fsync when half the prefetch is gathered,
        after ``raymq.acks.ACK_LINGER_SECONDS``, before the consumer asks for more
        messages, and on ``flush``, ``nack``, ``reject``, ``close`` and this queue handle's
        ``stats``/``browse``. Its outcome is checked as later ones are sent and by
        ``flush``/``close``, which raise the first error of an earlier one (such as
        ``InvalidAck``). A message whose ack had not reached the queue when this process
        died, or when the queue's actor died or moved, is delivered again (those are
        counted in ``acks_lost`` and logged).

        A pipelined offset the queue refuses (``InvalidAck``: never delivered, or held by
        another consumer) is reported alone: the other offsets gathered into the same
        call are acknowledged.

        ``wait=True`` sends it (with any gathered before it) and returns how many
        messages were newly acknowledged, once that is durable; refused, it raises
        ``InvalidAck`` and acknowledges none of ``messages``.
        """
        if type(messages) is Message and not wait and not self._closed:
            # The per-message loop: AckPipeline.add_one inlined (a call less per
            # message); no lock (list.append is atomic), no array.
            singles = self._ack_singles
            singles.append(messages[0])
            acks = self._acks
            if len(singles) + acks._unsent_count >= acks.batch_messages or not acks.lingering:
                acks._gathered()
            return None
        self._check_open()
        offsets = _offsets_of(messages)
        if wait:
            self._acks.send()
            self._acks.collect(block=False)
            # Refused, it changes nothing (as every typed error): the caller decides.
            return self.queue._invoke("ack", self.consumer_id, offsets, self._subscription)
        self._acks.add(offsets)
        return None

    def _send_acks(self) -> None:
        """Send the gathered pipelined acks as one call (not waiting for it), and check
        the calls that finished (a failure is raised by the next ack, flush or close):
        the linger thread only sends, so without this they would pile up."""
        self._acks.send()
        full = self._acks.in_flight > self._acks.max_in_flight
        self._acks.collect(block=full, raise_errors=False)

    def _send_ack_call(self, offsets: np.ndarray) -> concurrent.futures.Future:
        actor = self._actor
        fut = actor.ack.remote(self.consumer_id, offsets, self._subscription).future()
        fut.raymq_actor = actor  # (whom it went to: _follow_queue)
        return fut

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every pipelined ack is durable, at most ``timeout`` seconds (None:
        ``raymq.acks.ACK_ANSWER_SECONDS``); raises the first error of an ack, then
        ``BrokerUnavailable`` naming the queue if the queue has not answered them all
        (those stay in flight: a later ``flush`` waits for them again)."""
        unanswered = self._acks.flush(timeout)
        if unanswered:
            seconds = acks.ACK_ANSWER_SECONDS if timeout is None else timeout
            raise acks.unanswered_error(f"queue {self.queue.name!r}", unanswered, seconds)

    def _check_ack_call(self, fut: concurrent.futures.Future, parts: list[np.ndarray]) -> None:
        """Raise the typed error of one finished ack call.

        Pipelined acks are tracked as futures: asking a future whether it is done is
        free, where ``ray.wait(..., timeout=0)`` costs about 2 ms a call here.
        """
        try:
            fut.result()
        except ray.exceptions.RayTaskError as exc:
            error = _unwrap(exc)
            if isinstance(error, InvalidAck):
                # The queue refused the whole gathered call for some offsets it does not
                # let us ack: apply the others, report the first refused one.
                offsets = parts[0] if len(parts) == 1 else np.concatenate(parts)
                if len(offsets) > 1:
                    error = self._ack_apart(offsets) or error
            if isinstance(error, NotLeader):
                self._ack_lost(parts, error)
                self._follow_queue(fut)
                return
            raise error from None
        except _RETRYABLE as exc:
            self._ack_lost(parts, exc)
            self._follow_queue(fut)

    def _follow_queue(self, failed: concurrent.futures.Future) -> None:
        """An ack call failed because its queue actor is gone or leads no more: the
        next acks go to the queue's current actor (a replicated queue's new leader, a
        revived one), as the TargetList's fetches do, once per actor lost."""
        if getattr(failed, "raymq_actor", None) is self.queue._actor:
            self.queue._refresh("ack")

    def _ack_lost(self, parts: list[np.ndarray], why: object) -> None:
        """Pipelined acks whose outcome is unknown (the queue's actor died, restarts, a
        replica took over, or it did not answer before the consumer closed): a message
        they did not reach is delivered again, as at-least-once allows. Counted and
        logged."""
        lost = sum(len(p) for p in parts)
        if not lost:
            return
        self.acks_lost += lost
        _log.warning(
            "queue %r: %d pipelined acks of consumer %s may be lost with the queue's actor"
            " (%s); their messages are delivered again unless the ack was stored",
            self.queue.name,
            lost,
            self.consumer_id,
            why,
        )

    def _ack_apart(self, offsets: np.ndarray) -> InvalidAck | None:
        """Ack ``offsets`` after the queue refused them together (changing nothing): one
        call acks those it accepts; returns its refusal of the others, if any. A call
        that fails otherwise is counted in ``acks_lost``."""
        ref = self._actor.ack_acceptable.remote(self.consumer_id, offsets, self._subscription)
        try:
            _fresh, refusal = ray.get(ref, timeout=acks.ACK_ANSWER_SECONDS)
        except ray.exceptions.GetTimeoutError:
            ray.cancel(ref)
            self._ack_lost([offsets], f"unanswered in {acks.ACK_ANSWER_SECONDS} s")
            return None
        except ray.exceptions.RayTaskError as exc:
            error = _unwrap(exc)
            if isinstance(error, InvalidAck):
                return error
            self._ack_lost([offsets], error)
            return None
        except _RETRYABLE as exc:
            self._ack_lost([offsets], exc)
            return None
        return InvalidAck(refusal) if refusal else None

    def nack(self, messages: Message | int | Iterable | pa.RecordBatch | pa.Table) -> int:
        """Give messages back: they are delivered again with ``delivery_count`` + 1."""
        self._check_open()
        self._send_acks()  # in order: what was acked before is not given back
        offsets = _offsets_of(messages)
        return self.queue._invoke("nack", self.consumer_id, offsets, self._subscription)

    def reject(self, messages: Message | int | Iterable | pa.RecordBatch | pa.Table) -> int:
        """Give up on messages: they go to the queue's dead-letter queue (with
        ``RayMQDeadLetterReason`` "rejected") and are not delivered again here.

        Returns how many were taken; the move itself happens in the background (see
        ``dead_letters_pending`` and ``messages_dead_lettered`` in ``Queue.stats()``).
        """
        self._check_open()
        self._send_acks()  # in order, as for nack
        offsets = _offsets_of(messages)
        return self.queue._invoke("reject", self.consumer_id, offsets, self._subscription)

    def backlog(self) -> int:
        """Messages the queue has for this consumer that it has not received yet.

        Counts what its TargetList holds or is loading, what the queue would deliver to
        it next (matching its selector, not held by another consumer), and, while a
        consumer that arrived at a deep queue still scans stored properties, the stored
        messages left to examine (an upper bound then). Zero means a receive finds
        nothing until new messages arrive: "drain until empty" is
        ``while (got := c.receive(...)) or c.backlog(): ...``, which a short receive
        timeout alone gets wrong on a busy machine.
        """
        self._check_open()
        s = self.stats()
        loading = s.get("delivered", 0) - s.get("handed_out", 0) - s.get("given_back", 0)
        return (
            max(loading, 0)
            + s.get("cache_references", 0)
            + s.get("scan_remaining", 0)
            + s["client_buffered"]
        )

    def stats(self) -> dict[str, Any]:
        """The TargetList: watermark, high watermark, direct and CacheReference counts and
        bytes, PendingCache bytes, hits and misses, and what the consumer holds; and
        ``client_buffered``: messages this client took from the TargetList (counted in
        its ``handed_out``) that no receive has returned yet (a receive over the
        DeliveryChannel takes up to ``CHANNEL_TAKE_MESSAGES`` at once)."""
        s = _call(self.target_list.stats, retry=False, about=self._about)
        buffer = self._buffer
        s["client_buffered"] = 0 if buffer is None else buffer.num_rows
        return s

    def close(self) -> None:
        """Close; unacknowledged messages are delivered again (to any consumer).

        From another thread too: a receive waiting there ends with ``ConsumerClosed`` and
        ``for message in consumer`` stops. Gathered acks are sent first and waited for
        at most ``raymq.acks.ACK_ANSWER_SECONDS``; those the queue has not answered by
        then are counted in ``acks_lost`` and logged (their messages are delivered
        again unless the queue stored them). Raises the first refused ack (such as
        ``InvalidAck``), after closing. The TargetList actor is always released: if
        giving back what it held fails (logged, counted in ``close_failures``) it is
        killed, and the queue, watching it, delivers its messages again.
        """
        if self._closed:
            return
        self._closed = True  # first: receives in other threads stop at their next check
        self._first_answer.set()
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()  # ends a take waiting on it in another thread, at once
        ack_error: RayMQError | None = None
        try:
            unanswered = self._acks.flush()
        except RayMQError as exc:  # close anyway; then report the failed ack
            ack_error, unanswered = exc, self._acks.in_flight
        except Exception as exc:  # noqa: BLE001 - sending failed: counted below
            _log.warning("queue %r: sending acks on close failed: %r", self.queue.name, exc)
            unanswered = self._acks.in_flight
        left = self._acks.abandon()  # unanswered in flight, or unsent after a failure
        if left:
            why = f"{unanswered} ack calls not answered within {acks.ACK_ANSWER_SECONDS:g} s"
            self._ack_lost(left, why if unanswered else "not sent")
        with self._buffer_lock:
            buffer, self._buffer = self._buffer, None
        not_received = None if buffer is None else buffer.column("offset").to_numpy()
        if self._receiver is not None:
            self._receiver.shutdown(wait=False)
        try:
            self._release_target_list(not_received)
        finally:
            try:
                ray.kill(self.target_list, no_restart=True)
            except Exception as exc:  # noqa: BLE001 - a dead one: nothing left to release
                _log.warning("consumer %s: killing its TargetList: %r", self.consumer_id, exc)
        if ack_error is not None:
            raise ack_error

    def _release_target_list(self, not_received: np.ndarray | None) -> None:
        """Have the TargetList give back what it held (``not_received`` uncounted), else
        the queue directly; failures are logged and counted, never raised: the caller
        kills the TargetList, which the queue sees."""
        try:
            ray.get(self.target_list.close.remote(not_received), timeout=CLOSE_TIMEOUT_SECONDS)
            return
        except ray.exceptions.RayTaskError as exc:
            error: BaseException = _unwrap(exc)
        except Exception as exc:  # noqa: BLE001 - dead, timed out, or a bug: released below
            error = exc
        self.close_failures += 1
        _log.warning(
            "queue %r: consumer %s: its TargetList could not give back what it held (%r);"
            " asking the queue",
            self.queue.name,
            self.consumer_id,
            error,
        )
        try:
            close = self._actor.close_consumer
            ray.get(
                close.remote(self.consumer_id, not_received, self._subscription),
                timeout=CLOSE_TIMEOUT_SECONDS,
            )
        except Exception as exc:  # noqa: BLE001 - the kill that follows releases them
            _log.warning(
                "queue %r: consumer %s: closing at the queue failed (%r); it delivers the"
                " messages again when it sees the TargetList die",
                self.queue.name,
                self.consumer_id,
                exc,
            )


def _get_batches(refs: list) -> list[pa.RecordBatch | None]:
    """Read delivery batches from the object store (zero-copy on the same node)."""
    lost = (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError)
    try:
        return list(ray.get(refs))
    except lost:
        pass
    out: list[pa.RecordBatch | None] = []
    for ref in refs:
        try:
            out.append(ray.get(ref))
        except lost:
            out.append(None)
    return out


def _messages(batch: pa.RecordBatch) -> Messages:
    """The rows of a delivery batch as ``Message`` tuples (made as they are reached)."""
    return Messages(batch)


def _check_count(name: str, value: object, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidSetting(f"{name}={value!r} must be an int >= {minimum}")


def _offsets_of(messages: Any) -> np.ndarray:
    if isinstance(messages, Messages):  # as received: the column, no work per message
        return messages.offsets
    if isinstance(messages, Message):
        return np.array([messages.offset], dtype=np.int64)
    if isinstance(messages, pa.RecordBatch | pa.Table):
        return np.asarray(messages.column("offset").to_numpy(), dtype=np.int64)
    if isinstance(messages, bool):
        raise TypeError("ack takes messages or offsets, not bool")
    if isinstance(messages, int | np.integer):
        return np.array([int(messages)], dtype=np.int64)
    if isinstance(messages, np.ndarray):
        if messages.dtype.kind not in "iu":
            raise TypeError(f"offsets array must be integer, not {messages.dtype}")
        return messages.astype(np.int64)
    if isinstance(messages, Iterable) and not isinstance(messages, str | bytes):
        out = []
        for m in messages:
            if isinstance(m, Message):
                out.append(m.offset)
            elif isinstance(m, int | np.integer) and not isinstance(m, bool):
                out.append(int(m))
            else:
                raise TypeError(f"ack takes messages or int offsets, not {type(m).__name__}")
        return np.array(out, dtype=np.int64)
    raise TypeError(f"ack takes messages or offsets, not {type(messages).__name__}")
