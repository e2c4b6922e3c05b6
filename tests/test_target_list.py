"""TargetList without Ray: watermark and high watermark, the PendingCache, the
MemoryGovernor's budget, handing out in order and giving back what was never received;
and its eager loader, with a fake queue and a fake clock: failures are retried, and only
one that persists reaches ``take`` (the consumer's ``receive()``) as a typed error."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest

from raymq.core.budget import ConsumerUsage
from raymq.core.supervisor import Supervisor
from raymq.core.target_list import (
    PERSISTENT_FAILURES,
    QUEUE_ERROR_PATIENCE_SECONDS,
    RESTART_PATIENCE_SECONDS,
    DirectEntry,
    EagerLoader,
    FailureStreak,
    FetchFailed,
    TargetList,
)
from raymq.errors import BrokerUnavailable, ConsumerClosed, StorageError

#: Bound on a take that must return, in real seconds: only a wedge takes this long.
ANSWER_SECONDS = 30.0


def entry(first: int, n: int, nbytes: int | None = None) -> DirectEntry:
    return DirectEntry(f"ref{first}", np.arange(first, first + n), nbytes or 100 * n)


def test_room_stops_at_the_high_watermark_in_messages_and_bytes():
    t = TargetList(high_watermark=10, high_watermark_bytes=1000, pending_cache_bytes=0)
    assert t.room() == 10
    t.loaded(entry(0, 6))
    assert (t.watermark, t.room()) == (6, 4)
    t.loaded(entry(6, 4))  # 1000 bytes: full by bytes and by messages
    assert t.room() == 0
    small = TargetList(high_watermark=10, high_watermark_bytes=1, pending_cache_bytes=0)
    assert small.room() == 10  # an empty TargetList may always load one batch
    small.loaded(entry(0, 2))
    assert small.room() == 0


def test_take_hands_out_in_order_across_entries():
    t = TargetList(100, 10**6, 0)
    t.loaded(entry(0, 3))
    t.loaded(entry(3, 3))
    assert t.take(2) == [("ref0", 0, 2)]
    assert t.take(3) == [("ref0", 2, 1), ("ref3", 0, 2)]
    assert t.take(10) == [("ref3", 2, 1)]
    assert t.take(1) == [] and t.stats()["handed_out"] == 6


def test_take_hands_out_rows_of_shared_parts_in_order():
    # One fetch delivered rows 500: of batch A, all of batch B and rows :200 of C.
    e = DirectEntry(
        None,
        np.arange(100, 1800),
        1700 * 100,
        parts=[("A", 500, 500), ("B", 0, 1000), ("C", 0, 200)],
    )
    t = TargetList(10_000, 10**9, 0)
    t.loaded(e)
    assert t.take(300) == [("A", 500, 300)]
    assert t.take(1300) == [("A", 800, 200), ("B", 0, 1000), ("C", 0, 100)]
    assert t.take(500) == [("C", 100, 100)]
    assert t.watermark == 0 and t.stats()["handed_out"] == 1700


def test_a_lower_high_watermark_moves_entries_to_the_pending_cache_then_gives_back():
    t = TargetList(high_watermark=10, high_watermark_bytes=10**6, pending_cache_bytes=300)
    for first in (0, 3, 6):
        t.loaded(entry(first, 3))  # 300 bytes each
    t.take(1)  # offset 0 handed out: it is the application's now
    given_back = t.set_high_watermark(3, 10**6)
    # Newest entries leave the direct references first (6..8, then 3..5); the
    # PendingCache keeps the oldest that fit (3..5) and the rest goes back.
    assert t.watermark == 2 and t.pending_messages == 3
    assert given_back.tolist() == [6, 7, 8]
    assert t.drain().tolist() == [1, 2, 3, 4, 5]


def test_pending_cache_entries_come_back_first():
    t = TargetList(high_watermark=3, high_watermark_bytes=10**6, pending_cache_bytes=10**6)
    t.loaded(entry(0, 3))
    t.set_high_watermark(0, 10**6)  # all of it to the PendingCache
    assert (t.watermark, t.pending_messages, t.room()) == (0, 3, 0)
    t.set_high_watermark(3, 10**6)
    assert t.load_from_pending() and t.watermark == 3 and t.stats()["pending_cache_hits"] == 1


def test_the_governors_budget_lowers_the_limits_and_settings_stay_upper_bounds():
    t = TargetList(high_watermark=100, high_watermark_bytes=10_000, pending_cache_bytes=500)
    for first in range(0, 50, 10):
        t.loaded(entry(first, 10, nbytes=1000))
    released = t.set_budget(direct_bytes=2000, pending_bytes=10**9)
    assert t.high_watermark_bytes == 2000 and t.direct_bytes <= 2000
    assert t.pending_cache_bytes == 500  # the consumer's own setting still caps it
    assert t.pending_bytes <= 500
    held = t.watermark + t.pending_messages + len(released)
    assert held == 50  # nothing lost: kept, cached or given back
    usage = t.usage("c")
    assert isinstance(usage, ConsumerUsage) and usage.consumer_id == "c"
    assert usage.want_direct_bytes <= 10_000 and usage.want_pending_bytes == 500
    assert usage.direct_bytes == t.direct_bytes and usage.pending_bytes == t.pending_bytes


def test_drain_returns_everything_not_handed_out():
    t = TargetList(100, 10**6, 10**6)
    t.loaded(entry(0, 5))
    t.loaded(entry(5, 5))
    t.take(3)
    t.set_high_watermark(2, 10**6)
    assert sorted(t.drain().tolist()) == list(range(3, 10))
    assert t.watermark == 0 and t.pending_messages == 0


# -- the eager loader --------------------------------------------------------------------


class FakeTime:
    """A clock that only the loader's backoff sleeps move (seconds)."""

    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)


