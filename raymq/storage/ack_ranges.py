"""A set of acknowledged offsets, stored as ranges: one subscription's ack state.

Pulsar keeps a subscription's acknowledgements as a mark-delete position plus its
"individually deleted message ranges": the acked messages above the mark, as disjoint
ranges. ``AckRanges`` is that set of ranges for one subscription of a message address:
sorted, disjoint, non-adjacent half-open intervals ``[start, end)`` of offsets, kept in
two int64 numpy arrays. A subscription that keeps up acks in order and holds one or a
few intervals; competing consumers that ack out of order leave gaps, one interval per
run of acked offsets between them. Memory is 16 bytes per interval, whatever the number
of offsets, so ``[0, 10**12)`` costs as little as ``[0, 1)``.

Adding offsets merges them with the intervals they overlap or touch: those are found
with ``searchsorted`` and only they are rewritten, so a small batch added to a set of
100,000 intervals costs a binary search per new range and one splice of the arrays.

Plain numpy, no Ray (the storage package runs without it). All positions are offsets.
"""

from __future__ import annotations

import operator

import numpy as np

_INT64_MAX = int(np.iinfo(np.int64).max)
#: Bytes per interval in ``to_bytes``: two little-endian int64.
INTERVAL_BYTES = 16


def _empty() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


def _as_int64(values: np.ndarray, what: str) -> np.ndarray:
    """``values`` as an int64 array; integer dtypes only, no negative values."""
    a = np.asarray(values)
    if a.size == 0:
        return np.zeros(a.shape, dtype=np.int64)  # np.array([]) is float64: allow it
    if a.dtype.kind not in "iu":
        raise TypeError(f"{what} must be integers, got dtype {a.dtype}")
    if a.dtype.kind == "u" and a.max() > _INT64_MAX:
        raise ValueError(f"{what} must fit in int64, got {int(a.max())}")
    a = a.astype(np.int64, copy=False)
    low = int(a.min())
    if low < 0:
        raise ValueError(f"{what} must be non-negative, got {low}")
    return a


def _as_end(value: int) -> int:
    """An exclusive end argument as a Python int, capped to int64 (no offset is beyond)."""
    return min(operator.index(value), _INT64_MAX)


def _as_offset(value: int, what: str) -> int:
    """A scalar offset argument as a Python int, rejecting negatives."""
    v = operator.index(value)  # no floats: 1.5 is not an offset
    if v < 0:
        raise ValueError(f"{what} must be non-negative, got {v}")
    return v


def _as_ranges(ranges: np.ndarray) -> np.ndarray:
    """A (k, 2) int64 array of ranges, validated."""
    r = _as_int64(ranges, "range bounds")
    if r.size == 0:
        return np.zeros((0, 2), dtype=np.int64)
    if r.ndim != 2 or r.shape[1] != 2:
        raise ValueError(f"ranges must be a (k, 2) array, got shape {r.shape}")
    return r


