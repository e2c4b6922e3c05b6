"""Priorities without Ray: the PriorityIndex, and QueueCore on real files: higher first,
FIFO within a priority, one level a delivery, given back and first again, selectors,
scheduled ones, a paged backlog, an address's subscriptions, a restart, and a queue
without priorities that ignores them."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from raymq.batch import MessageBatch
from raymq.config import BrokerConfig, QueueConfig, check_priority
from raymq.core import queue as queue_module
from raymq.core.offset_set import OffsetSet
from raymq.core.priority import PRIORITY_PROPERTY, PriorityIndex
from raymq.core.queue import QueueCore
from raymq.core.schedule import SCHEDULED_PROPERTY
from raymq.errors import InvalidSetting
from tests.test_expiry import T0, Clock


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(queue_module, "time", c)
    return c


def _core(tmp_path, name: str = "jobs", **cfg) -> QueueCore:
    broker = BrokerConfig(paging_directory=str(tmp_path), checkpoint_interval=0.05)
    core = QueueCore(QueueConfig(name, **cfg), broker)
    core.start()
    return core


def _batch(bodies: list[bytes], priority: int | None = None, props=None, at=None):
    batch = MessageBatch.from_bodies(bodies, props, max_message_size=2**20)
    if priority is not None:
        batch = batch.with_property(PRIORITY_PROPERTY, priority, keep_existing=False)
    if at is not None:
        batch = batch.with_property(SCHEDULED_PROPERTY, int(at * 1000), keep_existing=False)
    return batch


def _bodies(rows) -> list[bytes]:
    return rows.column("body").to_pylist()


def _offsets(rows) -> list[int]:
    return rows.column("offset").to_pylist()


async def _drain(core: QueueCore, consumer: str, each: int = 100, **kw) -> list[list[bytes]]:
    """Every delivery to ``consumer`` until one comes back empty, acked as it comes."""
    deliveries = []
    while True:
        rows = await core.fetch(consumer, each, 0.0, 1000, **kw)
        if not rows.num_rows:
            return deliveries
        deliveries.append(_bodies(rows))
        await core.ack(consumer, np.array(_offsets(rows)), **kw)


def test_the_index_serves_the_highest_usable_level_in_offset_order():
    index = PriorityIndex(9)
    index.add(np.array([3, 8, 20, 21]), np.array([5, 9, 5, 9], dtype=np.int16))
    assert index.count == 4 and index.levels_of(np.array([3, 8, 4])).tolist() == [5, 9, 0]
    everything = lambda o: np.ones(len(o), dtype=np.bool_)  # noqa: E731
    assert index.take(10, everything).tolist() == [8, 21]  # one level a take
    assert index.take(1, lambda o: o != 3).tolist() == [20]  # 3 unusable: dropped
    assert index.take(10, everything).tolist() == []
    index.released(np.array([3, 8, 99]))  # given back: waiting again (99 is not indexed)
    assert index.take(10, everything).tolist() == [8]
    among = OffsetSet()
    among.add(np.array([1, 2]))
    assert index.take(10, everything, among=among).tolist() == []  # 3 is not among them
    among.add(np.array([3]))
    assert index.take(10, everything, among=among).tolist() == [3]
    index.forget(np.array([3, 8, 20, 21]))
    assert index.count == 0 and not index


def test_offset_sets_answer_membership_and_common_offsets_across_chunks():
    a, b = OffsetSet(), OffsetSet()
    a.add(np.array([1, 5, 70_000, 200_000, 200_001]))
    b.add(np.array([5, 9, 70_000, 200_001]))
    assert a.first_common(b, 10).tolist() == [5, 70_000, 200_001]
    assert a.first_common(b, 2).tolist() == [5, 70_000]
    probe = np.array([200_000, 1, 2, 70_000, 10**9])
    assert a.contains(probe).tolist() == [True, True, False, True, False]


def test_settings_and_priorities_are_checked():
    for bad in [0, 256, True, 2.0, "9"]:
        with pytest.raises(InvalidSetting, match="max_priority"):
            QueueConfig("q", max_priority=bad)
    for bad in [-1, 256, True, 1.5]:
        with pytest.raises(InvalidSetting, match="priority.*'q'"):
            check_priority(bad, "queue 'q'")
    check_priority(0, "queue 'q'")
    assert QueueConfig("q", max_priority=255).max_priority == 255


def test_higher_priority_first_fifo_within_one_and_one_level_a_delivery(tmp_path):
    async def scenario():
        core = _core(tmp_path, max_priority=9)
        try:
            await core.send_batch(_batch([b"a0", b"b0"]))
            await core.send_batch(_batch([b"a5"], priority=5))
            await core.send_batch(_batch([b"a9", b"b9"], priority=9))
            await core.send_batch(_batch([b"c0"], priority=0))
            await core.send_batch(_batch([b"b5"], priority=5))
            await core.send_batch(_batch([b"capped"], priority=200))  # counts as 9
            core.register_consumer("c", 1000)
            stats = core.stats()
            return await _drain(core, "c"), stats, core.stats()
        finally:
            await core.close()

    deliveries, before, after = asyncio.run(scenario())
    assert deliveries == [[b"a9", b"b9", b"capped"], [b"a5", b"b5"], [b"a0", b"b0", b"c0"]]
    assert before.max_priority == 9 and before.prioritized == 5
    assert after.prioritized == 0 and after.depth == 0


def test_a_queue_without_priorities_delivers_in_order(tmp_path):
    async def scenario():
        core = _core(tmp_path)
        try:
            await core.send_batch(_batch([b"low"]))
            await core.send_batch(_batch([b"high"], priority=9))
            core.register_consumer("c", 1000)
            return await _drain(core, "c"), core.stats()
        finally:
            await core.close()

    deliveries, stats = asyncio.run(scenario())
    assert deliveries == [[b"low", b"high"]] and stats.max_priority == 0


def test_a_given_back_high_priority_message_comes_first_again(tmp_path):
    async def scenario():
        core = _core(tmp_path, max_priority=3)
        try:
            await core.send_batch(_batch([b"x", b"y"]))
            await core.send_batch(_batch([b"urgent"], priority=3))
            core.register_consumer("c", 1000)
            first = await core.fetch("c", 10, 0.0, 1000)
            core.nack("c", np.array(_offsets(first)))
            again = await core.fetch("c", 10, 0.0, 1000)
            rest = await core.fetch("c", 10, 0.0, 1000)
            return first, again, rest
        finally:
            await core.close()

    first, again, rest = asyncio.run(scenario())
    assert _bodies(first) == [b"urgent"]
    assert _bodies(again) == [b"urgent"] and again.column("delivery_count").to_pylist() == [2]
    assert _bodies(rest) == [b"x", b"y"]


def test_selector_consumers_get_their_matches_by_priority(tmp_path):
    async def scenario():
        core = _core(tmp_path, max_priority=9)
        try:
            await core.send_batch(_batch([b"r0"], props={"color": "red"}))
            await core.send_batch(_batch([b"b9"], priority=9, props={"color": "blue"}))
            await core.send_batch(_batch([b"r9"], priority=9, props={"color": "red"}))
            core.register_consumer("red", 1000, "color = 'red'")  # stored ones: found at once
            red = await _drain(core, "red")
            await core.send_batch(_batch([b"r1"], props={"color": "red"}))
            await core.send_batch(_batch([b"r5"], priority=5, props={"color": "red"}))
            red_later = await _drain(core, "red")
            core.register_consumer("any", 1000)
            return red, red_later, await _drain(core, "any")
        finally:
            await core.close()

    red, red_later, anyone = asyncio.run(scenario())
    assert red == [[b"r9"], [b"r0"]]
    assert red_later == [[b"r5"], [b"r1"]]
    assert anyone == [[b"b9"]]


def test_a_scheduled_high_priority_message_waits_for_its_time_then_goes_first(tmp_path, clock):
    async def scenario():
        core = _core(tmp_path, max_priority=9)
        try:
            await core.send_batch(_batch([b"later9"], priority=9, at=T0 + 5))
            await core.send_batch(_batch([b"now0", b"now0b"]))
            core.register_consumer("c", 1000)
            early = await core.fetch("c", 1, 0.0, 1000)
            clock.now += 6
            after = await core.fetch("c", 10, 0.0, 1000)
            return early, after
        finally:
            await core.close()

    early, after = asyncio.run(scenario())
    assert _bodies(early) == [b"now0"]
    assert _bodies(after) == [b"later9"]


def test_a_high_priority_message_behind_a_paged_backlog_is_delivered_first(tmp_path):
    n = 20_000

    async def scenario():
        core = _core(tmp_path, max_priority=9, page_size_bytes=64 * 1024, max_size_bytes=64 * 1024)
        try:
            for i in range(0, n, 1000):
                bodies = [b"%07d" % j + b"." * 200 for j in range(i, i + 1000)]
                await core.send_batch(_batch(bodies))
            await core.send_batch(_batch([b"jump"], priority=9))
            core.register_consumer("c", 10_000)
            first = await core.fetch("c", 100, 0.0, 10_000)
            second = await core.fetch("c", 100, 0.0, 10_000)
            return first, second, core.stats()
        finally:
            await core.close()

    first, second, stats = asyncio.run(scenario())
    assert stats.bytes_on_disk > 4 * 1024 * 1024  # the backlog is in page files
    assert _bodies(first) == [b"jump"]
    assert _bodies(second)[0].startswith(b"0000000")


def test_each_subscription_of_an_address_delivers_by_priority(tmp_path):
    async def scenario():
        core = _core(tmp_path, name="news", address=True, max_priority=5)
        try:
            await core.create_subscription("a")
            await core.create_subscription("b", filter="kind = 'x'")
            await core.send_batch(_batch([b"x0"], props={"kind": "x"}))
            await core.send_batch(_batch([b"y5"], priority=5, props={"kind": "y"}))
            await core.send_batch(_batch([b"x5"], priority=5, props={"kind": "x"}))
            core.register_consumer("ca", 100, subscription="a")
            core.register_consumer("cb", 100, subscription="b")
            return (
                await _drain(core, "ca", subscription="a"),
                await _drain(core, "cb", subscription="b"),
            )
        finally:
            await core.close()

    a, b = asyncio.run(scenario())
    assert a == [[b"y5", b"x5"], [b"x0"]]
    assert b == [[b"x5"], [b"x0"]]


def test_priorities_are_found_again_after_a_restart(tmp_path):
    async def first_life():
        core = _core(tmp_path, max_priority=9)
        try:
            await core.send_batch(_batch([b"old0", b"old0b"]))
            await core.send_batch(_batch([b"held7"], priority=7))
            await core.send_batch(_batch([b"old9"], priority=9))
            core.register_consumer("c", 1000)
            got = await core.fetch("c", 1, 0.0, 1000)  # old9: delivered, never acked
            await core.ack("c", np.array(_offsets(await core.fetch("c", 1, 0.0, 1000))))
            return got
        finally:
            await core.close()

    async def second_life():
        core = _core(tmp_path, max_priority=9)
        try:
            await core.expiry_pass()  # runs at once after a restart; awaited here
            core.register_consumer("c2", 1000)
            return await _drain(core, "c2"), core.stats()
        finally:
            await core.close()

    got = asyncio.run(first_life())
    assert _bodies(got) == [b"old9"]
    deliveries, stats = asyncio.run(second_life())
    assert deliveries == [[b"old9"], [b"old0", b"old0b"]]  # held7 was acked
    assert stats.prioritized == 0
