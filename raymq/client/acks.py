"""AckPipeline: one consumer's acks, gathered, sent without waiting, checked later.

An ack that waits costs a round trip and the queue's fsync of its ack record, about as
much as receiving the 1,000 messages it acknowledges; AMQP's basic.ack is fire-and-forget
for the same reason. So ``Consumer.ack`` hands its offsets to this pipeline by default:

- offsets gather until ``batch_messages`` of them are waiting, or the oldest has waited
  ``linger_seconds`` (a process-wide thread sends those), or the consumer sends them
  first (before asking for more messages unless they are a trickle, before
  ``nack``/``reject``, on ``flush`` and ``close``): then they go out as ONE call, one
  ack record, one fsync;
- at most ``max_in_flight`` calls are in flight; a further send waits for the oldest,
  at most ``answer_seconds`` (then ``BrokerUnavailable`` naming the queue);
- a call's outcome is checked when a later call is sent and by ``flush``, which raise
  the first failure (a ``RayMQError``).

The linger thread never waits: not for a call's answer, nor for a consumer that holds
its pipeline's lock (that consumer is sending or waiting itself; the linger tries again
a linger later). So one consumer whose queue does not answer delays no other's acks.

A call that failed because the queue's actor died or moved is given back
(``requeue``) and sent again to the queue's current actor by the consumer's next send,
for as long as the consumer allows (``raymq.client``: the restart grace); an ack that
never reached the queue after that, or because this process died first, leaves its
message unacknowledged: it is delivered again. Delivery is at-least-once either way.

Ray-free: the call is a function returning a ``concurrent.futures.Future``-like object.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from raymq.errors import BrokerUnavailable

_log = logging.getLogger("raymq.acks")

#: Calls in flight before a send waits for the oldest.
MAX_PIPELINED_ACKS = 8
#: Longest a pipelined ack waits in the client before it is sent (seconds): a consumer
#: acking one message at a time, slowly, still has its acks at the queue promptly.
ACK_LINGER_SECONDS = 0.02
#: Pause before a flush sends again the acks of a call that did not reach the queue
#: (``requeue``): the queue's actor is restarting or moving (seconds).
RESEND_PAUSE_SECONDS = 0.05
#: Longest ``flush``, ``close`` or a send into a full window waits for the queue to
#: answer pipelined ack calls (seconds): as long as a call waits out a restarting actor.
ACK_ANSWER_SECONDS = 60.0


class _Future(Protocol):
    def done(self) -> bool: ...
    def result(self, timeout: float | None = None) -> Any: ...


#: Sends one gathered call: (offsets) -> its future.
SendAcks = Callable[[np.ndarray], _Future]
#: Checks one finished call: (future, the add() offsets it carried); raises its error.
CheckAcks = Callable[[_Future, list[np.ndarray]], None]


class AckPipeline:
    """The pipelined acks of one consumer (thread-safe)."""

    def __init__(
        self,
        send: SendAcks,
        check: CheckAcks,
        batch_messages: int,
        linger_seconds: float | None = None,
        max_in_flight: int = MAX_PIPELINED_ACKS,
        *,
        what: str = "queue",
        answer_seconds: float | None = None,
    ):
        self._send_call = send
        self._check = check
        self.batch_messages = max(batch_messages, 1)
        #: (seconds; None: ``ACK_LINGER_SECONDS`` as the module has it now)
        self.linger_seconds = ACK_LINGER_SECONDS if linger_seconds is None else linger_seconds
        self.max_in_flight = max_in_flight
        #: Names the queue in errors, e.g. "queue 'orders'".
        self.what = what
        #: (seconds; None: ``ACK_ANSWER_SECONDS`` as the module has it now)
        self.answer_seconds = answer_seconds
        self._lock = threading.RLock()
        self._unsent: list[np.ndarray] = []  # add()'s arrays
        self._unsent_count = 0  # offsets in them
        #: add_one's offsets, appended without the lock (``list.append`` is atomic); a
        #: send takes a prefix of them with a slice and ``del`` (atomic too), so an
        #: offset appended meanwhile stays for the next send. Never replaced.
        self._singles: list[int] = []
        #: A linger send is scheduled and has not started yet.
        self.lingering = False
        self._in_flight: list[tuple[_Future, list[np.ndarray]]] = []
        self._failures: list[Exception] = []  # checked, not raised yet

    @property
    def unsent(self) -> int:
        """Offsets gathered and not sent yet."""
        return self._unsent_count + len(self._singles)

    @property
    def in_flight(self) -> int:
        """Calls sent whose outcome has not been checked yet."""
        return len(self._in_flight)

    def _answer_seconds(self) -> float:
        return ACK_ANSWER_SECONDS if self.answer_seconds is None else self.answer_seconds

    def add(self, offsets: np.ndarray) -> None:
        """Gather ``offsets``; a call is sent once ``batch_messages`` are gathered
        (raising the first failure of an earlier call that has finished)."""
        with self._lock:
            self._unsent.append(offsets)
            self._unsent_count += len(offsets)
        self._gathered()

    def add_one(self, offset: int) -> None:
        """``add`` of one offset: the per-message path (``for message in consumer``),
        so it takes no lock and makes no array."""
        singles = self._singles
        singles.append(offset)
        if len(singles) + self._unsent_count >= self.batch_messages or not self.lingering:
            self._gathered()

    def _gathered(self) -> None:
        if self.unsent >= self.batch_messages:
            with self._lock:
                self.send()
                self.collect(block=len(self._in_flight) > self.max_in_flight)
        elif not self.lingering:  # sent after the linger at most
            _lingerer.schedule(self, self.linger_seconds)

    def send(self) -> None:
        """Send the gathered offsets as one call, not waiting for it."""
        with self._lock:
            singles = self._singles
            n = len(singles)
            if not n and not self._unsent_count:
                return
            parts = self._unsent
            if n:
                parts.append(np.array(singles[:n], dtype=np.int64))
                del singles[:n]
            self._unsent, self._unsent_count = [], 0
            offsets = parts[0] if len(parts) == 1 else np.concatenate(parts)
            try:
                fut = self._send_call(offsets)
            except BaseException:  # still unsent: the next send tries them again
                self._unsent[:0] = parts
                self._unsent_count += len(offsets)
                raise
            self._in_flight.append((fut, parts))

    def requeue(self, parts: list[np.ndarray]) -> None:
        """Gather again the offsets of a call that did not reach the queue (its actor
        died or moved): the next send carries them, to the queue's current actor. Sent
        after a linger at the latest."""
        with self._lock:
            self._unsent[:0] = parts
            self._unsent_count += sum(len(p) for p in parts)
        if not self.lingering:
            _lingerer.schedule(self, self.linger_seconds)

    def try_send(self) -> bool:
        """``send`` unless another thread holds the pipeline (it is adding, sending or
        waiting for answers): False then, at once. For the linger thread."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            self.send()
        finally:
            self._lock.release()
        return True

    def collect(self, block: bool, raise_errors: bool = True) -> None:
        """Check the calls that finished (with ``block``, wait for all but the newest
        half of a full window first, at most ``ACK_ANSWER_SECONDS``, else
        ``BrokerUnavailable``), raising the first failure; with ``raise_errors=False``
        a failure is kept for the next call that raises."""
        with self._lock:
            if block and self._in_flight:
                keep = self.max_in_flight // 2 if len(self._in_flight) > self.max_in_flight else 0
                waited = self._in_flight[: len(self._in_flight) - keep]
                if self._wait(waited, time.monotonic() + self._answer_seconds()):
                    self._check_done()
                    raise self._unanswered(len(waited))
            self._check_done()
            if raise_errors:
                self._raise_first()

    def flush(self, timeout: float | None = None, *, raise_errors: bool = True) -> int:
        """Send what is gathered and wait for every call, at most ``timeout`` seconds
        (None: ``ACK_ANSWER_SECONDS``); raises the first failure (with
        ``raise_errors=False`` it is kept for the consumer's next call that raises).
        Returns how many calls are still unanswered (they stay in flight, checked
        later): the caller decides whether that is an error or a loss."""
        deadline = time.monotonic() + (self._answer_seconds() if timeout is None else timeout)
        with self._lock:
            while True:
                self.send()
                unanswered = self._wait(list(self._in_flight), deadline)
                self._check_done()  # a call that did not reach the queue is requeued:
                if unanswered or not self.unsent or time.monotonic() >= deadline:
                    break
                time.sleep(min(RESEND_PAUSE_SECONDS, max(deadline - time.monotonic(), 0.0)))
            if raise_errors:
                self._raise_first()
            return unanswered

    def abandon(self) -> list[np.ndarray]:
        """Forget the calls still in flight (their outcome unknown) and the unsent
        offsets; returns their offsets. For a consumer closing: the queue delivers
        again whatever of them it did not store."""
        with self._lock:
            parts = [p for _, parts in self._in_flight for p in parts]
            self._in_flight = []
            return parts + self.discard()

    def discard(self) -> list[np.ndarray]:
        """Forget the unsent offsets (returned); their messages stay unacknowledged."""
        with self._lock:
            singles = self._singles
            n = len(singles)
            if n:
                self._unsent.append(np.array(singles[:n], dtype=np.int64))
                del singles[:n]
            parts, self._unsent, self._unsent_count = self._unsent, [], 0
            return parts

    def _wait(self, calls: list[tuple[_Future, list[np.ndarray]]], deadline: float) -> int:
        """Wait for ``calls`` until ``deadline`` (monotonic seconds); how many did not
        finish by then."""
        for i, (fut, _) in enumerate(calls):
            try:
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                return sum(1 for f, _ in calls[i:] if not f.done())
            except Exception:  # noqa: BLE001, S110 - checked (and raised) in order later
                pass
        return 0

    def _check_done(self) -> None:
        done, pending = [], []
        for item in self._in_flight:  # one done() each: a call finishing meanwhile
            (done if item[0].done() else pending).append(item)  # stays pending
        self._in_flight = pending
        for fut, parts in done:  # every finished call is checked, even after a failure
            try:
                self._check(fut, parts)
            except Exception as exc:  # noqa: BLE001 - kept and raised later, in order
                self._failures.append(exc)

    def _raise_first(self) -> None:
        if self._failures:
            first, self._failures = self._failures[0], []
            raise first

    def _unanswered(self, calls: int) -> BrokerUnavailable:
        return unanswered_error(self.what, calls, self._answer_seconds())