class FakeQueue:
    """A queue that delivers ``batch`` messages a fetch, numbered from 0; ``fail_with``
    makes fetches raise an error (after ``ok_first`` more good ones; the next ``times``
    of them, or all while ``times`` is None) until ``heal``; ``stall`` moves the clock
    by that many seconds a fetch."""

    def __init__(self, time: FakeTime, batch: int = 5) -> None:
        self.time = time
        self.batch = batch
        self.next = 0
        self.fetches = 0
        self.error: Exception | None = None
        self.times: int | None = None
        self.stall = 0.0
        self.ok_first = 0

    def fail_with(self, error: Exception, times: int | None = None, ok_first: int = 0) -> None:
        self.error, self.times, self.ok_first = error, times, ok_first

    def heal(self) -> None:
        self.error = None

    async def fetch(self, room: int) -> DirectEntry | None:
        self.fetches += 1
        self.time.now += self.stall
        await asyncio.sleep(0)
        if self.error is not None and self.ok_first:
            self.ok_first -= 1
        elif self.error is not None:
            error = self.error
            if self.times is not None:
                self.times -= 1
                if self.times == 0:
                    self.error = None
            raise error
        n = min(room, self.batch)
        self.next += n
        return entry(self.next - n, n)


def storage_error() -> StorageError:
    return StorageError(5, "queue 'orders': reading failed: Input/output error", "/p/seg")


def loader_of(queue: FakeQueue, high_watermark: int = 10) -> EagerLoader:
    targets = TargetList(high_watermark, 10**9, 0)
    t = queue.time
    return EagerLoader(targets, queue.fetch, queue="orders", clock=t.clock, sleep=t.sleep)


def run_loader(scenario, queue: FakeQueue, high_watermark: int = 10):
    """Run ``scenario(loader)`` beside the loader's task; returns what it returns."""

    async def main():
        loader = loader_of(queue, high_watermark)
        task = asyncio.get_running_loop().create_task(loader.run())
        try:
            return await asyncio.wait_for(scenario(loader), ANSWER_SECONDS)
        finally:
            loader.close()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    return asyncio.run(main())


def offsets_of(taken) -> list[int]:
    return [int(ref[3:]) + start + i for ref, start, n in taken for i in range(n)]


async def until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.001)


