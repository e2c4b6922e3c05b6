"""Pipelined sends (``send(wait=False)``, ``raymq.client.producer``) and asyncio sends over the
send channel: Ray-free against a real socket and a fake store, then a few on real Ray."""

# ruff: noqa: F811 - tests take the imported fixture "served" as their argument
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import types

import pytest

from raymq.batch import MessageBatch
from raymq.client.producer import Producer, SendFuture
from raymq.errors import AddressFull, NotLeader
from raymq.wire.errors import WireBroken
from raymq.wire.send import SendChannel
from tests.test_send_channel import MAX_MESSAGE, served  # noqa: F401 - the fixture
from tests.wire_helpers import MutePeer

# -- Ray-free: a real SendChannel to a server storing into a list ----------------------


class RaySend:
    """The Ray path's stand-in: records each batch, stores into the same store."""

    def __init__(self, store):
        self.store = store
        self.batches: list[list[bytes]] = []

    def __call__(self, batch: MessageBatch, timeout: float | None) -> tuple[int, int]:
        bodies = [batch.body(i) for i in range(len(batch))]
        self.batches.append(bodies)
        first = len(self.store.bodies)
        self.store.bodies.extend(bodies)
        return first, len(bodies)


def until(predicate, what: str, limit: float = 30.0) -> None:
    """Wait for a condition another thread makes true (fails the test after ``limit``)."""
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.001)


def hold_again(store, loop) -> None:
    """Make the store hold its answers again (done on its loop before returning)."""

    async def clear() -> None:
        store.release.clear()

    asyncio.run_coroutine_threadsafe(clear(), loop).result(10)


def producer_for(endpoint, store, **settings) -> tuple[Producer, SendChannel, RaySend]:
    channel = SendChannel(*endpoint, "q")
    ray_send = RaySend(store)
    return Producer("q", lambda: channel, ray_send, **settings), channel, ray_send


def test_pipelined_sends_gather_into_batches_in_order_and_flush_waits(served):
    store, _, endpoint, _ = served
    producer, channel, ray_send = producer_for(endpoint, store, max_batch_messages=64)
    futures = [producer.send(f"m{i}".encode(), b"", None) for i in range(2000)]
    assert all(isinstance(f, SendFuture) for f in futures)
    producer.flush()
    assert all(f.done() for f in futures)
    assert [f.result() for f in futures] == list(range(2000))  # offsets in the order sent
    assert store.bodies == [f"m{i}".encode() for i in range(2000)]
    assert len(store.batches) < 2000 and max(store.batches) <= 64  # batched, bounded
    stats = producer.stats()
    assert (stats.sent, stats.stored, stats.in_flight_messages) == (2000, 2000, 0)
    assert ray_send.batches == []
    channel.close()


def test_a_dropped_message_resolves_none_and_a_refused_batch_fails_each_future(served):
    store, _, endpoint, loop = served
    producer, channel, _ = producer_for(endpoint, store)
    store.hold = True  # the first batch stays in flight: the next sends gather behind it
    first = producer.send(b"first", b"", None)
    kept, dropped = producer.send(b"kept", b"", None), producer.send(b"drop", b"", None)
    loop.call_soon_threadsafe(store.release.set)
    assert (first.result(), kept.result(), dropped.result()) == (0, 1, None)
    hold_again(store, loop)
    refused = [producer.send(b"held", b"", None)]
    refused += [producer.send(b"ok", b"", None), producer.send(b"full", b"", None)]
    loop.call_soon_threadsafe(store.release.set)
    assert refused.pop(0).result() == 2
    for future in refused:  # one batch, refused whole (the queue's FAIL)
        with pytest.raises(AddressFull, match="full"):
            future.result()
        assert isinstance(future.exception(), AddressFull)
    with pytest.raises(AddressFull, match="2 pipelined sends to queue 'q' failed"):
        producer.flush()  # a fire-and-forget producer learns of it here
    producer.flush()  # reported once
    assert producer.stats().dropped == 1 and producer.stats().failed == 2
    channel.close()


