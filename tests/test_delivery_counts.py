"""Delivery counts that survive a crash, without Ray: QueueCores over real files,
"crashed" by leaving one unclosed (its files as a kill leaves them) and opening the
directory again, and the ack log's delivery-count sections.

(``tests/test_delivery_counts_on_ray.py`` SIGKILLs a queue actor for real.)
"""

from __future__ import annotations

import asyncio

import numpy as np

from raymq.config import BrokerConfig, QueueConfig
from raymq.core.delivery_counts import DeliveryCounts
from raymq.core.queue import QueueCore
from raymq.storage.acklog import AckLog, deliveries_as_ranges, read_ack_log
from tests.test_dead_letter import Sink, moved, send


def _broker(tmp_path, **kw) -> BrokerConfig:
    return BrokerConfig(paging_directory=str(tmp_path), head_cache_bytes=2**20, **kw)


def _open(tmp_path, **cfg) -> tuple[QueueCore, QueueCore]:
    """The queue ``orders`` (its dead letters to ``orders.DLQ``) and the DLQ."""
    broker = _broker(tmp_path)
    dlq = QueueCore(QueueConfig("orders.DLQ"), broker)
    return QueueCore(QueueConfig("orders", **cfg), broker, Sink(dlq)), dlq


def _lived(tmp_path, scenario, *, crash: bool, **cfg):
    """Run ``scenario(queue, dlq)`` on freshly opened cores; ``crash``: the queue is
    left unclosed (no final commit or checkpoint), as a SIGKILL leaves it."""

    async def main():
        q, dlq = _open(tmp_path, **cfg)
        q.start()
        dlq.start()
        try:
            return await scenario(q, dlq)
        finally:
            if not crash:
                await q.close()
            await dlq.close()

    return asyncio.run(main())


def _counts(batch) -> dict[int, int]:
    return dict(
        zip(
            batch.column("offset").to_pylist(),
            batch.column("delivery_count").to_pylist(),
            strict=True,
        )
    )


async def _nack_twice(q: QueueCore, _dlq) -> dict[int, int]:
    await send(q, 3)
    q.register_consumer("c", 10)
    got = []
    for _ in range(2):
        batch = await q.fetch("c", 1, 1.0, 10)
        got.append(_counts(batch))
        q.nack("c", np.array([0]))
        await q.flush_acks()  # what the actor's nack awaits before it answers
    return got


def test_a_crash_keeps_the_delivery_count_and_max_delivery_attempts_holds(tmp_path):
    assert _lived(tmp_path, _nack_twice, crash=True, max_delivery_attempts=3) == [
        {0: 1},
        {0: 2},
    ]

    async def after_the_crash(q, dlq):
        q.register_consumer("d", 10)
        third = _counts(await q.fetch("d", 10, 1.0, 10))
        q.nack("d", np.array([0]))
        await moved(q)
        rest = _counts(await q.fetch("d", 10, 0.2, 10))
        return third, rest, q.stats().depth, dlq.stats().depth

    third, rest, depth, in_dlq = _lived(
        tmp_path, after_the_crash, crash=False, max_delivery_attempts=3
    )
    assert third == {0: 3, 1: 1, 2: 1}
    assert rest == {}  # no fourth delivery: it is in the DLQ
    assert (depth, in_dlq) == (2, 1)


def test_a_message_in_flight_at_the_crash_counts_that_delivery(tmp_path):
    async def deliver_three_times(q, _dlq):
        got = await _nack_twice(q, _dlq)
        got.append(_counts(await q.fetch("c", 1, 1.0, 10)))  # its 3rd, in flight
        await q.flush_acks()
        return got

    got = _lived(tmp_path, deliver_three_times, crash=True, max_delivery_attempts=3)
    assert got == [{0: 1}, {0: 2}, {0: 3}]

    async def after(q, dlq):
        await moved(q)
        q.register_consumer("d", 10)
        return _counts(await q.fetch("d", 10, 1.0, 10)), dlq.stats().depth

    # Delivered max_delivery_attempts times already: to the DLQ, never a 4th time.
    assert _lived(tmp_path, after, crash=False, max_delivery_attempts=3) == ({1: 1, 2: 1}, 1)


def test_what_was_given_back_unseen_keeps_its_count_across_a_crash(tmp_path):
    async def scenario(q, _dlq):
        await send(q, 4)
        q.register_consumer("c", 10)
        await q.fetch("c", 4, 1.0, 10)  # all four delivered once
        q.nack("c", np.array([0]))  # 0: delivered, counted
        q.give_back("c", np.array([1]))  # 1: prefetched, never seen: not counted
        await q.flush_acks()

    _lived(tmp_path, scenario, crash=True)

    async def after(q, _dlq):
        q.register_consumer("d", 10)
        return _counts(await q.fetch("d", 10, 1.0, 10))

    # 2 and 3 were in flight at the crash: that delivery counts.
    assert _lived(tmp_path, after, crash=True) == {0: 2, 1: 1, 2: 2, 3: 2}


