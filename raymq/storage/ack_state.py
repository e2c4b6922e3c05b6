"""Ack state: which published messages are acknowledged, and acks waiting for the log.

The flags live in each segment's ack bitmap; this class routes offsets to segments,
keeps the depth (published, unacknowledged messages) and the acks not yet written.
"""

from __future__ import annotations

import numpy as np

from raymq.storage.acklog import to_ranges
from raymq.storage.segment import Segment, Segments


class AckState:
    """Acknowledgements over a queue's live segments."""

    def __init__(self, segments: Segments, *, durable: bool):
        self.segments = segments
        self.durable = durable
        self.depth = 0  # published, unacknowledged messages
        self._pending: list[np.ndarray] = []
        #: Ranges whose ack log write failed: written again with the next commit.
        self._retry: list[np.ndarray] = []

    def ack(self, offsets: np.ndarray, *, log_it: bool = True) -> int:
        """Mark published offsets acknowledged; returns how many were newly acked.

        Offsets outside the live segments (already deleted, or never published) are
        ignored. The ack reaches disk with the next group commit (``take_pending``).
        """
        offsets = np.asarray(offsets, dtype=np.int64)
        segments = self.segments
        if not len(offsets) or not segments:
            return 0
        lo, hi = int(offsets.min()), int(offsets.max())
        seg = segments[segments.index_at(lo)]
        if seg.base_offset <= lo and hi < seg.end_offset:
            # All in one segment, as a consumer's acks mostly are: no array of every
            # segment's base (a deep backlog has thousands) and no split.
            fresh = self._ack_in(seg, offsets, lo, hi)
            applied = [offsets]
        else:
            where = np.searchsorted(segments.bases(), offsets, side="right") - 1
            fresh, applied = 0, []
            for i in np.unique(where[where >= 0]):
                seg = segments[i]
                mine = offsets[(where == i)]
                mine = mine[mine < seg.end_offset]
                if len(mine):
                    fresh += self._ack_in(seg, mine, int(mine.min()), int(mine.max()))
                    applied.append(mine)
        self.depth -= fresh
        if log_it and self.durable:
            # Only what was applied goes to the ack log: an offset not published yet
            # would ack the message that gets it once the log is read back, and a
            # negative one reads back as a marker of the record's format.
            self._pending.extend(applied)
        return fresh

    @staticmethod
    def _ack_in(seg: Segment, offsets: np.ndarray, lo: int, hi: int) -> int:
        """Ack ``offsets`` (from ``lo`` to ``hi``, all in ``seg``); how many were new."""
        fresh = seg.ack(offsets)
        if seg.fd is None:
            seg.free_acked_records(lo, hi)
        return fresh

    def apply_ranges(self, ranges: np.ndarray) -> None:
        """Apply acknowledged [start, end) ranges read back from an ack log."""
        for start, end in ranges:
            self.ack(np.arange(start, end, dtype=np.int64), log_it=False)

    @property
    def has_pending(self) -> bool:
        """True when acks wait for the next write."""
        return bool(self._pending or self._retry)

    def take_pending(self) -> np.ndarray | None:
        """The acks waiting for the log as [start, end) ranges (None when there are none);
        they are no longer pending."""
        if not self._pending and not self._retry:
            return None
        parts = self._retry
        if self._pending:
            parts = [*parts, to_ranges(np.concatenate(self._pending))]
        self._pending, self._retry = [], []
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def requeue(self, ranges: np.ndarray) -> None:
        """Acks whose write failed: they stay applied, and go with the next commit."""
        self._retry.append(ranges)

    def lose(self, seg: Segment, start: int, end: int) -> int:
        """Take offsets [start, end) of ``seg`` out of delivery for good (damaged): counted
        in the segment's ``lost_n`` and acknowledged, durably with the next commit.
        Returns how many were not acknowledged yet."""
        fresh = seg.mark_lost(start, end)
        self.depth -= fresh
        if self.durable and fresh:
            self._pending.append(np.arange(start, end, dtype=np.int64))
        return fresh

    def recount(self) -> None:
        """Recompute the depth from the segments (after recovery)."""
        self.depth = sum(s.count - s.acked_n for s in self.segments)

    def published(self, messages: int) -> None:
        """Count newly published messages in the depth."""
        self.depth += messages

    def unacked(self, start: int, limit: int, end: int) -> np.ndarray:
        """Up to ``limit`` unacknowledged published offsets in [start, end)."""
        out, need = [], limit
        i = self.segments.index_at(start)
        for seg in self.segments[i:]:
            if need <= 0 or seg.base_offset >= end:
                break
            lo = max(start, seg.base_offset) - seg.base_offset
            hi = min(end, seg.end_offset) - seg.base_offset
            if hi <= lo or seg.acked_n == seg.count:
                continue
            idx = np.flatnonzero(~seg.acked[lo:hi])[:need]
            out.append(idx + (seg.base_offset + lo))
            need -= len(idx)
        if len(out) == 1:
            return out[0]
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def is_acked(self, offsets: np.ndarray) -> np.ndarray:
        """Ack flag per offset (offsets of deleted segments count as acked)."""
        offsets = np.asarray(offsets, dtype=np.int64)
        result = np.ones(len(offsets), dtype=np.bool_)
        segments = self.segments
        if not len(offsets) or not segments:
            return result
        where = np.searchsorted(segments.bases(), offsets, side="right") - 1
        for i in np.unique(where[where >= 0]).tolist():
            seg = segments[i]
            m = (where == i) & (offsets < seg.end_offset)
            if m.any():
                result[m] = seg.acked[offsets[m] - seg.base_offset]
        return result