def test_send_blocks_at_the_in_flight_bound_until_answers_free_room(served):
    store, _, endpoint, loop = served
    producer, channel, _ = producer_for(endpoint, store, max_in_flight_messages=10)
    store.hold = True
    finished = threading.Event()

    def produce() -> None:
        for i in range(50):
            producer.send(f"{i}".encode(), b"", None)
        finished.set()

    t = threading.Thread(target=produce)
    t.start()
    until(lambda: producer.stats().in_flight_messages == 10, "10 in flight")
    # Nothing is answered while the store holds: the 11th send cannot have returned.
    assert not finished.is_set() and producer.stats().in_flight_messages == 10
    loop.call_soon_threadsafe(store.release.set)
    t.join(30)
    producer.flush()
    assert store.bodies == [f"{i}".encode() for i in range(50)]
    assert producer.stats().blocked_seconds > 0
    channel.close()


def test_a_result_with_a_timeout_raises_timeout_error_while_unanswered(served):
    store, _, endpoint, loop = served
    producer, channel, _ = producer_for(endpoint, store)
    store.hold = True
    future = producer.send(b"held", b"", None)
    with pytest.raises(TimeoutError, match="'q'"):
        future.result(timeout=0.05)
    with pytest.raises(TimeoutError, match="1 pipelined sends unanswered"):
        producer.flush(timeout=0.05)
    loop.call_soon_threadsafe(store.release.set)
    assert future.result() == 0
    channel.close()


def test_batches_in_flight_when_the_channel_breaks_go_again_through_ray_in_order(served):
    store, _, endpoint, loop = served
    producer, channel, ray_send = producer_for(endpoint, store, max_batch_messages=8)
    store.hold = True  # the channel's batches stay unanswered
    futures = [producer.send(f"{i}".encode(), b"", None) for i in range(40)]
    until(lambda: len(producer._on_channel) >= 2, "batches on the channel")
    channel.close()  # outcome of those batches unknown
    producer.flush()  # every future resolves: through Ray
    assert [f.result() for f in futures] == list(range(40))
    assert [b for batch in ray_send.batches for b in batch] == [f"{i}".encode() for i in range(40)]
    assert producer.stats().resent_batches >= 2
    loop.call_soon_threadsafe(store.release.set)


def test_a_batch_resent_after_its_channel_broke_and_refused_is_of_unknown_outcome(served):
    # The old leader may have stored it before the connection broke; the new leader's
    # NotEnoughReplicas (its follower catching up) refuses only the second try. Its
    # sends are told BrokerUnavailable (it may be delivered), never NotEnoughReplicas
    # ("nothing of it is served").
    from raymq.errors import BrokerUnavailable, NotEnoughReplicas

    store, _, endpoint, loop = served
    channel = SendChannel(*endpoint, "q")

    def refuse(batch, timeout):
        raise NotEnoughReplicas("queue 'q': 1 of 2 replicas in sync")

    producer = Producer("q", lambda: channel, refuse)
    store.hold = True
    shipped = producer.send(b"0", b"", None)
    until(lambda: producer._on_channel, "the batch on the channel")
    channel.close()  # outcome unknown
    with pytest.raises(BrokerUnavailable, match="may have been stored") as raised:
        shipped.result()
    assert not isinstance(raised.value, NotEnoughReplicas)
    # One sent only now never reached the old leader: its refusal is the truth.
    with pytest.raises(NotEnoughReplicas):
        producer.send(b"1", b"", None).result()
    loop.call_soon_threadsafe(store.release.set)


def test_a_refusal_of_a_first_try_is_raised_as_it_is():
    from raymq.client.calls import resent_refusal
    from raymq.errors import NotEnoughReplicas

    refused = NotEnoughReplicas("queue 'q': 1 of 2 replicas in sync")
    assert resent_refusal(refused, None, "q") is refused  # no connection was lost