def test_a_persistent_queue_error_reaches_take_and_clears_when_the_queue_heals():
    time = FakeTime()
    queue = FakeQueue(time)
    queue.fail_with(storage_error())

    async def scenario(loader):
        with pytest.raises(StorageError, match="orders"):
            await loader.take(5, timeout=ANSWER_SECONDS)  # woken by the error, not the timeout
        failures = loader.failures.stats()
        assert failures.persistent and failures.failures >= PERSISTENT_FAILURES
        assert failures.failing_seconds >= QUEUE_ERROR_PATIENCE_SECONDS
        assert "StorageError" in failures.last_error
        with pytest.raises(StorageError):  # every receive, not just the first
            await loader.take(5, timeout=0)
        tried = queue.fetches
        await until(lambda: queue.fetches > tried + 2)  # the loader keeps trying
        queue.heal()
        await until(lambda: loader.failures.count == 0)
        got = await loader.take(5, timeout=ANSWER_SECONDS)
        return got, loader.failures.stats()

    got, failures = run_loader(scenario, queue)
    assert offsets_of(got) == [0, 1, 2, 3, 4]
    assert not failures.persistent and failures.last_error == ""


@pytest.mark.parametrize("failures", [1, 4])
def test_failures_that_clear_within_the_bounds_never_reach_take(failures):
    """One failure, or a few within the patience (backoffs 0.25 + 0.5 + 1 s < 2 s)."""
    time = FakeTime()
    queue = FakeQueue(time)
    queue.fail_with(storage_error(), times=failures)

    async def scenario(loader):
        got = []
        while len(got) < 10:
            got += offsets_of(await loader.take(10, timeout=ANSWER_SECONDS))
        return got, loader.failures.stats()

    got, stats = run_loader(scenario, queue)
    assert got == list(range(10))
    assert stats.failures_total == failures and stats.failures == 0


def test_one_long_failure_is_not_persistent_few_quick_ones_are_not_either():
    """Both bounds must hold: a single failure however long it took, and many failures
    within less than the patience, stay inside the loader."""
    time = FakeTime()
    queue = FakeQueue(time)
    queue.stall = 100.0  # one fetch that takes 100 s and fails
    queue.fail_with(storage_error(), times=1)

    async def scenario(loader):
        got = await loader.take(5, timeout=ANSWER_SECONDS)
        return got, loader.failures

    got, failures = run_loader(scenario, queue)
    assert offsets_of(got) == [0, 1, 2, 3, 4] and failures.total == 1
    quick = FakeTime()
    streak = FailureStreak(quick.clock)
    for _ in range(10):
        streak.failed(FetchFailed(storage_error()))
    assert streak.persistent() is None  # ten failures, no time passed
    quick.now = QUEUE_ERROR_PATIENCE_SECONDS
    assert isinstance(streak.persistent(), StorageError)


def test_a_restarting_queue_is_given_the_restart_patience():
    time = FakeTime()
    queue = FakeQueue(time)
    restarting = BrokerUnavailable("queue 'orders' is unavailable: restarting")
    queue.fail_with(FetchFailed(restarting, restarting=True))

    async def scenario(loader):
        with pytest.raises(BrokerUnavailable, match="orders"):
            await loader.take(5, timeout=ANSWER_SECONDS)
        return time.now

    raised_at = run_loader(scenario, queue)
    assert raised_at >= RESTART_PATIENCE_SECONDS


def test_buffered_messages_are_handed_out_before_the_error():
    time = FakeTime()
    queue = FakeQueue(time, batch=5)
    queue.fail_with(storage_error(), ok_first=1)  # one batch, then failures

    async def scenario(loader):
        await until(lambda: loader.error() is not None)
        first = offsets_of(await loader.take(3, timeout=0))
        rest = offsets_of(await loader.take(10, timeout=0))
        with pytest.raises(StorageError):
            await loader.take(10, timeout=0)
        return first, rest

    assert run_loader(scenario, queue) == ([0, 1, 2], [3, 4])


def test_pending_cache_entries_are_handed_out_before_the_error():
    time = FakeTime()
    queue = FakeQueue(time, batch=5)
    queue.fail_with(storage_error(), ok_first=1)

    async def scenario(loader):
        await until(lambda: loader.error() is not None)
        targets = loader.targets
        targets.max_pending_cache_bytes = 10**9
        targets.set_high_watermark(0, 10**9)  # all of it to the PendingCache
        targets.high_watermark = 10
        assert (targets.watermark, targets.pending_messages) == (0, 5)
        got = offsets_of(await loader.take(10, timeout=0))
        with pytest.raises(StorageError):
            await loader.take(10, timeout=0)
        return got

    assert run_loader(scenario, queue) == [0, 1, 2, 3, 4]


