"""AckRanges, the range-compressed set of acked offsets, without Ray: every operation
against a Python ``set`` model (hypothesis), then explicit cases and one at scale."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raymq.storage.ack_ranges import AckRanges

#: Far-apart bases: offsets near them collide with each other but not with 0..300.
LARGE_BASES = (10**9, 2**40, 2**62)

offsets_st = st.one_of(
    st.integers(0, 300),
    st.builds(lambda base, delta: base + delta, st.sampled_from(LARGE_BASES), st.integers(0, 30)),
)
# A query window: its end may lie far beyond every offset (and beyond int64).
query_st = st.tuples(
    offsets_st,
    st.one_of(st.integers(-5, 400), st.just(2**62), st.just(2**64)),
    st.integers(0, 40),
)
add_st = st.tuples(st.just("add"), st.lists(offsets_st, max_size=15), query_st)
ranges_st = st.tuples(
    st.just("add_ranges"),
    st.lists(st.tuples(offsets_st, st.integers(-3, 25)), max_size=6),
    query_st,
)
ops_st = st.lists(st.one_of(add_st, ranges_st), max_size=25)

#: Offsets checked with contains(): all the small ones and those around each base.
PROBES = np.array(
    sorted(set(range(0, 330)) | {b + d for b in LARGE_BASES for d in range(-2, 40)}),
    dtype=np.int64,
)


def model_runs(model: set[int], start: int = 0, end: int | None = None) -> list[list[int]]:
    """The model's offsets in [start, end) as maximal [start, end) runs."""
    runs: list[list[int]] = []
    for x in sorted(x for x in model if x >= start and (end is None or x < end)):
        if runs and runs[-1][1] == x:
            runs[-1][1] = x + 1
        else:
            runs.append([x, x + 1])
    return runs


def model_gaps(model: set[int], start: int, end: int, limit: int) -> list[int]:
    """Offsets of [start, end) not in the model, at most ``limit``: walks at most
    ``limit + len(model)`` offsets, so huge windows are fine."""
    out, x = [], start
    while x < end and len(out) < limit:
        if x not in model:
            out.append(x)
        x += 1
    return out


def model_first_gap(model: set[int], start: int) -> int:
    while start in model:
        start += 1
    return start


def check_invariants(acks: AckRanges, model: set[int]) -> None:
    starts, ends = acks.starts, acks.ends
    assert starts.dtype == np.int64 and ends.dtype == np.int64
    assert starts.ndim == 1 and starts.shape == ends.shape
    assert (starts < ends).all()  # non-empty
    assert (ends[:-1] < starts[1:]).all()  # sorted, disjoint and non-adjacent
    if len(starts):
        assert starts[0] >= 0
    assert isinstance(len(acks), int)
    assert len(acks) == len(model) == int((ends - starts).sum())
    assert acks.interval_count == len(starts)
    assert acks.nbytes == 16 * len(starts)


def check_against_model(acks: AckRanges, model: set[int]) -> None:
    check_invariants(acks, model)
    whole = acks.ranges()
    assert whole.dtype == np.int64 and whole.shape == (len(acks.starts), 2)
    assert whole.tolist() == model_runs(model)
    expected = np.array([int(p) in model for p in PROBES], dtype=bool)
    assert np.array_equal(acks.contains(PROBES), expected)
    # A checkpoint round trip, and the same set built another way, compare equal.
    data = acks.to_bytes()
    assert len(data) == 16 * acks.interval_count
    again = AckRanges.from_bytes(data)
    assert again == acks and len(again) == len(acks)
    assert AckRanges.from_ranges(whole) == acks


def check_queries(acks: AckRanges, model: set[int], query: tuple[int, int, int]) -> None:
    start, width, limit = query
    end = start + width
    gaps = acks.gaps(start, end, limit)
    assert gaps.dtype == np.int64
    assert gaps.tolist() == model_gaps(model, start, end, limit)
    assert acks.first_gap(start) == model_first_gap(model, start)
    assert acks.count_in(start, end) == sum(1 for x in model if start <= x < end)
    clipped = acks.ranges(start, end)
    assert clipped.dtype == np.int64 and clipped.shape[1:] == (2,)
    assert clipped.tolist() == model_runs(model, start, end)
    assert acks.ranges(start).tolist() == model_runs(model, start)