def test_batches_on_a_channel_gone_silent_go_through_ray_within_its_patience(monkeypatch):
    """The producer keeps no watch of its own: the channel's wire client pings a server
    it has not heard from and breaks the connection when the ping goes unanswered. That
    ends each wait on its batches (a send blocked at the in-flight bound, ``result``,
    ``flush``), and the batches go again through Ray, in order."""
    from raymq.wire import send

    monkeypatch.setattr(send, "REPLY_PATIENCE_SECONDS", 0.3)
    peer = MutePeer()  # takes the hello, then answers nothing, not even pings
    channel = SendChannel(*peer.endpoint(), "q")
    ray_send = RaySend(types.SimpleNamespace(bodies=[]))
    producer = Producer("q", lambda: channel, ray_send, max_in_flight_messages=2)

    def sends() -> list[int | None]:
        futures = [producer.send(b"%d" % i, b"", None) for i in range(3)]  # the third blocks
        offsets = [futures[-1].result()]
        producer.flush()
        return offsets + [f.result() for f in futures]

    started = time.monotonic()
    # Within a few patiences (a ping after 0.3 s, the break 0.3 s later), not for ever.
    assert bounded(sends, 30) == [2, 0, 1, 2]
    assert time.monotonic() - started < 20
    assert "ping" in str(channel.broken)
    assert [b for batch in ray_send.batches for b in batch] == [b"0", b"1", b"2"]
    assert producer.stats().resent_batches >= 1
    channel.close()
    peer.close()


def test_without_a_channel_batches_go_through_ray_calls(served):
    store, _, _, _ = served
    ray_send = RaySend(store)
    producer = Producer("q", lambda: None, ray_send)
    futures = [producer.send(f"{i}".encode(), b"", None) for i in range(500)]
    producer.flush()
    assert [f.result() for f in futures] == list(range(500))
    assert store.bodies == [f"{i}".encode() for i in range(500)]
    assert len(ray_send.batches) < 500  # gathered while the Ray call was on its way


def test_asyncio_sends_over_the_channel_do_not_block_the_loop(served):
    store, _, endpoint, loop = served
    channel = SendChannel(*endpoint, "q")

    async def main():
        ticks = 0

        async def tick():  # runs only if the loop is free while sends wait
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        store.hold = True
        pending = asyncio.gather(*(channel.send_async(b"a%d" % i, b"", None) for i in range(20)))
        before = ticks
        while ticks < before + 100:  # the loop turns while 20 sends wait for the store
            await asyncio.sleep(0)
        loop.call_soon_threadsafe(store.release.set)
        singles = await pending
        batch = MessageBatch.from_encoded([b"b0", b"b1"], [b"", b""])
        first, count = await channel.send_batch_async(batch, None)
        with pytest.raises(AddressFull):
            await channel.send_async(b"full", b"", None)
        ticker.cancel()
        return singles, first, count

    singles, first, count = asyncio.run(main())
    assert sorted(singles) == list(range(20)) and (first, count) == (20, 2)
    channel.close()


# -- real Ray --------------------------------------------------------------------------


def test_a_resolved_future_survives_a_kill_of_the_queue_process(broker):
    from raymq.client.calls import _call

    q = broker.create_queue("pipelined")
    futures = [q.send(b"%d" % i, {"i": i}, wait=False) for i in range(3000)]
    assert futures[-1].result() == 2999  # answered: durable, so are those before it
    assert q.producer_stats().batches < 3000
    pid = _call(q._actor.pid)
    os.kill(pid, signal.SIGKILL)
    again = broker.get_queue("pipelined")
    consumer = again.consumer()
    got = []
    while len(got) < 3000:
        got += consumer.receive(max_messages=3000, timeout=30)
    assert [m.body for m in got] == [b"%d" % i for i in range(3000)]
    assert [m.properties["i"] for m in got] == list(range(3000))
    consumer.close()


def test_pipelined_sends_on_ray_flush_fail_and_drop_per_future(broker):
    full = broker.create_queue("f", max_size_bytes=64 * 1024, address_full_policy="FAIL")
    futures = [full.send(b"x" * 1024, wait=False) for i in range(200)]
    with pytest.raises(AddressFull, match="'f'"):
        full.flush()
    outcomes = {type(f.exception()).__name__ if f.exception() else "stored" for f in futures}
    assert outcomes == {"stored", "AddressFull"}
    stored = [f.result() for f in futures if f.exception() is None]
    assert stored == list(range(len(stored)))
    drop = broker.create_queue("d", max_size_bytes=64 * 1024, address_full_policy="DROP")
    futures = [drop.send(b"x" * 1024, wait=False) for i in range(200)]
    drop.flush()  # DROP is the queue's policy, not an error
    offsets = [f.result() for f in futures]
    assert None in offsets and offsets[0] == 0
    kept = [o for o in offsets if o is not None]
    assert kept == list(range(len(kept)))
    # A waiting send after pipelined ones is stored after them.
    q = broker.create_queue("order")
    for i in range(100):
        q.send(b"%d" % i, wait=False)
    assert q.send(b"last") == 100