def test_consumer_closed_by_the_queue_ends_loading_after_the_buffer():
    time = FakeTime()
    queue = FakeQueue(time, batch=2)
    queue.fail_with(ConsumerClosed("consumer c of queue 'orders' is closed"), ok_first=1)

    async def scenario(loader):
        await until(lambda: loader.refused is not None)
        got = offsets_of(await loader.take(10, timeout=0))
        with pytest.raises(ConsumerClosed):
            await loader.take(10, timeout=ANSWER_SECONDS)
        return got, queue.fetches

    got, fetches = run_loader(scenario, queue)
    assert got == [0, 1] and fetches == 2  # no fetch after the refusal


def test_a_loader_bug_is_restarted_by_its_supervisor_and_reaches_take_if_it_persists():
    """An unexpected exception is not swallowed: the supervisor logs, counts and
    restarts the loader; while it goes on, take raises BrokerUnavailable naming it."""
    time = FakeTime()
    queue = FakeQueue(time)
    queue.stall = 1.0
    queue.fail_with(KeyError("a bug in fetch"))

    async def main():
        loader = loader_of(queue)
        tasks = Supervisor("consumer c of queue 'orders'", logging.getLogger("test"))
        tasks.spawn("eager loader", loader.run)
        try:
            with pytest.raises(BrokerUnavailable, match="orders.*a bug in fetch"):
                await asyncio.wait_for(loader.take(5, ANSWER_SECONDS), ANSWER_SECONDS)
            restarts = tasks.restarts
            queue.heal()
            await until(lambda: loader.failures.count == 0)  # the restarted loader fetched
            return restarts, await asyncio.wait_for(loader.take(5, 0), ANSWER_SECONDS)
        finally:
            loader.close()
            await tasks.cancel_all()

    restarts, got = asyncio.run(main())
    assert restarts >= PERSISTENT_FAILURES - 1 and offsets_of(got) == [0, 1, 2, 3, 4]


class OrderedQueue:
    """A queue as the loader sees it: a fetch answers messages given back first (lowest
    offsets), then new ones, ``batch`` at a time; while ``gate`` is set, a fetch's
    answer, already chosen, waits for it (a fetch under way). With ``fail_waiting``, a
    fetch waiting at the gate fails instead, and the next one waits for the same answer
    (as the TargetList actor keeps a Ray fetch that timed out)."""

    def __init__(self, batch: int = 5) -> None:
        self.batch = batch
        self.next = 0
        self.returned: list[int] = []
        self.gate: asyncio.Event | None = None
        self.waiting = 0  # fetches answered but held at the gate
        self.fail_waiting = False
        self.answered = 0
        self._kept: DirectEntry | None = None

    async def fetch(self, room: int) -> DirectEntry:
        if self._kept is None:
            self._kept = self._choose(room)
        gate = self.gate
        if gate is not None:
            self.waiting += 1
            if self.fail_waiting:
                self.fail_waiting = False  # the retry waits at the gate
                await asyncio.sleep(0)
                raise FetchFailed(BrokerUnavailable("no answer yet"), restarting=True)
            await gate.wait()
        got, self._kept = self._kept, None
        self.answered += 1
        return got

    def _choose(self, room: int) -> DirectEntry:
        n = min(room, self.batch)
        if self.returned:
            self.returned.sort()
            first, n = self.returned[0], min(n, len(self.returned))
            assert self.returned[:n] == list(range(first, first + n))
            del self.returned[:n]
        else:
            first, self.next = self.next, self.next + n
        return entry(first, n)

    async def give_back(self, offsets: np.ndarray) -> None:
        await asyncio.sleep(0)
        self.returned += offsets.tolist()


