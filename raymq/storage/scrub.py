"""The scrub: checks the CRCs of stored records a bounded number of bytes at a time, so
that rot is found (and quarantined) before a consumer needs the data."""

from __future__ import annotations

import contextlib
import os

import numpy as np

from raymq.storage.damage import Quarantine
from raymq.storage.files import storage_error
from raymq.storage.format import RECORD_HEADER, crc32
from raymq.storage.record import CorruptRecord, parse_header
from raymq.storage.segment import Segment, Segments


class Scrubber:
    """Walks the published records of the segment files, round and round."""

    def __init__(self, queue: str, segments: Segments, quarantine: Quarantine):
        self.queue = queue
        self.segments = segments
        self.quarantine = quarantine
        self._base = -1  # the segment and record to check next
        self._k = 0
        self.bytes_checked = 0
        self.passes = 0  # complete walks over every segment

    def step(self, max_bytes: int) -> int:
        """Check records until about ``max_bytes`` were read (at least one record);
        returns the bytes read. Records whose messages are all acknowledged are not
        checked. A damaged record is quarantined. Runs in the caller's thread (the event
        loop): reads ``max_bytes`` or one record at most, neighbouring records with one
        read (a record a read cost about 25 us of Python each: 5 ms a step of 1 KiB
        records, the event loop held meanwhile)."""
        done = 0
        while done < max_bytes:
            found = self._next()
            if found is None:
                self.passes += 1
                self._base, self._k = -1, 0
                break
            seg, k = found
            self._k = k + 1
            if _all_acked(seg, k):
                # Skipped in one numpy scan: a record at a time, a queue whose consumers
                # keep up walked its whole acknowledged log each step (10 ms a step at
                # 1,000 msg/s, the event loop held).
                self._k = _next_unacked_record(seg, k)
                continue
            stop = self._run_end(seg, k, max_bytes - done)
            done += self._check_run(seg, k, stop)
        self.bytes_checked += done
        return done

    @staticmethod
    def _run_end(seg: Segment, k: int, budget: int) -> int:
        """The end (exclusive) of the records from ``k`` read together: next to each
        other in the file, none quarantined or all acknowledged, about ``budget`` bytes
        (``k`` at least)."""
        positions, start, n = seg.positions, seg.positions[k], len(seg.firsts)
        j = k + 1
        while (
            j < n
            and positions[j] >= 0
            and seg.record_end(j) - start <= budget
            and not seg.is_damaged(j)
            and not _all_acked(seg, j)
        ):
            j += 1
        return j

    def _check_run(self, seg: Segment, k: int, stop: int) -> int:
        """Check records ``k`` to ``stop - 1`` from one read; returns the bytes read. At
        the first that fails, it is read alone (``verify_record``: the error names it)
        and quarantined if that fails too, and the walk goes on after it."""
        start = seg.positions[k]
        end = seg.record_end(stop - 1)
        with contextlib.suppress(AttributeError, OSError):  # read the disk, not the cache
            os.posix_fadvise(seg.fd, start, end - start, os.POSIX_FADV_DONTNEED)
        try:
            data = os.pread(seg.fd, end - start, start)
        except OSError as exc:
            raise storage_error(self.queue, "scrub read", seg.path, exc) from exc
        positions = seg.positions
        with memoryview(data) as view:
            for i in range(k, stop):
                self._k = i + 1
                first, last = seg.record_offsets(i)
                at = positions[i] - start
                until = (positions[i + 1] if i + 1 < stop else end) - start
                if _intact(view, at, until, seg.salt, positions[i], first, last):
                    continue
                try:
                    seg.verify_record(i)  # a short read, or rot: read it alone
                except CorruptRecord as exc:
                    self.quarantine.take_out(seg, i, str(exc))
                except OSError as exc:
                    raise storage_error(self.queue, "scrub read", seg.path, exc) from exc
                return positions[i] - start + (seg.record_end(i) - positions[i])
        return end - start

    def _next(self):
        """The next (segment, record index) to check, or None at the end of a pass."""
        segments = self.segments
        for seg in segments[segments.index_at(max(self._base, 0)) :]:
            if seg.base_offset < self._base:
                continue
            if seg.base_offset > self._base:  # the next segment (or ours was deleted)
                self._base, self._k = seg.base_offset, 0
            if seg.fd is None:
                continue
            while self._k < len(seg.firsts):
                if seg.positions[self._k] >= 0 and not seg.is_damaged(self._k):
                    return seg, self._k
                self._k += 1
        return None


def _intact(
    view: memoryview, at: int, until: int, salt: int | None, position: int, first: int, end: int
) -> bool:
    """True if the record in ``view[at:until]`` (file ``position``) has a valid header
    naming offsets within [first, end) from ``first``, and its payload's CRC matches."""
    hdr = parse_header(view, at, salt, position)
    if hdr is None:
        return False
    pcrc, length, hfirst, count = hdr
    payload = at + RECORD_HEADER.size
    return (
        hfirst == first
        and count <= end - first
        and payload + length <= until
        and crc32([view[payload : payload + length]]) == pcrc
    )


def _all_acked(seg: Segment, k: int) -> bool:
    """True if every message of record ``k`` is acknowledged (it is not checked)."""
    first, end = seg.record_offsets(k)
    return bool(seg.acked[first - seg.base_offset : end - seg.base_offset].all())


def _next_unacked_record(seg: Segment, k: int) -> int:
    """The first record from ``k`` on holding an unacknowledged message, or the number
    of records if there is none."""
    start = seg.firsts[k] - seg.base_offset
    rest = seg.acked[start:]
    if rest.all():
        return len(seg.firsts)
    return seg.record_index(seg.base_offset + start + int(np.argmin(rest)))