def test_async_sends_on_ray_go_over_the_channel(broker):
    q = broker.create_queue("aio")

    async def main():
        singles = await asyncio.gather(*(q.send_async(b"s%d" % i) for i in range(10)))
        offsets = await q.send_batch_async([b"b0", b"b1", b"b2"], {"k": 1})
        return singles, offsets

    singles, offsets = asyncio.run(main())
    assert sorted(singles) == list(range(10)) and offsets == [10, 11, 12]
    from raymq.client.handles import _send_channel

    assert _send_channel(q, connect=False) is not None  # they opened and used it


def bounded(fn, seconds: float = 120.0):
    """``fn()`` in a thread; its result, or a test failure if it has not returned in
    ``seconds`` (a hung send fails the test instead of the suite)."""
    out: list = []

    def run() -> None:
        try:
            out.append(("ok", fn()))
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            out.append(("error", exc))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert out, f"hung for {seconds} s"
    kind, value = out[0]
    if kind == "error":
        raise value
    return value


def test_channel_sends_into_a_queue_that_hibernates_go_to_its_revived_actor(broker):
    """F11 on Ray: a waiting send, a pipelined one and an async one, over the channel of
    a queue actor that closed for hibernation (left so by a broker that died before
    ending it), each reach the queue's next actor; nothing is lost or hangs. (An actor
    the broker ended breaks the channel: test_many_queues revives through old handles.)"""
    from raymq.client.calls import _call

    q = broker.create_queue("sleepy")
    assert q.send(b"0") == 0  # the channel is open
    assert _call(q._actor.hibernate)  # closed, not ended: as if its broker had died
    assert bounded(lambda: q.send(b"1")) == 1
    assert bounded(lambda: q.send(b"2", wait=False).result()) == 2
    assert bounded(lambda: asyncio.run(q.send_async(b"3"))) == 3
    with broker.get_queue("sleepy").consumer() as consumer:
        got = []
        while len(got) < 4:
            got += consumer.receive(4 - len(got), timeout=30)
    assert [m.body for m in got] == [b"%d" % i for i in range(4)]


def test_an_async_send_outlives_its_patience_while_the_server_answers_pings(served, monkeypatch):
    from raymq.wire import send

    store, server, endpoint, loop = served
    # Long enough for a loaded machine to answer a ping within it: a miss breaks the channel.
    monkeypatch.setattr(send, "REPLY_PATIENCE_SECONDS", 0.5)
    channel = SendChannel(*endpoint, "q")
    store.hold = True

    async def main():
        pending = asyncio.ensure_future(channel.send_async(b"late", b"", None))
        while not server.server.pings_answered:  # it pinged: the server still holds the send
            await asyncio.sleep(0.01)
        assert not pending.done()
        loop.call_soon_threadsafe(store.release.set)
        return await pending

    assert asyncio.run(main()) == 0
    channel.close()


# -- review regressions (Ray-free) --------------------------------------------------------


class FakeChannel:
    """A SendChannel stand-in whose answers the test gives: requests wait in
    ``waiting`` until ``answer_all`` stores them (in order) or ``fail_all`` breaks it."""

    def __init__(self, store: list[bytes]):
        self.store = store
        self.broken: BaseException | None = None
        self.waiting: list[tuple[list[bytes], object]] = []

    def submit_one(self, body, props, timeout, reply) -> None:
        self._submit([body], reply)

    def submit_batch(self, wire: MessageBatch, timeout, reply) -> None:
        self._submit([wire.body(i) for i in range(len(wire))], reply)

    def _submit(self, bodies: list[bytes], reply) -> None:
        if self.broken is not None:
            raise WireBroken("broken")
        self.waiting.append((bodies, reply))

    def answer_all(self) -> None:
        waiting, self.waiting = self.waiting, []
        for bodies, reply in waiting:
            first = len(self.store)
            self.store.extend(bodies)
            reply.set_result([first, len(bodies)])

    def fail_all(self) -> None:
        waiting, self.waiting = self.waiting, []
        for _, reply in waiting:
            reply.set_exception(WireBroken("reset"))


