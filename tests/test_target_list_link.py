"""A TargetList's link to its queue, without Ray: a fake queue endpoint that can restart
in place, die and be revived, move to a new leader, pause, be ended, break its
FetchChannel and park large deliveries. In each case the consumer gets every message,
never one loaded from a queue process since replaced, and fails only with typed errors
naming the queue; and closing gives back everything not received."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pyarrow as pa
import pytest

from raymq.core.link import Fault, LinkFault
from raymq.core.target_list import (
    PERSISTENT_FAILURES,
    RESTART_PATIENCE_SECONDS,
    FetchAnswer,
    FetchFailed,
    TargetList,
)
from raymq.core.target_list_link import ConsumerSpec, StaleEndpoint, TargetListLink
from raymq.errors import BrokerUnavailable, NotLeader, QueueNotFound
from raymq.wire.errors import WireBroken
from raymq.wire.fetch import INLINE_BYTES, InlineDelivery
from tests.test_target_list import FakeTime

#: Bound on any wait that must end, in real seconds: only a wedge takes this long.
WEDGE_SECONDS = 10.0
#: The link's wait for a Ray fetch's answer in these tests (seconds).
ANSWER_SECONDS = 0.05


def batch_of(offsets: list[int], body_bytes: int = 10) -> pa.RecordBatch:
    """A delivery of ``offsets`` (each body ``body_bytes`` long)."""
    n = len(offsets)
    return pa.RecordBatch.from_pydict(
        {"offset": pa.array(offsets, pa.int64()), "body": [b"x" * body_bytes] * n}
    )


def offsets_taken(entries: list[tuple[object, int, int]]) -> list[int]:
    """The offsets of what the loader handed out."""
    out = []
    for ref, start, n in entries:
        # Inline rows, or a Ray fetch's reference (the fake's call holds its batch).
        batch = ref.batch if isinstance(ref, InlineDelivery | FakeCall) else ref
        out += batch.column("offset").to_pylist()[start : start + n]
    return out


class FakeCall:
    """A Ray fetch sent to one process of the queue: answered once, then again the
    same (as an ObjectRef awaited twice)."""

    def __init__(self, process: int, args: tuple | None = None, parked: int | None = None):
        self.process = process
        self.args = args
        self.parked = parked
        self.answer: FetchAnswer | None = None
        self.batch: pa.RecordBatch | None = None


class FakeQueue:
    """A queue's actor as a TargetList's link sees it (``QueueEndpoint``), holding
    messages ``0..n-1`` for one consumer.

    Each process of the queue has a number (its FetchChannel's secret says it). A new
    process (restart in place, revival, new leader) has forgotten what it delivered:
    everything not acknowledged is delivered again. ``state``: "up", "restarting"
    (calls fail RESTARTING), "dead" (GONE; ``find`` revives it), "moved" (NotLeader
    until ``find``), "paused" (no answers until ``resume``), "ended" (GONE for good;
    ``find`` answers QueueNotFound). Deliveries of ``large_bytes`` bodies are parked on
    the channel and taken by a Ray call."""

    def __init__(self, n: int, *, batch: int = 5, channel: bool = True, body_bytes: int = 10):
        self.n = n
        self.batch = batch
        self.channel = channel
        self.body_bytes = body_bytes
        self.process = 1
        self.state = "up"
        self.next = 0  # the next offset never delivered
        self.again: set[int] = set()  # to deliver again first (given back, forgotten)
        self.held: set[int] = set()  # delivered to the consumer by this process
        self.acked: set[int] = set()
        self.stale_acks = 0  # acks of copies this process did not deliver to us
        self.watched = False  # this process has our handle (a Ray registration)
        self.registrations = 0
        self.finds = 0
        self.ray_fetches: list[tuple] = []
        self.channel_fetches = 0
        self.pipelined_fetches = 0  # first fetches written behind a registration
        self.closed_with: list[int] | None = None
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._parked: dict[int, FakeCall] = {}

    # -- what the test does to the queue --------------------------------------------------

    def new_process(self) -> None:
        """The queue's actor is a new process: what it delivered is forgotten."""
        self.process += 1
        self.again |= self.held
        self.held = set()
        self.watched = False

    def restart(self) -> None:
        self.state = "restarting"

    def recover(self) -> None:
        self.new_process()
        self.state = "up"

    def die(self) -> None:
        self.state = "dead"

    def move(self) -> None:
        self.state = "moved"

    def end(self) -> None:
        self.state = "ended"

    def pause(self) -> None:
        self.state = "paused"
        self._resumed.clear()

    def resume(self) -> None:
        self.state = "up"
        self._resumed.set()

    def ack(self, offsets: list[int]) -> None:
        """The application's ack (it goes to the queue directly, not through the link)."""
        for o in offsets:
            if o in self.held:
                self.held.remove(o)
                self.acked.add(o)
            else:
                self.stale_acks += 1

    # -- the endpoint ----------------------------------------------------------------------

    async def _reach(self) -> None:
        if self.state == "paused":
            await self._resumed.wait()
        if self.state == "restarting":
            raise LinkFault(Fault.RESTARTING, "the actor is restarting")
        if self.state in ("dead", "ended"):
            raise LinkFault(Fault.GONE, "the actor died", final=self.state == "ended")
        if self.state == "moved":
            raise NotLeader("queue 'q': a newer leader serves it")

    def _endpoint(self) -> tuple[str, int, str] | None:
        return ("fake", 1, f"process {self.process}") if self.channel else None

    def _deliver(self, room: int) -> list[int]:
        out = sorted(self.again)[:room]
        self.again -= set(out)
        while len(out) < min(room, self.batch) and self.next < self.n:
            out.append(self.next)
            self.next += 1
        self.held |= set(out)
        return out

    async def register(self):
        await self._reach()
        self.registrations += 1
        self.watched = True
        return self._endpoint()

    async def find(self) -> None:
        self.finds += 1
        if self.state == "ended":
            raise FetchFailed(QueueNotFound("no queue 'q'"))
        if self.state in ("dead", "moved"):
            self.recover()

    async def connect(self, endpoint, timeout: float, register=None, fetch=None):
        if self.state != "up" or endpoint != self._endpoint():
            raise WireBroken(f"queue 'q': {endpoint} refused the connection")
        channel = FakeChannel(self, self.process)
        if register is not None:
            await channel.register(*register)
            if fetch is not None:  # as the real one: written behind the registration
                self.pipelined_fetches += 1
                channel.pending_fetch = asyncio.ensure_future(channel.fetch(*fetch, streams=True))
        return channel

    async def fetch(self, args: tuple):
        self.ray_fetches.append(args)
        call = FakeCall(self.process, args)
        return call, call

    async def fetch_parked(self, token: int):
        call = self._parked.pop(token)
        return call, call

    async def answer(self, call: FakeCall) -> FetchAnswer:
        if call.answer is None:
            await self._reach()
            if call.process != self.process:
                raise LinkFault(Fault.RESTARTING, "the call's process was replaced")
            _, room = call.args[0], call.args[1]
            offsets = self._deliver(room)
            call.batch = batch_of(offsets, self.body_bytes)
            call.answer = FetchAnswer(np.array(offsets, dtype=np.int64), call.batch.nbytes, [])
        return call.answer

    async def give_back(self, offsets: np.ndarray) -> None:
        await self._reach()
        mine = self.held & set(offsets.tolist())  # only what this process counts as ours
        self.held -= mine
        self.again |= mine

    async def close_consumer(self, offsets: np.ndarray) -> int:
        await self._reach()
        mine = self.held & set(offsets.tolist())
        self.held -= mine
        self.again |= mine
        self.closed_with = sorted(offsets.tolist())
        return len(mine)

    async def consumer_stats(self) -> dict:
        await self._reach()
        return {"queue_held": len(self.held), "queue_process": self.process}


class FakeChannel:
    """A FetchChannel to one process of the fake queue."""

    def __init__(self, queue: FakeQueue, process: int):
        self.queue = queue
        self.process = process
        self.closed = False
        self.finished = False
        self.pending_fetch: asyncio.Task | None = None

    def _check(self) -> None:
        q = self.queue
        if self.closed or q.process != self.process or q.state in ("restarting", "dead", "ended"):
            self.closed = True
            raise WireBroken(f"queue 'q': the channel to process {self.process} broke")
        if q.state == "moved":
            raise NotLeader("queue 'q': a newer leader serves it")

    async def register(self, consumer_id, prefetch, selector, subscription) -> None:
        self._check()
        self.queue.registrations += 1

    async def fetch(self, *args, streams: bool = False):
        q = self.queue
        if q.state == "paused":
            await q._resumed.wait()
        self._check()
        q.channel_fetches += 1
        offsets = [] if self.finished else q._deliver(args[1])
        if not offsets:
            return None
        batch = batch_of(offsets, q.body_bytes)
        if batch.nbytes > INLINE_BYTES:  # parked: taken by a Ray call
            call = FakeCall(q.process)
            call.batch = batch
            call.answer = FetchAnswer(np.array(offsets, dtype=np.int64), batch.nbytes, [])
            q._parked[id(call)] = call
            return id(call)
        return InlineDelivery(batch, b"")

    def finish(self) -> None:
        self.finished = True

    def close(self) -> None:
        self.closed = True


class Consumer:
    """A link with its loader running, as the TargetList actor runs them."""

    def __init__(self, queue: FakeQueue, *, high_watermark: int = 10, clock=None):
        self.queue = queue
        self.clock = clock or FakeTime()  # moved by the loader's backoff only
        spec = ConsumerSpec("q", "c1", prefetch=high_watermark)
        targets = TargetList(high_watermark, 10**9, 0)
        self.link = TargetListLink(
            spec,
            queue,
            targets,
            answer_seconds=ANSWER_SECONDS,
            watch_delay=0.01,
            clock=self.clock.clock,
            sleep=self.clock.sleep,
        )
        self.task: asyncio.Task | None = None

    async def start(self, *, endpoint=None, cached: bool = False) -> None:
        registering = await self.link.begin(endpoint, cached)
        self.task = asyncio.ensure_future(self.link.loader.run())
        if registering is not None:
            await self.link.finish_registration(registering)

    async def take(self, n: int) -> list[int]:
        """Up to ``n`` offsets (at least one, unless the loader raises)."""
        entries = await asyncio.wait_for(self.link.loader.take(n, WEDGE_SECONDS), WEDGE_SECONDS)
        if entries:
            self.link.delivered()
        return offsets_taken(entries)

    async def consume(self, n: int, *, during=None) -> list[int]:
        """Take and ack until ``n`` distinct offsets are acked; ``during(i)`` is called
        after the i-th take (to break the queue mid-stream). Returns all handed out."""
        got: list[int] = []
        i = 0
        while len(self.queue.acked) < n:
            taken = await self.take(3)
            got += taken
            self.queue.ack(taken)
            if during is not None:
                await during(i)
            i += 1
        return got

    async def close(self, not_received=None) -> int:
        self.link.stop()
        self.task.cancel()  # (as the actor's supervisor does; it may have ended)
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        return await self.link.close(not_received)


def run(main):
    return asyncio.run(asyncio.wait_for(main(), 4 * WEDGE_SECONDS))


# -- the way it works when nothing fails ---------------------------------------------------


def test_a_consumer_with_the_endpoint_fetches_inline_and_is_watched_after_its_first_delivery():
    async def main():
        queue = FakeQueue(20)
        consumer = Consumer(queue)
        await consumer.start(endpoint=queue._endpoint())
        assert not queue.watched  # put off: the first message goes first
        got = await consumer.consume(20)
        await asyncio.wait_for(consumer.link._watching, WEDGE_SECONDS)
        await consumer.close()
        return queue, consumer.link.stats(), got

    queue, stats, got = run(main)
    assert got == list(range(20)) and queue.stale_acks == 0
    assert queue.watched and stats.watched_by_queue
    assert stats.fetches_inline > 0 and stats.fetches_by_ray == 0 and not queue.ray_fetches
    # The first fetch went behind the registration, and its answer was handed out.
    assert queue.pipelined_fetches == 1


def test_without_the_endpoint_the_first_fetch_goes_by_ray_without_waiting_then_the_channel():
    async def main():
        queue = FakeQueue(20)
        consumer = Consumer(queue)
        await consumer.start()
        got = await consumer.consume(20)
        await consumer.close()
        return queue, consumer.link.stats(), got

    queue, stats, got = run(main)
    assert got == list(range(20))
    assert queue.ray_fetches[0][2] == 0.0  # the first fetch takes what is there
    assert stats.fetches_inline > 0 and stats.watched_by_queue


def test_a_queue_without_a_channel_is_fetched_by_ray():
    async def main():
        queue = FakeQueue(12, channel=False)
        consumer = Consumer(queue)
        await consumer.start()
        got = await consumer.consume(12)
        await consumer.close()
        return consumer.link.stats(), got

    stats, got = run(main)
    assert got == list(range(12)) and stats.fetches_by_ray > 0 and stats.fetches_inline == 0


def test_large_deliveries_are_parked_then_fetched_by_ray_alone():
    async def main():
        queue = FakeQueue(40, body_bytes=INLINE_BYTES)  # each over the inline bound
        consumer = Consumer(queue)
        await consumer.start(endpoint=queue._endpoint())
        got = await consumer.consume(40)
        await consumer.close()
        return queue, consumer.link.stats(), got

    queue, stats, got = run(main)
    assert got == list(range(40))
    # One parked delivery shows they are large: the rest go by Ray, without the channel.
    assert stats.fetches_parked == 1 and stats.fetches_by_ray > 0 and stats.fetches_inline == 0


# -- following the queue's actor -----------------------------------------------------------


def test_a_queue_restarting_in_place_is_followed_and_its_old_copies_never_handed_out():
    async def main():
        queue = FakeQueue(30)
        consumer = Consumer(queue)
        await consumer.start(endpoint=queue._endpoint())
        first = await consumer.take(3)
        queue.ack(first)
        await asyncio.wait_for(_until(lambda: consumer.link.targets.watermark == 10), WEDGE_SECONDS)
        queue.restart()  # a while: calls fail RESTARTING
        await asyncio.sleep(0)
        queue.recover()  # process 2: delivers 3..12 again
        # Taken before the link can know (the queue drops and counts its ack). The
        # room it makes starts a fetch: the channel is broken, the link registers
        # again and meets process 2, so the other 9 held from process 1 go back.
        stale = await consumer.take(1)
        queue.ack(stale)
        link = consumer.link
        await asyncio.wait_for(_until(lambda: link.stats().stale_dropped > 0), WEDGE_SECONDS)
        rest = await consumer.consume(30)
        stats = link.stats()
        await consumer.close()
        return queue, stats, first, stale, rest

    queue, stats, first, stale, rest = run(main)
    assert first == [0, 1, 2] and stale == [3] and queue.stale_acks == 1
    assert stats.stale_dropped == 9  # never handed out
    assert rest == list(range(3, 30)) and queue.acked == set(range(30))
    assert stats.fetch_channel_failures == 1 and stats.fetch_channel and queue.watched


async def _until(condition) -> None:
    """Yield to the loop until ``condition()`` (every caller bounds it)."""
    while not condition():
        await asyncio.sleep(0)


def test_a_dead_queue_is_found_again_revived_and_registered_with():
    async def main():
        queue = FakeQueue(30, channel=False)
        consumer = Consumer(queue, high_watermark=3)

        async def kill(i):
            if i == 2:
                queue.die()  # hibernated, or killed: the broker revives it on find

        await consumer.start()
        got = await consumer.consume(30, during=kill)
        await consumer.close()
        return queue, got

    queue, got = run(main)
    assert queue.acked == set(range(30)) and queue.finds == 1 and queue.process == 2
    assert queue.watched  # the new process has our handle


def test_a_moved_leader_is_followed_over_the_channel():
    async def main():
        queue = FakeQueue(30)
        consumer = Consumer(queue, high_watermark=3)

        async def move(i):
            if i == 2:
                queue.move()

        await consumer.start(endpoint=queue._endpoint())
        got = await consumer.consume(30, during=move)
        await consumer.close()
        return queue, consumer.link.stats(), got

    queue, stats, got = run(main)
    assert queue.acked == set(range(30)) and queue.finds == 1 and queue.process == 2
    assert stats.fetches_inline > 0  # back on the new leader's channel


def test_a_paused_queue_is_waited_for_not_asked_twice():
    async def main():
        queue = FakeQueue(20, channel=False)
        consumer = Consumer(queue, high_watermark=5)
        await consumer.start()
        await asyncio.wait_for(_until(lambda: consumer.link.targets.watermark == 5), WEDGE_SECONDS)
        queue.pause()
        sent = len(queue.ray_fetches)
        got = await consumer.take(5)  # what is held; the room makes the loader fetch
        queue.ack(got)
        # Unanswered in ANSWER_SECONDS: a failure, and the same fetch is waited for again.
        await asyncio.wait_for(
            _until(lambda: consumer.link.loader.failures.count >= 3), WEDGE_SECONDS
        )
        during = len(queue.ray_fetches) - sent
        error = consumer.link.loader.failures.stats().last_error
        queue.resume()
        got += await consumer.consume(20)
        await consumer.close()
        return queue, got, during, error

    queue, got, during, error = run(main)
    assert during == 1  # one fetch in flight all along
    assert "did not answer a fetch" in error and "'q'" in error
    assert got == list(range(20))  # nothing twice


def test_a_queue_ended_for_good_raises_its_typed_error_from_take():
    async def main():
        queue = FakeQueue(20, channel=False)
        consumer = Consumer(queue, high_watermark=5)
        await consumer.start()
        queue.ack(await consumer.take(5))
        queue.end()
        with pytest.raises(QueueNotFound):
            while True:  # until the failures persist (the fake clock runs on backoff)
                queue.ack(await consumer.take(5))
        return consumer.link.loader.failures.stats()

    stats = run(main)
    assert stats.persistent and stats.failures >= PERSISTENT_FAILURES


def test_a_restart_that_outlasts_its_patience_raises_broker_unavailable_naming_the_queue():
    async def main():
        queue = FakeQueue(20, channel=False)
        consumer = Consumer(queue, high_watermark=5)
        await consumer.start()
        queue.ack(await consumer.take(5))
        queue.restart()
        with pytest.raises(BrokerUnavailable, match="queue 'q' is unavailable") as raised:
            while True:
                queue.ack(await consumer.take(5))
        return raised.value

    error = run(main)
    assert not isinstance(error, NotLeader)


def test_a_restart_that_fails_for_good_is_not_waited_for_the_restart_patience():
    """A queue actor restarting in place whose start then fails (Ray gives up on it: a
    final fault, then the broker cannot revive it) ends the restart's wait: ``take``
    raises the typed error after the queue error's patience, not after
    ``RESTART_PATIENCE_SECONDS`` counted from the restart (a CI run once waited 69 s
    for ``test_a_queue_that_cannot_restart_fails_receive_until_it_is_back``)."""

    async def main():
        queue = FakeQueue(20, channel=False)
        consumer = Consumer(queue, high_watermark=5)
        await consumer.start()
        queue.ack(await consumer.take(5))
        failures = consumer.link.loader.failures
        queue.restart()
        queue.ack(await consumer.take(5))  # what it holds: room for a fetch, which fails
        while failures.count < 2:  # (the fake clock moves on the loader's backoff)
            await asyncio.sleep(0)
        assert failures.patience == RESTART_PATIENCE_SECONDS
        restarted_at = failures.since
        queue.end()
        with pytest.raises(QueueNotFound):
            while True:
                queue.ack(await consumer.take(5))
        return restarted_at, consumer.clock.now

    restarted_at, raised_at = run(main)
    assert raised_at - restarted_at < RESTART_PATIENCE_SECONDS / 4


def test_a_broken_channel_falls_back_to_ray_and_registers_again():
    async def main():
        queue = FakeQueue(30)
        consumer = Consumer(queue, high_watermark=3)

        async def cut(i):
            if i == 1:
                consumer.link._channel.close()  # the socket broke; the process lives

        await consumer.start(endpoint=queue._endpoint())
        registrations = queue.registrations
        got = await consumer.consume(30, during=cut)
        stats = consumer.link.stats()
        await consumer.close()
        return queue, stats, got, registrations

    queue, stats, got, registrations = run(main)
    assert got == list(range(30)) and stats.stale_dropped == 0
    assert stats.fetch_channel_failures == 1 and queue.registrations > registrations
    assert stats.fetch_channel  # reconnected from the new registration's answer


def test_a_cached_endpoint_that_fails_is_stale_and_nothing_starts():
    async def main():
        queue = FakeQueue(5)
        consumer = Consumer(queue)
        old = queue._endpoint()
        queue.recover()  # another process since the client remembered it
        with pytest.raises(StaleEndpoint):
            await consumer.link.begin(old, cached=True)
        # Not cached (the queue's own answer): a failure falls back to Ray.
        assert await consumer.link.begin(old, cached=False) is not None
        return consumer.link.stats()

    assert run(main).fetch_channel_failures == 1


# -- closing --------------------------------------------------------------------------------


def test_closing_gives_back_what_is_held_and_what_the_client_never_received():
    async def main():
        queue = FakeQueue(30)
        consumer = Consumer(queue)
        await consumer.start(endpoint=queue._endpoint())
        taken = await consumer.take(4)
        await asyncio.wait_for(_until(lambda: consumer.link.targets.watermark == 10), WEDGE_SECONDS)
        given = await consumer.close(np.array(taken[2:]))  # two never reached the app
        return queue, taken, given

    queue, taken, given = run(main)
    assert queue.closed_with == sorted(taken[2:] + list(range(4, 14)))
    assert given == 12 and queue.held == set(taken[:2])


def test_closing_rides_a_restart_and_ends_quietly_on_a_deleted_queue():
    async def main():
        queue = FakeQueue(10, channel=False)
        consumer = Consumer(queue, high_watermark=3)
        await consumer.start()
        await consumer.take(1)
        queue.restart()
        closing = asyncio.ensure_future(consumer.close())
        await asyncio.wait_for(_until(lambda: consumer.clock.now >= 1.0), WEDGE_SECONDS)
        queue.recover()  # after five retries (the fake clock runs on close's pauses)
        first = await closing
        deleted = FakeQueue(10, channel=False)
        other = Consumer(deleted, high_watermark=3)
        await other.start()
        deleted.end()
        return first, await other.close()

    assert run(main) == (0, 0)  # the new process forgot; the deleted queue has nothing


def test_a_ray_fetch_answered_before_close_goes_back_as_not_received():
    async def main():
        queue = FakeQueue(10, channel=False)
        consumer = Consumer(queue, high_watermark=3)
        await consumer.start()
        await asyncio.wait_for(_until(lambda: consumer.link.targets.watermark == 3), WEDGE_SECONDS)
        # The loader now waits for room; a fetch is in flight as close comes.
        call, _ = await queue.fetch(("c1", 4, 0.0, 3, None, None))
        await queue.answer(call)
        from raymq.core.target_list_link import InFlight

        consumer.link._in_flight = InFlight(call, call.batch)
        return queue, await consumer.close()

    queue, given = run(main)
    assert queue.closed_with == [0, 1, 2, 3, 4, 5, 6] and given == 7 and not queue.held


def test_a_channel_fetch_that_finished_as_the_loader_was_cancelled_goes_back_at_close():
    # The FetchChannel's answer came in the very turn close cancelled the loader: the
    # rows are held by this consumer in the queue, and must go back unseen.
    async def main():
        queue = FakeQueue(10)
        consumer = Consumer(queue)
        link = consumer.link
        fetched = asyncio.get_running_loop().create_future()
        link._channel_fetch = fetched
        loader = asyncio.ensure_future(link._fetch_once(10))
        await asyncio.sleep(0)  # one turn: the loader now waits for its fetch
        fetched.set_result(InlineDelivery(batch_of([4, 5]), b""))
        loader.cancel()  # close, before the loader took the answer in
        with pytest.raises(asyncio.CancelledError):
            await loader
        return await link._unreceived_fetch()

    assert run(main).tolist() == [4, 5]


def test_the_put_off_registration_is_not_made_after_close():
    async def main():
        queue = FakeQueue(5)
        consumer = Consumer(queue)
        consumer.link._watch_delay = WEDGE_SECONDS
        await consumer.start(endpoint=queue._endpoint())
        await consumer.close()
        return queue

    queue = run(main)
    assert not queue.watched and queue.closed_with is not None


def test_messages_loaded_from_a_queue_process_since_replaced_go_back_unseen():
    # The same process registered again keeps all; fetching by Ray meanwhile (no
    # endpoint) says nothing; another process's endpoint sends all back.
    async def main():
        queue = FakeQueue(10)
        consumer = Consumer(queue)
        link = consumer.link
        link._set_endpoint(("fake", 1, "process 1"))
        link.targets.loaded(_entry([0, 1, 2, 3, 4]))
        queue.held = {0, 1, 2, 3, 4}
        link._set_endpoint(("fake", 1, "process 1"))
        kept = link.targets.watermark
        link._set_endpoint(None)
        assert link._stale_give_back is None
        link._set_endpoint(("fake", 1, "process 2"))
        await link._stale_give_back
        return queue, link, kept

    queue, link, kept = run(main)
    assert kept == 5 and link.targets.watermark == 0 and link.stats().stale_dropped == 5
    assert link.targets.take(10) == [] and queue.again == {0, 1, 2, 3, 4}


def _entry(offsets: list[int]):
    from raymq.core.target_list import DirectEntry

    batch = batch_of(offsets)
    return DirectEntry(batch, np.array(offsets), batch.nbytes)


def test_the_queues_view_follows_a_moved_queue_and_faults_are_typed():
    async def main():
        queue = FakeQueue(5)
        consumer = Consumer(queue)
        await consumer.start(endpoint=queue._endpoint())
        queue.move()
        moved = await consumer.link.queue_side()
        queue.restart()
        with pytest.raises(BrokerUnavailable, match="'q'"):
            await consumer.link.queue_side()
        queue.recover()
        with pytest.raises(BrokerUnavailable, match="did not take 1 messages back"):
            queue.restart()
            await consumer.link.give_back(np.array([0]))
        return moved

    assert run(main)["queue_process"] == 2