@pytest.mark.parametrize("how", ["give back", "into the PendingCache", "fetch retried"])
def test_a_fetch_under_way_when_held_messages_leave_does_not_overtake_them(how):
    """The governor shrinks a consumer's budget while its next fetch is under way: the
    messages that leave its direct references, given back to the queue or kept in its
    PendingCache, are received before those of that fetch (which came after), also when
    the fetch failed before they left and its retry gets the answer."""
    queue = OrderedQueue()
    backoff = asyncio.Event()  # "fetch retried": the loader's backoff lasts until set

    async def sleep(seconds: float) -> None:
        await backoff.wait()

    async def main():
        pending = 10**9 if how == "into the PendingCache" else 0
        targets = TargetList(10, 10**9, pending)
        loader = EagerLoader(
            targets, queue.fetch, queue="orders", give_back=queue.give_back, sleep=sleep
        )
        task = asyncio.get_running_loop().create_task(loader.run())
        try:
            await until(lambda: targets.watermark == 10)  # 0-4 and 5-9 held
            gate = queue.gate = asyncio.Event()
            queue.fail_waiting = how == "fetch retried"  # the first attempt fails
            got = offsets_of(await loader.take(5, timeout=ANSWER_SECONDS))
            # 10-14 are chosen for the fetch, not arrived (its first attempt failed, the
            # loader is in its backoff): 5-9 leave direct
            await until(
                lambda: queue.waiting == 1 and (how != "fetch retried" or loader.failures.count)
            )
            released = targets.set_budget(1, pending)
            assert await loader.give_back(released) == (0 if pending else 5)
            queue.gate = None
            gate.set()
            backoff.set()
            await until(lambda: queue.answered >= 3)  # 10-14 landed
            while len(got) < 15:
                targets.set_budget(10**9, pending)  # the next round gives room again
                loader.wake()
                got += offsets_of(await loader.take(15 - len(got), timeout=ANSWER_SECONDS))
            return got, loader.stale_fetches
        finally:
            loader.close()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    got, stale = asyncio.run(asyncio.wait_for(main(), ANSWER_SECONDS))
    assert got == list(range(15))
    assert stale == (0 if how == "into the PendingCache" else 1)


def test_a_fetch_landing_behind_the_pending_cache_over_its_limit_goes_back():
    """A fetch that lands behind a PendingCache at its limit stays out of it: its
    messages go back to the queue (the newest held, so the order is kept)."""
    t = TargetList(high_watermark=10, high_watermark_bytes=10**9, pending_cache_bytes=500)
    t.loaded(entry(0, 5))  # 500 bytes
    assert t.set_high_watermark(0, 10**9).tolist() == []  # 0-4 into the PendingCache
    assert t.loaded(entry(5, 5)).tolist() == [5, 6, 7, 8, 9]
    assert t.set_high_watermark(10, 10**9).tolist() == []
    assert t.load_from_pending()
    assert [o for e in t.direct for o in e.offsets.tolist()] == [0, 1, 2, 3, 4]


def test_taken_messages_given_back_come_again_before_those_held_after_them():
    """A delivery taken for the application that never reached it (a broken delivery
    channel) goes back with everything held after it: received again in order."""
    queue = OrderedQueue()

    async def main():
        targets = TargetList(10, 10**9, 0)
        loader = EagerLoader(targets, queue.fetch, queue="orders", give_back=queue.give_back)
        task = asyncio.get_running_loop().create_task(loader.run())
        try:
            await until(lambda: targets.watermark == 10)  # 0-4 and 5-9 held
            lost = offsets_of(await loader.take(3, timeout=ANSWER_SECONDS))  # 0-2
            assert await loader.give_back_taken(np.array(lost)) == 10
            got: list[int] = []
            while len(got) < 15:
                got += offsets_of(await loader.take(15 - len(got), timeout=ANSWER_SECONDS))
            return got
        finally:
            loader.close()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    assert asyncio.run(main()) == list(range(15))


def test_a_restart_keeps_its_patience_while_the_queue_answers_other_errors():
    """Issue 28, Observed 2: a queue restarting in place answers with other errors as it
    comes back (its actor not found by name yet, say). The row keeps the restart's
    patience: the consumer sees no error before ``RESTART_PATIENCE_SECONDS``."""
    quick = FakeTime()
    streak = FailureStreak(quick.clock)
    streak.failed(FetchFailed(BrokerUnavailable("q restarting"), restarting=True))
    for _ in range(5):
        streak.failed(FetchFailed(BrokerUnavailable("q: no actor named 'q' yet")))
    quick.now = QUEUE_ERROR_PATIENCE_SECONDS * 2
    assert streak.persistent() is None
    quick.now = RESTART_PATIENCE_SECONDS
    assert isinstance(streak.persistent(), BrokerUnavailable)
    streak.succeeded()
    for _ in range(PERSISTENT_FAILURES):  # a new row starts with its own kind's patience
        streak.failed(FetchFailed(storage_error()))
    quick.now += QUEUE_ERROR_PATIENCE_SECONDS
    assert isinstance(streak.persistent(), StorageError)