def test_a_batch_waits_for_earlier_ones_on_a_broken_channel_to_be_resent_first():
    """F13: the channel breaks with batch A on it; before its failure reaches the
    producer, batch B ships. B must not overtake A (over a new channel)."""
    stored: list[bytes] = []
    channels = [FakeChannel(stored), FakeChannel(stored)]
    opened = iter(channels)

    def ray_send(wire: MessageBatch, timeout) -> tuple[int, int]:
        first = len(stored)
        stored.extend(wire.body(i) for i in range(len(wire)))
        return first, len(wire)

    producer = Producer("q", lambda: next(opened), ray_send)
    a = producer.send(b"A", b"", None)  # nothing in flight: on channel 1 at once
    channels[0].broken = ConnectionError("reset")  # broken; A's failure not told yet
    b = producer.send(b"B", b"", None)  # gathers behind A
    flusher = threading.Thread(target=producer.flush)
    flusher.start()  # ships B
    until(lambda: producer._open is None, "B shipped")
    channels[1].answer_all()  # a new channel would store B now
    channels[0].fail_all()  # A's outcome unknown: resent through Ray
    flusher.join(30)
    assert not flusher.is_alive()
    assert stored == [b"A", b"B"]
    assert (a.result(), b.result()) == (0, 1)


def test_no_producer_batch_is_over_the_channel_frame_limit(served, monkeypatch):
    """F2: with max_message_size below 1 MiB, the handle's producer keeps its batches
    within it: the channel never breaks on a frame over its limit, nothing is resent."""
    store, _, endpoint, loop = served
    q, channel = fake_queue(endpoint, store, monkeypatch)
    store.hold = True  # the first batch stays in flight: the rest gather behind it
    futures = [q.send(b"%04d" % i + b"x" * 300, wait=False) for i in range(300)]
    loop.call_soon_threadsafe(store.release.set)
    q.flush()
    assert [f.result() for f in futures] == list(range(300))
    stats = q.producer_stats()
    assert stats.resent_batches == 0 and channel.broken is None
    assert stats.batches >= 300 * (304 + 16) // MAX_MESSAGE  # 3 messages a batch at most
    channel.close()


def test_async_sends_come_after_the_handles_pipelined_sends(served, monkeypatch):
    """F8: send_async and send_batch_async of a handle with unanswered pipelined sends
    are stored after them (the event loop is not blocked meanwhile)."""
    store, _, endpoint, loop = served
    q, channel = fake_queue(endpoint, store, monkeypatch)
    store.hold = True
    q.send(b"p1", wait=False)  # in flight, held
    q.send(b"p2", wait=False)  # open behind it

    async def main() -> tuple[int | None, list[int]]:
        single = asyncio.ensure_future(q.send_async(b"s"))
        for _ in range(50):  # the loop turns while the send waits
            await asyncio.sleep(0)
        loop.call_soon_threadsafe(store.release.set)
        offset = await single
        q.send(b"p3", wait=False)
        hold_again(store, loop)
        q.send(b"p4", wait=False)
        batch = asyncio.ensure_future(q.send_batch_async([b"b1", b"b2"]))
        await asyncio.sleep(0.01)
        loop.call_soon_threadsafe(store.release.set)
        return offset, await batch

    offset, offsets = asyncio.run(main())
    assert store.bodies == [b"p1", b"p2", b"s", b"p3", b"p4", b"b1", b"b2"]
    assert (offset, offsets) == (2, [5, 6])
    channel.close()


