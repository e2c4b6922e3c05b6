"""The DeliveryChannel's wiring on a real Ray: single messages come inline over the
socket, a deep prefetch's worth by reference through Ray, in order either way; a
consumer whose channel broke (or was never opened) receives through Ray; asyncio
receives do not block the event loop and a cancelled one loses nothing. The
FetchChannel: the TargetList's fetches come inline over it, large ones parked and taken
by Ray, and through Ray calls when it is off; a TargetList given its address registers
over it (bad settings still raise) and makes no Ray fetch at all."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import ray
from raymq.actors.target_list_actor import TargetListActor
from raymq.placement import spares
from raymq.placement.nodes import current_node_id

from raymq.errors import SelectorError
from raymq.selector.parser import MAX_SELECTOR_LENGTH
from raymq.wire import delivery as delivery_channel
from tests.consumer_helpers import receive_all, unwatched_consumer


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
        c._channel._client.close()  # the connection breaks under it
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


# -- the FetchChannel: the TargetList's fetches over a socket to the queue actor ---------


def test_fetches_come_inline_large_ones_parked_and_by_ray_when_switched_off(broker):
    q = broker.create_queue("fetch-channel")
    with q.consumer() as c:
        sent = [q.send(f"m{i}".encode()) for i in range(3)]
        got = []
        while len(got) < 3:
            got += c.receive(max_messages=10, timeout=30)
        assert [m.offset for m in got] == sent
        first = q.send_batch([b"x" * 1024] * 3000)[0]  # 3 MiB: parked, taken by Ray
        rows = []
        while len(rows) < 3000:
            batch = c.receive_batch(1000, timeout=30)
            assert batch.num_rows
            rows += batch.column("offset").to_pylist()
        assert rows == list(range(first, first + 3000))
        ray.get(c.target_list.use_fetch_channel.remote(False))
        a = q.send(b"a")  # may still come by the channel's fetch under way
        assert [m.offset for m in c.receive(timeout=30)] == [a]
        b = q.send(b"b")  # after it: the loader's next fetch is a Ray call
        assert [m.offset for m in c.receive(timeout=30)] == [b]
        c.ack([*got, *rows, a, b], wait=True)
        stats = c.stats()
    assert stats["fetch_channel"] is False and stats["fetch_channel_failures"] == 0
    assert stats["fetches_inline"] >= 1 and stats["fetches_parked"] >= 1
    assert stats["fetches_by_ray"] >= 1
    assert q.stats()["depth"] == 0


def test_a_target_list_registers_over_the_fetch_channel_and_bad_settings_still_raise(broker):
    q = broker.create_queue("fetch-register")
    endpoint = ray.get(q._actor.fetch_endpoint.remote())
    bad = TargetListActor.remote()
    with pytest.raises(SelectorError):
        ray.get(
            bad.start.remote(
                q._actor,
                q.name,
                "bad",
                10,
                "x =",
                10,
                2**20,
                0,
                None,
                endpoint,
            )
        )
    assert q.stats()["consumers"] == 0
    tl = TargetListActor.remote()
    ray.get(tl.start.remote(q._actor, q.name, "c1", 10, None, 10, 2**20, 0, None, endpoint))
    offset = q.send(b"hello")
    entries = ray.get(tl.take.remote(10, 30))
    bodies = [ray.get(ref).slice(start, n).column("body").to_pylist() for ref, start, n in entries]
    assert bodies == [[b"hello"]]
    stats = ray.get(tl.stats.remote())
    assert stats["fetch_channel"] and stats["fetches_inline"] >= 1
    assert stats["fetches_by_ray"] == 0  # not even the first: no Ray fetch at all
    assert ray.get(tl.close.remote(None)) == 1  # the message goes back
    assert q.stats()["consumers"] == 0 and q.stats()["depth"] == 1
    for actor in (bad, tl):
        ray.kill(actor)
    with q.consumer() as c:
        assert [m.offset for m in c.receive(timeout=30)] == [offset]


def test_a_warm_spare_is_started_over_its_channel_and_one_still_starting_by_ray(
    broker, monkeypatch
):
    q = broker.create_queue("started-over")
    sent = q.send_batch([b"a", b"b"])
    assert spares.wait_warm(timeout=60)
    with q.consumer() as c:
        assert [m.offset for m in c.receive(timeout=30)] == sent[:1]
        assert c.stats()["started_over"] == "delivery channel"
    assert spares.wait_warm(timeout=60)
    longest = "b = '" + "é" * (MAX_SELECTOR_LENGTH - 6) + "'"  # 2 bytes a character
    with q.consumer(selector=longest) as c:
        assert c.stats()["started_over"] == "delivery channel"
    take = spares.take
    monkeypatch.setattr(spares, "take", lambda node: take(node).without_channel())  # not up yet
    with q.consumer() as c:
        got = receive_all(c, 2)
        stats = c.stats()
        c.ack(sent, wait=True)
    assert [m.offset for m in got] == sent
    assert stats["started_over"] == "ray" and stats["delivery_channel"]
    assert c.delivery_channel_failures == 0


def test_messages_of_a_target_list_that_dies_before_the_queue_watches_it_come_again(broker):
    q = broker.create_queue("unwatched")
    sent = q.send_batch([b"a", b"b", b"c"])
    c = unwatched_consumer(q, loaded=3)
    assert not c.stats()["watched_by_queue"]
    ray.kill(c.target_list, no_restart=True)  # its FetchChannel closes with it
    with q.consumer() as again:
        got = receive_all(again, 3)
        assert sorted(m.offset for m in got) == sent
        again.ack(got, wait=True)
    c.close()  # its TargetList is dead: nothing to give back


def test_a_consumer_closed_before_the_queue_watches_it_gives_back_uncounted(broker):
    q = broker.create_queue("closed-unwatched")
    sent = q.send_batch([b"a", b"b", b"c"])
    c = unwatched_consumer(q, loaded=3)
    c.close()  # never watched: its fetch channel closes too, and that is no death
    with q.consumer() as again:
        got = receive_all(again, 3)
        assert sorted(m.offset for m in got) == sent
        assert [m.delivery_count for m in got] == [1, 1, 1]  # none was received before
        again.ack(got, wait=True)
    assert q.stats()["depth"] == 0


def test_a_channel_start_raises_the_typed_error_of_a_ray_registration(broker):
    q = broker.create_queue("typed-start")
    assert spares.wait_warm(timeout=60)
    actor, _, channel = spares.take(current_node_id())
    assert channel is not None  # connected while the spare waited
    channel.name_queue(q.name)
    settings = {
        "queue": q.name,
        "consumer_id": "c1",
        "prefetch": 10,
        "selector": "x =",  # malformed: the queue refuses the registration
        "high_watermark": 10,
        "high_watermark_bytes": 2**20,
        "pending_cache_bytes": 0,
        "fetch_endpoint": None,  # registered through Ray
        "namespace": broker.namespace,
    }
    try:
        with pytest.raises(SelectorError):
            channel.start(settings, 30.0)
    finally:
        channel.close()
        ray.kill(actor, no_restart=True)
    assert q.stats()["consumers"] == 0


def _dead(pid: int) -> bool:
    """Gone, or a zombie its parent has not reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:  # gone (ENOENT), or going while read (ESRCH)
        return True


