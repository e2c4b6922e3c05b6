"""``Consumer``: receives through its TargetList actor (a DeliveryChannel, else
Ray calls), acks through its ``AckPipeline`` to the queue's current actor (as frames
on the process's SendChannel to it, else Ray calls)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import ray

from raymq.batch import (
    DELIVERY_SCHEMA,
    EMPTY_DELIVERY,
    offsets_of,
    warm_arrow_conversions,
)
from raymq.client import acks
from raymq.client.acks import AckPipeline
from raymq.client.async_receive import AsyncReceives
from raymq.client.calls import _call, _unwrap
from raymq.client.consumer_acks import ConsumedQueue, ConsumerAcks
from raymq.client.messages import (
    ITER_CHUNK_MESSAGES,
    Message,
    Messages,
    _get_batches,
    _messages,
)
from raymq.core.expiry import expired_rows, now_ms
from raymq.errors import (
    BrokerUnavailable,
    ConsumerClosed,
    InvalidSetting,
    RayMQError,
)
from raymq.wire import delivery as delivery_channel
from raymq.wire.delivery import BY_REFERENCE, INLINE_BYTES, DeliveryChannel
from raymq.wire.errors import WireBroken
from raymq.wire.fetch import STALE_FETCH_ENDPOINT

if TYPE_CHECKING:  # imported where used: placement imports the actors
    from raymq.placement.spares import Spare


_log = logging.getLogger("raymq.client")

#: Fewest messages a receive asks the DeliveryChannel for: one round trip brings a
#: few receive()s' worth, and a deep queue's first message does not wait for a
#: prefetch's worth to be read into this process (messages).
CHANNEL_TAKE_MESSAGES = 128
#: Fewer acks than this gathered when a receive waits for messages go after their linger
#: (a consumer taking one message at a time would cost the queue an ack frame and an
#: fsync for each); more go first, as their credit lets the TargetList load more.
TRICKLE_ACKS = 16
#: The delivery batches' properties column, by index (a lookup by name costs more).
PROPERTIES_COLUMN = DELIVERY_SCHEMA.get_field_index("properties")
#: (seconds); past it the TargetList is killed, and the queue, watching it, delivers
#: again what it held.
CLOSE_TIMEOUT_SECONDS = 60.0
#: The consumer's own counters ``stats()`` adds to its TargetList's.
CLIENT_ACK_COUNTERS = (
    "acks_lost",
    "acks_resent",
    "acks_over_wire",
    "calls_over_wire",
    "calls_in_doubt",
)


class Consumer(AsyncReceives, ConsumerAcks):
    """Receives messages of one queue through its TargetList actor; usable as a context
    manager (closes on exit). Acks go straight to the queue actor.

    Thread-safe: ``close`` from another thread ends a receive waiting there
    (``ConsumerClosed``) and a ``for message in consumer`` loop.
    """

    def __init__(
        self,
        queue: ConsumedQueue,
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
        # queue actor a frame (or a Ray call) and an fdatasync of its ack record: capped at 1,000
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
        self._init_counters()
        # Asked first: it also follows an old handle to its queue's current actor (a
        # revived hibernated queue), and the TargetList then needs no first Ray call.
        fetch_endpoint, cached = queue._fetch_endpoint()
        node = near(node_id).node_id
        spare = spares.take(node)
        self.target_list = spare.actor
        warm_arrow_conversions()  # a process that did not connect() (once per process)
        self._channel: DeliveryChannel | None = None  # receives over a socket, if it opens
        self._init_async_receives()
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
        self._launch(node, spare, fetch_endpoint, cached, settings)

    def _init_counters(self) -> None:
        """The consumer's failure counters (``stats`` and the logs tell them)."""
        #: Pipelined acks whose call failed with the queue's actor for longer than the
        #: restart grace, or that the queue had not answered when the consumer closed
        #: (see ``ack``).
        self.acks_lost = 0
        #: Pipelined acks sent again to the queue's current actor after their call
        #: failed with its old one (``_resend_acks``).
        self.acks_resent = 0
        #: Pipelined ack calls sent as frames on this process's SendChannel to the queue's
        #: actor (the others went by Ray call: no channel open yet, or too many offsets).
        self.acks_over_wire = 0
        self.calls_over_wire = 0  # waited acks, nacks and rejects (ConsumerAcks)
        self.calls_in_doubt = 0
        self._acks_failing_since: float | None = None  # monotonic seconds
        #: Failures of ``close`` giving back what the TargetList held (logged; the
        #: TargetList is killed anyway, and the queue delivers its messages again).
        self.close_failures = 0
        self.delivery_channel_failures = 0  # channels that broke or did not open: Ray then
        #: The TargetList answered "by reference" last: more than the channel sends inline
        #: was ready (a deep queue). Fills then ask through Ray at once, as the channel
        #: would only answer that again (see ``_take_from_target_list``).
        self._by_reference = False
        #: Channel breaks whose unread answer could not be given back (``_channel_broke``).
        self.delivery_channel_unread = 0
        #: Messages that expired between the queue and the application: not handed out.
        self.messages_expired = 0

    def _launch(
        self,
        node: str,
        spare: Spare,
        fetch_endpoint: tuple[str, int, str] | None,
        cached: bool,
        settings: dict,
    ) -> None:
        """Start the ``spare`` TargetList as this consumer's, over
        its DeliveryChannel if the spare has one, else by a Ray call, and connect to its
        channel; a failure kills the spare (it is never a spare again) and is raised."""
        from raymq.placement import spares

        queue = self.queue
        try:
            spare = self._open_spare_channel(node, spare)
            try:
                endpoint = self._start(fetch_endpoint, cached, settings)
            except BrokerUnavailable as exc:
                if self._channel is None or not isinstance(exc.__cause__, WireBroken):
                    raise
                # The spare may have died while it waited: ended (the queue gives back
                # anything it loaded), and a new one started by Ray.
                _log.warning("queue %r: a spare TargetList did not start: %s", queue.name, exc)
                self._channel.close()
                self._channel = None
                spare = self._replace_target_list(node)
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
        # Started by Ray (a spare still starting, or a new one): it answered its channel.
        by_ray = self._channel is None and spare.endpoint is None
        if by_ray and endpoint is not None and delivery_channel.USE_CHANNEL:
            try:
                self._channel = DeliveryChannel(*endpoint, queue.name)
            except WireBroken as exc:
                self._channel_broke(exc)
        # The next consumer's spare: once this one has its first answer, not before.
        spares.warm(node, after=self._first_answer)

    def _open_spare_channel(self, node: str, spare: Spare) -> Spare:
        """Take the ``spare``'s DeliveryChannel as ``self._channel`` (connected while the
        spare waited, or now); returns the spare in use: a new one, started by Ray,
        if the spare's channel does not connect (the spare is killed)."""

        queue = self.queue
        if not delivery_channel.USE_CHANNEL:
            return spare.without_channel()
        if spare.channel is not None:
            spare.channel.name_queue(queue.name)
            self._channel = spare.channel
            return spare
        if spare.endpoint is None:  # still starting: started by Ray
            return spare
        try:
            self._channel = DeliveryChannel(*spare.endpoint, queue.name)
            return spare
        except WireBroken as exc:  # the spare died since it was up, say
            _log.warning("queue %r: a spare TargetList did not connect: %s", queue.name, exc)
            return self._replace_target_list(node)

    def _replace_target_list(self, node: str) -> Spare:
        """Kill the spare TargetList this consumer took (it failed) and take another,
        started by a Ray call; returns it."""
        from raymq.placement import spares

        with contextlib.suppress(Exception):
            ray.kill(self.target_list, no_restart=True)
        spare = spares.take(node).without_channel()
        self.target_list = spare.actor
        return spare

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
        except WireBroken as exc:  # it may have started or not: not ours to use
            raise BrokerUnavailable(
                f"queue {self.queue.name!r}: consumer {self.consumer_id}: its TargetList"
                f" did not start: {exc}"
            ) from exc

    def _channel_broke(self, exc: WireBroken, channel: DeliveryChannel | None = None) -> None:
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
        # A trickle (under a quarter of the prefetch: credit is not short) lingers.
        self._send_acks(at_least=min(max(self.prefetch // 4, 1), TRICKLE_ACKS))
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
            except WireBroken as exc:
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
            batch = None if buffer is None else self._slice(buffer, max_messages)
        return self._without_expired(batch)

    def _take(self, max_messages: int, timeout: float | None) -> pa.RecordBatch | None:
        """Up to ``max_messages`` for the application, none of them expired, waiting up
        to ``timeout`` seconds (None: until some come)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
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
                batch = self._slice(batch, max_messages)
            batch = self._without_expired(batch)
            if batch is not None:
                return batch
            if deadline is not None:  # every one had expired: wait on for the rest
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    return None

    def _without_expired(self, batch: pa.RecordBatch | None) -> pa.RecordBatch | None:
        """``batch`` without the messages that expired while this consumer held them
        (None if nothing is left): the queue takes those back for its expiry queue."""
        if batch is None:
            return None
        expired = expired_rows(batch.column(PROPERTIES_COLUMN), now_ms(time.time()))
        if expired is None:
            return batch
        offsets = offsets_of(batch)[expired]
        self.messages_expired += len(offsets)
        self._send_acks()  # in order, as for reject
        try:
            self.queue._invoke("expire", self.consumer_id, offsets, self._subscription)
        except RayMQError as exc:  # held still: the queue finds them expired when released
            _log.warning("queue %r: expired messages not handed back: %s", self.queue.name, exc)
        kept = batch.filter(pa.array(~expired))
        return kept if kept.num_rows else None

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
        DeliveryChannel takes up to ``CHANNEL_TAKE_MESSAGES`` at once); and this
        client's ack counters (``acks_lost``, ``acks_resent``, ``acks_over_wire``,
        ``calls_over_wire``, ``calls_in_doubt``: ``ConsumerAcks``)."""
        s = _call(self.target_list.stats, retry=False, about=self._about)
        buffer = self._buffer
        s["client_buffered"] = 0 if buffer is None else buffer.num_rows
        for name in CLIENT_ACK_COUNTERS:
            s[name] = getattr(self, name)
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
