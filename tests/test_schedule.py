"""Scheduled delivery without Ray: the ScheduleIndex, delivery times, and QueueCore on
real files with an injected clock: not before its time, not in the way of others,
selectors, a restart, expiry before the time, and the index's size."""

from __future__ import annotations

import asyncio
import datetime

import numpy as np
import pytest

from raymq.batch import MessageBatch
from raymq.config import BrokerConfig, QueueConfig
from raymq.core import queue as queue_module
from raymq.core.expiry import EXPIRATION_PROPERTY
from raymq.core.queue import QueueCore
from raymq.core.schedule import SCHEDULED_PROPERTY, ScheduleIndex, delivery_time
from raymq.errors import InvalidSetting
from tests.storage_helpers import flip
from tests.test_expiry import T0, Clock

ms = 1000  # milliseconds in a second


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(queue_module, "time", c)
    return c


def _core(tmp_path, **cfg) -> QueueCore:
    broker = BrokerConfig(paging_directory=str(tmp_path), checkpoint_interval=0.05)
    core = QueueCore(QueueConfig("jobs", **cfg), broker)
    core.start()
    return core


def _batch(bodies: list[bytes], at: float | None = None, ttl_at: float | None = None, props=None):
    batch = MessageBatch.from_bodies(bodies, props, max_message_size=2**20)
    if at is not None:
        batch = batch.with_property(SCHEDULED_PROPERTY, int(at * ms), keep_existing=False)
    if ttl_at is not None:
        batch = batch.with_property(EXPIRATION_PROPERTY, int(ttl_at * ms), keep_existing=False)
    return batch


def _bodies(rows) -> list[bytes]:
    return rows.column("body").to_pylist()


def test_the_index_keeps_runs_and_gives_them_back_at_their_time():
    index = ScheduleIndex()
    index.add(np.arange(10, 20), np.full(10, 500))
    index.add(np.array([30, 31, 40]), np.array([100, 100, 900]))
    index.add(np.arange(15, 18), np.full(3, 1))  # set aside already: left as they are
    assert index.count == 13 and bool(index)
    assert index.contains(np.array([9, 10, 19, 20, 31, 32, 40])).tolist() == [
        False, True, True, False, True, False, True,
    ]  # fmt: skip
    assert index.next_due() == 100
    assert index.pop_due(99).tolist() == []
    assert index.pop_due(500).tolist() == [*range(10, 20), 30, 31]
    assert index.count == 1 and index.next_due() == 900
    assert not index.contains(np.array([10, 30])).any()
    assert index.pop_due(10**12).tolist() == [40] and not index


def test_a_million_messages_sent_in_batches_cost_the_index_little():
    index = ScheduleIndex()
    for b in range(1000):
        index.add(np.arange(b * 1000, (b + 1) * 1000), np.full(1000, 10**12 + b))
    assert index.count == 1_000_000
    assert index.nbytes < 200_000  # one run per batch, not an entry per message


def test_delivery_times_from_deliver_at_or_delay():
    assert delivery_time(None, None, 5.0, "q") is None
    assert delivery_time(None, 1.5, 10.0, "q") == 11_500
    assert delivery_time(12.0001, None, 10.0, "q") == 12_001  # rounded up: never early
    when = datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC)
    assert delivery_time(when, None, 0.0, "q") == int(when.timestamp() * 1000)
    for bad in [(1.0, 2.0), (None, -1), (None, "1"), ("x", None), (float("nan"), None)]:
        with pytest.raises(InvalidSetting, match="q"):
            delivery_time(*bad, 0.0, "q")


def test_a_scheduled_message_waits_for_its_time_and_others_pass_it(tmp_path, clock):
    async def scenario():
        core = _core(tmp_path)
        try:
            await core.send_batch(_batch([b"later-1", b"later-2"], at=T0 + 5))
            await core.send_batch(_batch([b"now"]))
            core.register_consumer("c", 10)
            first = await core.fetch("c", 10, 0.0, 10)
            scheduled = core.stats().scheduled
            clock.now += 4.9
            early = await core.fetch("c", 10, 0.0, 10)
            clock.now += 0.2
            late = await core.fetch("c", 10, 0.0, 10)
            return first, scheduled, early, late, core.stats()
        finally:
            await core.close()

    first, scheduled, early, late, stats = asyncio.run(scenario())
    assert _bodies(first) == [b"now"] and scheduled == 2
    assert early.num_rows == 0
    assert _bodies(late) == [b"later-1", b"later-2"]
    assert late.column("delivery_count").to_pylist() == [1, 1]
    assert stats.scheduled == 0 and stats.in_flight == 3 and stats.messages_redelivered == 0


