"""Acks without Ray, against a Python ``set`` model (hypothesis): ``to_ranges`` (its
walk for a few offsets and its numpy path for many) and a segment log's acks across
segments, past the published end and before its first live offset, before and after
a restart."""

from __future__ import annotations

import tempfile

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from raymq.storage import SegmentLog
from raymq.storage.acklog import SMALL_RANGES, to_ranges
from tests.storage_helpers import commit


def model_ranges(offsets: list[int]) -> list[list[int]]:
    """The maximal [start, end) runs of the set of ``offsets``, ascending."""
    out: list[list[int]] = []
    for x in sorted(set(offsets)):
        if out and out[-1][1] == x:
            out[-1][1] = x + 1
        else:
            out.append([x, x + 1])
    return out


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 200), max_size=3 * SMALL_RANGES),
    st.sampled_from([np.int64, np.int32, np.uint64]),
)
def test_to_ranges_covers_exactly_the_offsets_given(offsets, dtype):
    got = to_ranges(np.array(offsets, dtype=dtype))
    assert got.dtype == np.int64 and got.shape == (len(model_ranges(offsets)), 2)
    assert got.tolist() == model_ranges(offsets)


def test_to_ranges_of_sorted_runs_on_both_sides_of_the_walk():
    for n in (1, SMALL_RANGES - 1, SMALL_RANGES, SMALL_RANGES + 1, 1000):
        runs = np.concatenate([np.arange(0, n), np.arange(n + 5, 2 * n + 5)])
        assert to_ranges(runs).tolist() == [[0, n], [n + 5, 2 * n + 5]]


#: A page holds one batch of 6 messages of 100 bytes: 60 messages in 10 segments.
PAGE = 1024
BODY = b"x" * 100


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(-5, 75), max_size=12), min_size=1, max_size=8))
def test_acks_in_one_or_many_segments_match_a_set_model(ack_calls):
    with tempfile.TemporaryDirectory() as d:
        log, _ = SegmentLog.open(d, queue="q", page_size_bytes=PAGE, durable=True)
        for _ in range(10):
            commit(log, [BODY] * 6)
        assert len(log.segments) == 10 and log.unacked(0, 100).tolist() == list(range(60))
        acked: set[int] = set()
        for offsets in ack_calls:
            fresh = log.ack(np.array(offsets, dtype=np.int64))
            new = {o for o in offsets if 0 <= o < 60} - acked
            assert fresh == len(new), offsets
            acked |= new
            commit(log)  # the acks' group commit
            assert log.depth == 60 - len(acked)
            assert log.unacked(0, 100).tolist() == sorted(set(range(60)) - acked)
        log.close()
        again, report = SegmentLog.open(d, queue="q", page_size_bytes=PAGE, durable=True)
        assert report.depth == 60 - len(acked)
        assert again.unacked(0, 100).tolist() == sorted(set(range(60)) - acked)
        again.close()
