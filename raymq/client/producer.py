"""Pipelined single sends: ``Queue.send(body, wait=False)`` returns a ``SendFuture`` at
once; the messages gather into batches shipped over the send channel without waiting.

Why: a waiting ``send`` costs a round trip and a group commit per message; a thread
that does not wait can have thousands of messages on the way, and they then travel and
are stored as a few large batches (one write, one fsync each), as Kafka's producer
batches per-message sends.

How a batch forms (Nagle-like, rather than Kafka's fixed ``linger.ms``): a message joins
the open batch; the batch ships at once if no batch of this producer is in flight (an
idle producer adds no delay), else when it reaches ``max_batch_messages`` or
``max_batch_bytes``, or when the last batch in flight is answered. So batches grow by
themselves to what arrives during one round trip and group commit, and no timer thread
is needed. ``flush`` ships the open batch at once.

Waiting sends (``Queue.send(body)``, ``wait=True``) go the same way, each thread waiting
on its message's future: the sends of a process's threads that arrive while a batch is
in flight leave together as the next batch (one frame, one group commit), which is what
lets 8 waiting threads share round trips and fsyncs. A batch of one message travels as
the channel's single-message frame (no packing: an idle producer is as quick as a bare
channel send).

Guarantees:

- A future resolves only when the queue answered its batch, which it does only after
  the batch is durable (fsynced; on replicated queues, on ``min_insync_replicas``).
- The messages of one producer (one ``Queue`` handle) are stored in the order sent:
  batches go over one channel at a time; a batch is sent over a (new) channel only once
  no earlier batch is unanswered on another, else through Ray calls after those.
- Backpressure: ``send`` blocks while ``max_in_flight_messages`` messages or
  ``max_in_flight_bytes`` bytes are unanswered (the open batch included).
- The channel breaking with batches in flight (the queue actor restarted, the network
  failed): their outcome is unknown, so they are sent again, in order, through Ray
  calls (which also follow a replicated queue's new leader): at-least-once, as a
  waiting ``send`` retried after ``WireBroken``. No future is left unresolved.
- A batch's bytes stay within ``max_batch_bytes`` (but for a single larger message), so
  a producer made with the channel's limit never sends a frame the channel refuses.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raymq.batch import MessageBatch
from raymq.client.calls import resent_refusal
from raymq.errors import NotLeader, RayMQError
from raymq.wire.errors import WireBroken
from raymq.wire.send import SendChannel

log = logging.getLogger("raymq.producer")

#: Errors after which a batch's outcome is unknown or it went to the wrong actor: it is
#: sent again through Ray.
_RESENT = (WireBroken, NotLeader)

#: A batch ships once it holds this many messages (messages).
MAX_BATCH_MESSAGES = 2048
#: A batch ships once its bodies and properties reach this size (bytes).
MAX_BATCH_BYTES = 2**20
#: ``send(wait=False)`` blocks while this many messages are unanswered (messages).
MAX_IN_FLIGHT_MESSAGES = 100_000
#: ``send(wait=False)`` blocks while this many bytes of bodies and properties are
#: unanswered (bytes; Kafka's ``buffer.memory`` is 32 MiB too).
MAX_IN_FLIGHT_BYTES = 32 * 2**20
#: Bytes a message is counted for beyond its body and properties (its two offsets).
MESSAGE_OVERHEAD_BYTES = 16
#: Longest a batch is held, counted from the answer that woke waiting senders, for those
#: senders to send again, when nothing is in flight (seconds): threads that wait on each
#: send then keep sharing one batch, one frame and one commit, instead of splitting into
#: cohorts. Only while woken senders have been coming back within it (see
#: ``RETURN_WEIGHT``): senders paced by a schedule would only be delayed by it.
WAIT_LINGER_SECONDS = 0.001
#: Weight of the newest in the moving average of how long the senders one answer woke
#: took to send again: with the average over the linger, batches are no longer held.
RETURN_WEIGHT = 0.25


@dataclass(frozen=True)
class ProducerStats:
    """What one producer (one ``Queue`` handle's pipelined sends) did so far."""

    sent: int  # messages accepted by send (waiting sends included)
    stored: int  # messages the queue stored (their futures hold an offset)
    dropped: int  # messages the queue DROPped (their futures resolve None)
    failed: int  # messages whose futures hold an error
    batches: int  # batches shipped (over the channel or through Ray)
    resent_batches: int  # batches sent again through Ray after the channel broke
    in_flight_messages: int  # messages not answered yet (the open batch included)
    in_flight_bytes: int  # their bytes, as counted against max_in_flight_bytes
    blocked_seconds: float  # time send() spent blocked on the in-flight bound


class _Batch:
    """Messages shipped together; every ``SendFuture`` of them points here."""

    __slots__ = (
        "producer",
        "bodies",
        "props",
        "nbytes",
        "timeout",
        "seq",
        "wire",
        "on_channel",
        "lost",
        "done",
        "first",
        "count",
        "error",
        "n",
        "waited",
        "waiters",
    )

    def __init__(self, producer: Producer, timeout: float | None, seq: int) -> None:
        self.producer = producer
        self.bodies: list[bytes] = []
        self.props: list[bytes] = []
        self.nbytes = 0
        self.timeout = timeout
        self.seq = seq
        self.wire: MessageBatch | None = None
        self.on_channel = False
        #: Its channel broke with it in flight: it may be stored (``resent_refusal``).
        self.lost: BaseException | None = None
        self.done = False
        self.first = 0
        self.count = 0
        self.error: BaseException | None = None
        self.n = 0  # messages, once shipped
        self.waited = 0  # of them, from waiting sends (their errors are raised, not kept)
        self.waiters: list[threading.Lock] | None = None  # threads in result(), each its lock

    # the SendChannel's reply protocol (called from its reader thread)
    def set_result(self, value: Any) -> None:
        if value is None or type(value) is int:  # a single-message frame's answer: its offset
            value = (0, 0) if value is None else (value, 1)  # None: DROPped
        self.producer._answered(self, value, None)

    def set_exception(self, error: BaseException) -> None:
        self.producer._answered(self, None, error)


class SendFuture:
    """The offset a pipelined ``send`` will have: ``result()`` waits for it.

    Light on purpose (two slots, no lock of its own): one is made per message."""

    __slots__ = ("_batch", "_index")

    def __init__(self, batch: _Batch, index: int) -> None:
        self._batch = batch
        self._index = index

    def done(self) -> bool:
        """True once the queue answered this message's batch."""
        return self._batch.done

    def result(self, timeout: float | None = None) -> int | None:
        """The message's offset once durable; None if the queue DROPped it. Raises the
        queue's typed error (``AddressFull``, ``StorageError``, ...), or ``TimeoutError``
        after ``timeout`` seconds (None: until answered)."""
        batch = self._batch
        if not batch.done:
            batch.producer._wait_for(batch, timeout)
        if batch.error is not None:
            raise batch.error
        return batch.first + self._index if self._index < batch.count else None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The error this send ended in (None: stored or DROPped); waits as ``result``."""
        batch = self._batch
        if not batch.done:
            batch.producer._wait_for(batch, timeout)
        return batch.error

    def __repr__(self) -> str:
        if not self._batch.done:
            return "SendFuture(pending)"
        try:
            return f"SendFuture(offset={self.result()})"
        except Exception as exc:
            return f"SendFuture(error={exc!r})"


class Producer:
    """The pipelined sends of one queue handle.

    ``channel_of()`` returns the process's SendChannel to the queue (None: none now);
    ``ray_send(batch, timeout)`` stores a batch through a Ray call and returns (first
    offset, count stored). Both are given by ``Queue`` (tests give fakes).
    """

    def __init__(
        self,
        queue: str,
        channel_of: Callable[[], SendChannel | None],
        ray_send: Callable[[MessageBatch, float | None], tuple[int, int]],
        *,
        max_batch_messages: int = MAX_BATCH_MESSAGES,
        max_batch_bytes: int = MAX_BATCH_BYTES,
        max_in_flight_messages: int = MAX_IN_FLIGHT_MESSAGES,
        max_in_flight_bytes: int = MAX_IN_FLIGHT_BYTES,
        wait_linger: float = WAIT_LINGER_SECONDS,
    ) -> None:
        self.queue = queue
        self._channel_of = channel_of
        self._ray_send = ray_send
        self.max_batch_messages = max_batch_messages
        self.max_batch_bytes = max_batch_bytes
        self.max_in_flight_messages = max_in_flight_messages
        self.max_in_flight_bytes = max_in_flight_bytes
        #: Longest a waiting send holds its batch for woken senders (seconds; 0: never).
        self.wait_linger = wait_linger
        # Reentrant: a channel found broken while shipping fails the earlier batches
        # from within the shipping thread, which already holds it.
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        self._channel: SendChannel | None = None
        #: The channel of the batches in ``_on_channel`` (all on one: the order).
        self._flight_channel: SendChannel | None = None
        #: Batches shipped and not answered, by seq (dicts keep the order: oldest first).
        self._unfinished: dict[int, _Batch] = {}
        self._open: _Batch | None = None
        self._seq = 0
        self._in_flight = 0  # batches shipped and not answered
        self._pending_msgs = 0  # messages not answered (the open batch's included)
        self._pending_bytes = 0
        #: Waiting senders the last answer woke that have not sent again: while some
        #: are, a waiting send holds the open batch for them (up to WAIT_LINGER_SECONDS)
        #: rather than ship it alone, so that the threads go on sharing one batch.
        self._returning = 0
        self._woken = 0  # waiting senders the last answer woke
        self._answered_at = 0.0  # when (time.monotonic)
        #: Moving average of how long the senders an answer woke took to send again, all
        #: of them, when it woke several (seconds; capped at twice the linger).
        self._return_seconds = 0.0
        self._on_channel: set[int] = set()  # seqs of batches in flight on a channel
        self._lane: list[tuple[int, _Batch]] = []  # batches for Ray calls, by seq
        self._lane_busy = False  # the Ray worker thread runs
        self._cv_waiting = 0  # threads in self._cv.wait: only then is it notified
        self._first_error: BaseException | None = None
        self._errors = 0  # messages failed since the last flush
        self._sent = self._stored = self._dropped = self._failed = 0
        self._batches = self._resent = 0
        self._blocked = 0.0

    # -- sending --------------------------------------------------------------------

    def send(
        self, body: bytes, props: bytes, timeout: float | None, waited: bool = False
    ) -> SendFuture:
        """Add one checked message (bytes body, msgpack properties) to the open batch;
        blocks while the in-flight bound is reached. ``timeout`` is the BLOCK policy's
        wait for room, in seconds, for the batch it goes in. ``waited``: the caller
        waits for the result and raises its error (not kept for ``flush``)."""
        size = len(body) + len(props) + MESSAGE_OVERHEAD_BYTES
        with self._lock:  # the Condition's own lock: one Python call fewer per message
            if (
                self._pending_msgs >= self.max_in_flight_messages
                or self._pending_bytes + size > self.max_in_flight_bytes
            ) and self._pending_msgs:
                self._wait_for_room(size)
            batch = self._open
            if batch is not None and (
                batch.timeout != timeout or batch.nbytes + size > self.max_batch_bytes
            ):
                # One timeout per batch (it goes with the batch), and never more bytes
                # than max_batch_bytes: the channel's frame limit may be that.
                self._ship()
                batch = None
            if batch is None:
                self._seq += 1
                batch = self._open = _Batch(self, timeout, self._seq)
            index = len(batch.bodies)
            batch.bodies.append(body)
            batch.props.append(props)
            batch.nbytes += size
            hold = False
            if waited:
                batch.waited += 1
                if self._returning:  # one of the threads the last answer woke is back
                    self._returning -= 1
                    now = time.monotonic()
                    if self._returning:  # the others are coming: they go together
                        hold = self._holds(now)
                    elif self._woken > 1:  # the last of them: how long they all took
                        self._note_return(now - self._answered_at)
            self._pending_msgs += 1
            self._pending_bytes += size
            self._sent += 1
            if (
                (not self._in_flight and not hold)
                or index + 1 >= self.max_batch_messages
                or batch.nbytes >= self.max_batch_bytes
            ):
                self._ship()
        return SendFuture(batch, index)

    def busy(self) -> bool:
        """True while any pipelined send is unanswered."""
        return self._pending_msgs > 0

    def flush(self, timeout: float | None = None) -> None:
        """Ship the open batch and wait until every pipelined send so far is answered.

        Raises ``TimeoutError`` naming the queue after ``timeout`` seconds (None: no
        limit; each batch still ends, within its BLOCK timeout or when the channel is
        found dead). Then, if sends failed since the last flush, raises the first one's
        error (the same class, saying how many failed); their futures hold each error.
        """
        with self._cv:
            self.drain(timeout)
            error, count = self._first_error, self._errors
            self._first_error, self._errors = None, 0
        if error is not None:
            raise _summary(error, count, self.queue)

    def drain(self, timeout: float | None = None) -> None:
        """``flush`` without raising the errors of failed sends (their futures hold
        them): what a batch send of the same handle does to keep the order. Waits for
        the sends made before it only (others' later sends cannot starve it)."""
        with self._cv:
            if self._open is not None:
                self._ship()
            last = self._seq

            def answered() -> bool:
                unfinished = self._unfinished
                return not unfinished or next(iter(unfinished)) > last

            if not self._wait(answered, timeout):
                raise TimeoutError(
                    f"queue {self.queue!r}: {self._pending_msgs} pipelined sends unanswered"
                    f" after {timeout} s"
                )

    def stats(self) -> ProducerStats:
        """Counts so far (a snapshot)."""
        with self._cv:
            return ProducerStats(
                sent=self._sent,
                stored=self._stored,
                dropped=self._dropped,
                failed=self._failed,
                batches=self._batches,
                resent_batches=self._resent,
                in_flight_messages=self._pending_msgs,
                in_flight_bytes=self._pending_bytes,
                blocked_seconds=self._blocked,
            )

    # -- shipping (all with the lock held) ------------------------------------------

    def _ship(self) -> None:
        """Send the open batch: over the channel unless batches wait for Ray calls (they
        go first: order), earlier batches are unanswered on another channel (a broken
        or replaced one: they may yet be sent again through Ray, and go first), or there
        is no channel."""
        batch = self._open
        self._open = None
        batch.n = len(batch.bodies)
        self._in_flight += 1
        self._batches += 1
        self._unfinished[batch.seq] = batch
        if not self._lane and not self._lane_busy:
            channel = self._usable_channel()
            if channel is not None:
                batch.on_channel = True
                self._on_channel.add(batch.seq)
                self._flight_channel = channel
                try:
                    if batch.n == 1:  # the single-message frame: nothing to pack
                        channel.submit_one(batch.bodies[0], batch.props[0], batch.timeout, batch)
                    else:
                        channel.submit_batch(self._wire(batch), batch.timeout, batch)
                    return
                except WireBroken:
                    batch.on_channel = False
                    self._on_channel.discard(batch.seq)
        self._to_lane(batch)

    def _usable_channel(self) -> SendChannel | None:
        """The channel a batch may go over now, keeping the order (None: Ray calls)."""
        if self._on_channel:  # only behind its own batches, on a channel still working
            channel = self._flight_channel
            if channel is self._channel and channel is not None and channel.broken is None:
                return channel
            return None
        channel = self._channel
        if channel is None or channel.broken is not None:
            try:
                channel = self._channel = self._channel_of()
            except Exception as exc:  # never lose the batch: Ray carries it
                log.warning("queue %r: no send channel: %r", self.queue, exc)
                channel = self._channel = None
        return channel

    @staticmethod
    def _wire(batch: _Batch) -> MessageBatch:
        """The batch packed (once: the packed copy is what is kept for a resend)."""
        if batch.wire is None:
            batch.wire = MessageBatch.from_encoded(batch.bodies, batch.props)
            batch.bodies = batch.props = None
        return batch.wire

    def _to_lane(self, batch: _Batch) -> None:
        heapq.heappush(self._lane, (batch.seq, batch))
        if not self._lane_busy:
            self._lane_busy = True
            threading.Thread(
                target=self._lane_loop, name=f"raymq-producer-{self.queue}", daemon=True
            ).start()
        self._cv.notify_all()

    def _lane_loop(self) -> None:
        """Send the lane's batches through Ray calls, in order: a batch waits while an
        earlier one is still in flight on a (broken) channel, whose failure brings it
        here too."""
        while True:
            with self._cv:
                while self._lane and self._on_channel and min(self._on_channel) < self._lane[0][0]:
                    self._cv_waiting += 1
                    try:
                        self._cv.wait(1.0)
                    finally:
                        self._cv_waiting -= 1
                if not self._lane:
                    self._lane_busy = False
                    if self._open is not None and not self._in_flight:
                        self._ship()  # what gathered meanwhile goes over a channel again
                    return
                _, batch = heapq.heappop(self._lane)
            try:  # whatever fails, the batch's futures are told and the lane goes on
                value: Any = self._ray_send(self._wire(batch), batch.timeout)
                error = None
            except Exception as exc:  # the queue's typed error, for each of its futures
                value, error = None, resent_refusal(exc, batch.lost, self.queue)
            self._finish(batch, value, error)

    # -- answers --------------------------------------------------------------------

    def _answered(self, batch: _Batch, value: Any, error: BaseException | None) -> None:
        """The channel's answer to ``batch`` (from its reader thread, or the thread that
        found it broken). An unknown outcome sends it again through Ray."""
        if error is not None and isinstance(error, _RESENT):
            with self._cv:
                if isinstance(error, NotLeader):
                    self._channel = None  # the handle finds the new leader (Ray): its channel
                else:
                    batch.lost = error  # its outcome is unknown
                batch.on_channel = False
                self._on_channel.discard(batch.seq)
                self._resent += 1
                log.warning(
                    "queue %r: batch of %d pipelined sends resent through Ray: %s",
                    self.queue,
                    batch.n,
                    error,
                )
                self._to_lane(batch)
            return
        self._finish(batch, value, error)

    def _finish(self, batch: _Batch, value: Any, error: BaseException | None) -> None:
        n = batch.n
        with self._cv:
            if error is None:
                batch.first, batch.count = value[0], value[1]
                self._stored += batch.count
                self._dropped += n - batch.count
            else:
                batch.error = error
                self._failed += n
                kept = n - batch.waited  # a waiting send raised its error already
                if kept:
                    self._errors += kept
                    if self._first_error is None:
                        self._first_error = error
            batch.done = True
            waiters, batch.waiters = batch.waiters, None
            if waiters:  # first: their wake-up overlaps the bookkeeping below
                for waiter in waiters:  # only the threads waiting on this batch wake
                    waiter.release()
            if self._returning and self._woken > 1:  # the last answer's did not all return
                self._note_return(2 * self.wait_linger)
            self._returning = self._woken = batch.waited
            self._answered_at = time.monotonic()
            if batch.on_channel:
                batch.on_channel = False
                self._on_channel.discard(batch.seq)
            self._unfinished.pop(batch.seq, None)
            batch.wire = batch.bodies = batch.props = None
            self._in_flight -= 1
            self._pending_msgs -= n
            self._pending_bytes -= batch.nbytes
            held = self._open
            if held is not None and not self._in_flight and not self._lane_busy:
                if self._returning and held.waiters and self._holds(self._answered_at):
                    # Held for the waiting senders this answer woke, which join it; one
                    # of its own waiting threads wakes to keep the linger time.
                    held.waiters.pop(0).release()
                else:
                    self._ship()  # Nagle: what gathered during the round trip goes now
            if self._cv_waiting:  # flush, drain, the in-flight bound or the lane wait
                self._cv.notify_all()

    # -- waiting (with the lock held) -----------------------------------------------

    def _wait_for(self, batch: _Batch, timeout: float | None) -> None:
        """Wait until ``batch`` is answered (``TimeoutError`` after ``timeout`` seconds;
        None: no limit). Each waiting thread blocks on a lock of its own, released by the
        answer: no thread waiting on another batch wakes.

        An open batch is not shipped for it while another is in flight: the answer to
        that one ships it (Nagle), with what else gathers. With nothing in flight it
        ships at once, unless waiting senders woken by the last answer are still to
        send again and such senders have been coming back within the linger: then it
        waits for them until ``WAIT_LINGER_SECONDS`` after that answer (the last of
        them back ships it). A batch on a channel that went silent needs no watch here:
        the channel's wire client pings a server it has not heard from while requests
        wait, and breaks the connection when the ping goes unanswered; the batch then
        fails with ``WireBroken`` and goes again through Ray (never a hung wait)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        waiter: threading.Lock | None = None
        lingered = False
        while True:
            with self._lock:
                if batch.done:
                    return
                wait = None  # until answered
                if batch is self._open and not self._in_flight:
                    now = time.monotonic()
                    if self._returning and not lingered and self._holds(now):
                        wait, lingered = self._answered_at + self.wait_linger - now, True
                    else:  # nobody else is coming (or came in time): it goes now
                        self._returning = 0
                        self._ship()
                        if batch.done:
                            return
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        if waiter is not None and batch.waiters and waiter in batch.waiters:
                            batch.waiters.remove(waiter)
                        raise TimeoutError(
                            f"queue {self.queue!r}: pipelined send unanswered after {timeout} s"
                        )
                    wait = left if wait is None else min(wait, left)
                if waiter is None:
                    waiter = threading.Lock()
                    waiter.acquire()
                    if batch.waiters is None:
                        batch.waiters = [waiter]
                    else:
                        batch.waiters.append(waiter)
            if waiter.acquire(timeout=-1 if wait is None else wait):
                if batch.done:
                    return
                waiter = None  # woken to keep the linger time of a held batch: look again
            # else a linger or the deadline passed: looked at above

    def _note_return(self, seconds: float) -> None:
        """Add to the average how long an answer's woken senders took to send again
        (capped: senders back much later must not stop holds for long)."""
        took = min(seconds, 2 * self.wait_linger)
        self._return_seconds += RETURN_WEIGHT * (took - self._return_seconds)

    def _holds(self, now: float) -> bool:
        """Whether the open batch waits for senders the last answer woke: the linger
        from that answer (``now``, ``time.monotonic``) is not over, and woken senders
        have been coming back within it."""
        linger = self.wait_linger
        return now < self._answered_at + linger and self._return_seconds < linger

    def _wait_for_room(self, size: int) -> None:
        """Block until the message of ``size`` bytes fits the in-flight bound."""
        if self._open is not None:
            self._ship()  # the open batch counts against the bound: it must be on its way
        t0 = time.monotonic()
        self._wait(
            lambda: (
                not self._pending_msgs
                or (
                    self._pending_msgs < self.max_in_flight_messages
                    and self._pending_bytes + size <= self.max_in_flight_bytes
                )
            ),
            None,
        )
        self._blocked += time.monotonic() - t0

    def _wait(self, done: Callable[[], bool], timeout: float | None) -> bool:
        """Wait until ``done()``; False after ``timeout`` seconds (None: no limit). Every
        batch ends (``_wait_for``): a dead channel's wire client breaks the connection,
        and its batches go through Ray."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done():
            wait = None
            if deadline is not None:
                wait = deadline - time.monotonic()
                if wait <= 0:
                    return False
            self._cv_waiting += 1
            try:
                self._cv.wait(wait)
            finally:
                self._cv_waiting -= 1
        return True


def _summary(error: BaseException, count: int, queue: str) -> BaseException:
    """``error`` again, saying how many pipelined sends failed (same class when a
    RayMQ error, which all take one message)."""
    if count > 1 and isinstance(error, RayMQError):
        try:
            return type(error)(
                f"{count} pipelined sends to queue {queue!r} failed since the last flush;"
                f" the first: {error}"
            )
        except TypeError:
            pass
    return error
