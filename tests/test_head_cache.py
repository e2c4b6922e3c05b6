"""The HeadQueueCache on its own (no Ray, no files): its window over the subscriptions'
heads, appends, trims, refills, and the shared parts it hands out."""

from __future__ import annotations

import dataclasses

from raymq.batch import MessageBatch
from raymq.core.head_cache import HeadQueueCache

BODY = b"x" * 100


def batch(first: int, n: int) -> MessageBatch:
    b = MessageBatch.from_bodies([BODY] * n, max_message_size=2**20)
    return dataclasses.replace(b, first_offset=first)


def log_of(*batches: MessageBatch):
    """A ``read(start, end)`` over the given batches: exactly [start, end), gaps
    skipped, as ``SegmentLog.read`` slices its records."""

    def read(start: int, end: int) -> list[MessageBatch]:
        out = []
        for b in batches:
            lo, hi = max(start, b.first_offset), min(end, b.end_offset)
            if hi > lo:
                out.append(b.slice(lo - b.first_offset, hi - b.first_offset))
        return out

    return read


def test_the_window_follows_the_leading_subscriptions():
    cache = HeadQueueCache(max_bytes=10_000)
    # 100 bytes a message: the cache reaches 100 messages.
    assert cache.window_start([500, 480, 450], 100.0) == 450  # all within reach
    assert cache.window_start([500, 480, 0], 100.0) == 480  # a stopped one is left out
    assert cache.window_start([], 100.0) is None
    # A batch to add counts as the lead when the leaders keep up with it.
    assert cache.window_start([500, 420], 100.0, newest=510) == 420
    assert cache.window_start([500, 420], 100.0, newest=560) == 500


def test_append_continues_the_range_until_full_then_a_refill_catches_up():
    b0, b1, b2 = batch(0, 40), batch(40, 40), batch(80, 40)
    size = b0.nbytes
    cache = HeadQueueCache(max_bytes=2 * size)
    assert cache.append(b0) and cache.append(b1)
    assert not cache.append(b2) and cache.behind  # full: the log has more
    assert (cache.start, cache.end, cache.messages, cache.bytes) == (0, 80, 80, 2 * size)
    cache.trim(40)  # batch 0 delivered by everyone in the window
    assert (cache.start, cache.end) == (40, 80)
    assert not cache.append(batch(120, 40))  # not contiguous: the refill reads 80.. first
    cache.refill(log_of(b0, b1, b2), 40, 120)
    assert (cache.start, cache.end, cache.behind) == (40, 120, False)


def test_an_empty_cache_that_fell_behind_restarts_only_where_the_window_starts():
    cache = HeadQueueCache(max_bytes=10**6)
    cache.behind = True
    assert not cache.append(batch(100, 10), window_start=50)  # 50..100 must be read first
    assert cache.append(batch(100, 10), window_start=100)
    assert (cache.start, cache.end, cache.behind) == (100, 110, False)


def test_refill_until_stops_at_the_need_not_the_budget():
    batches = [batch(k * 10, 10) for k in range(1000)]
    cache = HeadQueueCache(max_bytes=10**9)
    cache.refill(log_of(*batches), 0, 10_000, until=25)  # one read step (4096 offsets)
    assert cache.start == 0 and 25 <= cache.end <= 4100 and cache.behind
    cache.refill(log_of(*batches), 0, 10_000)
    assert (cache.end, cache.behind) == (10_000, False)


def test_a_refill_steps_over_a_gap_only_if_nobody_will_ask_for_it():
    read = log_of(batch(0, 10), batch(20, 10))  # 10..20: a deleted segment, say
    cache = HeadQueueCache(max_bytes=10**6)
    cache.refill(read, 0, 30, gap_ok=lambda a, b: False)
    assert (cache.start, cache.end, cache.behind) == (0, 10, True)
    cache.refill(read, 0, 30, gap_ok=lambda a, b: (a, b) == (10, 20))
    assert (cache.start, cache.end, cache.behind, cache.messages) == (0, 30, False, 20)
    assert [b.first_offset for b in cache.get(5, 25)] == [5, 20]
    assert cache.shared(5, 25) is None  # not one run of rows: made for the delivery
    assert [(p.first_row, p.rows) for p in cache.shared(20, 25)] == [(0, 5)]


def test_shared_parts_are_made_once_per_batch_and_cover_exactly_the_range():
    made = []

    def share(arrow):
        made.append(arrow)
        return len(made)  # a reference: which object

    cache = HeadQueueCache(max_bytes=10**6, share=share)
    for k in range(3):
        cache.append(batch(k * 10, 10))
    parts = cache.shared(5, 25)
    assert [(p.ref, p.first_row, p.rows) for p in parts] == [(1, 5, 5), (2, 0, 10), (3, 0, 5)]
    again = cache.shared(0, 30)
    assert [p.ref for p in again] == [1, 2, 3] and len(made) == cache.shared_batches == 3
    rows = [o for p in again for o in p.arrow.slice(p.first_row, p.rows).column(0).to_pylist()]
    assert rows == list(range(30))
    assert cache.shared(25, 31) is None and cache.shared(-1, 3) is None


def test_many_small_batches_are_found_and_dropped_in_order():
    cache = HeadQueueCache(max_bytes=10**9)
    for k in range(1000):
        cache.append(batch(k, 1))
    cache.trim(700)  # compacts the lists behind the scenes
    assert (len(cache), cache.start, cache.messages) == (300, 700, 300)
    got = cache.get(850, 853)
    assert [b.first_offset for b in got] == [850, 851, 852]
    cache.resize(100 * cache.bytes // 300)  # the newest go first
    assert (cache.start, cache.end, cache.behind) == (700, 800, True)


def test_a_refill_step_reads_about_step_bytes_and_the_next_call_goes_on():
    batches = [batch(40 * i, 40) for i in range(10)]
    size = batches[0].nbytes
    cache = HeadQueueCache(max_bytes=11 * size)  # all of it, slices' overhead included
    read = log_of(*batches)
    # About a step: reads are sized by the average message, so within one message.
    cache.refill(read, 0, 400, step_bytes=3 * size)
    first = cache.bytes
    assert cache.start == 0 and cache.behind and 2 * size < first <= 3 * size
    cache.refill(read, 0, 400, step_bytes=3 * size)  # goes on where it stopped
    assert cache.start == 0 and cache.behind and first + 2 * size < cache.bytes <= 6 * size
    cache.refill(read, 0, 400)  # no step: up to the budget, here the log's end
    assert (cache.start, cache.end, cache.behind) == (0, 400, False)