@pytest.mark.parametrize("break_seen", [True, False], ids=["break-seen", "break-unseen"])
def test_a_spare_that_died_after_it_was_up_is_replaced_by_a_new_target_list(
    broker, monkeypatch, break_seen
):
    """The spare's channel was connected while it waited, and it died. Whether or not
    this process has read the connection's end yet (if not, the start over it fails),
    a new TargetList started by Ray serves the consumer, over a channel of its own."""
    q = broker.create_queue("dead-spare")
    offset = q.send(b"a")
    spares.warm(current_node_id())  # (the module's broker may be older than this test)
    assert spares.wait_warm(timeout=60)
    key = spares._key(current_node_id())
    spare, channel = spares._spares[key], spares._channels[key]
    pid = ray.get(spare.pid.remote())
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not _dead(pid):
        assert time.monotonic() < deadline, "the spare's process did not die"
        time.sleep(0.05)
    if not break_seen:  # take hands the channel on as a working one
        monkeypatch.setattr(type(channel), "broken", property(lambda self: None))
    with q.consumer() as c:
        assert c.target_list._actor_id != spare._actor_id
        assert c._channel is not None  # its own channel, once Ray started it
        assert [m.offset for m in c.receive(timeout=30)] == [offset]
        assert c.stats()["started_over"] == "ray"
        c.ack(offset, wait=True)