def test_waiting_sends_from_threads_share_frames_and_raise_their_own_errors(served, monkeypatch):
    """Waiting sends of many threads leave together behind the batch in flight (one
    frame, one commit); a refused waiting send raises in its thread and is not kept
    for flush (it was reported)."""
    store, _, endpoint, _ = served
    q, channel = fake_queue(endpoint, store, monkeypatch)
    got: dict[bytes, int] = {}

    def produce(k: int) -> None:
        for i in range(40):
            body = b"%d-%d" % (k, i)
            got[body] = q.send(body)

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(got.values()) == list(range(320))
    assert all(store.bodies[offset] == body for body, offset in got.items())
    assert max(store.batches) > 1  # gathered: fewer commits than sends
    with pytest.raises(AddressFull, match="full"):
        q.send(b"full")
    q.flush()  # the waiting send raised it; flush does not raise it again
    stats = q.producer_stats()
    assert (stats.sent, stats.failed, stats.in_flight_messages) == (321, 1, 0)
    channel.close()


def test_a_closed_server_answers_its_stores_refuses_new_requests_then_closes(served, monkeypatch):
    """F11: a queue that hibernates closes its channel server: requests arriving after
    get NotLeader at once (a producer's go through Ray, after its earlier batches);
    stores under way are answered, then the connections close."""
    from raymq.wire import send

    store, server, endpoint, loop = served
    monkeypatch.setattr(send, "CLOSE_GRACE_SECONDS", 600)  # not what closes them
    channel = SendChannel(*endpoint, "q")
    assert channel.send(b"before", b"", None) == 0
    store.hold = True  # a store under way when the queue closes
    # One message a batch: each ships at once, the later ones while "held" is in flight.
    producer, pchannel, ray_send = producer_for(endpoint, store, max_batch_messages=1)
    held = producer.send(b"held", b"", None)
    until(lambda: server.server._under_way == 1, "the store under way")
    asyncio.run_coroutine_threadsafe(_close(server), loop).result(10)
    with pytest.raises(NotLeader, match="ask the broker"):
        channel.send(b"after", b"", None)
    later = [producer.send(b"later%d" % i, b"", None) for i in range(3)]
    # later0 leaves on the channel behind "held" and is refused; later1 and later2 are
    # refused too if they left before that answer, or else join the Ray lane at once.
    # Either way all three wait in the lane, behind the held one.
    until(lambda: len(producer._lane) == 3, "refused: to Ray")
    assert 1 <= producer.stats().resent_batches <= 3
    assert not held.done() and not any(f.done() for f in later)  # behind the held one
    loop.call_soon_threadsafe(store.release.set)
    producer.flush(timeout=30)
    assert held.result() == 1 and [f.result() for f in later] == [2, 3, 4]
    assert store.bodies == [b"before", b"held", b"later0", b"later1", b"later2"]
    until(lambda: channel.broken is not None, "the connection closed")  # no store left
    channel.close()
    pchannel.close()


def test_a_store_unanswered_after_the_close_grace_fails_with_channel_broken(served, monkeypatch):
    """F11: a store the closing queue never answers does not hang its sender: the
    connection closes after CLOSE_GRACE_SECONDS and the send raises WireBroken."""
    from raymq.wire import send

    store, server, endpoint, loop = served
    monkeypatch.setattr(send, "CLOSE_GRACE_SECONDS", 0.2)
    channel = SendChannel(*endpoint, "q")
    store.hold = True  # never released before the close
    errors: list[BaseException] = []

    def send() -> None:
        try:
            channel.send(b"held", b"", None)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            errors.append(exc)

    t = threading.Thread(target=send)
    t.start()
    until(lambda: server.server._under_way == 1, "the store under way")
    asyncio.run_coroutine_threadsafe(_close(server), loop).result(10)
    t.join(30)
    assert len(errors) == 1 and isinstance(errors[0], WireBroken)
    loop.call_soon_threadsafe(store.release.set)


async def _close(server) -> None:
    server.close()


