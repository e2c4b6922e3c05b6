"""Delayed redelivery without Ray: ``nack(delay=)`` and ``redelivery_delay_s`` on
QueueCore over real files, across a restart, and the ack log's delay sections."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from raymq.config import BrokerConfig, QueueConfig
from raymq.core.queue import QueueCore
from raymq.core.target_area import DELAYED_HOLDER
from raymq.errors import InvalidSetting
from raymq.storage.acklog import AckLog, read_ack_log


def _core(tmp_path, **cfg) -> QueueCore:
    broker = BrokerConfig(paging_directory=str(tmp_path), checkpoint_interval=0.05)
    return QueueCore(QueueConfig("jobs", **cfg), broker)


def _offsets(batch) -> list[int]:
    return batch.column("offset").to_pylist()


def test_a_delayed_message_is_not_delivered_before_its_time(tmp_path):
    async def scenario():
        core = _core(tmp_path)
        core.start()
        try:
            await core.send_batch(_batch(3))
            core.register_consumer("c", 10)
            got = await core.fetch("c", 3, 1.0, 10)
            assert _offsets(got) == [0, 1, 2]
            t0 = time.monotonic()
            assert core.nack("c", np.array([0]), delay=0.3) == 1
            assert core.nack("c", np.array([1]), delay=0) == 1  # at once
            stats = core.stats()
            assert stats.delayed_messages == 1 and stats.in_flight == 1
            first = await core.fetch("c", 3, 0.0, 10)
            assert _offsets(first) == [1]
            late = await core.fetch("c", 3, 5.0, 10)
            waited = time.monotonic() - t0
            counts = (
                first.column("delivery_count").to_pylist(),
                late.column("delivery_count").to_pylist(),
            )
            return _offsets(late), waited, counts
        finally:
            await core.close()

    late, waited, counts = asyncio.run(scenario())
    # Counted as a nack at once is: one more delivery.
    assert late == [0] and waited >= 0.3 and counts[0] == counts[1]


def test_a_delay_survives_a_restart_and_the_queue_default_applies(tmp_path):
    async def first_run():
        core = _core(tmp_path, redelivery_delay_s=3600.0)
        core.start()
        try:
            await core.send_batch(_batch(2))
            core.register_consumer("c", 10)
            await core.fetch("c", 2, 1.0, 10)
            core.nack("c", np.array([0, 1]))  # the queue's redelivery_delay_s
            await core.flush_acks()
            return core.stats().delayed_messages
        finally:
            await core.close()

    async def second_run():
        core = _core(tmp_path, redelivery_delay_s=3600.0)
        core.start()
        try:
            core.register_consumer("d", 10)
            got = await core.fetch("d", 2, 0.2, 10)
            return _offsets(got), core.stats(), dict(core._own.area.delayed)
        finally:
            await core.close()

    assert asyncio.run(first_run()) == 2
    for _ in range(2):  # also after the checkpoint the first restart wrote
        got, stats, delayed = asyncio.run(second_run())
        assert got == [] and stats.delayed_messages == 2 and stats.depth == 2
        assert sorted(delayed) == [0, 1] and min(delayed.values()) > time.time() + 3000


def test_delays_are_released_when_due_in_offset_order():
    from raymq.core.target_area import TargetArea

    class Log:  # the parts of SegmentLog the area uses here
        next_offset = 10

        def unacked(self, start, limit, end=None):
            return np.arange(start, 10)[:limit]

        def properties(self, start, end):
            return []

        def is_acked(self, offsets):
            return np.zeros(len(offsets), dtype=bool)

    area = TargetArea(Log(), "jobs")
    area.register("c", 10)
    offsets, _ = area.take("c", 3)
    assert offsets.tolist() == [0, 1, 2]
    area.release("c", np.array([2, 0]), delay_until=100.0)
    area.release("c", np.array([1]), delay_until=50.0)
    assert area.next_due() == 50.0 and area._holder[0] == DELAYED_HOLDER
    assert area.release_due(49.9) == 0
    assert area.release_due(50.0) == 1 and area.next_due() == 100.0
    assert area.take("c", 1)[0].tolist() == [1]
    assert area.release_due(1000.0) == 2 and area.next_due() is None
    assert area.take("c", 5)[0].tolist() == [0, 2, 3, 4, 5]


def test_ack_records_carry_delay_sections(tmp_path):
    ack_log = AckLog(str(tmp_path), 1)
    ack_log.create(100)
    ack_log.write(
        np.array([[0, 5]], dtype=np.int64),
        100,
        {3: np.array([[7, 9]], dtype=np.int64)},
        [(1_700_000_000_000_000, np.array([[10, 12]], dtype=np.int64))],
    )
    ack_log.close()
    got = read_ack_log(ack_log.path)
    assert got.ranges.tolist() == [[0, 5]] and got.high == 100
    assert {k: v.tolist() for k, v in got.subscriptions.items()} == {3: [[7, 9]]}
    assert [(d, r.tolist()) for d, r in got.delays] == [(1_700_000_000_000_000, [[10, 12]])]


@pytest.mark.parametrize("delay", [-1, "1", float("nan"), 8 * 86400.0])
def test_bad_delays_are_refused_naming_the_queue(tmp_path, delay):
    with pytest.raises(InvalidSetting, match="jobs"):
        QueueConfig("jobs", redelivery_delay_s=delay)
    core = _core(tmp_path)
    try:
        with pytest.raises(InvalidSetting, match="jobs"):
            core.nack("c", np.array([0]), delay=delay)
    finally:
        asyncio.run(core.close())


def _batch(n: int):
    from raymq.batch import MessageBatch

    return MessageBatch.from_bodies([b"m%d" % i for i in range(n)], None, max_message_size=2**20)
