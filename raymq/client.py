"""The client API: ``connect()``, and handles for the broker, queues and consumers.

Usable from a driver, a Ray task, an actor or a ``ray job submit`` job. Every call to
a broker actor goes through ``_call``, which turns Ray's wrapped errors back into the
typed errors of ``raymq.errors`` and retries while a restarting actor comes back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import ray

from raymq import delivery_channel
from raymq.acks import AckPipeline
from raymq.batch import (
    EMPTY_DELIVERY,
    MessageBatch,
    check_size,
    check_sizes,
    warm_arrow_conversions,
)
from raymq.config import (
    BrokerConfig,
    QueueConfig,
    apply_ray_env_defaults,
    validate_queue_name,
)
from raymq.delivery_channel import BY_REFERENCE, DeliveryChannel
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
from raymq.producer import Producer, ProducerStats
from raymq.properties import decode_properties, encode_properties, validate_properties
from raymq.selector import Selector
from raymq.send_channel import ChannelBroken, SendChannel

_log = logging.getLogger("raymq.client")

#: Pipelined acks (``ack(wait=False)``) a consumer lets run before it waits for some.
#: How long a call keeps retrying while an actor restarts (seconds).
RESTART_GRACE_SECONDS = 60.0
#: Messages ``for message in consumer`` takes from the buffer at a time.
ITER_CHUNK_MESSAGES = 256
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
    method, *args, retry: bool = True, refresh: Callable[[], Any] | None = None, **kwargs
) -> Any:
    """Call an actor method and wait; typed errors unwrapped, restarts waited out.

    ``refresh`` gives the method again on a new actor when this one is unavailable or
    answers ``NotLeader`` (a replicated queue's leader moved): the call goes there.
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
                raise BrokerUnavailable(f"actor unavailable: {exc}") from exc
            if refresh is not None:
                method = refresh()
                delay = min(delay, 0.2)
            time.sleep(delay)
            delay = min(delay * 2, 1.0)


async def _call_async(method, *args, **kwargs) -> Any:
    try:
        return await method.remote(*args, **kwargs)
    except ray.exceptions.RayTaskError as exc:
        raise _unwrap(exc) from None
    except _RETRYABLE as exc:
        raise BrokerUnavailable(f"actor unavailable: {exc}") from exc


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
    actor = BrokerActor.options(
        name=BROKER_ACTOR_NAME,
        namespace=namespace,
        lifetime="detached",
        get_if_exists=True,
        scheduling_strategy=pinned_to(current_node_id()),
    ).remote(config, namespace)
    running: BrokerConfig = _call(actor.config)
    if broker_config and running != config:
        raise InvalidSetting(f"broker in namespace {namespace!r} runs with {running}, not {config}")
    spares.warm(current_node_id())  # the first consumer need not wait for a process
    warm_arrow_conversions()  # nor its first receive for pyarrow's lazy imports
    governor = MemoryGovernorActor.options(
        name=GOVERNOR_ACTOR_NAME,
        namespace=namespace,
        lifetime="detached",
        get_if_exists=True,
        scheduling_strategy=pinned_to(current_node_id()),
    ).remote(running, namespace)
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

    def shutdown(self) -> None:
        """Stop the broker's actors, keeping every queue's files."""
        if self._shut_down:
            return
        self._shut_down = True
        try:
            if self._governor is not None:
                ray.kill(self._governor, no_restart=True)
            _call(self._actor.stop_queues, retry=False)
        finally:
            ray.kill(self._actor, no_restart=True)


@dataclass
class _PendingSend:
    """One single-message send waiting in the coalescer."""

    body: bytes
    properties: bytes
    offset: int | None = None
    error: BaseException | None = None
    done: bool = False


class _Coalescer:
    """Coalesces concurrent single-message sends of one process into one actor call.

    The first caller in becomes the leader and sends what has gathered; callers arriving
    meanwhile wait and go out together in the next call (client-side group commit).
    """

    def __init__(self, queue: Queue, timeout: float | None):
        self._queue = queue
        self._timeout = timeout
        self._cv = threading.Condition()
        self._waiting: list[_PendingSend] = []
        self._leader = False

    def send(self, body: bytes, props: bytes) -> int | None:
        item = _PendingSend(body, props)
        with self._cv:
            self._waiting.append(item)
            while self._leader and not item.done:
                self._cv.wait()
            lead = not item.done
            if lead:
                self._leader = True
        if lead:
            try:
                self._flush_until(item)
            finally:
                with self._cv:
                    self._leader = False
                    self._cv.notify_all()
        if item.error is not None:
            raise item.error
        return item.offset

    def _flush_until(self, mine: _PendingSend) -> None:
        while not mine.done:
            with self._cv:
                items, self._waiting = self._waiting, []
            batch = MessageBatch.from_encoded(
                [i.body for i in items], [i.properties for i in items]
            )
            try:
                first, count = self._queue._invoke("send_batch", batch, self._timeout)
                for k, it in enumerate(items[:count]):  # the rest were DROPped
                    it.offset = first + k
            except Exception as exc:  # every waiter of this call gets the error
                for it in items:
                    it.error = exc
            with self._cv:
                for it in items:
                    it.done = True
                self._cv.notify_all()


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
    except (OSError, RayMQError):  # unreachable port, refused, or the actor is gone
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
        self._coalescers: dict[float | None, _Coalescer] = {}
        self._coalescers_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Queue({self.name!r})"

    def _check_body(self, body: object) -> bytes:
        if not isinstance(body, bytes | bytearray | memoryview):
            raise TypeError(
                f"body for queue {self.name!r} must be bytes, not {type(body).__name__}"
            )
        check_size(len(body), self.broker.config.max_message_size, self.name)
        return bytes(body)

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

        It goes over this process's SendChannel to the queue actor (a socket, see
        ``raymq.send_channel``), else through a Ray call; concurrent sends from threads
        of one process share one write and one fsync. At
        the queue's ``max_size_bytes``: PAGE stores it anyway, DROP drops it (returns
        None), FAIL raises ``AddressFull``, BLOCK waits for room up to ``timeout``
        seconds (None: for ever), then raises ``AddressFull``.

        ``wait=False`` pipelines (``raymq.producer``): the message joins this handle's
        open batch, shipped without waiting; ``SendFuture.result()`` gives the offset
        (None: DROPped) or raises the error once the queue has the batch durable.
        ``send`` then blocks only while ``MAX_IN_FLIGHT_MESSAGES`` messages or
        ``MAX_IN_FLIGHT_BYTES`` bytes are unanswered; ``flush()`` waits for all. A
        handle's messages are stored in the order sent, waiting or not. Bad input
        (type, size, properties) raises here, at once, in both modes.
        """
        body = self._check_body(body)
        props = (
            b""
            if properties is None
            else encode_properties(
                validate_properties(properties, where=f"message for queue {self.name!r}")
            )
        )
        if props:  # the queue counts properties toward max_message_size too
            check_size(len(body) + len(props), self.broker.config.max_message_size, self.name)
        producer = self._producer
        if not wait:
            return (producer or self._make_producer()).send(body, props, timeout)
        if producer is not None and producer.busy():  # behind pipelined sends: order
            return producer.send(body, props, timeout).result()
        channel = _send_channel(self)
        if channel is not None:
            try:
                return channel.send(body, props, timeout)
            except (ChannelBroken, NotLeader):
                pass  # the actor restarted, moved or the network failed: Ray calls follow
        with self._coalescers_lock:
            coalescer = self._coalescers.get(timeout)
            if coalescer is None:
                coalescer = self._coalescers[timeout] = _Coalescer(self, timeout)
        return coalescer.send(body, props)

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
            self._producer.drain()  # pipelined sends of this handle go first: order
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
        loop; through a Ray call when the queue has no channel or it broke."""
        body = self._check_body(body)
        props = (
            b""
            if properties is None
            else encode_properties(
                validate_properties(properties, where=f"message for queue {self.name!r}")
            )
        )
        if props:  # the queue counts properties toward max_message_size too
            check_size(len(body) + len(props), self.broker.config.max_message_size, self.name)
        channel = await self._send_channel_async()
        if channel is not None:
            try:
                return await channel.send_async(body, props, timeout)
            except (ChannelBroken, NotLeader):
                pass  # as in ``send``: a Ray call follows a restart or a new leader
        batch = MessageBatch.from_encoded([body], [props])
        first, count = await _call_async(self._actor.send_batch, batch, timeout)
        return first if count else None

    async def send_batch_async(
        self, bodies, properties=None, *, timeout: float | None = None
    ) -> list[int]:
        """``send_batch`` for asyncio code: over the send channel as ``send_batch``,
        awaiting without blocking the event loop; else through a Ray call."""
        batch = self._pack(bodies, properties)
        if batch.nbytes <= self.broker.config.max_message_size:
            channel = await self._send_channel_async()
            if channel is not None:
                try:
                    first, count = await channel.send_batch_async(batch, timeout)
                    return list(range(first, first + count))
                except (ChannelBroken, NotLeader):
                    pass  # as in ``send_batch``
        first, count = await _call_async(self._actor.send_batch, batch, timeout)
        return list(range(first, first + count))

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
        with self._coalescers_lock:  # one per handle, even when threads race here
            if self._producer is None:
                self._producer = Producer(
                    self.name,
                    lambda: _send_channel(self),
                    lambda batch, timeout: self._invoke("send_batch", batch, timeout),
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
            batch, pos = _call(
                self._actor.browse, pos, batch_size, selector, self.subscription_name
            )
            yield from _messages(batch)
            if batch.num_rows < batch_size:  # the queue walks to its end before stopping short
                return

    def stats(self) -> dict[str, Any]:
        """Depth, bytes in memory and on disk, segment files, consumers and rates."""
        self._flush_acks()
        return self._invoke("stats", self.subscription_name).to_dict()

    def _flush_acks(self) -> None:
        """Make the pipelined acks of this handle's open consumers durable first."""
        for consumer in list(self._consumers):
            consumer.flush()

    def _invoke(self, method: str, *args) -> Any:
        """Call the queue actor's ``method`` (``_call``), following a replicated
        queue's leader to its new actor when it moves."""
        return _call(getattr(self._actor, method), *args, refresh=lambda: self._refresh(method))

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
        return [spec.name for spec in _call(self._actor.list_subscriptions)]

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
        out = _call(self._actor.stats).to_dict()
        out["subscriptions"] = _call(self._actor.subscription_depths)
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


class Consumer:
    """Receives messages of one queue through its TargetList actor; usable as a context
    manager (closes on exit). Acks go straight to the queue actor."""

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
        self._closed = False
        # ack(wait=False): gathered, one call per half prefetch (at most 1,000 offsets).
        self._acks = AckPipeline(
            self._send_ack_call, self._check_ack_call, min(max(prefetch // 2, 1), 1000)
        )
        queue._consumers.add(self)  # its stats() and browse() see our acks
        #: Pipelined acks whose call failed with the queue's actor (see ``ack``).
        self.acks_lost = 0
        node = near(node_id).node_id
        self.target_list = spares.take(node)
        warm_arrow_conversions()  # a process that did not connect() (once per process)
        self._channel: DeliveryChannel | None = None  # receives over a socket, if it opens
        self.delivery_channel_failures = 0  # channels that broke or did not open: Ray then
        #: receive_async's thread: one per consumer, so a receive waiting for messages
        #: holds no thread of the loop's default pool; it runs the takes in order.
        self._receiver: concurrent.futures.ThreadPoolExecutor | None = None
        self._async_takes = 0  # takes under way in that thread
        try:
            endpoint = _call(
                self.target_list.start,
                queue._actor,
                queue.actor_name,
                self.consumer_id,
                prefetch,
                selector,
                prefetch if high_watermark is None else high_watermark,
                high_watermark_bytes,
                pending_cache_bytes,
                queue.subscription_name,
                retry=False,
            )
        except BaseException:
            spares.warm(node)
            raise
        if endpoint is not None and delivery_channel.USE_CHANNEL:
            try:
                self._channel = DeliveryChannel(*endpoint, queue.name)
            except DeliveryBroken as exc:
                self._channel_broke(exc)
        spares.warm(node)  # the next consumer's: once this one is up, not before

    def _channel_broke(self, exc: DeliveryBroken) -> None:
        """The DeliveryChannel failed: receive through Ray from now on (counted, logged)."""
        self.delivery_channel_failures += 1
        self._channel = None
        _log.warning("consumer %s: receiving through Ray calls: %s", self.consumer_id, exc)

    def __enter__(self) -> Consumer:
        return self

    @property
    def _actor(self):
        """The queue's actor (a replicated queue's current leader, as the queue handle
        last found it)."""
        return self.queue._actor

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ConsumerClosed(
                f"consumer {self.consumer_id} of queue {self.queue.name!r} is closed"
            )

    def _fill(self, timeout: float | None, want: int = 1) -> None:
        """Fill the empty buffer for a receive of ``want`` messages, waiting up to
        ``timeout`` seconds (None: until some come)."""
        self._send_acks()  # the credit they return lets the TargetList load more
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = 1.0 if deadline is None else max(0.0, deadline - time.monotonic())
            batch = self._take_batch(wait, want)
            if batch is not None or (deadline is not None and time.monotonic() >= deadline):
                self._buffer = batch
                return

    async def receive_async(
        self, max_messages: int = 1, timeout: float | None = None
    ) -> list[Message]:
        """``receive`` for asyncio code (Ray Serve deployments, async actors): up to
        ``max_messages`` messages, waiting up to ``timeout`` seconds (None: until some
        arrive) without blocking the event loop. Cancelled while waiting, what it took
        meanwhile stays in this consumer's buffer for the next receive (not lost)."""
        batch = await self._take_async(max_messages, timeout)
        return [] if batch is None else _messages(batch)

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
        (slicing it does not block), else in this consumer's receive thread."""
        if self._buffer is not None and not self._async_takes:
            return self._take(max_messages, 0.0)
        self._check_open()
        if self._receiver is None:
            self._receiver = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"raymq-consumer-{self.consumer_id[:8]}"
            )
        abandoned = threading.Event()

        def take() -> pa.RecordBatch | None:
            batch = self._take(max_messages, timeout)
            if abandoned.is_set() and batch is not None:
                self._unget(batch)  # its caller was cancelled: the next receive has it
                return None
            return batch

        def finished(_done: asyncio.Future) -> None:
            self._async_takes -= 1  # on the loop's thread, as the increment

        self._async_takes += 1
        fut = asyncio.get_running_loop().run_in_executor(self._receiver, take)
        fut.add_done_callback(finished)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            abandoned.set()

            def keep(done: asyncio.Future) -> None:
                # Finished between the cancel and the flag: put its rows back.
                ok = not done.cancelled() and done.exception() is None
                if ok and done.result() is not None and not self._closed:
                    self._receiver.submit(self._unget, done.result())

            fut.add_done_callback(keep)
            raise

    def _take_batch(self, wait: float, want: int = 1) -> pa.RecordBatch | None:
        """Messages from the TargetList for a receive of ``want``, waiting up to
        ``wait`` seconds for the first; None if none came. Over the DeliveryChannel
        (one socket round trip, at least ``CHANNEL_TAKE_MESSAGES`` asked for, the rows
        inline), unless it is broken or more than it sends inline is ready for the
        receive: then a prefetch's worth through Ray (references read without a copy
        from the object store)."""
        if self._channel is not None:
            try:
                got = self._channel.take(min(max(want, CHANNEL_TAKE_MESSAGES), self.prefetch), wait)
            except DeliveryBroken as exc:
                self._channel_broke(exc)  # the Ray call below raises the typed error
            else:
                if got is not BY_REFERENCE:
                    return got if got is not None and got.num_rows else None
                wait = 0.0  # BY_REFERENCE: they are ready
        entries = _call(self.target_list.take, self.prefetch, wait, retry=False)
        parts = []
        for (_ref, start, n), batch in zip(
            entries, _get_batches([e[0] for e in entries]), strict=True
        ):
            if batch is not None:  # None: lost with a restarted queue (comes again)
                parts.append(batch.slice(start, n))
        return None if not parts else parts[0] if len(parts) == 1 else pa.concat_batches(parts)

    def _take(self, max_messages: int, timeout: float | None) -> pa.RecordBatch | None:
        self._check_open()
        if isinstance(max_messages, bool) or not isinstance(max_messages, int) or max_messages < 1:
            raise InvalidSetting(f"max_messages={max_messages!r} must be an int >= 1")
        if self._buffer is None:
            self._fill(timeout, max_messages)
            if self._buffer is None:
                return None
        out = self._buffer.slice(0, max_messages)
        rest = self._buffer.slice(max_messages)
        self._buffer = rest if rest.num_rows else None
        return out

    def receive(self, max_messages: int = 1, timeout: float | None = None) -> list[Message]:
        """Up to ``max_messages`` messages, waiting up to ``timeout`` seconds (None: forever)."""
        batch = self._take(max_messages, timeout)
        return [] if batch is None else _messages(batch)

    def __iter__(self) -> Iterator[Message]:
        """Messages one at a time as they arrive, until the consumer is closed; ack each
        (``consumer.ack(message)``, pipelined) or they are delivered again.

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
            messages = _messages(batch)
            for i, message in enumerate(messages):
                try:
                    yield message
                except GeneratorExit:
                    self._unget(batch.slice(i + 1))
                    raise

    def _unget(self, rows: pa.RecordBatch) -> None:
        """Put rows taken but not handed out back in front of the buffer."""
        if self._closed or not rows.num_rows:
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
        out with others as one call and one fsync when 1,000 (or half the prefetch) are
        gathered, after ``raymq.acks.ACK_LINGER_SECONDS``, before the consumer asks for
        more messages, and on ``flush``, ``nack``, ``reject``, ``close`` and this queue
        handle's ``stats``/``browse``. Its outcome is checked as later ones are sent and by
        ``flush``/``close``, which raise the first error of an earlier one (such as
        ``InvalidAck``). A message whose ack had not reached the queue when this process
        died, or when the queue's actor died or moved, is delivered again (those are
        counted in ``acks_lost`` and logged).

        ``wait=True`` sends it (with any gathered before it) and returns how many
        messages were newly acknowledged, once that is durable.
        """
        self._check_open()
        if not wait and type(messages) is Message:  # the per-message loop: no array each
            self._acks.add_one(messages.offset)
            return None
        offsets = _offsets_of(messages)
        if wait:
            self._acks.send()
            self._acks.collect(block=False)
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
        return self._actor.ack.remote(self.consumer_id, offsets, self._subscription).future()

    def flush(self) -> None:
        """Wait until every pipelined ack is durable; raises the first error."""
        self._acks.flush()

    def _check_acks(self, block: bool) -> None:
        """Collect finished pipelined acks (all of them when ``block``), raising the
        first failure as its typed error."""
        if block:
            self._acks.flush()
        else:
            self._acks.collect(block=False)

    def _check_ack_call(self, fut: concurrent.futures.Future, parts: list[np.ndarray]) -> None:
        """Raise the typed error of one finished ack call.

        Pipelined acks are tracked as futures: asking a future whether it is done is
        free, where ``ray.wait(..., timeout=0)`` costs about 2 ms a call here.
        """
        try:
            fut.result()
        except ray.exceptions.RayTaskError as exc:
            error = _unwrap(exc)
            if isinstance(error, InvalidAck) and len(parts) > 1:
                # The queue refused the whole gathered call for one ack() whose
                # offsets it does not know: apply the others, report that one.
                error = self._ack_one_by_one(parts) or error
            if isinstance(error, NotLeader):
                self._ack_lost(parts, error)
                return
            raise error from None
        except _RETRYABLE as exc:
            self._ack_lost(parts, exc)

    def _ack_lost(self, parts: list[np.ndarray], why: BaseException) -> None:
        """A pipelined ack call failed with the queue's actor (it died, restarts or a
        replica took over): whether it was applied is unknown, and a message it did not
        reach is delivered again, as at-least-once allows. Counted and logged."""
        lost = sum(len(p) for p in parts)
        self.acks_lost += lost
        _log.warning(
            "queue %r: %d pipelined acks of consumer %s may be lost with the queue's actor"
            " (%s); their messages are delivered again unless the ack was stored",
            self.queue.name,
            lost,
            self.consumer_id,
            why,
        )

    def _ack_one_by_one(self, parts: list[np.ndarray]) -> InvalidAck | None:
        """Send each ``ack()``'s offsets alone; returns the first refusal."""
        first: InvalidAck | None = None
        for offsets in parts:
            try:
                _call(self._actor.ack, self.consumer_id, offsets, self._subscription)
            except InvalidAck as exc:
                first = first or exc
        return first

    def nack(self, messages: Message | int | Iterable | pa.RecordBatch | pa.Table) -> int:
        """Give messages back: they are delivered again with ``delivery_count`` + 1."""
        self._check_open()
        self._send_acks()  # in order: what was acked before is not given back
        return _call(self._actor.nack, self.consumer_id, _offsets_of(messages), self._subscription)

    def reject(self, messages: Message | int | Iterable | pa.RecordBatch | pa.Table) -> int:
        """Give up on messages: they go to the queue's dead-letter queue (with
        ``RayMQDeadLetterReason`` "rejected") and are not delivered again here.

        Returns how many were taken; the move itself happens in the background (see
        ``dead_letters_pending`` and ``messages_dead_lettered`` in ``Queue.stats()``).
        """
        self._check_open()
        self._send_acks()  # in order, as for nack
        return _call(
            self._actor.reject, self.consumer_id, _offsets_of(messages), self._subscription
        )

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
        buffered = 0 if self._buffer is None else self._buffer.num_rows
        return (
            max(loading, 0) + s.get("cache_references", 0) + s.get("scan_remaining", 0) + buffered
        )

    def stats(self) -> dict[str, Any]:
        """The TargetList: watermark, high watermark, direct and CacheReference counts and
        bytes, PendingCache bytes, hits and misses, and what the consumer holds."""
        return _call(self.target_list.stats, retry=False)

    def close(self) -> None:
        """Close; unacknowledged messages are delivered again (to any consumer)."""
        if self._closed:
            return
        ack_error: RayMQError | None = None
        try:
            self._send_acks()
            self._check_acks(block=True)
        except RayMQError as exc:  # close anyway; then report the failed ack
            ack_error = exc
        self._closed = True
        not_received = None if self._buffer is None else self._buffer.column("offset").to_numpy()
        self._buffer = None
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._receiver is not None:
            self._receiver.shutdown(wait=False)
        try:
            _call(self.target_list.close, not_received, retry=False)
        except BrokerUnavailable:  # the TargetList died: the queue releases what it held
            _call(self._actor.close_consumer, self.consumer_id, not_received, self._subscription)
        finally:
            ray.kill(self.target_list, no_restart=True)
        if ack_error is not None:
            raise ack_error


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


def _messages(batch: pa.RecordBatch) -> list[Message]:
    """The rows of a delivery batch as ``Message`` tuples.

    Column by column: ``RecordBatch.to_pydict`` made a ``datetime`` of every timestamp,
    4 ms per 1,000 messages, more than receiving them."""
    offsets = batch.column("offset").to_numpy().tolist()
    bodies = batch.column("body").to_pylist()
    counts = batch.column("delivery_count").to_numpy().tolist()
    micros = batch.column("timestamp").cast(pa.int64()).to_numpy()
    seconds = (micros / 1e6).tolist()
    props = batch.column("properties").to_pylist()
    new = tuple.__new__  # skips NamedTuple's argument handling, per message
    return [new(Message, row) for row in zip(offsets, bodies, counts, seconds, props, strict=True)]


def _check_count(name: str, value: object, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidSetting(f"{name}={value!r} must be an int >= {minimum}")


def _offsets_of(messages: Any) -> np.ndarray:
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