def unanswered_error(what: str, calls: int, seconds: float) -> BrokerUnavailable:
    """The error of pipelined ack calls that ``what`` (e.g. "queue 'q'") did not answer."""
    return BrokerUnavailable(
        f"{what}: {calls} pipelined ack calls not answered within {seconds:g} s (their"
        " messages are delivered again unless the queue stored the acks)"
    )


class _Lingerer:
    """One daemon thread per process sending the acks that lingered long enough."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, weakref.ref]] = []
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        #: Sends that raised (the acks stay gathered for the consumer's next send).
        self.failed_sends = 0

    def schedule(self, pipeline: AckPipeline, after: float) -> None:
        """Send ``pipeline``'s gathered acks ``after`` seconds from now."""
        with self._cv:
            pipeline.lingering = True
            entry = (time.monotonic() + after, next(self._ids), weakref.ref(pipeline))
            heapq.heappush(self._heap, entry)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="raymq-acks", daemon=True)
                self._thread.start()
            if self._heap[0] is entry:
                self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    wait = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._cv.wait(wait)
                _, _, ref = heapq.heappop(self._heap)
            pipeline = ref()
            if pipeline is None:
                continue
            # Cleared before the send takes the gathered offsets: one added after that
            # schedules its own linger (add_one reads the flag without a lock).
            pipeline.lingering = False
            try:
                sent = pipeline.try_send()  # never waits: see the module's docstring
            except Exception as exc:  # noqa: BLE001 - still gathered: the next send raises
                self.failed_sends += 1
                _log.warning("%s: sending lingering acks failed: %s", pipeline.what, exc)
                continue
            if not sent and pipeline.unsent:  # its consumer holds it: try again later
                self.schedule(pipeline, pipeline.linger_seconds)


_lingerer = _Lingerer()