@settings(max_examples=300, deadline=None)
@given(ops_st)
def test_matches_set_model(ops):
    acks, model = AckRanges(), set()
    check_against_model(acks, model)
    for kind, arg, query in ops:
        if kind == "add":
            fresh = acks.add(np.array(arg, dtype=np.int64))
            assert fresh.dtype == np.int64
            assert fresh.tolist() == sorted(set(arg) - model)
            model |= set(arg)
        else:
            pairs = [(s, max(0, s + n)) for s, n in arg]
            new = {x for s, e in pairs for x in range(s, e)}
            ranges = np.array(pairs, dtype=np.int64).reshape(-1, 2)
            assert acks.add_ranges(ranges) == len(new - model)
            model |= new
        check_against_model(acks, model)
        check_queries(acks, model, query)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(offsets_st, st.integers(-3, 25)), max_size=12),
    st.randoms(use_true_random=False),
)
def test_from_ranges_any_order_and_equality(pairs, rnd):
    pairs = [(s, max(0, s + n)) for s, n in pairs]
    model = {x for s, e in pairs for x in range(s, e)}
    acks = AckRanges.from_ranges(np.array(pairs, dtype=np.int64).reshape(-1, 2))
    check_against_model(acks, model)
    # The same offsets one by one, shuffled, in two batches: the same set.
    offsets = sorted(model)
    rnd.shuffle(offsets)
    other = AckRanges()
    other.add(np.array(offsets[: len(offsets) // 2], dtype=np.int64))
    other.add(np.array(offsets[len(offsets) // 2 :], dtype=np.int64))
    assert other == acks
    # One more offset makes them differ.
    extra = model_first_gap(model, 0)
    other.add(np.array([extra], dtype=np.int64))
    assert other != acks


def test_empty_set():
    acks = AckRanges()
    assert len(acks) == 0 and not acks
    assert acks.interval_count == 0 and acks.nbytes == 0
    assert acks.contains(np.array([0, 5, 2**62], dtype=np.int64)).tolist() == [False] * 3
    assert acks.gaps(3, 8, 10).tolist() == [3, 4, 5, 6, 7]
    assert acks.gaps(3, 8, 2).tolist() == [3, 4]
    assert acks.gaps(8, 3, 10).tolist() == []
    assert acks.first_gap(7) == 7
    assert acks.count_in(0, 2**62) == 0
    assert acks.ranges().shape == (0, 2) and acks.ranges().dtype == np.int64
    assert acks.to_bytes() == b""
    assert AckRanges.from_bytes(b"") == acks
    fresh = acks.add(np.array([], dtype=np.int64))
    assert fresh.dtype == np.int64 and len(fresh) == 0
    assert acks.add_ranges(np.zeros((0, 2), dtype=np.int64)) == 0
    assert acks.add_ranges(np.array([[5, 5], [9, 2]], dtype=np.int64)) == 0  # empty ranges
    assert acks == AckRanges() and len(acks) == 0


def test_adjacent_ranges_merge_into_one():
    acks = AckRanges.from_ranges(np.array([[10, 15], [0, 5]], dtype=np.int64))
    assert acks.ranges().tolist() == [[0, 5], [10, 15]]
    assert acks.add_ranges(np.array([[5, 10]], dtype=np.int64)) == 5
    assert acks.ranges().tolist() == [[0, 15]]
    assert acks.add(np.array([15, 16, 14], dtype=np.int64)).tolist() == [15, 16]
    assert acks.ranges().tolist() == [[0, 17]] and len(acks) == 17
    # Adjacent, overlapping and duplicate ranges within one call.
    one = AckRanges.from_ranges(np.array([[4, 9], [3, 4], [0, 3], [2, 6], [9, 9]]))
    assert one.ranges().tolist() == [[0, 9]] and len(one) == 9
    assert one.first_gap(0) == 9 and one.first_gap(9) == 9


def test_equality_compares_offsets():
    one = AckRanges.from_ranges(np.array([[0, 2]], dtype=np.int64))
    assert one == AckRanges.from_ranges(np.array([[1, 2], [0, 1]], dtype=np.int64))
    assert one != AckRanges.from_ranges(np.array([[1, 3]], dtype=np.int64))  # same size
    assert one != AckRanges.from_ranges(np.array([[0, 1], [2, 3]], dtype=np.int64))
    assert one != [[0, 2]]
    # Same size and same interval ends, different starts.
    two = AckRanges.from_ranges(np.array([[0, 2], [5, 6]], dtype=np.int64))
    assert two != AckRanges.from_ranges(np.array([[1, 2], [4, 6]], dtype=np.int64))
    assert two != AckRanges.from_ranges(np.array([[0, 1], [5, 7]], dtype=np.int64))


def test_add_returns_only_new_offsets():
    acks = AckRanges()
    assert acks.add(np.array([3, 3, 1, 2], dtype=np.int64)).tolist() == [1, 2, 3]
    assert acks.add(np.array([2, 5, 5, 1], dtype=np.int64)).tolist() == [5]
    assert acks.add(np.array([5, 3], dtype=np.int64)).tolist() == []
    # Sorted with duplicates, then strictly ascending (the path that skips np.unique).
    assert acks.add(np.array([7, 8, 8, 9], dtype=np.int64)).tolist() == [7, 8, 9]
    assert acks.add(np.array([6, 9, 10], dtype=np.int64)).tolist() == [6, 10]
    assert acks.ranges().tolist() == [[1, 4], [5, 11]] and len(acks) == 9


def test_huge_range_queries_cost_nothing_per_offset():
    # Four offsets missing out of 10**12: any query that walked offsets would not finish,
    # and one that materialised the window (2**62 offsets) could not allocate it.
    half = 5 * 10**11
    acks = AckRanges.from_ranges(np.array([[half + 3, 10**12], [0, half]], dtype=np.int64))
    assert len(acks) == 10**12 - 3
    assert acks.nbytes == 32
    expected = [half, half + 1, half + 2] + list(range(10**12, 10**12 + 7))
    assert acks.gaps(0, 2**62, 10).tolist() == expected
    assert acks.gaps(0, 10**12, 2**70).tolist() == [half, half + 1, half + 2]
    assert acks.gaps(1, half - 1, 10**15).tolist() == []
    assert acks.first_gap(0) == half
    assert acks.first_gap(half + 3) == 10**12
    assert acks.count_in(0, 2**62) == 10**12 - 3
    assert acks.count_in(half - 10, half + 10) == 17
    assert acks.ranges(half - 1, half + 5).tolist() == [[half - 1, half], [half + 3, half + 5]]
    probes = np.array([0, half - 1, half, half + 2, half + 3, 10**12 - 1, 10**12])
    assert acks.contains(probes).tolist() == [True, True, False, False, True, True, False]
    # Filling the gap with a single offset each time keeps it one or two intervals.
    assert acks.add(np.array([half + 1], dtype=np.int64)).tolist() == [half + 1]
    assert acks.interval_count == 3
    assert acks.add_ranges(np.array([[half - 5, half + 4]], dtype=np.int64)) == 2
    assert acks.ranges().tolist() == [[0, 10**12]] and len(acks) == 10**12


BAD_CALLS = {
    "add": lambda a: a.add(np.array([4, -1, 7], dtype=np.int64)),
    "add_ranges": lambda a: a.add_ranges(np.array([[3, 9], [-5, 2]], dtype=np.int64)),
    "from_ranges": lambda a: AckRanges.from_ranges(np.array([[-6, 2]], dtype=np.int64)),
    "contains": lambda a: a.contains(np.array([1, -2], dtype=np.int64)),
    "gaps": lambda a: a.gaps(-3, 10, 5),
    "first_gap": lambda a: a.first_gap(-4),
    "count_in": lambda a: a.count_in(-7, 10),
    "ranges": lambda a: a.ranges(-8),
}
BAD_VALUES = {
    "add": "-1",
    "add_ranges": "-5",
    "from_ranges": "-6",
    "contains": "-2",
    "gaps": "-3",
    "first_gap": "-4",
    "count_in": "-7",
    "ranges": "-8",
}


@pytest.mark.parametrize("call", sorted(BAD_CALLS))
def test_negative_offsets_are_a_value_error(call):
    acks = AckRanges.from_ranges(np.array([[0, 3]], dtype=np.int64))
    with pytest.raises(ValueError, match=BAD_VALUES[call]):
        BAD_CALLS[call](acks)
    # Nothing was added by the failed call.
    assert acks.ranges().tolist() == [[0, 3]] and len(acks) == 3


def test_other_bad_input():
    acks = AckRanges()
    with pytest.raises(TypeError):
        acks.add(np.array([1.5]))
    with pytest.raises(ValueError, match="shape"):
        acks.add_ranges(np.array([1, 2, 3], dtype=np.int64))
    with pytest.raises(ValueError, match="limit"):
        acks.gaps(0, 10, -1)
    assert len(acks) == 0
    # The arrays are read-only views: the set cannot be changed behind its counter.
    acks.add(np.array([1, 2], dtype=np.int64))
    with pytest.raises(ValueError):
        acks.starts[0] = 0


def test_to_bytes_layout_and_bad_bytes():
    acks = AckRanges.from_ranges(np.array([[7, 9], [1, 3]], dtype=np.int64))
    assert acks.to_bytes() == struct.pack("<4q", 1, 3, 7, 9)
    with pytest.raises(ValueError, match="bytes"):
        AckRanges.from_bytes(b"\0" * 24)
    for bad in ([5, 3], [1, 3, 3, 9], [1, 5, 4, 9], [7, 9, 1, 3], [-1, 3]):
        with pytest.raises(ValueError):
            AckRanges.from_bytes(struct.pack(f"<{len(bad)}q", *bad))


def dense_ranges(dense: np.ndarray) -> list[list[int]]:
    """The [start, end) runs of True in a bool array."""
    edges = np.diff(np.concatenate(([0], dense.astype(np.int8), [0])))
    return np.stack([np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)], axis=1).tolist()


def test_100k_intervals_then_1000_more_in_the_middle():
    size = 200_002
    dense = np.zeros(size, dtype=bool)
    acks = AckRanges()
    evens = np.arange(0, 200_000, 2, dtype=np.int64)
    assert np.array_equal(acks.add(evens), evens)
    dense[evens] = True
    assert acks.interval_count == 100_000 and len(acks) == 100_000
    assert acks.nbytes == 100_000 * 16

    # 1,000 odd offsets in the middle, shuffled among evens already acked: each odd one
    # joins its two neighbours into one interval.
    odds = np.arange(99_001, 101_001, 2, dtype=np.int64)
    batch = np.concatenate((odds, np.arange(99_000, 101_000, 4, dtype=np.int64)))
    np.random.default_rng(7).shuffle(batch)
    assert np.array_equal(acks.add(batch), odds)
    dense[odds] = True
    assert acks.interval_count == 99_000 and len(acks) == 101_000
    check_dense(acks, dense)

    # Ranges spread over the array, and one that only widens the last interval.
    spread = np.array([[150_001, 150_050], [10_003, 10_004], [199_999, 200_000]])
    expected_new = int((~dense[150_001:150_050]).sum() + 1 + 1)
    assert acks.add_ranges(spread) == expected_new
    dense[150_001:150_050] = dense[10_003] = dense[199_999] = True
    check_dense(acks, dense)
    # Widening the last interval alone changes the arrays in place.
    assert acks.add(np.array([200_000], dtype=np.int64)).tolist() == [200_000]
    dense[200_000] = True
    check_dense(acks, dense)


def check_dense(acks: AckRanges, dense: np.ndarray) -> None:
    assert len(acks) == int(dense.sum())
    assert acks.ranges().tolist() == dense_ranges(dense)
    assert np.array_equal(acks.contains(np.arange(len(dense), dtype=np.int64)), dense)
    for start, end in ((98_990, 101_020), (0, len(dense)), (150_000, 150_060)):
        expected = np.flatnonzero(~dense[start:end])[:100] + start
        assert np.array_equal(acks.gaps(start, end, 100), expected)
        assert acks.count_in(start, end) == int(dense[start:end].sum())
        assert acks.first_gap(start) == int(expected[0])
