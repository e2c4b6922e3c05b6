"""QueueActor: one async Ray actor per queue, wrapping ``raymq.core.queue.QueueCore``.

Named ``raymq.queue.<name>``, detached, restarted forever (``max_restarts=-1``) and
pinned to the node holding its files; on restart it recovers from those files. Calls
interleave at the awaits of QueueCore; every method is safe to retry except ``send_batch``,
whose retry after a crash may store a message twice (at-least-once).

Consumers: for each registered TargetList actor the queue keeps one call to its
``until_closed`` pending; Ray fails that call as soon as it knows the actor died (its
owner process killed, its node gone), and the queue then delivers again what it held.
A ping of consumers not heard from for a while backs this up, and a consumer whose
FetchChannel connection ended before it was watched is closed after a grace. Those
decisions are ``raymq.core.consumer_liveness``'s; this shell makes its calls.

Dead letters go to the dead-letter queue through the broker actor, which creates that
queue when first needed (with this queue's durability).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Any

import numpy as np
import pyarrow as pa
import ray
from raymq.actors.names import BROKER_ACTOR_NAME, queue_actor_name
from raymq.actors.replica_actor import LeaderRole

from raymq import metrics
from raymq.batch import MessageBatch
from raymq.config import BrokerConfig, QueueConfig
from raymq.core.budget import QueueUsage
from raymq.core.consumer_liveness import (
    Action,
    Close,
    ConsumerKey,
    ConsumerLiveness,
    Ping,
    PingOutcome,
    Unwatch,
    Watch,
)
from raymq.core.hibernation import Activity
from raymq.core.queue import QueueCore, QueueStats
from raymq.core.replication import ReplicationLeader
from raymq.core.subscription import LEASE_PREFETCH, Delivery
from raymq.core.target_list import FetchAnswer
from raymq.errors import BrokerUnavailable, NotLeader, StorageError
from raymq.heap import freeze_startup_heap
from raymq.storage.retention import Position
from raymq.storage.subscriptions import SubscriptionSpec
from raymq.wire.fetch import FetchServer
from raymq.wire.send import SendServer

#: Longest a dead-letter batch waits on a BLOCKed dead-letter queue before it is
#: retried (seconds).
DEAD_LETTER_SEND_TIMEOUT_SECONDS = 5.0
_ACTOR_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
#: Longest a replicated queue's leader waits for the controller (seconds): a commit
#: that needs it is refused after that (``NotEnoughReplicas``), a start
#: ``BrokerUnavailable``: neither is held for ever.
CONTROLLER_SECONDS = 10.0

log = logging.getLogger("raymq.queue")


@ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=1000)
class QueueActor:
    """The Ray shell of one queue."""

    def __init__(
        self,
        config: QueueConfig,
        broker: BrokerConfig,
        namespace: str,
        role: LeaderRole | None = None,
    ):
        """``namespace`` is the broker's (a detached actor's runtime context names the
        namespace of the job that created it, not its own). ``role``: this actor leads
        a replicated queue (its copy, epoch and followers)."""
        self.namespace = namespace
        self.role = role
        replication = None
        if role is not None:
            replication = ReplicationLeader(
                config.name,
                role.directory,
                replica_id=role.replica_id,
                node_id=ray.get_runtime_context().get_node_id(),
                epoch=role.epoch,
                quorum=config.insync_quorum,
                epochs=[],
                report_in_sync=self._report_in_sync,
                new_epoch=self._next_epoch,
            )
        # Cached batches are put in the object store once, on their first delivery:
        # every delivery of them, to any subscription, is then a reference.
        self.core = QueueCore(
            config,
            broker,
            self._send_dead_letters,
            share=ray.put,
            directory=role.directory if role else None,
            replication=replication,
        )
        self._start_lock = asyncio.Lock()
        #: Dead-letter and expiry queues' actor handles, by name, once found.
        self._dead_letter_queues: dict[str, Any] = {}
        #: Which consumers are taken for dead, and when (the clock: monotonic seconds).
        self._liveness = ConsumerLiveness(time.monotonic)
        #: Set when an event brought the liveness's next tick nearer (a channel lost).
        self._liveness_moved = asyncio.Event()
        #: The death watches running, by consumer; the pings out (kept from the GC).
        self._watches: dict[ConsumerKey, asyncio.Task] = {}
        self._pings: set[asyncio.Task] = set()
        self._started = False
        self._metrics_task: asyncio.Task | None = None
        judged_whole = config.max_size_bytes > 0 and config.address_full_policy in (
            "FAIL",
            "BLOCK",
        )
        self._channel = SendServer(
            self._channel_send_batch,
            config.name,
            broker.max_message_size,
            gather=not judged_whole,  # each client's send judged alone by its policy
            send_ids=self._channel_send_ids,
            ack=self.ack,  # a consumer's pipelined acks (the same method as Ray's)
            nack=self.nack,
            reject=self.reject,
        )
        self._endpoint: tuple[str, int, str] | None = None
        #: Its last call, for the broker's hibernation (``idle_seconds``).
        self._activity = Activity()
        #: Set once ``hibernate`` began: later calls are sent back to the broker.
        self._hibernating = False
        self._closing: asyncio.Task | None = None

    def _channel_send_batch(self, batch, timeout: float | None):
        """The SendChannel's sends: calls too, for hibernation (a queue only written
        over its channel is not idle)."""
        self._activity.touch()
        return self.core.send_batch(batch, timeout)

    def _channel_send_ids(self, batch, ids: list, timeout: float | None):
        """The SendChannel's sends with producer ids (``QueueCore.send_batch_ids``)."""
        self._activity.touch()
        return self.core.send_batch_ids(batch, ids, timeout)

    async def _ensure_started(self, touch: bool = True) -> None:
        if touch:  # (not the governor's rounds: they would keep every queue awake)
            self._activity.touch()
        if self._hibernating:
            # Clients take NotLeader as "ask the broker again" (Queue._refresh): it
            # waits for this hibernation to end and revives the queue.
            raise NotLeader(f"queue {self.core.name!r} is hibernating: ask the broker again")
        if self._started:
            return
        async with self._start_lock:  # every call waits for the start, epoch included
            if self._started:
                return
            leading = self.role is not None
            if leading:
                leading = await self._begin_epoch()
            self.core.start()
            self.core.supervise("consumer watch", self._watch_consumers)
            self._metrics_task = self.core.supervise("metrics", self._export_metrics)
            if leading:
                self.core.replication.set_followers(self.role.links())
                self.core.supervise("heartbeats", self.core.replication.heartbeat_loop)
            try:
                self._endpoint = await self._channel.start(ray.util.get_node_ip_address())
            except OSError as exc:  # single sends then go through Ray calls
                log.warning("queue %r: no send channel: %s", self.core.name, exc)
            self._started = True
            freeze_startup_heap()  # no 50-75 ms full collections of it (raymq.heap)

    async def _begin_epoch(self) -> bool:
        """Lead in an epoch of its own, every (re)start: the controller gives the next
        epoch and the current followers (a restart in place has old ones in its
        arguments); ``ReplicationLeader.begin`` does the rest. False: it stepped down."""
        epoch, followers = await self._ask_controller(
            "begin_epoch", self.core.name, self.role.replica_id
        )
        self.role = LeaderRole(self.role.replica_id, self.role.directory, epoch, followers)
        in_sync = await self._ask_controller("in_sync_replicas", self.core.name)
        lost_here = self.core.recovery.damaged > 0  # found by this recovery
        return await self.core.replication.begin(epoch, self.role.links(), in_sync, lost_here)

    async def _export_metrics(self) -> None:
        """Every ``metrics.EXPORT_PERIOD_SECONDS``, set this queue's metrics and its
        consumers' lag from local snapshots (``raymq.metrics``). Lag is exported here,
        not by the TargetList actors, because here it costs no remote call."""
        ctx = ray.get_runtime_context()
        node_id, broker, me = ctx.get_node_id(), ctx.namespace, ctx.get_actor_id()
        with metrics.guard(f"queue {self.core.name!r}"):
            name = queue_actor_name(self.core.name)
            broker = await asyncio.to_thread(metrics.broker_of, name, me)
        while True:
            with metrics.guard(f"queue {self.core.name!r}"):
                metrics.export_queue(self.core.stats(), node_id, broker)
                for name in self.core.subscriptions:  # an address's: "address/subscription"
                    metrics.export_queue(self.core.stats(name), node_id, broker)
                for sub in self.core.all_subscriptions():
                    consumers = {cid: sub.consumer_stats(cid) for cid in sub.area.consumers}
                    metrics.export_queue_consumers(sub.name, consumers, node_id, broker)
            await asyncio.sleep(metrics.EXPORT_PERIOD_SECONDS)

    async def _ask_controller(self, method: str, *args):
        """Call ``method`` of the controller (the broker actor), waiting at most
        ``CONTROLLER_SECONDS``: ``BrokerUnavailable`` naming the queue after that, or if
        the broker actor cannot be found or reached (a start waiting on a paused broker
        would otherwise hold every call to this queue)."""
        try:
            broker = ray.get_actor(BROKER_ACTOR_NAME, namespace=self.namespace)
            return await asyncio.wait_for(getattr(broker, method).remote(*args), CONTROLLER_SECONDS)
        except (TimeoutError, ValueError, *_ACTOR_GONE) as exc:
            raise BrokerUnavailable(
                f"queue {self.core.name!r}: no answer from the broker to {method}"
                f" ({exc!r}; waited at most {CONTROLLER_SECONDS:.0f} s)"
            ) from None

    async def _report_in_sync(self, epoch: int, in_sync: list[str]) -> bool:
        """Tell the controller (the broker actor) this leader's in-sync replicas;
        False if ``epoch`` is no longer the queue's."""
        return await self._ask_controller("update_in_sync", self.core.name, epoch, in_sync)

    async def _next_epoch(self) -> int:
        """The controller's next epoch for this leader (after a cut-back commit)."""
        epoch, _followers = await self._ask_controller(
            "begin_epoch", self.core.name, self.role.replica_id
        )
        return epoch

    async def set_followers(self, epoch: int, followers: tuple) -> None:
        """The controller's followers for this leader (``LeaderRole.followers``)."""
        await self._ensure_started()
        rep = self.core.replication
        if rep is None or epoch != rep.epoch:
            return
        self.role = LeaderRole(self.role.replica_id, self.role.directory, epoch, followers)
        rep.set_followers(self.role.links())

    async def wait_in_sync(self, replicas: int, timeout: float) -> list[str]:
        """Wait up to ``timeout`` seconds until ``replicas`` replicas are in sync;
        returns the in-sync replica ids (for the controller and tests)."""
        await self._ensure_started()
        rep = self.core.replication
        if rep is None:
            return []
        deadline = asyncio.get_running_loop().time() + timeout
        while len(rep.in_sync) < replicas and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        return rep.in_sync

    async def ping(self) -> int:
        """The epoch this actor leads (0: not replicated; -1: it was replaced), once
        started; answers while it lives."""
        await self._ensure_started()
        rep = self.core.replication
        if rep is None:
            return 0
        return -1 if rep.fenced is not None else rep.epoch

    async def _send_dead_letters(self, dead_letter_queue: str, batch: MessageBatch) -> None:
        """The QueueCore's dead-letter sink: append ``batch`` durably to the dead-letter
        queue, which the broker actor creates if it does not exist."""
        handle = self._dead_letter_queues.get(dead_letter_queue)
        if handle is None:
            broker = ray.get_actor(BROKER_ACTOR_NAME, namespace=self.namespace)
            handle = await broker.dead_letter_queue.remote(
                dead_letter_queue, self.core.config.durable
            )
            self._dead_letter_queues[dead_letter_queue] = handle
        try:
            await handle.send_batch.remote(batch, DEAD_LETTER_SEND_TIMEOUT_SECONDS)
        except _ACTOR_GONE:
            del self._dead_letter_queues[dead_letter_queue]  # deleted, or restarting
            raise

    # -- consumer liveness (raymq.core.consumer_liveness decides) -------------------

    def _act(self, actions: list[Action]) -> None:
        """Carry out what the consumer liveness decided."""
        for action in actions:
            if isinstance(action, Watch):
                self._start_watch(action)
            elif isinstance(action, Unwatch):
                self._stop_watch((action.consumer_id, action.subscription))
            elif isinstance(action, Ping):
                task = asyncio.get_running_loop().create_task(self._ping(action))
                self._pings.add(task)
                task.add_done_callback(self._pings.discard)
            else:
                self._close_dead(action)

    def _start_watch(self, w: Watch) -> None:
        """Keep a call to the consumer's ``until_closed`` pending: Ray fails it as soon
        as it knows the actor is dead, which is the fastest notice Ray gives."""
        key = (w.consumer_id, w.subscription)
        self._stop_watch(key)

        async def watch() -> None:
            died = False
            try:
                await w.watch.until_closed.remote()
            except _ACTOR_GONE:
                died = True
            except Exception as exc:  # e.g. an old TargetList without until_closed
                log.info("queue %r: no death watch on %s: %s", self.core.name, key[0], exc)
            if self._watches.get(key) is asyncio.current_task():
                del self._watches[key]
            self._act(self._liveness.watch_ended(*key, w.generation, died))

        self._watches[key] = asyncio.get_running_loop().create_task(watch())

    def _stop_watch(self, key: ConsumerKey) -> None:
        task = self._watches.pop(key, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    async def _ping(self, p: Ping) -> None:
        """Ping a silent consumer's TargetList; the liveness judges the outcome."""
        try:
            await asyncio.wait_for(p.watch.ping.remote(), self._liveness.ping_timeout)
            outcome = PingOutcome.ANSWERED
        except _ACTOR_GONE:
            outcome = PingOutcome.GONE
        except TimeoutError:
            outcome = PingOutcome.UNANSWERED  # busy, not dead: asked again next round
        except Exception as exc:  # no death either: asked again next round
            log.info("queue %r: ping of consumer %s: %r", self.core.name, p.consumer_id, exc)
            outcome = PingOutcome.UNANSWERED
        self._act(self._liveness.ping_ended(p.consumer_id, p.subscription, p.generation, outcome))

    def _close_dead(self, c: Close) -> None:
        """Close a consumer taken for dead: what it held is delivered again."""
        if self._hibernating or not self._registered(c.consumer_id, c.subscription):
            return  # closed meanwhile (its subscription deleted, say)
        try:
            n = self.core.close_consumer(c.consumer_id, subscription=c.subscription)
        except Exception:  # a bug: a watch's or a ping's task has no caller to tell
            log.exception("queue %r: closing consumer %s", self.core.name, c.consumer_id)
            return
        log.warning(
            "queue %r: consumer %s died (%s); %d messages will be delivered again",
            self.core.name,
            c.consumer_id,
            c.reason.value,
            n,
        )

    def _registered(self, consumer_id: str, subscription: str | None) -> bool:
        """The core has the consumer (and its subscription still exists)."""
        sub = self.core.subscriptions.get(subscription) if subscription else self.core._own
        return sub is not None and consumer_id in sub.area.consumers

    async def _watch_consumers(self) -> None:
        """Tick the consumer liveness when it is due (its pings' rounds, the ends of
        graces), or sooner when an event brought that time nearer."""
        while True:
            wait = self._liveness.next_tick() - time.monotonic()
            if wait > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._liveness_moved.wait(), wait)
            self._liveness_moved.clear()
            self._act(self._liveness.tick())

    async def ready(self) -> dict:
        """Wait until recovery is done; returns the recovery report as a dict."""
        await self._ensure_started()
        r = self.core.recovery
        return {
            "seconds": r.seconds,
            "depth": r.depth,
            "damage": r.damage,
            "truncated_bytes": r.truncated_bytes,
            "lost_messages": r.lost_messages,
        }

    async def send_batch(
        self, batch: MessageBatch, timeout: float | None = None
    ) -> tuple[int, int]:
        """Append a batch durably; returns (first offset, count stored). ``timeout``
        bounds the wait of a BLOCKed send (seconds; None: for ever)."""
        await self._ensure_started()
        return await self.core.send_batch(batch, timeout)

    async def send_batch_ids(
        self, batch: MessageBatch, ids: list[str | None], timeout: float | None = None
    ) -> list[int | None]:
        """``send_batch`` with producer ids (``QueueCore.send_batch_ids``): each
        message's offset (a duplicate's: the first one's; None: DROPped)."""
        await self._ensure_started()
        return await self.core.send_batch_ids(batch, ids, timeout)

    async def send_endpoint(self) -> tuple[str, int, str] | None:
        """(host, port, secret) of this queue's SendChannel, None if it has none."""
        await self._ensure_started()
        return self._endpoint

    async def fetch_batch(
        self,
        consumer_id: str,
        max_messages: int,
        timeout: float,
        prefetch: int,
        selector: str | None = None,
        subscription: str | None = None,
    ) -> tuple[FetchAnswer, pa.RecordBatch | None]:
        """``fetch`` for a TargetList actor, called with ``num_returns=2``: a small
        ``FetchAnswer`` and a batch as a separate object the caller owns and can hand on
        by reference. The delivery is the answer's shared parts, then that batch's rows
        (None when the parts carry it all). ``subscription``: an address's, by name."""
        await self._ensure_started()
        self._liveness.heard_from(consumer_id, subscription)
        delivery = await self.core.fetch_delivery(
            consumer_id, max_messages, timeout, prefetch, selector, subscription=subscription
        )
        parts = [(p.ref, p.first_row, p.rows) for p in delivery.parts]
        return FetchAnswer(delivery.offsets, delivery.nbytes, parts), delivery.batch

    async def register_consumer(
        self,
        consumer_id: str,
        prefetch: int,
        selector: str | None = None,
        watch=None,
        subscription: str | None = None,
    ) -> tuple[str, int, str] | None:
        """Register a consumer with its prefetch, selector and TargetList actor handle.
        Returns the (host, port, secret) of this queue's FetchChannel, for the
        TargetList's fetches (``raymq.wire.fetch``), None if it has none."""
        await self._ensure_started()
        self.core.register_consumer(
            consumer_id, prefetch, selector, watch, subscription=subscription
        )
        self._act(self._liveness.registered(consumer_id, subscription, watch))
        return await self._fetch_endpoint()

    #: The FetchChannel's server, and its start (answering its (host, port, secret)),
    #: by the first registration: a queue nobody consumes from listens on no second
    #: socket.
    _fetch_server: FetchServer | None = None
    _fetch_starting: asyncio.Future | None = None

    async def fetch_endpoint(self) -> tuple[str, int, str] | None:
        """(host, port, secret) of this queue's FetchChannel (``raymq.wire.fetch``),
        None if it has none: a client hands it to a new consumer's TargetList, which
        then registers and fetches over it without a first Ray call to this actor."""
        await self._ensure_started()
        return await self._fetch_endpoint()

    async def _fetch_endpoint(self) -> tuple[str, int, str] | None:
        if self._fetch_starting is None:  # once; concurrent registrations wait for it
            self._fetch_starting = asyncio.ensure_future(self._start_fetch_server())
        return await asyncio.shield(self._fetch_starting)

    async def _start_fetch_server(self) -> tuple[str, int, str] | None:
        server = FetchServer(
            self._channel_fetch,
            self._channel_give_back,
            self.core.name,
            register=self._channel_register,
            lost=self._channel_lost,
        )
        try:
            address = await server.start(ray.util.get_node_ip_address())
        except OSError as exc:  # fetches then go through Ray calls
            log.warning("queue %r: no fetch channel: %s", self.core.name, exc)
            return None
        self._fetch_server = server
        return address

    async def _channel_fetch(
        self,
        consumer_id: str,
        max_messages: int,
        timeout: float,
        prefetch: int,
        selector: str | None,
        subscription: str | None,
    ) -> Delivery:
        """``fetch_batch`` for the FetchChannel: the delivery itself."""
        await self._ensure_started()
        self._liveness.heard_from(consumer_id, subscription)
        return await self.core.fetch_delivery(
            consumer_id, max_messages, timeout, prefetch, selector, subscription=subscription
        )

    async def _channel_register(
        self, consumer_id: str, prefetch: int, selector: str | None, subscription: str | None
    ) -> None:
        """``register_consumer`` for the FetchChannel, without the death watch (the
        TargetList sends its handle through Ray next; until then ``_channel_lost``)."""
        await self._ensure_started()
        self.core.register_consumer(
            consumer_id, prefetch, selector, None, subscription=subscription
        )
        self._act(self._liveness.registered(consumer_id, subscription))

    def _channel_lost(self, registered: list[tuple[str, str | None]]) -> None:
        """A FetchChannel connection ended: consumers it registered that are still
        unwatched are closed after a grace, unless watched (or closed) by then
        (``ConsumerLiveness.channel_lost``)."""
        if not self._started or self._hibernating:
            return
        self._liveness.channel_lost(registered)
        self._liveness_moved.set()  # its tick may be due sooner

    def _channel_give_back(
        self, consumer_id: str, offsets: np.ndarray, subscription: str | None
    ) -> None:
        """Rows of a FetchChannel answer that could not be written (never received)."""
        if not self._started or self._hibernating:
            return
        try:
            self.core.give_back(consumer_id, offsets, subscription=subscription)
        except Exception as exc:  # closed meanwhile: its close released them already
            log.info("queue %r: giving back to consumer %s: %r", self.core.name, consumer_id, exc)

    async def fetch_parked(self, token: int) -> tuple[FetchAnswer, pa.RecordBatch | None]:
        """A delivery the FetchChannel parked (too large to send inline), as
        ``fetch_batch`` answers (called with ``num_returns=2``); an empty answer if it
        is unknown (dropped after ``raymq.wire.fetch.PARKED_SECONDS``, or a restart)."""
        await self._ensure_started()
        delivery = None if self._fetch_server is None else self._fetch_server.take_parked(token)
        if delivery is None:
            return FetchAnswer(np.zeros(0, dtype=np.int64), 0, []), None
        parts = [(p.ref, p.first_row, p.rows) for p in delivery.parts]
        return FetchAnswer(delivery.offsets, delivery.nbytes, parts), delivery.batch

    async def give_back(
        self, consumer_id: str, offsets: np.ndarray, subscription: str | None = None
    ) -> int:
        """Release prefetched messages never handed to the application."""
        await self._ensure_started()
        self._liveness.heard_from(consumer_id, subscription)
        return self.core.give_back(consumer_id, offsets, subscription=subscription)

    async def consumer_stats(self, consumer_id: str, subscription: str | None = None) -> dict:
        """The queue side of one consumer's TargetList."""
        await self._ensure_started()
        return self.core.consumer_stats(consumer_id, subscription=subscription)

    async def browse(
        self,
        start: int,
        max_messages: int,
        selector: str | None = None,
        subscription: str | None = None,
    ) -> tuple[pa.RecordBatch, int]:
        """Unacknowledged messages from ``start`` on, changing nothing; and where to go on."""
        await self._ensure_started()
        return self.core.browse(start, max_messages, selector, subscription=subscription)

    async def lease(
        self,
        consumer_id: str,
        max_messages: int,
        selector: str | None = None,
        watch=None,
        subscription: str | None = None,
        timeout: float = 0.0,
    ) -> tuple[np.ndarray, bool]:
        """Hold up to ``max_messages`` for a reader without reading them (waiting up
        to ``timeout`` seconds for one when there is none); ``watch`` (its ReadLease
        actor) is watched as a TargetList is: when it dies, what the reader holds is
        delivered again. Returns (offsets, whether more may be there)."""
        await self._ensure_started()
        if not self._registered(consumer_id, subscription):
            self.core.register_consumer(
                consumer_id, LEASE_PREFETCH, selector, watch, subscription=subscription
            )
            self._act(self._liveness.registered(consumer_id, subscription, watch))
        self._liveness.heard_from(consumer_id, subscription)
        return await self.core.lease(
            consumer_id, max_messages, selector, timeout, subscription=subscription
        )

    async def read_leased(
        self, consumer_id: str, offsets: np.ndarray, subscription: str | None = None
    ) -> pa.RecordBatch:
        """Leased messages as a delivery batch (read tasks of ``QueueReader``)."""
        await self._ensure_started()
        # On the event loop, as browse: the log's reads and caches are not thread-safe.
        return self.core.read_leased(consumer_id, offsets, subscription=subscription)

    async def ack(
        self, consumer_id: str, offsets: np.ndarray, subscription: str | None = None
    ) -> int:
        """Acknowledge; returns how many were newly acked, once durable."""
        await self._ensure_started()
        self._liveness.heard_from(consumer_id, subscription)
        return await self.core.ack(consumer_id, offsets, subscription=subscription)

    async def ack_acceptable(
        self, consumer_id: str, offsets: np.ndarray, subscription: str | None = None
    ) -> tuple[int, str]:
        """Acknowledge the offsets the consumer may ack, leaving the others alone (after
        the queue refused them together); returns (newly acked, the refusal or "")."""
        await self._ensure_started()
        self._liveness.heard_from(consumer_id, subscription)
        return await self.core.ack_acceptable(consumer_id, offsets, subscription=subscription)

    async def nack(
        self,
        consumer_id: str,
        offsets: np.ndarray,
        subscription: str | None = None,
        delay: float | None = None,
    ) -> int:
        """Release for redelivery with delivery count + 1, after ``delay`` seconds
        (None: the queue's ``redelivery_delay_s``); a delay is durable when answered."""
        await self._ensure_started()
        self._liveness.heard_from(consumer_id, subscription)
        n = self.core.nack(consumer_id, offsets, subscription=subscription, delay=delay)
        await self._counts_durable()
        return n

    async def reject(
        self, consumer_id: str, offsets: np.ndarray, subscription: str | None = None
    ) -> int:
        """Move held messages to the dead-letter queue instead of delivering them again."""
        await self._ensure_started()
        self._liveness.heard_from(consumer_id, subscription)
        return self.core.reject(consumer_id, offsets, subscription=subscription)

    async def expire(
        self, consumer_id: str, offsets: np.ndarray, subscription: str | None = None
    ) -> int:
        """Held messages that expired before the application received them (found by
        the consumer): to the expiry queue, or dropped."""
        await self._ensure_started()
        self._liveness.heard_from(consumer_id, subscription)
        return self.core.expire(consumer_id, offsets, subscription=subscription)

    async def close_consumer(
        self,
        consumer_id: str,
        not_received: np.ndarray | None,
        subscription: str | None = None,
    ) -> int:
        """Remove a consumer; what it held is delivered again, and what it never
        received (``not_received``) does not count as delivered: on disk once answered."""
        await self._ensure_started()
        self._act(self._liveness.closed(consumer_id, subscription))
        n = self.core.close_consumer(consumer_id, not_received, subscription=subscription)
        # A take of what it never received may be on disk already (counts go with the
        # next commit): its give-back must be too, or a crash now counts that delivery.
        await self._counts_durable()
        return n

    async def _counts_durable(self) -> None:
        """Write the delivery counts and delays waiting for the next commit now (a
        durable queue's), so that the caller's answer says they are on disk."""
        if self.core.log.has_pending_acks and self.core.config.durable:
            await self.core.flush_acks()

    # -- an address's subscriptions ----------------------------------------------------

    async def create_subscription(
        self,
        name: str,
        filter: str | None = None,
        start: Position = "latest",
        max_delivery_attempts: int | None = None,
        dead_letter_queue: str | None = None,
    ) -> SubscriptionSpec:
        """Bind a subscription to this address (see ``QueueCore.create_subscription``)."""
        await self._ensure_started()
        return await self.core.create_subscription(
            name,
            filter=filter,
            start=start,
            max_delivery_attempts=max_delivery_attempts,
            dead_letter_queue=dead_letter_queue,
        )

    async def seek(self, name: str, position: Position) -> int:
        """Move a subscription to ``position`` (see ``QueueCore.seek``); the offset it
        starts at now, once durable."""
        await self._ensure_started()
        return await self.core.seek(name, position)

    async def delete_subscription(self, name: str) -> None:
        """Unbind a subscription; its consumers are closed."""
        await self._ensure_started()
        await self.core.delete_subscription(name)
        self._act(self._liveness.subscription_deleted(name))

    async def list_subscriptions(self) -> list[SubscriptionSpec]:
        """The address's subscriptions."""
        await self._ensure_started()
        return self.core.list_subscriptions()

    async def subscription_depths(self) -> dict[str, int]:
        """Each subscription's depth (messages it has not acknowledged)."""
        await self._ensure_started()
        return self.core.subscription_depths()

    async def usage(self) -> tuple[QueueUsage, list[tuple[str, object]]]:
        """For the MemoryGovernor: the queue's usage (a ``QueueUsage``, bytes) on this
        node, and its consumers' TargetList actors as (consumer id, handle)."""
        await self._ensure_started(touch=False)
        consumers = [
            (t.consumer_id, t.watch)
            for sub in self.core.all_subscriptions()
            for t in sub.area.consumers.values()
            if t.watch is not None
        ]
        return self.core.usage(ray.get_runtime_context().get_node_id()), consumers

    async def set_budget(self, queue_bytes: int) -> None:
        """The MemoryGovernor's budget for this actor's caches (bytes)."""
        await self._ensure_started(touch=False)
        self.core.set_budget(queue_bytes)

    async def stats(self, subscription: str | None = None) -> QueueStats:
        """A QueueStats snapshot of the queue (address), or of one subscription."""
        await self._ensure_started()
        return self.core.stats(subscription)

    async def config(self) -> QueueConfig:
        """The queue's settings."""
        return self.core.config

    def pid(self) -> int:
        """The actor's process id (for fault tests and diagnostics)."""
        return os.getpid()

    def _busy(self) -> bool:
        """True if hibernating now could cost a client more than a delay
        (``QueueCore.busy``), or the queue is replicated (its leadership is the
        controller's, not hibernation's)."""
        if self.role is not None:
            return True
        return self._started and self.core.busy()

    def idle_seconds(self) -> float | None:
        """Seconds since this queue's last call (this probe excepted); None while it is
        busy (see ``hibernate``). For the broker's hibernation."""
        return self._activity.idle_seconds(self._busy())

    async def hibernate(self) -> bool:
        """If the queue is idle (no consumer, nothing pending, nothing unacknowledged,
        not replicated), close its send channel and files for the broker to end this
        actor; returns False (changing nothing) if it is busy. Calls arriving from now
        on raise ``NotLeader`` (clients then ask the broker, which revives the queue).
        A channel send caught between the check and the close is made durable by the
        close; its producer, whose channel breaks, sends it again (at-least-once)."""
        if self._hibernating:  # again (its broker died meanwhile): once it is closed
            await self._closing
            return True
        if self._started and self.role is None and self.core.log.has_pending_acks:
            # Acks and delivery counts a moment from the disk anyway: not a reason to stay.
            with contextlib.suppress(StorageError):
                await self.core.flush_acks()
        if self._busy():
            return False
        self._hibernating = True
        self._closing = asyncio.get_running_loop().create_task(self._close_for_hibernation())
        await self._closing
        return True

    async def _close_for_hibernation(self) -> None:
        if self._metrics_task is not None:
            self._metrics_task.cancel()
        self._channel.close()
        if self._fetch_server is not None:  # stop listening: this actor ends next
            self._fetch_server.close()
        if self._started:
            await self.core.close()
        log.info("queue %r: hibernating", self.core.name)

    async def shutdown(self, delete_files: bool = False) -> None:
        """Flush, close files and optionally delete the queue's directory."""
        await self._ensure_started()
        if self._metrics_task is not None:
            self._metrics_task.cancel()  # a closed core has nothing left to report
        self._channel.close()
        if self._fetch_server is not None:
            self._fetch_server.close()
        await self.core.close()
        if delete_files:
            import shutil

            shutil.rmtree(self.core.directory, ignore_errors=True)
