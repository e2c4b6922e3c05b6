"""TargetList: one consumer's direct references, its watermark and its PendingCache.

Entries up to the watermark are *direct references*: object-store references to
delivery batches the queue has already given this consumer (held against its
prefetch). Beyond the watermark the consumer's matching messages are CacheReferences
kept by the queue's TargetArea (an ``OffsetSet``: one bit per message, each offset
naming its segment and position). The eager loader (in the TargetList actor) raises the
watermark toward the high watermark, first from the PendingCache, then from the queue.
When the high watermark drops, direct entries above it move to the PendingCache; what
does not fit there is given back to the queue (as never received).

``EagerLoader`` is that loader, given the fetch as a function: it retries failed fetches
with backoff forever, and once a failure persists (``FailureStreak``) the consumer's
``take`` raises it as a typed error naming the queue, until a fetch succeeds again.

Plain Python, no Ray: references are opaque objects here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from raymq.core.budget import ConsumerUsage
from raymq.errors import BrokerUnavailable, ConsumerClosed, RayMQError

#: No offsets (read-only: shared).
_NOTHING = np.zeros(0, dtype=np.int64)
_NOTHING.flags.writeable = False

log = logging.getLogger("raymq.consumer")

#: Fetches that fail this many times in a row, for at least the patience of their kind
#: (below), make the consumer's ``receive()`` raise the last error (fetches).
PERSISTENT_FAILURES = 3
#: Patience with a queue that answers fetches with an error of its own, such as a
#: ``StorageError``, or whose actor is dead for good (seconds).
QUEUE_ERROR_PATIENCE_SECONDS = 2.0
#: Patience with a queue actor that is restarting or does not answer: as long as the
#: client waits for a restarting actor (``raymq.client.RESTART_GRACE_SECONDS``) (seconds).
RESTART_PATIENCE_SECONDS = 60.0
#: First and longest wait before the loader fetches again after a failure (seconds).
RETRY_BACKOFF_SECONDS = 0.25
RETRY_BACKOFF_MAX_SECONDS = 2.0
#: Messages the loader's first fetch asks for; each fetch that brings some doubles it,
#: up to the room below the high watermark. A new consumer's first message waits for
#: the queue to read and convert that first batch (10,000 rows of a deep backlog took
#: tens of milliseconds, 1,000 a few), and 128 of 1 KiB come inline over the
#: FetchChannel (``raymq.fetch_channel.INLINE_BYTES``) rather than by a Ray call
#: (messages).
FIRST_FETCH_MESSAGES = 128


class FetchAnswer(NamedTuple):
    """What a queue actor answers a TargetList's fetch with, beside the batch it made
    (a separate object): the offsets of every row, their bytes, and the shared parts
    that come first, each (reference, first row, rows) of an object every delivery of
    those messages shares (see ``DirectEntry``)."""

    offsets: np.ndarray
    nbytes: int
    parts: list[tuple[object, int, int]]


@dataclass
class DirectEntry:
    """Rows ``start:`` of one delivery held through references: one delivery batch
    (``ref``), or rows of shared batches (``parts``: (reference, first row, rows)
    each, in order; ``ref`` unused)."""

    ref: object
    offsets: np.ndarray  # offset of every row, in row order
    nbytes: int  # bytes of the whole delivery
    start: int = 0  # first row not yet handed out
    parts: list[tuple[object, int, int]] | None = None

    def refs(self, start: int, n: int) -> list[tuple[object, int, int]]:
        """Rows ``start:start + n`` of the delivery as (reference, first row, rows)."""
        if not self.parts:
            return [(self.ref, start, n)]
        out, row = [], 0
        for ref, first, rows in self.parts:
            lo, hi = max(start, row), min(start + n, row + rows)
            if lo < hi:
                out.append((ref, first + lo - row, hi - lo))
            row += rows
            if row >= start + n:
                break
        return out

    @property
    def remaining(self) -> int:
        """Rows not yet handed out."""
        return len(self.offsets) - self.start

    @property
    def remaining_bytes(self) -> int:
        """Approximate bytes of the rows not yet handed out."""
        return self.nbytes * self.remaining // max(len(self.offsets), 1)


def _messages(entries) -> int:
    return sum(e.remaining for e in entries)


def _bytes(entries) -> int:
    return sum(e.remaining_bytes for e in entries)


class TargetList:
    """Watermark accounting of one consumer (messages and bytes)."""

    def __init__(self, high_watermark: int, high_watermark_bytes: int, pending_cache_bytes: int):
        self.high_watermark = high_watermark
        #: The consumer's own caps (bytes); the MemoryGovernor's budget may lower them.
        self.max_high_watermark_bytes = high_watermark_bytes
        self.max_pending_cache_bytes = pending_cache_bytes
        self.budget: tuple[int, int] | None = None  # (direct, pending) from the governor
        self.high_watermark_bytes = high_watermark_bytes
        self.pending_cache_bytes = pending_cache_bytes
        self.direct: deque[DirectEntry] = deque()
        self.pending: deque[DirectEntry] = deque()  # the PendingCache
        self.pending_hits = 0
        self.pending_misses = 0  # loads from the QueueArea
        self.message_bytes = 0.0  # running average size of a delivered message (bytes)
        self.handed_out = 0

    # -- levels ------------------------------------------------------------------------

    @property
    def watermark(self) -> int:
        """Messages held as direct references, not yet handed to the application."""
        return _messages(self.direct)

    @property
    def direct_bytes(self) -> int:
        """Bytes of those messages."""
        return _bytes(self.direct)

    @property
    def pending_messages(self) -> int:
        """Messages in the PendingCache."""
        return _messages(self.pending)

    @property
    def pending_bytes(self) -> int:
        """Bytes in the PendingCache."""
        return _bytes(self.pending)

    def room(self) -> int:
        """Messages the eager loader may add below the high watermark (0 when full).

        An empty TargetList may always load one batch, however small its byte budget:
        a consumer is never starved by the governor, only kept shallow.
        """
        if self.direct and self.direct_bytes >= self.high_watermark_bytes:
            return 0
        return max(0, self.high_watermark - self.watermark)

    # -- loading -----------------------------------------------------------------------

    def load_from_pending(self) -> bool:
        """Move the oldest PendingCache entry up to the direct references (a hit)."""
        if not self.pending or self.room() <= 0:
            return False
        self.direct.append(self.pending.popleft())
        self.pending_hits += 1
        return True

    def loaded(self, entry: DirectEntry) -> np.ndarray:
        """A batch came from the queue (a PendingCache miss). It goes behind what the
        PendingCache holds, if anything (entries a smaller limit moved there while it
        was fetched come before it); returns offsets to give back to the queue, if that
        takes the PendingCache over its limit (as ``set_high_watermark``)."""
        if not len(entry.offsets):
            return _NOTHING
        self.pending_misses += 1
        size = entry.nbytes / len(entry.offsets)
        self.message_bytes = (
            size if not self.message_bytes else 0.9 * self.message_bytes + 0.1 * size
        )
        if not self.pending:
            self.direct.append(entry)
            return _NOTHING
        self.pending.append(entry)
        return self._apply_limits()

    # -- handing out -------------------------------------------------------------------

    def take(self, max_messages: int) -> list[tuple[object, int, int]]:
        """Hand out up to ``max_messages`` as (reference, first row, rows), in order."""
        out = []
        need = max_messages
        while need > 0 and self.direct:
            e = self.direct[0]
            n = min(need, e.remaining)
            out.extend(e.refs(e.start, n))
            e.start += n
            need -= n
            if e.remaining == 0:
                self.direct.popleft()
        self.handed_out += max_messages - need
        return out

    def bytes_ahead(self, max_messages: int) -> int:
        """Approximate bytes of the next ``max_messages`` that ``take`` would hand out."""
        total, need = 0, max_messages
        for e in self.direct:
            if need <= 0:
                break
            n = min(need, e.remaining)
            total += e.nbytes * n // max(len(e.offsets), 1)
            need -= n
        return total

    # -- budgets -----------------------------------------------------------------------

    def set_high_watermark(self, messages: int, max_bytes: int) -> np.ndarray:
        """Lower or raise the high watermark; returns offsets to give back to the queue.

        Direct entries above the new high watermark move (newest first) to the
        PendingCache; what the PendingCache cannot hold is returned.
        """
        self.high_watermark, self.max_high_watermark_bytes = messages, max_bytes
        return self._apply_limits()

    def set_budget(self, direct_bytes: int, pending_bytes: int) -> np.ndarray:
        """Take the MemoryGovernor's budget (bytes of direct references and of the
        PendingCache); the consumer's own settings stay upper bounds. Returns offsets to
        give back to the queue, as ``set_high_watermark``."""
        self.budget = (max(0, direct_bytes), max(0, pending_bytes))
        return self._apply_limits()

    def usage(self, consumer_id: str) -> ConsumerUsage:
        """What the MemoryGovernor needs of consumer ``consumer_id`` (bytes). It wants
        direct references for ``high_watermark`` messages of the size seen so far, at
        most its ``high_watermark_bytes``: asking for the cap alone would starve the
        HeadQueueCache of memory the consumer never fills."""
        want = self.max_high_watermark_bytes
        if self.message_bytes:
            want = min(want, int(self.high_watermark * self.message_bytes * 1.25) + 1)
        return ConsumerUsage(
            consumer_id=consumer_id,
            direct_bytes=self.direct_bytes,
            pending_bytes=self.pending_bytes,
            want_direct_bytes=want,
            want_pending_bytes=self.max_pending_cache_bytes,
        )

    def _apply_limits(self) -> np.ndarray:
        """Set effective byte limits from settings and budget, evicting above them."""
        direct, pending = self.max_high_watermark_bytes, self.max_pending_cache_bytes
        if self.budget is not None:
            direct, pending = min(direct, self.budget[0]), min(pending, self.budget[1])
        self.high_watermark_bytes, self.pending_cache_bytes = direct, pending
        messages, max_bytes = self.high_watermark, direct
        while self.direct and (self.watermark > messages or self.direct_bytes > max_bytes):
            self.pending.appendleft(self.direct.pop())
        released = []
        while self.pending and self.pending_bytes > self.pending_cache_bytes:
            e = self.pending.pop()
            released.append(e.offsets[e.start :])
        return np.concatenate(released) if released else _NOTHING

    def drain(self) -> np.ndarray:
        """Forget every entry not handed out; returns their offsets (for close)."""
        rest = [e.offsets[e.start :] for e in (*self.direct, *self.pending)]
        self.direct.clear()
        self.pending.clear()
        return np.concatenate(rest) if rest else _NOTHING

    def stats(self) -> dict:
        """Levels and PendingCache counters (messages, bytes)."""
        return {
            "watermark": self.watermark,
            "high_watermark": self.high_watermark,
            "high_watermark_bytes": self.high_watermark_bytes,
            "direct_references": self.watermark,
            "direct_bytes": self.direct_bytes,
            "pending_cache_messages": self.pending_messages,
            "pending_cache_bytes": self.pending_bytes,
            "pending_cache_limit_bytes": self.pending_cache_bytes,
            "governor_budget": None if self.budget is None else list(self.budget),
            "pending_cache_hits": self.pending_hits,
            "pending_cache_misses": self.pending_misses,
            "handed_out": self.handed_out,
        }


# -- the eager loader ------------------------------------------------------------------


class FetchFailed(Exception):
    """A fetch of the eager loader failed.

    ``error`` is the typed error, naming the queue, that ``take`` raises once failures
    persist; ``restarting`` says the queue actor is restarting or silent, which is given
    ``RESTART_PATIENCE_SECONDS`` to come back (else ``QUEUE_ERROR_PATIENCE_SECONDS``);
    ``final`` says its actor could not start again (Ray gave up on it): a restart being
    waited for is over, and failed.
    """

    def __init__(self, error: RayMQError, *, restarting: bool = False, final: bool = False):
        super().__init__(str(error))
        self.error = error
        self.restarting = restarting
        self.final = final


@dataclass(frozen=True)
class LoaderStats:
    """The loader's failures: ``failures`` in a row now (fetches), ``failures_total``
    since start, ``failing_seconds`` since the first of the row, the ``last_error``
    (``""`` when the last fetch succeeded) and whether it is ``persistent`` (``take``
    raises it)."""

    failures: int
    failures_total: int
    failing_seconds: float
    last_error: str
    persistent: bool


class FailureStreak:
    """Consecutive failed fetches, and when they persist: at least
    ``PERSISTENT_FAILURES`` in a row, the first at least the longest patience of their
    kinds ago. One failure then a success never persists. ``clock`` gives seconds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self.count = 0
        self.total = 0
        self.since = 0.0  # clock at the first failure of the row
        self.error: RayMQError | None = None
        self.patience = QUEUE_ERROR_PATIENCE_SECONDS

    def failed(self, failure: FetchFailed) -> float:
        """Count ``failure``; returns the seconds to wait before fetching again
        (doubling from ``RETRY_BACKOFF_SECONDS`` up to ``RETRY_BACKOFF_MAX_SECONDS``)."""
        if self.count == 0:
            self.since = self._clock()
        self.count += 1
        self.total += 1
        self.error = failure.error
        # A queue that was restarting answers with other errors while it comes back
        # (its name not registered yet, its broker reviving it): the whole row gets the
        # restart's patience, or a consumer sees errors during a restart in place. A
        # restart that failed for good (the actor's start raised) is waited for no more:
        # the row has the patience of what follows from then on (a revival's error).
        patience = RESTART_PATIENCE_SECONDS if failure.restarting else QUEUE_ERROR_PATIENCE_SECONDS
        if self.count == 1 or failure.final:
            self.patience = patience
        else:
            self.patience = max(self.patience, patience)
        return min(RETRY_BACKOFF_SECONDS * 2 ** min(self.count - 1, 16), RETRY_BACKOFF_MAX_SECONDS)

    def succeeded(self) -> None:
        """A fetch succeeded: the row is over."""
        self.count = 0
        self.error = None

    def persistent(self) -> RayMQError | None:
        """The last error if the failures persist now, else None."""
        if self.count < PERSISTENT_FAILURES or self._clock() - self.since < self.patience:
            return None
        return self.error

    def stats(self) -> LoaderStats:
        """A snapshot of the failures."""
        return LoaderStats(
            failures=self.count,
            failures_total=self.total,
            failing_seconds=self._clock() - self.since if self.count else 0.0,
            last_error="" if self.error is None else f"{type(self.error).__name__}: {self.error}",
            persistent=self.persistent() is not None,
        )


