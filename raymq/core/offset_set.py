"""OffsetSet: a set of message offsets in one bit per offset, whatever its size.

A TargetList's CacheReferences beyond its watermark can number tens of millions; a
Python object per offset would cost ~100 bytes each. Here offsets live in chunks of
``CHUNK`` bits (8 KiB packed), created on first use and dropped when empty, so ten
million offsets cost about 1.2 MiB.
"""

from __future__ import annotations

import bisect

import numpy as np

#: Offsets per chunk (a power of two).
CHUNK = 1 << 16
_SHIFT = 16


class OffsetSet:
    """A set of non-negative int64 offsets, as packed bitmaps per chunk."""

    def __init__(self) -> None:
        self._chunks: dict[int, np.ndarray] = {}  # chunk id -> bool array of CHUNK
        self._ids: list[int] = []  # sorted chunk ids
        self._count = 0

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        """Memory held by the bitmaps (bytes)."""
        return len(self._chunks) * (CHUNK // 8)

    def _chunk(self, cid: int) -> np.ndarray:
        bits = self._chunks.get(cid)
        if bits is None:
            bits = np.zeros(CHUNK // 8, dtype=np.uint8)
            self._chunks[cid] = bits
            bisect.insort(self._ids, cid)
        return bits

    def add(self, offsets: np.ndarray) -> None:
        """Add offsets (any order, duplicates allowed)."""
        self._set(offsets, 1)

    def add_range(self, start: int, end: int) -> None:
        """Add every offset in [start, end)."""
        while start < end:
            stop = min(end, ((start >> _SHIFT) + 1) << _SHIFT)
            self.add(np.arange(start, stop, dtype=np.int64))
            start = stop

    def discard(self, offsets: np.ndarray) -> None:
        """Remove offsets that are present."""
        self._set(offsets, 0)

    def _set(self, offsets: np.ndarray, bit: int) -> None:
        """Set (1) or clear (0) the bits of ``offsets``, chunk by chunk."""
        offsets = np.asarray(offsets, dtype=np.int64)
        if not len(offsets):
            return
        cids = offsets >> _SHIFT
        for cid in np.unique(cids).tolist():
            bits = self._chunk(cid) if bit else self._chunks.get(cid)
            if bits is None:
                continue
            unpacked = np.unpackbits(bits)
            before = int(unpacked.sum())
            unpacked[offsets[cids == cid] & (CHUNK - 1)] = bit
            after = int(unpacked.sum())
            self._count += after - before
            if after:
                self._chunks[cid] = np.packbits(unpacked)
            else:
                self._drop(cid)

    def _drop(self, cid: int) -> None:
        del self._chunks[cid]
        self._ids.pop(bisect.bisect_left(self._ids, cid))

    def discard_below(self, offset: int) -> None:
        """Remove every offset < ``offset``."""
        while self._ids and (self._ids[0] + 1) << _SHIFT <= offset:
            cid = self._ids[0]
            self._count -= int(np.unpackbits(self._chunks[cid]).sum())
            self._drop(cid)
        if self._ids and self._ids[0] << _SHIFT < offset:
            self.discard(np.arange(self._ids[0] << _SHIFT, offset, dtype=np.int64))

    def first(self, n: int, start: int = 0) -> np.ndarray:
        """The ``n`` smallest offsets >= ``start``, ascending (fewer if the set runs out)."""
        out: list[np.ndarray] = []
        need = n
        i = bisect.bisect_left(self._ids, start >> _SHIFT)
        while need > 0 and i < len(self._ids):
            cid = self._ids[i]
            found = np.flatnonzero(np.unpackbits(self._chunks[cid])) + (cid << _SHIFT)
            if found[0] < start:
                found = found[found >= start]
            out.append(found[:need])
            need -= len(out[-1])
            i += 1
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def first_common(self, other: OffsetSet, n: int) -> np.ndarray:
        """The ``n`` smallest offsets in both this set and ``other``, ascending (a
        bitwise and of the chunks they share)."""
        out: list[np.ndarray] = []
        need = n
        for cid in self._ids:
            theirs = other._chunks.get(cid)
            if theirs is None:
                continue
            both = np.bitwise_and(self._chunks[cid], theirs)
            if not both.any():
                continue
            out.append((np.flatnonzero(np.unpackbits(both)) + (cid << _SHIFT))[:need])
            need -= len(out[-1])
            if need <= 0:
                break
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def contains(self, offsets: np.ndarray) -> np.ndarray:
        """Which of ``offsets`` (int64, any order) are in the set (a bool mask)."""
        offsets = np.asarray(offsets, dtype=np.int64)
        mask = np.zeros(len(offsets), dtype=np.bool_)
        if not self._count or not len(offsets):
            return mask
        cids = offsets >> _SHIFT
        for cid in np.unique(cids).tolist():
            bits = self._chunks.get(cid)
            if bits is None:
                continue
            at = cids == cid
            low = offsets[at] & (CHUNK - 1)
            mask[at] = (bits[low >> 3] & (0x80 >> (low & 7))) != 0
        return mask

    def __contains__(self, offset: int) -> bool:
        bits = self._chunks.get(offset >> _SHIFT)
        if bits is None:
            return False
        low = offset & (CHUNK - 1)
        return bool(bits[low >> 3] & (0x80 >> (low & 7)))
