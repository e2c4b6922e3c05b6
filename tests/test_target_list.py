"""TargetList without Ray: watermark and high watermark, the PendingCache, the
MemoryGovernor's budget, handing out in order and giving back what was never received."""

from __future__ import annotations

import numpy as np

from raymq.core.target_list import DirectEntry, TargetList


def entry(first: int, n: int, nbytes: int | None = None) -> DirectEntry:
    return DirectEntry(f"ref{first}", np.arange(first, first + n), nbytes or 100 * n)


def test_room_stops_at_the_high_watermark_in_messages_and_bytes():
    t = TargetList(high_watermark=10, high_watermark_bytes=1000, pending_cache_bytes=0)
    assert t.room() == 10
    t.loaded(entry(0, 6))
    assert (t.watermark, t.room()) == (6, 4)
    t.loaded(entry(6, 4))  # 1000 bytes: full by bytes and by messages
    assert t.room() == 0
    small = TargetList(high_watermark=10, high_watermark_bytes=1, pending_cache_bytes=0)
    assert small.room() == 10  # an empty TargetList may always load one batch
    small.loaded(entry(0, 2))
    assert small.room() == 0


def test_take_hands_out_in_order_across_entries():
    t = TargetList(100, 10**6, 0)
    t.loaded(entry(0, 3))
    t.loaded(entry(3, 3))
    assert t.take(2) == [("ref0", 0, 2)]
    assert t.take(3) == [("ref0", 2, 1), ("ref3", 0, 2)]
    assert t.take(10) == [("ref3", 2, 1)]
    assert t.take(1) == [] and t.stats()["handed_out"] == 6


def test_a_lower_high_watermark_moves_entries_to_the_pending_cache_then_gives_back():
    t = TargetList(high_watermark=10, high_watermark_bytes=10**6, pending_cache_bytes=300)
    for first in (0, 3, 6):
        t.loaded(entry(first, 3))  # 300 bytes each
    t.take(1)  # offset 0 handed out: it is the application's now
    given_back = t.set_high_watermark(3, 10**6)
    # Newest entries leave the direct references first (6..8, then 3..5); the
    # PendingCache keeps the oldest that fit (3..5) and the rest goes back.
    assert t.watermark == 2 and t.pending_messages == 3
    assert given_back.tolist() == [6, 7, 8]
    assert t.drain().tolist() == [1, 2, 3, 4, 5]


def test_pending_cache_entries_come_back_first():
    t = TargetList(high_watermark=3, high_watermark_bytes=10**6, pending_cache_bytes=10**6)
    t.loaded(entry(0, 3))
    t.set_high_watermark(0, 10**6)  # all of it to the PendingCache
    assert (t.watermark, t.pending_messages, t.room()) == (0, 3, 0)
    t.set_high_watermark(3, 10**6)
    assert t.load_from_pending() and t.watermark == 3 and t.stats()["pending_cache_hits"] == 1


def test_the_governors_budget_lowers_the_limits_and_settings_stay_upper_bounds():
    t = TargetList(high_watermark=100, high_watermark_bytes=10_000, pending_cache_bytes=500)
    for first in range(0, 50, 10):
        t.loaded(entry(first, 10, nbytes=1000))
    released = t.set_budget(direct_bytes=2000, pending_bytes=10**9)
    assert t.high_watermark_bytes == 2000 and t.direct_bytes <= 2000
    assert t.pending_cache_bytes == 500  # the consumer's own setting still caps it
    assert t.pending_bytes <= 500
    held = t.watermark + t.pending_messages + len(released)
    assert held == 50  # nothing lost: kept, cached or given back
    assert t.usage()["want_direct_bytes"] <= 10_000


def test_drain_returns_everything_not_handed_out():
    t = TargetList(100, 10**6, 10**6)
    t.loaded(entry(0, 5))
    t.loaded(entry(5, 5))
    t.take(3)
    t.set_high_watermark(2, 10**6)
    assert sorted(t.drain().tolist()) == list(range(3, 10))
    assert t.watermark == 0 and t.pending_messages == 0