def test_a_selector_consumer_gets_a_scheduled_match_at_its_time(tmp_path, clock):
    async def scenario():
        core = _core(tmp_path)
        try:
            core.register_consumer("red", 10, "color = 'red'")
            core.register_consumer("any", 10)
            await core.send_batch(_batch([b"r"], at=T0 + 2, props={"color": "red"}))
            await core.send_batch(_batch([b"b"], at=T0 + 2, props={"color": "blue"}))
            early = [await core.fetch(c, 10, 0.0, 10) for c in ("red", "any")]
            clock.now += 3
            red = await core.fetch("red", 10, 0.0, 10)
            rest = await core.fetch("any", 10, 0.0, 10)
            return early, red, rest
        finally:
            await core.close()

    early, red, rest = asyncio.run(scenario())
    assert [e.num_rows for e in early] == [0, 0]
    assert _bodies(red) == [b"r"] and _bodies(rest) == [b"b"]


def test_scheduled_messages_survive_a_restart(tmp_path, clock):
    async def first_run():
        core = _core(tmp_path)
        try:
            await core.send_batch(_batch([b"a", b"b"], at=T0 + 60))
            await core.send_batch(_batch([b"c"]))
        finally:
            await core.close()

    async def second_run():
        core = _core(tmp_path)
        try:
            await core.expiry_pass()  # (it runs at once after a restart)
            scheduled = core.stats().scheduled
            core.register_consumer("c", 10)
            now = await core.fetch("c", 10, 0.0, 10)
            clock.now += 61
            later = await core.fetch("c", 10, 0.0, 10)
            return scheduled, _bodies(now), _bodies(later)
        finally:
            await core.close()

    asyncio.run(first_run())
    assert asyncio.run(second_run()) == (2, [b"c"], [b"a", b"b"])


def test_a_message_that_expires_before_its_time_is_never_delivered(tmp_path, clock):
    async def scenario():
        core = _core(tmp_path)
        try:
            await core.send_batch(_batch([b"stale"], at=T0 + 10, ttl_at=T0 + 5))
            core.register_consumer("c", 10)
            early = await core.fetch("c", 10, 0.0, 10)
            clock.now += 11
            late = await core.fetch("c", 10, 0.0, 10)
            await core.dead_letters_settled()
            return early.num_rows, late.num_rows, core.stats()
        finally:
            await core.close()

    early, late, stats = asyncio.run(scenario())
    assert (early, late) == (0, 0)
    assert stats.messages_expired == 1 and stats.depth == 0 and stats.scheduled == 0


def test_a_record_found_damaged_while_its_delivery_time_is_read_is_not_delivered(tmp_path, clock):
    """Simulator seed 2500544: a fetch took a redelivered message (below the
    HeadQueueCache) and a record the cache held; the properties read for their delivery
    times went to disk for the whole range and found the record damaged. The record was
    quarantined, but its messages, with no delivery time read, were then served from
    the cache's intact copy: one before its time. They are out of delivery for good."""

    async def scenario():
        core = _core(tmp_path)
        try:
            await core.send_batch(_batch([b"stale"], ttl_at=T0 + 5))
            later = {SCHEDULED_PROPERTY: int((T0 + 60) * ms)}
            await core.send_batch(
                MessageBatch.from_bodies(
                    [b"a", b"later", b"b"], [None, later, None], max_message_size=2**20
                )
            )
            core.register_consumer("first", 1)
            taken = await core.fetch("first", 1, 0.0, 1)
            core.housekeeping()  # the HeadQueueCache holds what is undelivered: 1..3
            cached = core.head_cache.get(1, 4) is not None
            core.close_consumer("first")  # "stale" is given back, below the cache
            seg = core.log.segments.holding(1)
            flip(seg.path, int(seg.positions[seg.record_index(1)]))  # the record's header
            clock.now += 6  # "stale" expires
            core.register_consumer("second", 10)
            rows = await core.fetch("second", 10, 0.0, 10)
            clock.now += 60
            after = await core.fetch("second", 10, 0.0, 10)
            return _bodies(taken), cached, _bodies(rows), _bodies(after), core.stats()
        finally:
            await core.close()

    taken, cached, rows, after, stats = asyncio.run(scenario())
    assert taken == [b"stale"] and cached  # the scenario
    assert rows == [] and after == []
    assert stats.damaged_messages == 3 and stats.in_flight == 0


def test_the_index_lets_offsets_lost_to_damage_go():
    index = ScheduleIndex()
    index.add(np.arange(10, 20), np.full(10, 500))
    index.add(np.array([30, 31]), np.array([100, 100]))
    assert index.discard(np.array([5, 10, 14, 15, 19, 31, 40])) == 5
    assert index.count == 7
    assert index.contains(np.arange(9, 33)).nonzero()[0].tolist() == [
        o - 9 for o in (11, 12, 13, 16, 17, 18, 30)
    ]
    assert index.discard(np.array([10])) == 0 and index.next_due() == 100
    assert index.pop_due(500).tolist() == [11, 12, 13, 16, 17, 18, 30] and not index