#: ``fetch(room)``: up to ``room`` messages from the queue as a ``DirectEntry`` (None,
#: or no offsets, when none came within its poll).
Fetch = Callable[[int], Awaitable[DirectEntry | None]]
#: Hands offsets back to the queue for delivery again (not counted as deliveries).
GiveBack = Callable[[np.ndarray], Awaitable[object]]


class EagerLoader:
    """Keeps a TargetList filled toward its high watermark and hands out what it holds.

    ``fetch`` raises ``ConsumerClosed`` when the queue closed this consumer (loading
    ends; ``take`` raises it once nothing is buffered), ``FetchFailed`` or another
    ``RayMQError`` when it failed. Failures are retried with backoff forever; while they
    persist (``FailureStreak``), ``take`` raises the last one whenever nothing is
    buffered, and once a fetch succeeds it hands out messages again. Any other exception
    is a bug: it is counted as a failure and raised, for the task's supervisor to log
    and restart ``run``.

    Messages go back to the queue only through ``give_back``, which keeps their order:
    the queue hands given-back messages out again before later ones, so a fetch must
    not overtake a give-back. No fetch starts while a give-back is under way, and a
    fetch that was under way when one started is given back too (it may bring messages
    after those given back, which would otherwise be received before them). "Under
    way" counts from the first attempt: a fetch that failed may still be answered to
    a retry (the owner may wait for the same one again), so the epoch it is checked
    against is that of the first attempt after the last answer.

    Interleaving: ``run`` (one task) and any number of ``take`` calls interleave at their
    awaits; each state change between two awaits is one synchronous step. ``clock`` and
    ``sleep`` (seconds) are injectable for tests.
    """

    def __init__(
        self,
        targets: TargetList,
        fetch: Fetch,
        *,
        queue: str,
        give_back: GiveBack | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        self.targets = targets
        self.queue = queue
        self._fetch = fetch
        self._give_back = give_back
        self._sleep = sleep
        #: Give-backs started (an epoch: a fetch sent before the last one is stale) and
        #: under way (no fetch starts until they are done).
        self.give_backs = 0
        #: ``give_backs`` when the fetch under way (or retried) was first asked for.
        self._fetch_epoch: int | None = None
        self._giving_back = 0
        self._given_back = asyncio.Event()
        self._given_back.set()
        self.failures = FailureStreak(clock)
        #: Set when the queue closed this consumer: loading is over.
        self.refused: ConsumerClosed | None = None
        self.closed = False
        self._filled = asyncio.Event()  # something to hand out, or an error to raise
        self.fetch_size = FIRST_FETCH_MESSAGES  # grows: see FIRST_FETCH_MESSAGES
        #: Fetches given back whole because a give-back started while under way.
        self.stale_fetches = 0
        self._space = asyncio.Event()  # room below the high watermark again

    def error(self) -> RayMQError | None:
        """What ``take`` raises when it has nothing to hand out, if anything."""
        return self.refused or self.failures.persistent()

    async def run(self) -> None:
        """Raise the watermark toward the high watermark until closed or refused."""
        while not self.closed and self.refused is None:
            room = self.targets.room()
            if room <= 0:
                self._space.clear()
                await self._space.wait()
                continue
            if self.targets.load_from_pending():
                self._filled.set()
                continue
            if self._giving_back:
                await self._given_back.wait()
                continue
            if self._fetch_epoch is None:
                self._fetch_epoch = self.give_backs
            try:
                entry = await self._fetch(min(room, self.fetch_size))
            except ConsumerClosed as exc:
                self.refused = exc  # the queue closed us: take() says so
                self._filled.set()
                return
            except FetchFailed as exc:
                await self._sleep(self._failed(exc))
                continue
            except RayMQError as exc:
                await self._sleep(self._failed(FetchFailed(exc)))
                continue
            except Exception as exc:
                error = BrokerUnavailable(
                    f"queue {self.queue!r}: the consumer's loader failed: {exc!r}"
                )
                self._failed(FetchFailed(error))
                raise  # a bug: the supervisor logs it and runs us again after a backoff
            if self.failures.count:
                log.info("queue %r: fetches work again", self.queue)
            self.failures.succeeded()
            stale, self._fetch_epoch = self._fetch_epoch != self.give_backs, None
            if entry is None or not len(entry.offsets):
                continue
            if stale:
                self.stale_fetches += 1
                with contextlib.suppress(Exception):  # logged: kept, out of order, then
                    await self._return(entry.offsets[entry.start :])
                    continue
            released = self.targets.loaded(entry)
            self._filled.set()
            self.fetch_size = min(self.fetch_size * 2, 2**31)
            if len(released):  # the newest: nothing later is under way
                with contextlib.suppress(Exception):  # logged: held until close, then
                    await self._return(released)
            # A receive waiting for these goes first: the next fetch can wait that long
            # (its request costs the loop about 0.5 ms here, before the receive's rows).
            await asyncio.sleep(0)

    def _failed(self, failure: FetchFailed) -> float:
        """Count a failure, wake waiting takes if it now persists; returns the backoff."""
        was_persistent = self.failures.persistent() is not None
        backoff = self.failures.failed(failure)
        if self.failures.persistent() is not None:
            self._filled.set()  # takes waiting for messages raise the error now
            if not was_persistent:
                log.error(
                    "queue %r: fetches failed %d times in %.1f s, receive() raises: %s",
                    self.queue,
                    self.failures.count,
                    self.failures.stats().failing_seconds,
                    failure.error,
                )
        elif self.failures.count == 1:
            log.warning("queue %r: fetch failed (retrying): %s", self.queue, failure.error)
        return backoff

    async def take(self, max_messages: int, timeout: float) -> list[tuple[object, int, int]]:
        """Up to ``max_messages`` as (reference, first row, rows), waiting up to
        ``timeout`` seconds for the first. With nothing to hand out, raises the queue's
        ``ConsumerClosed`` or a persistent fetch error (``FailureStreak``)."""
        await self.wait(timeout)
        return self.take_now(max_messages)

    async def wait(self, timeout: float) -> None:
        """Return once something is buffered to hand out or an error is to be raised,
        or after ``timeout`` seconds."""
        if not self.targets.direct:
            self.targets.load_from_pending()  # buffered here: hand it out before any error
        if not self.targets.direct and self.error() is None:
            self._filled.clear()
            # Not ``wait_for``: its inner task would wake us two loop turns after the
            # loader's ``set`` (the loader yields one turn to a waiting receive).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(timeout, 0.0)):
                    await self._filled.wait()

    def take_now(self, max_messages: int) -> list[tuple[object, int, int]]:
        """``take`` without waiting: what is buffered, up to ``max_messages``, else the
        error to raise (if any), else nothing."""
        if not self.targets.direct:
            self.targets.load_from_pending()
        out = self.targets.take(max_messages)
        if out:
            self._space.set()
            return out
        error = self.error()
        if error is not None:
            raise error.with_traceback(None)  # raised again and again: no growing traceback
        return out

    def wake(self) -> None:
        """The high watermark or the budget changed: look for room again."""
        self._space.set()

    async def give_back_taken(self, offsets: np.ndarray) -> int:
        """``offsets`` were taken (handed out) but never reached the application (a
        delivery that could not be written): they were the oldest held, so everything
        held after them goes back with them, and the queue hands all out again in
        order (a receive would otherwise get the later ones first). Returns how many."""
        return await self.give_back(np.concatenate([offsets, self.targets.drain()]))

    async def _return(self, offsets: np.ndarray) -> None:
        """``give_back`` for the loader's own task: a failure is logged and raised."""
        try:
            await self.give_back(offsets)
        except Exception as exc:
            log.warning(
                "queue %r: %d messages could not go back to the queue: %r",
                self.queue,
                len(offsets),
                exc,
            )
            raise

    async def give_back(self, offsets: np.ndarray) -> int:
        """Hand ``offsets`` (messages never received by the application) back to the
        queue, in order with fetches (see the class); returns how many."""
        if len(offsets):
            if self._give_back is None:
                raise RuntimeError("this loader has no give_back")
            self.give_backs += 1
            self._giving_back += 1
            self._given_back.clear()
            try:
                await self._give_back(offsets)
            finally:
                self._giving_back -= 1
                if not self._giving_back:
                    self._given_back.set()
        self.wake()
        return len(offsets)

    def close(self) -> None:
        """Load nothing more (the owner cancels the ``run`` task)."""
        self.closed = True
        self._space.set()
