"""The client API: ``connect()``, and handles for the broker, queues and consumers.

Usable from a driver, a Ray task, an actor or a ``ray job submit`` job. Every call to
a broker actor goes through ``_call``, which turns Ray's wrapped errors back into the
typed errors of ``raymq.errors`` and retries while a restarting actor comes back.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import pyarrow as pa
import ray

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
from raymq.properties import decode_properties, encode_properties, validate_properties
from raymq.selector import Selector
from raymq.send_channel import ChannelBroken, SendChannel

#: Pipelined acks (``ack(wait=False)``) a consumer lets run before it waits for some.
MAX_PIPELINED_ACKS = 8
#: How long a call keeps retrying while an actor restarts (seconds).
RESTART_GRACE_SECONDS = 60.0
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
        """Each queue's (and address's) statistics as a dict, by name."""
        names = _call(self._actor.list_all)
        handles = [_call(self._actor.get_queue, n) for n in names]
        return {
            n: s.to_dict()
            for n, s in zip(names, ray.get([h.stats.remote() for h in handles]), strict=True)
        }

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


def _send_channel(queue: Queue) -> SendChannel | None:
    """This process's SendChannel to ``queue``'s actor, opened on first use; None when
    the queue has none, it is being opened, or opening it failed lately (single sends
    then go through Ray calls)."""
    key = (ray.get_runtime_context().get_job_id(), queue._actor._actor_id.hex())
    with _channels_lock:
        got = _channels.get(key, 0.0)
        if isinstance(got, SendChannel) and got.broken is None:
            return got
        if got is None or (isinstance(got, float) and time.monotonic() < got):
            return None
        _channels[key] = None  # this thread connects; the others use Ray meanwhile
    channel: SendChannel | None = None
    try:
        endpoint = _call(queue._actor.send_endpoint)
        if endpoint is not None:
            channel = SendChannel(*endpoint, queue=queue.name)
    except (OSError, RayMQError):  # unreachable port, refused, or the actor is gone
        channel = None
    with _channels_lock:
        _channels[key] = channel or time.monotonic() + CHANNEL_RETRY_SECONDS
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

    def send(
        self,
        body: bytes,
        properties: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,
    ) -> int | None:
        """Send one message; returns its offset once it is durable.

        It goes over this process's SendChannel to the queue actor (a socket, see
        ``raymq.send_channel``), else through a Ray call; concurrent sends from threads
        of one process share one write and one fsync. At
        the queue's ``max_size_bytes``: PAGE stores it anyway, DROP drops it (returns
        None), FAIL raises ``AddressFull``, BLOCK waits for room up to ``timeout``
        seconds (None: for ever), then raises ``AddressFull``.
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
        """``send`` for asyncio code."""
        offsets = await self.send_batch_async(
            [self._check_body(body)], None if properties is None else [properties], timeout=timeout
        )
        return offsets[0] if offsets else None

    async def send_batch_async(
        self, bodies, properties=None, *, timeout: float | None = None
    ) -> list[int]:
        """``send_batch`` for asyncio code."""
        first, count = await _call_async(
            self._actor.send_batch, self._pack(bodies, properties), timeout
        )
        return list(range(first, first + count))

    def consumer(
        self,
        selector: str | None = None,
        prefetch: int = 1000,
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
        return self._invoke("stats", self.subscription_name).to_dict()

    def _invoke(self, method: str, *args) -> Any:
        """Call the queue actor's ``method`` (``_call``), following a replicated
        queue's leader to its new actor when it moves."""
        return _call(getattr(self._actor, method), *args, refresh=lambda: self._refresh(method))

    def _refresh(self, method: str):
        """A replicated queue's current leader, asked of the broker (which checks a
        leader that does not answer, and fails over), as ``method``; an unreplicated
        queue keeps its actor (Ray restarts it in place)."""
        old = self._actor
        try:
            actor_id = old._actor_id.hex()
            if _call(self.broker._actor.suspect_leader, self.actor_name, actor_id, retry=False):
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


@dataclass
class Message:
    """One delivered message."""

    offset: int
    body: bytes
    delivery_count: int
    #: Seconds since the epoch when the queue stored the message.
    timestamp: float
    _properties: bytes = b""

    @cached_property
    def properties(self) -> dict[str, Any]:
        """The message's properties (decoded on first use)."""
        return decode_properties(self._properties)


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
        # Pipelined acks in flight: each call's future and the ack() offsets it carries.
        self._acks: list[tuple[concurrent.futures.Future, list[np.ndarray]]] = []
        # Pipelined acks not sent yet: they go out together (one call, one fsync).
        self._unsent_acks: list[np.ndarray] = []
        self._unsent_count = 0
        node = near(node_id).node_id
        self.target_list = spares.take(node)
        warm_arrow_conversions()  # a process that did not connect() (once per process)
        _call(
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

    def _fill(self, timeout: float | None) -> None:
        self._send_acks()  # the credit they return lets the TargetList load more
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = 1.0 if deadline is None else max(0.0, deadline - time.monotonic())
            entries = _call(self.target_list.take, self.prefetch, wait, retry=False)
            parts = []
            for (_ref, start, n), batch in zip(
                entries, _get_batches([e[0] for e in entries]), strict=True
            ):
                if batch is not None:  # None: lost with a restarted queue (comes again)
                    parts.append(batch.slice(start, n))
            if parts or (deadline is not None and time.monotonic() >= deadline):
                self._buffer = (
                    None if not parts else parts[0] if len(parts) == 1 else pa.concat_batches(parts)
                )
                return

    def _take(self, max_messages: int, timeout: float | None) -> pa.RecordBatch | None:
        self._check_open()
        if isinstance(max_messages, bool) or not isinstance(max_messages, int) or max_messages < 1:
            raise InvalidSetting(f"max_messages={max_messages!r} must be an int >= 1")
        if self._buffer is None:
            self._fill(timeout)
            if self._buffer is None:
                return None
        out = self._buffer.slice(0, max_messages)
        rest = self._buffer.slice(max_messages)
        self._buffer = rest if rest.num_rows else None
        return out

    def receive(self, max_messages: int = 1, timeout: float | None = None) -> list[Message]:
        """Up to ``max_messages`` messages, waiting up to ``timeout`` seconds (None: forever)."""
        batch = self._take(max_messages, timeout)
        return [] if batch is None else list(_messages(batch))

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
        wait: bool = True,
    ) -> int | None:
        """Acknowledge messages; returns how many were newly acknowledged (durably).

        ``wait=False`` pipelines the ack: it returns None at once, so receiving the next
        batch overlaps the ack's fsync. Pipelined acks are gathered and go out as one
        call when they reach half the prefetch, before the consumer asks its TargetList
        for more, and on ``flush``, ``nack``, a waiting ``ack`` and ``close``. Their
        outcome is checked by the next ``ack`` or by ``flush``/``close``, which raise the
        first error of an earlier one. (Delivery is at-least-once either way: an ack
        lost with a crash means one more delivery.)
        """
        self._check_open()
        offsets = _offsets_of(messages)
        if wait:
            self._send_acks()
            self._check_acks(block=False)
            return self.queue._invoke("ack", self.consumer_id, offsets, self._subscription)
        self._unsent_acks.append(offsets)
        self._unsent_count += len(offsets)
        if self._unsent_count >= max(self.prefetch // 2, 1):
            self._send_acks()
        self._check_acks(block=len(self._acks) > MAX_PIPELINED_ACKS)
        return None

    def _send_acks(self) -> None:
        """Send the gathered pipelined acks as one call (not waiting for it)."""
        if not self._unsent_acks:
            return
        parts, self._unsent_acks, self._unsent_count = self._unsent_acks, [], 0
        offsets = parts[0] if len(parts) == 1 else np.concatenate(parts)
        self._acks.append(
            (self._actor.ack.remote(self.consumer_id, offsets, self._subscription).future(), parts)
        )

    def flush(self) -> None:
        """Wait for every pipelined ack (``ack(wait=False)``); raise the first error."""
        self._send_acks()
        self._check_acks(block=True)

    def _check_acks(self, block: bool) -> None:
        """Collect finished pipelined acks (all of them when ``block``), raising the
        first failure as its typed error.

        Pipelined acks are tracked as futures: asking a future whether it is done is
        free, where ``ray.wait(..., timeout=0)`` costs about 2 ms a call here, as much
        as the rest of a 1,000-message receive and ack.
        """
        if not self._acks:
            return
        if block:
            keep = MAX_PIPELINED_ACKS // 2 if len(self._acks) > MAX_PIPELINED_ACKS else 0
            concurrent.futures.wait([fut for fut, _ in self._acks[: len(self._acks) - keep]])
        done, still = [], []
        for item in self._acks:
            (done if item[0].done() else still).append(item)
        self._acks = still
        for fut, parts in done:
            try:
                fut.result()
            except ray.exceptions.RayTaskError as exc:
                error = _unwrap(exc)
                if isinstance(error, InvalidAck) and len(parts) > 1:
                    # The queue refused the whole gathered call for one ack() whose
                    # offsets it does not know: apply the others, report that one.
                    error = self._ack_one_by_one(parts) or error
                raise error from None
            except _RETRYABLE as exc:
                raise BrokerUnavailable(f"queue {self.queue.name!r} unavailable: {exc}") from exc

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


def _messages(batch: pa.RecordBatch) -> Iterator[Message]:
    cols = batch.to_pydict()
    ts = batch.column("timestamp").cast(pa.int64()).to_numpy()
    for o, b, c, t, p in zip(
        cols["offset"], cols["body"], cols["delivery_count"], ts, cols["properties"], strict=True
    ):
        yield Message(o, b, int(c), float(t) / 1e6, p)


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
