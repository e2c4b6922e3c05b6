"""AckPipeline: one consumer's acks, gathered, sent without waiting, checked later.

An ack that waits costs a round trip and the queue's fsync of its ack record, about as
much as receiving the 1,000 messages it acknowledges; AMQP's basic.ack is fire-and-forget
for the same reason. So ``Consumer.ack`` hands its offsets to this pipeline by default:

- offsets gather until ``batch_messages`` of them are waiting, or the oldest has waited
  ``linger_seconds`` (a process-wide thread sends those), or the consumer sends them
  first (before asking for more messages, before ``nack``/``reject``, on ``flush`` and
  ``close``): then they go out as ONE call, one ack record, one fsync;
- at most ``max_in_flight`` calls are in flight; a further send waits for the oldest;
- a call's outcome is checked when a later call is sent and by ``flush``, which raise
  the first failure (a ``RayMQError``).

An ack that never reached the queue (the process crashed first, or the call failed)
leaves its message unacknowledged: it is delivered again. Delivery is at-least-once
either way.

Ray-free: the call is a function returning a ``concurrent.futures.Future``-like object.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

#: Calls in flight before a send waits for the oldest.
MAX_PIPELINED_ACKS = 8
#: Longest a pipelined ack waits in the client before it is sent (seconds): a consumer
#: acking one message at a time, slowly, still has its acks at the queue promptly.
ACK_LINGER_SECONDS = 0.02


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
    ):
        self._send_call = send
        self._check = check
        self.batch_messages = max(batch_messages, 1)
        #: (seconds; None: ``ACK_LINGER_SECONDS`` as the module has it now)
        self.linger_seconds = ACK_LINGER_SECONDS if linger_seconds is None else linger_seconds
        self.max_in_flight = max_in_flight
        self._lock = threading.RLock()
        self._unsent: list[np.ndarray] = []
        self._singles: list[int] = []  # add_one's offsets, an array once sent
        self._unsent_count = 0
        self._in_flight: list[tuple[_Future, list[np.ndarray]]] = []
        self._failures: list[Exception] = []  # checked, not raised yet

    @property
    def unsent(self) -> int:
        """Offsets gathered and not sent yet."""
        return self._unsent_count

    @property
    def in_flight(self) -> int:
        """Calls sent whose outcome has not been checked yet."""
        return len(self._in_flight)

    def add(self, offsets: np.ndarray) -> None:
        """Gather ``offsets``; a call is sent once ``batch_messages`` are gathered
        (raising the first failure of an earlier call that has finished)."""
        with self._lock:
            self._unsent.append(offsets)
            self._gathered(len(offsets))

    def add_one(self, offset: int) -> None:
        """``add`` of one offset: a message acked on its own costs no array."""
        with self._lock:
            self._singles.append(offset)
            self._gathered(1)

    def _gathered(self, n: int) -> None:
        self._unsent_count += n
        if self._unsent_count >= self.batch_messages:
            self.send()
            self.collect(block=len(self._in_flight) > self.max_in_flight)
        elif self._unsent_count == n:  # the first gathered: sent after the linger at most
            _lingerer.schedule(self, self.linger_seconds)

    def send(self) -> None:
        """Send the gathered offsets as one call, not waiting for it."""
        with self._lock:
            if not self._unsent_count:
                return
            parts = self._unsent
            if self._singles:
                parts.append(np.array(self._singles, dtype=np.int64))
            self._unsent, self._singles, self._unsent_count = [], [], 0
            offsets = parts[0] if len(parts) == 1 else np.concatenate(parts)
            try:
                fut = self._send_call(offsets)
            except BaseException:  # still unsent: the next send tries them again
                self._unsent[:0], self._unsent_count = parts, self._unsent_count + len(offsets)
                raise
            self._in_flight.append((fut, parts))

    def collect(self, block: bool, raise_errors: bool = True) -> None:
        """Check the calls that finished (with ``block``, wait for all but the newest
        half of a full window first), raising the first failure; with
        ``raise_errors=False`` a failure is kept for the next call that raises."""
        with self._lock:
            if block and self._in_flight:
                keep = self.max_in_flight // 2 if len(self._in_flight) > self.max_in_flight else 0
                for fut, _ in self._in_flight[: len(self._in_flight) - keep]:
                    with contextlib.suppress(Exception):  # raised in order, below
                        fut.result()
            done, pending = [], []
            for item in self._in_flight:  # one done() each: a call finishing meanwhile
                (done if item[0].done() else pending).append(item)  # stays pending
            self._in_flight = pending
            for fut, parts in done:  # every finished call is checked, even after a failure
                try:
                    self._check(fut, parts)
                except Exception as exc:  # noqa: BLE001 - kept and raised below, in order
                    self._failures.append(exc)
            if raise_errors and self._failures:
                first, self._failures = self._failures[0], []
                raise first

    def flush(self) -> None:
        """Send what is gathered and wait for every call; raises the first failure."""
        with self._lock:
            self.send()
            self.collect(block=True)
            while self._in_flight:
                self.collect(block=True)

    def discard(self) -> list[np.ndarray]:
        """Forget the unsent offsets (returned); their messages stay unacknowledged."""
        with self._lock:
            if self._singles:
                self._unsent.append(np.array(self._singles, dtype=np.int64))
            parts, self._unsent, self._singles, self._unsent_count = self._unsent, [], [], 0
            return parts


class _Lingerer:
    """One daemon thread per process sending the acks that lingered long enough."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, weakref.ref]] = []
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def schedule(self, pipeline: AckPipeline, after: float) -> None:
        """Send ``pipeline``'s gathered acks ``after`` seconds from now."""
        with self._cv:
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
            if pipeline is not None:
                # A failed send leaves the acks gathered: the consumer's next send raises.
                with contextlib.suppress(Exception):
                    pipeline.send()


_lingerer = _Lingerer()
