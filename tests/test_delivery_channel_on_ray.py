"""The DeliveryChannel's wiring on a real Ray: single messages come inline over the
socket, a deep prefetch's worth by reference through Ray, in order either way; a
consumer whose channel broke (or was never opened) receives through Ray; asyncio
receives do not block the event loop and a cancelled one loses nothing."""

from __future__ import annotations

import asyncio

from raymq import delivery_channel


def test_single_messages_come_inline_and_a_deep_batch_by_reference(broker):
    q = broker.create_queue("inline")
    with q.consumer(prefetch=10_000) as c:
        assert c._channel is not None
        sent = [q.send(f"m{i}".encode()) for i in range(3)]
        got = []
        while len(got) < 3:
            got += c.receive(max_messages=10, timeout=30)
        assert [m.offset for m in got] == sent and got[0].body == b"m0"
        big = q.send_batch([b"x" * 1024] * 2000)  # 2 MiB: more than is sent inline
        rows = []
        while len(rows) < 2000:
            batch = c.receive_batch(1000, timeout=30)
            assert batch.num_rows
            rows += batch.column("offset").to_pylist()
        assert rows == list(range(big[0], big[0] + 2000))
        c.ack(got)
        c.ack(rows)
        c.flush()
        stats = c.stats()
    assert stats["delivery_channel"] and stats["delivery_channel_answers"] >= 1
    assert stats["delivery_channel_by_reference"] >= 1
    assert stats["delivery_channel_given_back"] == 0
    assert q.stats()["depth"] == 0


def test_without_a_channel_or_after_it_broke_receives_go_through_ray(broker, monkeypatch):
    q = broker.create_queue("no-channel")
    monkeypatch.setattr(delivery_channel, "USE_CHANNEL", False)
    with q.consumer() as c:
        assert c._channel is None
        offset = q.send(b"a")
        assert [m.offset for m in c.receive(timeout=30)] == [offset]
        c.ack(offset, wait=True)
    monkeypatch.setattr(delivery_channel, "USE_CHANNEL", True)
    with q.consumer() as c:
        c._channel._sock.close()  # the connection breaks under it
        offset = q.send(b"b")
        assert [m.offset for m in c.receive(timeout=30)] == [offset]
        assert c._channel is None and c.delivery_channel_failures == 1


def test_async_receives_leave_the_loop_free_and_a_cancelled_one_loses_nothing(broker):
    q = broker.create_queue("async")

    async def main(c) -> tuple[list, int, list, list, list]:
        ticks = 0
        waiting = asyncio.create_task(c.receive_async(timeout=30))
        while not waiting.done() and ticks < 5:
            await asyncio.sleep(0.01)  # runs while the receive waits in its thread
            ticks += 1
        waiting.cancel()  # before anything was sent: it took nothing, or keeps it
        await asyncio.gather(waiting, return_exceptions=True)
        sent = q.send_batch([b"a", b"b", b"c"])
        got = []
        while len(got) < 3:
            got += [m.offset for m in await c.receive_async(3, timeout=30)]
        more = q.send_batch([b"d", b"e"])
        batch = await c.receive_batch_async(10, timeout=30)
        rows = batch.column("offset").to_pylist()
        last = q.send(b"f")
        async for message in c:
            rows.append(message.offset)
            if message.offset == last:
                break
        return got, ticks, sent, rows, [*more, last]

    with q.consumer() as c:
        got, ticks, sent, rows, expected = asyncio.run(asyncio.wait_for(main(c), 120))
    assert ticks == 5  # the loop ran while a receive waited
    assert got == sent and rows == expected
