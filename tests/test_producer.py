"""Pipelined sends (``send(wait=False)``, ``raymq.producer``) and asyncio sends over the
send channel: Ray-free against a real socket and a fake store, then a few on real Ray."""

# ruff: noqa: F811 - tests take the imported fixture "served" as their argument
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from raymq.batch import MessageBatch
from raymq.errors import AddressFull
from raymq.producer import Producer, SendFuture
from raymq.send_channel import SendChannel
from tests.test_send_channel import served  # noqa: F401 - the fixture

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
    from raymq.client import _call

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
    from raymq.client import _send_channel

    assert _send_channel(q, connect=False) is not None  # they opened and used it


def test_an_async_send_outlives_its_patience_while_the_server_answers_pings(served, monkeypatch):
    from raymq import send_channel

    store, server, endpoint, loop = served
    # Long enough for a loaded machine to answer a ping within it: a miss breaks the channel.
    monkeypatch.setattr(send_channel, "REPLY_PATIENCE_SECONDS", 0.5)
    channel = SendChannel(*endpoint, "q")
    store.hold = True

    async def main():
        pending = asyncio.ensure_future(channel.send_async(b"late", b"", None))
        while not server.pings_answered:  # it pinged: the server still holds the send
            await asyncio.sleep(0.01)
        assert not pending.done()
        loop.call_soon_threadsafe(store.release.set)
        return await pending

    assert asyncio.run(main()) == 0
    channel.close()
