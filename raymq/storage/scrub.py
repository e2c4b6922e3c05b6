"""The scrub: checks the CRCs of stored records a bounded number of bytes at a time, so
that rot is found (and quarantined) before a consumer needs the data."""

from __future__ import annotations

import contextlib
import os

from raymq.storage.damage import Quarantine
from raymq.storage.files import storage_error
from raymq.storage.record import CorruptRecord
from raymq.storage.segment import Segments


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
        returns the bytes read. Records whose messages are all acknowledged are skipped
        unread. A damaged record is quarantined. Runs in the caller's thread (the event
        loop): reads ``max_bytes`` or one record at most."""
        done = 0
        while done < max_bytes:
            found = self._next()
            if found is None:
                self.passes += 1
                self._base, self._k = -1, 0
                break
            seg, k = found
            self._k = k + 1
            first, end = seg.record_offsets(k)
            if seg.acked[first - seg.base_offset : end - seg.base_offset].all():
                continue
            pos, stop = seg.positions[k], seg.record_end(k)
            with contextlib.suppress(AttributeError, OSError):  # read the disk, not the cache
                os.posix_fadvise(seg.fd, pos, stop - pos, os.POSIX_FADV_DONTNEED)
            try:
                done += seg.verify_record(k)
            except CorruptRecord as exc:
                self.quarantine.take_out(seg, k, str(exc))
                done += stop - pos
            except OSError as exc:
                raise storage_error(self.queue, "scrub read", seg.path, exc) from exc
        self.bytes_checked += done
        return done

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
