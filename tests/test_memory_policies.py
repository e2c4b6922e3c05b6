"""Address-full policies, memory budgets and flow to disk of one queue, without Ray.

QueueCore is driven directly with asyncio; files are real and fsynced.
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from raymq.batch import MessageBatch
from raymq.config import BrokerConfig, QueueConfig
from raymq.core.queue import QueueCore
from raymq.errors import AddressFull

KIB = 1024


def batch_of(n: int, size: int = KIB, start: int = 0) -> MessageBatch:
    bodies = [(start + i).to_bytes(8, "little") + b"x" * (size - 8) for i in range(n)]
    return MessageBatch.from_bodies(bodies, None, max_message_size=2**20, queue="t")


def core(tmp_path, **cfg) -> QueueCore:
    broker = BrokerConfig(paging_directory=str(tmp_path), head_cache_bytes=2**20)
    return QueueCore(QueueConfig(cfg.pop("name", "q"), **cfg), broker)


def run(coro_fn, q: QueueCore):
    async def main():
        q.start()
        try:
            return await coro_fn()
        finally:
            await q.close()

    return asyncio.run(main())


async def drain(q: QueueCore, consumer: str = "c") -> list[int]:
    """Receive and ack everything; returns the first 8 body bytes of each as ints."""
    q.register_consumer(consumer, 10_000)
    seen: list[int] = []
    while True:
        got = await q.fetch(consumer, 1000, 0.05, 10_000)
        if got.num_rows == 0:
            return seen
        seen.extend(int.from_bytes(b[:8], "little") for b in got.column("body").to_pylist())
        await q.ack(consumer, got.column("offset").to_numpy())


def test_fail_refuses_the_whole_batch_and_writes_nothing(tmp_path):
    q = core(tmp_path, max_size_bytes=50 * KIB, address_full_policy="FAIL")

    async def scenario():
        await q.send_batch(batch_of(40))
        before = q.stats()
        with pytest.raises(AddressFull, match=r"queue 'q'.*max_size_bytes=51,200.*FAIL"):
            await q.send_batch(batch_of(20, start=40))
        after = q.stats()
        assert (after.next_offset, after.depth) == (before.next_offset, before.depth) == (40, 40)
        assert after.bytes_on_disk == before.bytes_on_disk
        assert await drain(q) == list(range(40))
        first, count = await q.send_batch(batch_of(20, start=40))  # room again after acks
        assert count == 20 and first == 40

    run(scenario, q)


def test_drop_stores_what_fits_and_counts_the_rest(tmp_path):
    q = core(tmp_path, max_size_bytes=50 * KIB, address_full_policy="DROP")

    async def scenario():
        first, count = await q.send_batch(batch_of(100))
        assert first == 0 and 40 <= count < 50
        s = q.stats()
        assert s.messages_dropped == 100 - count and s.depth == count
        assert s.bytes_queued <= 50 * KIB
        assert await drain(q) == list(range(count))

    run(scenario, q)


def test_block_waits_for_acks_and_shows_why(tmp_path):
    q = core(tmp_path, max_size_bytes=50 * KIB, address_full_policy="BLOCK")

    async def scenario():
        await q.send_batch(batch_of(45))
        blocked = asyncio.create_task(q.send_batch(batch_of(10, start=45)))
        while q.stats().blocked_producers == 0:
            assert not blocked.done(), blocked
            await asyncio.sleep(0)
        s = q.stats()
        assert s.blocked_producers == 1 and "address_full_policy=BLOCK" in s.blocked_reason
        assert not blocked.done()
        q.register_consumer("c", 100)
        got = await q.fetch("c", 20, 1.0, 100)
        await q.ack("c", got.column("offset").to_numpy())
        assert await asyncio.wait_for(blocked, 5) == (45, 10)
        assert q.stats().blocked_producers == 0
        with pytest.raises(AddressFull, match="blocked"):
            await q.send_batch(batch_of(40, start=55), timeout=0.2)
        with pytest.raises(AddressFull):  # can never fit: refused at once
            await q.send_batch(batch_of(60, start=55))

    run(scenario, q)


def test_block_admits_blocked_sends_first_come_first_served(tmp_path):
    """A small send that would fit waits behind a blocked larger one (no starvation),
    and each blocked send is stored in the order it blocked."""
    q = core(tmp_path, max_size_bytes=50 * KIB, address_full_policy="BLOCK")

    async def scenario():
        await q.send_batch(batch_of(45))
        big = asyncio.create_task(q.send_batch(batch_of(10, start=45)))
        while q.stats().blocked_producers < 1:
            await asyncio.sleep(0)
        small = asyncio.create_task(q.send_batch(batch_of(1, start=55)))
        while q.stats().blocked_producers < 2:
            assert not small.done(), "a send jumped ahead of a blocked one"
            await asyncio.sleep(0)
        assert not big.done() and not small.done()
        q.register_consumer("c", 100)
        got = await q.fetch("c", 20, 1.0, 100)
        await q.ack("c", got.column("offset").to_numpy())
        assert await asyncio.wait_for(big, 5) == (45, 10)
        assert await asyncio.wait_for(small, 5) == (55, 1)
        assert q.stats().blocked_producers == 0

    run(scenario, q)


def test_transient_messages_flow_to_disk_above_the_budget(tmp_path):
    q = core(tmp_path, durable=False, page_size_bytes=64 * KIB)

    async def scenario():
        q.set_budget(200 * KIB)  # read cache gets an eighth, transient messages the rest
        limit = q.log.memory_limit
        assert limit == 175 * KIB
        for i in range(10):
            await q.send_batch(batch_of(50, start=50 * i))
            assert q.log.transient_bytes <= limit
        s = q.stats()
        assert s.flowing_to_disk and s.messages_flowed_to_disk > 0
        assert s.segment_files > 0 and s.bytes_on_disk > 0
        files = [f for f in os.listdir(q.directory) if f.endswith(".seg")]
        assert len(files) == s.segment_files
        # a smaller budget flows existing transient messages too
        q.set_budget(40 * KIB)
        assert q.log.transient_bytes <= q.log.memory_limit
        assert await drain(q) == list(range(500))
        await q.send_batch(batch_of(1, start=500))  # makes the fully acked files go
        assert await drain(q) == [500]
        assert [f for f in os.listdir(q.directory) if f.endswith(".seg")] == []

    run(scenario, q)


def test_a_transient_queue_starts_empty_without_old_flowed_files(tmp_path):
    q = core(tmp_path, durable=False)

    async def fill():
        q.set_budget(0)
        await q.send_batch(batch_of(10))
        assert q.stats().segment_files == 1

    run(fill, q)
    again = core(tmp_path, durable=False)
    assert again.stats().depth == 0 and os.listdir(again.directory) == ["LOCK"]


def test_durable_budget_bounds_head_cache_and_read_cache(tmp_path):
    q = core(tmp_path, page_size_bytes=64 * KIB)

    async def scenario():
        for i in range(20):
            await q.send_batch(batch_of(50, start=50 * i))
        q.set_budget(100 * KIB)
        s = q.stats()
        assert s.head_cache_bytes <= 75 * KIB and s.memory_budget == 100 * KIB
        assert q.usage().index_bytes >= 1000  # one ack flag a message at least
        assert await drain(q) == list(range(1000))
        assert q.log.read_cache_used <= 25 * KIB + 60 * KIB  # at most one record over
        assert q.usage().memory_bytes <= 100 * KIB + 60 * KIB

    run(scenario, q)


def test_usage_reports_size_and_activity(tmp_path):
    q = core(tmp_path)

    async def scenario():
        await q.send_batch(batch_of(100))
        u = q.usage()
        assert u.active and 100 * KIB <= u.size_bytes <= 110 * KIB
        assert not q.usage().active  # nothing happened since
        await drain(q)
        assert q.usage().size_bytes == 0

    run(scenario, q)


@pytest.mark.parametrize("policy", ["FAIL", "DROP", "BLOCK"])
def test_policies_count_per_message_metadata(tmp_path, policy):
    """Tiny messages still fill the queue: 24 bytes of metadata each count."""
    q = core(tmp_path, max_size_bytes=24 * 100, address_full_policy=policy)

    async def scenario():
        empty = MessageBatch.from_bodies([b""] * 100, None, max_message_size=10, queue="q")
        assert (await q.send_batch(empty))[1] == 100
        assert q.stats().bytes_queued == pytest.approx(2400, rel=0.2)
        more = MessageBatch.from_bodies([b""] * 10, None, max_message_size=10, queue="q")
        if policy == "DROP":
            assert (await q.send_batch(more))[1] < 10
        else:
            with pytest.raises(AddressFull):
                await q.send_batch(more, timeout=0.05)
        assert np.all(q.log.is_acked(np.arange(100)) == 0)

    run(scenario, q)


def test_acknowledged_transient_records_free_their_memory(tmp_path):
    q = core(tmp_path, durable=False)

    async def scenario():
        for i in range(5):
            await q.send_batch(batch_of(100, start=100 * i))
        full = q.log.transient_bytes
        q.register_consumer("c", 1000)
        got = await q.fetch("c", 300, 1.0, 1000)
        await q.ack("c", got.column("offset").to_numpy())
        assert q.log.transient_bytes == pytest.approx(full * 2 / 5, rel=0.05)
        q.set_budget(0)  # the rest flows to disk; freed records are not written
        assert q.log.transient_bytes == 0 and q.log.segment_files == 1
        assert await drain(q) == list(range(300, 500))

    run(scenario, q)


def test_a_head_cache_refill_does_not_also_fill_the_read_cache(tmp_path):
    q = core(tmp_path)

    async def scenario():
        q.set_budget(0)  # nothing cached as it arrives: the messages are on disk only
        await q.send_batch(batch_of(200))
        assert q.head_cache.bytes == 0 and q.log.read_cache_used == 0
        q.set_budget(8 * 2**20)  # room again: housekeeping refills from the files
        return q.stats()

    stats = run(scenario, q)
    assert stats.head_cache_messages == 200
    assert stats.read_cache_bytes == 0  # so memory figures add up, nothing counted twice


def test_a_large_budget_caches_only_what_consumers_can_take_plus_the_margin(tmp_path):
    """The budget is an upper limit: with room for the whole backlog, the HeadQueueCache
    holds ``head_cache_bytes`` beyond its consumers' prefetch, grows when a consumer
    comes and shrinks back when it goes; nothing is lost to the smaller cache."""
    margin = 64 * KIB
    broker = BrokerConfig(paging_directory=str(tmp_path), head_cache_bytes=margin)
    q = QueueCore(QueueConfig("q", page_size_bytes=64 * KIB), broker)
    per_message = batch_of(1).nbytes  # the cache's own measure of a message

    async def scenario():
        q.set_budget(64 * 2**20)  # room for all 2,000 messages many times over
        for i in range(40):
            await q.send_batch(batch_of(50, start=50 * i))
        q.housekeeping()
        assert 0 < q.head_cache.bytes <= margin  # the margin only: no consumers
        assert q.head_cache.start == 0  # and it is the head
        q.register_consumer("c", 500)
        q.housekeeping()  # the bound follows the consumers (every tick, every round)
        bound = q.head_cache.max_bytes
        # 500 messages at the cache's average size (1 KiB bodies and their framing).
        assert margin + 500 * KIB <= bound <= margin + 500 * per_message * 1.05
        assert margin < q.head_cache.bytes <= bound
        q.close_consumer("c")
        q.housekeeping()
        assert q.head_cache.bytes <= margin
        return await drain(q, "d")

    assert run(scenario, q) == list(range(2000))


def test_a_reopened_queue_reads_only_the_margin_when_its_budget_comes(tmp_path):
    """Restart: a large budget arriving just after the open makes the queue read the
    head its first consumers need, not the whole backlog (it would block the event loop
    while the first consumer waits)."""
    margin = 64 * KIB
    broker = BrokerConfig(paging_directory=str(tmp_path), head_cache_bytes=margin)
    cfg = QueueConfig("q", page_size_bytes=64 * KIB)
    q = QueueCore(cfg, broker)

    async def fill():
        for i in range(40):
            await q.send_batch(batch_of(50, start=50 * i))

    run(fill, q)
    q = QueueCore(cfg, broker)

    async def reopened():
        q.set_budget(64 * 2**20)
        assert 0 < q.head_cache.bytes <= margin and q.head_cache.start == 0
        return await drain(q)

    assert run(reopened, q) == list(range(2000))