def fake_queue(endpoint, store, monkeypatch):
    """A ``Queue`` handle without Ray: its channel is a real SendChannel to ``store``'s
    server; its Ray calls store into ``store`` too (max_message_size ``MAX_MESSAGE``)."""
    from types import SimpleNamespace

    from raymq.client import handles as client
    from raymq.config import BrokerConfig

    channel = SendChannel(*endpoint, "q")
    monkeypatch.setattr(
        client, "_send_channel", lambda queue, connect=True: None if channel.broken else channel
    )
    broker = SimpleNamespace(config=BrokerConfig(max_message_size=MAX_MESSAGE))
    q = client.Queue(broker, "q", None)
    ray_send = RaySend(store)
    q._invoke = lambda method, batch, timeout, **_: ray_send(batch, timeout)
    return q, channel


def test_a_batch_held_for_woken_senders_ships_without_them_after_the_linger(served, monkeypatch):
    """Waiting sends hold a batch for the senders the last answer woke (so that
    threads keep sharing one batch); one that never sends again delays the others by
    WAIT_LINGER_SECONDS at most, never for ever."""
    store, _, endpoint, loop = served
    q, channel = fake_queue(endpoint, store, monkeypatch)
    store.hold = True
    offsets: list[int | None] = []
    first = threading.Thread(target=lambda: offsets.append(q.send(b"1")))
    first.start()  # in flight, held by the store
    until(lambda: q._producer is not None and q._producer._in_flight == 1, "first in flight")
    second = threading.Thread(target=lambda: offsets.append(q.send(b"2")))
    second.start()  # open behind it; its thread waits
    until(lambda: q._producer._open is not None and q._producer._open.waiters, "second waits")
    loop.call_soon_threadsafe(store.release.set)
    first.join(30)  # woken by the answer, it never sends again
    second.join(30)
    assert not second.is_alive() and sorted(offsets) == [0, 1]
    assert store.bodies == [b"1", b"2"]
    channel.close()


def test_woken_senders_are_waited_for_only_while_they_come_back_within_the_linger(
    monkeypatch,
):
    """After an answer wakes waiting senders, the next waiting send holds its batch for
    them only within ``wait_linger`` of that answer and while woken senders have been
    coming back that fast (threads sending back to back). A sender paced by a schedule
    (back long after the answer) ships at once: holding it would only add latency."""
    from raymq.client import producer as producer_module

    now = [100.0]
    monkeypatch.setattr(producer_module, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    stored: list[bytes] = []
    channel = FakeChannel(stored)
    producer = Producer("q", lambda: channel, lambda wire, timeout: (0, 0), wait_linger=0.001)

    def answer_two_waited_senders() -> None:
        """A batch of two waiting sends answered: two senders woken, nothing in flight."""
        producer.send(b"w1", b"", None, waited=True)  # nothing in flight: ships
        producer.send(b"w2", b"", None, waited=True)  # behind it (Nagle)...
        producer.send(b"w3", b"", None, waited=True)  # ...with this one
        channel.answer_all()  # w1's answer ships w2 and w3
        channel.answer_all()  # theirs wakes both
        assert not channel.waiting and producer._open is None

    answer_two_waited_senders()
    now[0] += 0.0001  # one of them is back at once: held for the other
    producer.send(b"back-to-back", b"", None, waited=True)
    assert producer._open is not None and not channel.waiting

    flusher = threading.Thread(target=producer.flush)
    flusher.start()  # ships it, then waits for its answer
    until(lambda: channel.waiting, "the held batch shipped by a flush")
    channel.answer_all()
    flusher.join(30)
    answer_two_waited_senders()
    now[0] += 0.010  # back 10 ms after the answer: the linger is over, it goes now
    producer.send(b"paced", b"", None, waited=True)
    assert producer._open is None and [b for b, _ in channel.waiting] == [[b"paced"]]
    channel.answer_all()

    # Woken senders have not all come back before the next answer, again and again:
    # the next answer's are not waited for, even by a sender back at once.
    for _ in range(3):
        answer_two_waited_senders()
        now[0] += 0.010
        producer.send(b"late", b"", None, waited=True)
        channel.answer_all()
    answer_two_waited_senders()
    now[0] += 0.0001
    producer.send(b"soon after", b"", None, waited=True)
    assert producer._open is None and len(channel.waiting) == 1
    channel.answer_all()