def _merge(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union of non-empty intervals (any order, overlaps allowed) as canonical intervals."""
    if len(starts) == 0:
        return _empty(), _empty()
    if len(starts) > 1 and not (starts[1:] >= starts[:-1]).all():
        order = np.argsort(starts, kind="stable")
        starts, ends = starts[order], ends[order]
    reach = np.maximum.accumulate(ends)
    # A new interval begins where a start lies beyond everything before it; equal means
    # adjacent, which merges too.
    begins = np.flatnonzero(starts[1:] > reach[:-1]) + 1
    first = np.concatenate(([0], begins))
    last = np.concatenate((begins - 1, [len(starts) - 1]))
    return starts[first].copy(), reach[last].copy()


def _runs(sorted_unique: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique offsets as the starts and ends of their runs of consecutive values."""
    if len(sorted_unique) == 0:
        return _empty(), _empty()
    breaks = np.flatnonzero(np.diff(sorted_unique) != 1) + 1
    starts = np.concatenate((sorted_unique[:1], sorted_unique[breaks]))
    ends = np.concatenate((sorted_unique[breaks - 1], sorted_unique[-1:])) + 1
    return starts, ends


def _expand(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Every offset of the given disjoint, ascending, non-empty intervals, ascending."""
    lengths = ends - starts
    total = int(lengths.sum())
    if total == 0:
        return _empty()
    # Offset i of the output belongs to interval j: start_j + (i - first output index of j).
    firsts = np.cumsum(lengths) - lengths
    return np.repeat(starts - firsts, lengths) + np.arange(total, dtype=np.int64)


class AckRanges:
    """A set of non-negative int64 offsets, range-compressed (see the module docstring).

    Invariants: ``starts`` and ``ends`` are int64 arrays of equal length with
    ``starts[i] < ends[i] < starts[i + 1]`` (sorted, disjoint, non-adjacent), and the
    set's size is kept in a counter.
    """

    __slots__ = ("_count", "_ends", "_starts")

    def __init__(self) -> None:
        """An empty set."""
        self._starts = _empty()  # interval starts (inclusive), ascending
        self._ends = _empty()  # interval ends (exclusive), ascending
        self._count = 0

    @property
    def starts(self) -> np.ndarray:
        """Interval starts, ascending: a read-only view, valid until the next add."""
        view = self._starts.view()
        view.flags.writeable = False
        return view

    @property
    def ends(self) -> np.ndarray:
        """Interval ends (exclusive), ascending: a read-only view, valid until the next add."""
        view = self._ends.view()
        view.flags.writeable = False
        return view

    # -- construction -----------------------------------------------------------------

    @classmethod
    def from_ranges(cls, ranges: np.ndarray) -> AckRanges:
        """The set covering ``ranges``: a (k, 2) int64 array of [start, end) offsets.

        Any order; overlapping, adjacent and empty ranges are allowed.
        """
        result = cls()
        result.add_ranges(ranges)
        return result

    @classmethod
    def from_bytes(cls, data: bytes) -> AckRanges:
        """The set written by ``to_bytes``; raises ValueError if ``data`` is not one."""
        if len(data) % INTERVAL_BYTES:
            raise ValueError(f"ack ranges are {INTERVAL_BYTES}-byte pairs, got {len(data)} bytes")
        pairs = np.frombuffer(data, dtype="<i8").reshape(-1, 2)
        starts = pairs[:, 0].astype(np.int64)  # copies: frombuffer's view is read-only
        ends = pairs[:, 1].astype(np.int64)
        if len(starts) and (
            starts[0] < 0 or not (starts < ends).all() or not (ends[:-1] < starts[1:]).all()
        ):
            raise ValueError("ack ranges are not sorted, disjoint, non-adjacent intervals")
        result = cls()
        result._starts, result._ends = starts, ends
        result._count = int((ends - starts).sum())
        return result

    def to_bytes(self) -> bytes:
        """The intervals as little-endian int64 (start, end) pairs, for a checkpoint."""
        return np.stack([self._starts, self._ends], axis=1).astype("<i8", copy=False).tobytes()

    # -- size -------------------------------------------------------------------------

    def __len__(self) -> int:
        """The number of offsets in the set."""
        return self._count

    @property
    def interval_count(self) -> int:
        """The number of intervals the set is stored as."""
        return len(self._starts)

    @property
    def nbytes(self) -> int:
        """Bytes held by the interval arrays (16 per interval)."""
        return int(self._starts.nbytes + self._ends.nbytes)

    # -- adding -----------------------------------------------------------------------

    def add(self, offsets: np.ndarray) -> np.ndarray:
        """Add ``offsets`` (int64, any order, duplicates allowed).

        Returns the offsets that were not in the set before: sorted, unique, int64.
        """
        o = _as_int64(offsets, "offsets").ravel()
        if len(o) == 0:
            return _empty()
        if int(o.max()) == _INT64_MAX:
            raise ValueError(f"offsets must be below {_INT64_MAX}, got {_INT64_MAX}")
        if len(o) > 1 and not (o[1:] > o[:-1]).all():  # acks often come sorted: skip
            o = np.unique(o)
        fresh = o[~self.contains(o)]
        self._insert(*_runs(fresh))
        return fresh

    def add_ranges(self, ranges: np.ndarray) -> int:
        """Add [start, end) ranges: a (k, 2) int64 array, any order, empty ranges ignored.

        Returns how many offsets were newly added.
        """
        r = _as_ranges(ranges)
        r = r[r[:, 1] > r[:, 0]]
        return self._insert(*_merge(r[:, 0], r[:, 1]))

    def _insert(self, new_starts: np.ndarray, new_ends: np.ndarray) -> int:
        """Union with canonical intervals ``new_*``; returns how many offsets were new."""
        if len(new_starts) == 0:
            return 0
        starts, ends = self._starts, self._ends
        # Window of existing intervals each new one overlaps or touches: [lo, hi).
        lo = np.searchsorted(ends, new_starts, side="left")  # first with end >= start
        hi = np.searchsorted(starts, new_ends, side="right")  # first with start > end
        hit = hi > lo
        last = np.maximum(hi - 1, 0)
        if len(starts):
            safe_lo = np.minimum(lo, len(starts) - 1)
            merged_starts = np.where(hit, np.minimum(new_starts, starts[safe_lo]), new_starts)
            merged_ends = np.where(hit, np.maximum(new_ends, ends[last]), new_ends)
        else:
            merged_starts, merged_ends = new_starts, new_ends
        # Two new intervals that reach the same existing one now overlap: group them.
        # Each group replaces the existing intervals [lo of its first, hi of its last).
        begins = np.flatnonzero(merged_starts[1:] > merged_ends[:-1]) + 1
        first = np.concatenate(([0], begins))
        final = np.concatenate((begins - 1, [len(merged_starts) - 1]))
        group_starts = merged_starts[first]
        group_ends = merged_ends[final]
        group_lo, group_hi = lo[first], hi[final]

        # Existing intervals the groups replace: every index of each [lo, hi) window.
        replaced = _expand(group_lo, group_hi)
        removed = int((ends[replaced] - starts[replaced]).sum())
        added = int((group_ends - group_starts).sum()) - removed
        if ((group_hi - group_lo) == 1).all():
            # Each group widens exactly one interval: rewrite it in place, no splice.
            starts[group_lo] = group_starts
            ends[group_lo] = group_ends
        else:
            # Splice: the kept slices between windows, each group in place of its window;
            # one concatenate copies each array once (np.delete + np.insert took 30x longer).
            kept_starts, kept_ends, after = [], [], 0
            windows = np.stack([group_lo, group_hi], axis=1).tolist()
            for g, (g_lo, g_hi) in enumerate(windows):
                kept_starts += (starts[after:g_lo], group_starts[g : g + 1])
                kept_ends += (ends[after:g_lo], group_ends[g : g + 1])
                after = g_hi
            self._starts = np.concatenate([*kept_starts, starts[after:]])
            self._ends = np.concatenate([*kept_ends, ends[after:]])
        self._count += added
        return added

    # -- queries ----------------------------------------------------------------------

    def contains(self, offsets: np.ndarray) -> np.ndarray:
        """A bool mask: which of ``offsets`` are in the set (same shape as ``offsets``)."""
        o = _as_int64(offsets, "offsets")
        if len(self._starts) == 0:
            return np.zeros(o.shape, dtype=bool)
        # The interval that could hold each offset: the last one starting at or before it.
        i = np.searchsorted(self._starts, o, side="right") - 1
        return (i >= 0) & (o < self._ends[np.maximum(i, 0)])

    def first_gap(self, start: int) -> int:
        """The smallest offset >= ``start`` not in the set; costs O(log k)."""
        start = _as_offset(start, "start")
        i = int(np.searchsorted(self._starts, start, side="right")) - 1
        if i >= 0 and start < self._ends[i]:
            return int(self._ends[i])  # non-adjacent intervals: an end is never in the set
        return start

    def gaps(self, start: int, end: int, limit: int) -> np.ndarray:
        """Offsets of [start, end) not in the set: ascending, at most ``limit``, int64.

        Costs O(log k + intervals visited + limit) however wide [start, end) is.
        """
        start = _as_offset(start, "start")
        end = _as_end(end)
        limit = operator.index(limit)
        if limit < 0:
            raise ValueError(f"limit must be non-negative, got {limit}")
        if end <= start or limit == 0:
            return _empty()
        limit = min(limit, _INT64_MAX)  # numpy arithmetic below is int64
        i = int(np.searchsorted(self._ends, start, side="right"))  # first ending after start
        j_all = int(np.searchsorted(self._starts, end, side="left"))  # first starting at end+
        # Intervals are non-adjacent: each one visited after the first has a gap offset
        # before it and the last one has one after it, so `limit` intervals are enough.
        j = min(j_all, i + limit)
        gap_starts = np.concatenate(([start], self._ends[i:j]))
        tail = int(self._starts[j]) if j < j_all else end  # the gap after the last one
        gap_ends = np.concatenate((self._starts[i:j], [tail]))
        np.clip(gap_starts, start, end, out=gap_starts)
        np.clip(gap_ends, gap_starts, end, out=gap_ends)
        # Cut the gaps down to the first `limit` offsets before expanding them.
        lengths = gap_ends - gap_starts
        before = np.cumsum(lengths) - lengths
        gap_ends = gap_starts + np.clip(limit - before, 0, lengths)
        return _expand(gap_starts, gap_ends)

    def count_in(self, start: int, end: int) -> int:
        """How many offsets of [start, end) are in the set.

        Costs O(log k + intervals in the window).
        """
        start = _as_offset(start, "start")
        end = _as_end(end)
        if end <= start:
            return 0
        i = int(np.searchsorted(self._ends, start, side="right"))
        j = int(np.searchsorted(self._starts, end, side="left"))
        if j <= i:
            return 0
        clipped_ends = np.minimum(self._ends[i:j], end)
        clipped_starts = np.maximum(self._starts[i:j], start)
        return int((clipped_ends - clipped_starts).sum())

    def ranges(self, start: int = 0, end: int | None = None) -> np.ndarray:
        """The intervals as a new (k, 2) int64 array of [start, end), clipped to the window.

        Without ``end``, the window reaches past the last interval.
        """
        start = _as_offset(start, "start")
        if end is None:
            i = int(np.searchsorted(self._ends, start, side="right"))
            j = len(self._starts)
            end = _INT64_MAX
        else:
            end = _as_end(end)
            if end <= start:
                return np.zeros((0, 2), dtype=np.int64)
            i = int(np.searchsorted(self._ends, start, side="right"))
            j = int(np.searchsorted(self._starts, end, side="left"))
        out = np.stack([self._starts[i:j], self._ends[i:j]], axis=1)
        np.clip(out, start, end, out=out)
        return out

    # -- comparison -------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        """Equal when both hold the same offsets."""
        if not isinstance(other, AckRanges):
            return NotImplemented
        return (
            self._count == other._count
            and np.array_equal(self._starts, other._starts)
            and np.array_equal(self._ends, other._ends)
        )

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return f"AckRanges({self._count} offsets in {len(self._starts)} intervals)"