def test_the_checkpoint_carries_the_counts_once_the_ack_logs_are_gone(tmp_path):
    async def scenario(q, dlq):
        got = await _nack_twice(q, dlq)
        # 0's third delivery, 1 and 2's first: in flight; then 1 is acknowledged.
        assert _counts(await q.fetch("c", 3, 1.0, 10)) == {0: 3, 1: 1, 2: 1}
        await q.ack("c", np.array([1]))
        await q.commits.checkpoint()  # the ack logs before it are deleted
        return got

    _lived(tmp_path, scenario, crash=True)
    records = [read_ack_log(p) for p in sorted((tmp_path / "orders").glob("acks-*.log"))]
    assert len(records) == 1 and not records[0].deliveries  # only the checkpoint has them

    async def after(q, _dlq):
        q.register_consumer("d", 10)
        return _counts(await q.fetch("d", 10, 1.0, 10))

    assert _lived(tmp_path, after, crash=False) == {0: 4, 2: 2}
    # Again, past the recovery's own checkpoint (it replaced the ack logs): that
    # open delivered both once more, to a consumer that held them when it closed.
    assert _lived(tmp_path, after, crash=False) == {0: 5, 2: 3}


def test_a_memory_queue_counts_in_memory_only(tmp_path):
    class Log:
        durable = False

        def record_deliveries(self, offsets, count):
            raise AssertionError("a memory queue writes no counts")

    counts = DeliveryCounts(Log())
    assert counts.taken(np.array([0, 1]), [0, 1]).tolist() == [1, 1]
    assert counts.counted(0) == 1
    counts.not_counted([1])
    assert counts.of(np.array([0, 1, 2])).tolist() == [1, 0, 0]


def test_counts_are_recorded_as_ranges_and_the_latest_wins(tmp_path):
    class Log:
        durable = True

        def __init__(self):
            self.records: list[tuple[list[int], int]] = []

        def record_deliveries(self, offsets, count):
            self.records.append(([int(o) for o in offsets], count))

    log = Log()
    counts = DeliveryCounts(log)
    counts.taken(np.array([0, 1, 2]), [0, 1, 2])
    counts.counted(1)
    assert counts.taken(np.array([1, 3]), [1, 3]).tolist() == [2, 1]
    counts.not_counted([3])
    assert log.records == [([0, 1, 2], 1), ([3], 1), ([1], 2), ([3], 0)]
    holder = {0: "c", 1: "c", 2: "\x00dead-letter"}
    sections = counts.sections(holder, lambda who: not who.startswith("\x00"))
    # 1: delivered twice (the second under way); 0: once, under way; 2 is no delivery.
    assert [(n, r.tolist()) for n, r in sections] == [(2, [[1, 2]]), (1, [[0, 1]])]

    ack_log = AckLog(str(tmp_path), 1)
    ack_log.create(10)
    ack_log.write(
        np.array([[5, 6]], dtype=np.int64),
        10,
        delays=[(1_700_000_000_000_000, np.array([[7, 8]], dtype=np.int64))],
        deliveries=deliveries_as_ranges({0: 1, 1: 1, 3: 2}) + [(0, np.array([[1, 2]]))],
    )
    ack_log.close()
    got = read_ack_log(ack_log.path)
    assert got.ranges.tolist() == [[5, 6]]
    assert [(d, r.tolist()) for d, r in got.delays] == [(1_700_000_000_000_000, [[7, 8]])]
    assert [(n, r.tolist()) for n, r in got.deliveries] == [
        (1, [[0, 2]]),
        (2, [[3, 4]]),
        (0, [[1, 2]]),
    ]


def test_a_sends_commit_leaves_the_counts_to_a_write_of_the_ack_log_within_the_linger(
    tmp_path, monkeypatch
):
    """A take's count goes with the next commit that writes the ack log anyway, or
    with the first one ``COUNTS_LINGER_SECONDS`` after the last counts written: a send
    taken one at a time costs one fdatasync a commit, not two. A flush takes them."""
    from raymq.core import group_commit

    async def take_then_send(q, _dlq):
        await send(q, 2)
        q.register_consumer("c", 10)
        await q.fetch("c", 1, 1.0, 10)
        assert q.log.has_pending_acks  # the take's count
        await send(q, 1)  # a send's commit within the linger: the count waits
        waited = q.log.has_pending_acks
        await q.flush_acks()
        return waited, q.log.has_pending_acks

    monkeypatch.setattr(group_commit, "COUNTS_LINGER_SECONDS", 3600.0)
    assert _lived(tmp_path / "a", take_then_send, crash=False) == (True, False)
    monkeypatch.setattr(group_commit, "COUNTS_LINGER_SECONDS", 0.0)
    assert _lived(tmp_path / "b", take_then_send, crash=False) == (False, False)


def test_counts_left_waiting_by_a_send_survive_a_crash_once_a_flush_took_them(
    tmp_path, monkeypatch
):
    """The counts a send's commit left waiting are written by the next flush (a nack's,
    an ack's): a crash after it keeps them."""
    from raymq.core import group_commit

    monkeypatch.setattr(group_commit, "COUNTS_LINGER_SECONDS", 3600.0)

    async def take_send_flush(q, _dlq):
        await send(q, 2)
        q.register_consumer("c", 10)
        first = _counts(await q.fetch("c", 1, 1.0, 10))
        await send(q, 1)
        await q.flush_acks()
        return first

    assert _lived(tmp_path, take_send_flush, crash=True) == {0: 1}

    async def after(q, _dlq):
        q.register_consumer("d", 10)
        return _counts(await q.fetch("d", 10, 1.0, 10))

    # Delivered once before the crash: its next delivery is its second.
    assert _lived(tmp_path, after, crash=False) == {0: 2, 1: 1, 2: 1}
