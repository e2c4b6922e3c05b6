"""One segment (page) file of a queue, and the list of a queue's live segments.

A segment holds whole records, each one MessageBatch of consecutive offsets. The
in-memory index per segment is two int64 arrays (first offset and file position of each
record) and an ack bitmap of one byte per message: no Python object per message.
Framing is in ``record.py``; scanning after a crash in ``scanner.py``.
"""

from __future__ import annotations

import contextlib
import os
import struct
from array import array
from bisect import bisect_left, bisect_right

import numpy as np

from raymq.batch import MessageBatch, PropertyGroups, as_u8
from raymq.storage.files import create_file
from raymq.storage.format import (
    RECORD_HEADER,
    SEGMENT_HEADER,
    SEGMENT_HEADER_V1,
    SEGMENT_MAGIC,
    SEGMENT_PREFIX,
    SEGMENT_VERSION,
    crc32,
    segment_name,
)
from raymq.storage.record import CorruptRecord, decode_payload, parse_header

#: A segment summary keeps at most this many distinct property maps.
SUMMARY_MAX_DISTINCT = 256


class BadSegmentHeader(CorruptRecord):
    """A segment file's header is missing, short or invalid."""

    def __init__(self, message: str, size: int, torn: bool = False):
        super().__init__(message)
        #: Bytes in the file.
        self.size = size
        #: What a crash during the file's creation leaves: the header cut short or in a
        #: page that never reached the disk (zeros). Otherwise the header rotted.
        self.torn = torn


def new_salt() -> int:
    """A random 64-bit salt for a new segment file."""
    return int.from_bytes(os.urandom(8), "little")


def segment_header(base_offset: int, salt: int) -> bytes:
    """A version-2 segment file header."""
    head = SEGMENT_HEADER.pack(SEGMENT_MAGIC, SEGMENT_VERSION, 0, base_offset, salt, 0, 0)[:32]
    return head + struct.pack("<II", crc32([head]), 0)


def parse_segment_header(data: bytes, base_offset: int, path: str) -> tuple[int | None, int]:
    """(salt, version) of a segment file image; salt None for version 1."""
    if len(data) < SEGMENT_PREFIX.size:
        raise BadSegmentHeader(f"{path}: header missing ({len(data)} bytes)", len(data), True)
    magic, version = SEGMENT_PREFIX.unpack_from(data, 0)
    if magic == SEGMENT_MAGIC and version == 1 and len(data) >= SEGMENT_HEADER_V1.size:
        _m, _v, _r, base = SEGMENT_HEADER_V1.unpack_from(data, 0)
        if base == base_offset:
            return None, 1
    if magic == SEGMENT_MAGIC and version == 2 and len(data) >= SEGMENT_HEADER.size:
        _m, _v, _f, base, salt, hcrc, _r = SEGMENT_HEADER.unpack_from(data, 0)
        if base == base_offset and crc32([data[:32]]) == hcrc:
            return salt, 2
    if data[: SEGMENT_HEADER.size].strip(b"\0") == b"":
        raise BadSegmentHeader(f"{path}: header missing ({len(data)} bytes)", len(data), True)
    raise BadSegmentHeader(
        f"{path}: bad header (magic {magic!r}, version {version}, {len(data)} bytes)",
        len(data),
        torn=len(data) < SEGMENT_HEADER.size,
    )


def record_time(data, pos: int) -> int:
    """The first timestamp (µs since the epoch) of the record at ``pos`` of a file's
    bytes ``data``: the first 8 bytes of its payload."""
    at = pos + RECORD_HEADER.size
    return int.from_bytes(data[at : at + 8], "little", signed=True)


class Segment:
    """One page file of a queue and its in-memory index and ack bitmap.

    For a non-durable queue there is no file: records stay in ``self.batches``.
    ``size`` is the published (readable) length in bytes; ``planned_size`` includes a
    write in flight.
    """

    def __init__(
        self,
        directory: str | None,
        base_offset: int,
        *,
        fd: int | None = None,
        salt: int | None = None,
        version: int = SEGMENT_VERSION,
    ):
        self.directory = directory
        self.base_offset = base_offset
        self.path = os.path.join(directory, segment_name(base_offset)) if directory else None
        self.fd = fd
        #: Random per file (version 2), mixed into every record header's CRC; None for a
        #: version-1 file (and for memory).
        self.salt = salt
        self.version = version
        self.firsts = array("q")
        self.positions = array("q")
        #: Each record's time (its first message's timestamp, µs since the epoch): the
        #: segment's time index (Kafka's .timeindex, kept in memory; see FORMAT.md).
        self.times = array("q")
        self.batches: list[MessageBatch | None] = []  # in memory (transient) only
        self.count = 0  # messages published
        self.header_size = SEGMENT_HEADER.size if version >= 2 else SEGMENT_HEADER_V1.size
        self.size = self.header_size if directory else 0
        self.planned_size = self.size
        self.planned_end = base_offset
        self._acked = np.zeros(64, dtype=np.bool_)
        self.acked_n = 0
        self.lost_n = 0  # offsets lost to damage; counted as acked, never served
        self.memory_bytes = 0
        #: Distinct property maps of this segment's messages (msgpack -> count), so a
        #: selector that matches none of them skips the segment unread. None when
        #: unknown (after a restart, until a scan rebuilds it) or over the cap.
        self.summary: dict[bytes, int] | None = {}
        self.summary_overflow = False
        #: False if records must not be appended (a version-1 file, or damaged bytes
        #: left at its end).
        self.appendable = True
        #: Indexes of records quarantined as damaged (never read again), if any.
        self.damaged_records: set[int] | None = None

    # -- files -----------------------------------------------------------------------

    @classmethod
    def create(cls, directory: str, base_offset: int) -> Segment:
        """Create the (empty) file, 0600, with a new random salt. Its header is written
        with its first records (``file_header``), in the same pwritev."""
        fd = create_file(os.path.join(directory, segment_name(base_offset)))
        return cls(directory, base_offset, fd=fd, salt=new_salt())

    def file_header(self) -> bytes:
        """The version-2 header of this segment's file."""
        return segment_header(self.base_offset, self.salt)

    @classmethod
    def open_existing(cls, directory: str, base_offset: int) -> tuple[Segment, bytes]:
        """Open a file for recovery; returns the segment and the file's bytes.

        Raises ``BadSegmentHeader`` (the fd closed) if the header is short or invalid.
        """
        path = os.path.join(directory, segment_name(base_offset))
        fd = os.open(path, os.O_RDWR)
        try:
            with open(fd, "rb", closefd=False) as f:
                data = f.read()
            salt, version = parse_segment_header(data, base_offset, path)
        except BaseException:
            os.close(fd)
            raise
        return cls(directory, base_offset, fd=fd, salt=salt, version=version), data

    def close(self) -> None:
        """Close the file descriptor (the file stays)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def delete(self) -> None:
        """Close and unlink the file."""
        self.close()
        if self.path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    # -- index -----------------------------------------------------------------------

    @property
    def end_offset(self) -> int:
        """One past the last published offset in this segment."""
        return self.base_offset + self.count

    def add_record(self, first: int, count: int, position: int, time_us: int = 0) -> None:
        """Index a published record (``time_us``: its first timestamp, µs since the
        epoch). Offsets skipped before it (records lost to damage, found by recovery)
        stay unacknowledged until ``mark_lost``."""
        self.firsts.append(first)
        self.positions.append(position)
        # Never earlier than the record before: a clock stepped back (or bytes read
        # without their CRC) cannot make the index unsorted.
        self.times.append(max(time_us, self.times[-1]) if self.times else time_us)
        self.count = first + count - self.base_offset
        self._grow(self.count)

    def extend_to(self, end: int) -> None:
        """Make offsets up to ``end`` part of this segment (lost ones, see ``mark_lost``)."""
        if end > self.end_offset:
            self._grow(end - self.base_offset)
            self.count = end - self.base_offset

    def mark_lost(self, start: int, end: int) -> int:
        """Count offsets [start, end) of this segment lost to damage: acknowledged (never
        served again); returns how many were not acknowledged already."""
        self.extend_to(end)
        sl = self._acked[start - self.base_offset : end - self.base_offset]
        fresh = int((~sl).sum())
        self.lost_n += fresh
        self.acked_n += fresh
        sl[:] = True
        return fresh

    def _grow(self, n: int) -> None:
        if n > len(self._acked):
            bigger = np.zeros(max(n, 2 * len(self._acked)), dtype=np.bool_)
            bigger[: len(self._acked)] = self._acked
            self._acked = bigger

    @property
    def index_bytes(self) -> int:
        """Bytes of this segment's in-memory index and per-message metadata."""
        summary = sum(len(b) + 16 for b in self.summary) if self.summary else 0
        return (
            self._acked.nbytes
            + self.firsts.itemsize * len(self.firsts)
            + self.positions.itemsize * len(self.positions)
            + self.times.itemsize * len(self.times)
            + summary
        )

    @property
    def acked(self) -> np.ndarray:
        """Ack flags of this segment's published messages (a view; True = acked)."""
        return self._acked[: self.count]

    def set_acked(self, flags: np.ndarray, acked_n: int) -> None:
        """Restore ack flags from a checkpoint."""
        self._grow(len(flags))
        self._acked[: len(flags)] = flags
        self.acked_n = acked_n

    def ack(self, offsets: np.ndarray) -> int:
        """Mark offsets (all inside this segment) acked; returns how many were new."""
        idx = offsets - self.base_offset
        fresh = idx[~self._acked[idx]]
        if len(fresh) > 1 and not (fresh[1:] > fresh[:-1]).all():
            fresh = np.unique(fresh)  # duplicates must count once
        self._acked[fresh] = True
        self.acked_n += len(fresh)
        return len(fresh)

    @property
    def fully_acked(self) -> bool:
        """True when every published message is acked (or lost)."""
        return self.count > 0 and self.acked_n == self.count

    @property
    def newest_time(self) -> int:
        """The time of its newest record (µs since the epoch; 0: no record)."""
        return self.times[-1] if self.times else 0

    def offset_at(self, time_us: int) -> int | None:
        """The first offset of the first record of time ``time_us`` (µs since the epoch)
        or later; None if every record is older."""
        k = bisect_left(self.times, time_us)
        return self.firsts[k] if k < len(self.firsts) else None

    def index_times(self, data) -> None:
        """Rebuild the time index from the file's bytes ``data`` (after a checkpoint
        restored the positions): each record's first timestamp, read without its CRC."""
        self.times = array("q")
        for pos in self.positions:
            t = record_time(data, pos) if pos >= 0 else 0
            self.times.append(max(t, self.times[-1]) if self.times else t)

    def record_index(self, offset: int) -> int:
        """Index of the record holding ``offset``."""
        return bisect_right(self.firsts, offset) - 1

    def is_damaged(self, k: int) -> bool:
        """True if record ``k`` was quarantined."""
        return self.damaged_records is not None and k in self.damaged_records

    def note_damaged(self, k: int) -> None:
        """Remember that record ``k`` is damaged: it is never read again."""
        if self.damaged_records is None:
            self.damaged_records = set()
        self.damaged_records.add(k)

    def record_end(self, k: int) -> int:
        """File position after record ``k`` (the next record's, or the published size)."""
        positions = self.positions
        for j in range(k + 1, len(positions)):
            if positions[j] >= 0:  # (-1: a freed transient record, not in the file)
                return positions[j]
        return self.size

    def record_offsets(self, k: int) -> tuple[int, int]:
        """Offsets [first, end) of record ``k``."""
        end = self.firsts[k + 1] if k + 1 < len(self.firsts) else self.end_offset
        return self.firsts[k], end

    def _checked_header(self, k: int) -> tuple[int, int, int, int]:
        """The header of record ``k``, checked against its salt, position and the index."""
        pos = self.positions[k]
        hdr = parse_header(os.pread(self.fd, RECORD_HEADER.size, pos), 0, self.salt, pos)
        if hdr is None:
            raise CorruptRecord(f"{self.path}: bad record header at byte {pos}")
        first, end = self.record_offsets(k)
        if hdr[2] != first or hdr[3] > end - first:
            raise CorruptRecord(f"{self.path}: record at byte {pos} is not the indexed one")
        return hdr

    def read_record(self, k: int, *, verify: bool = True) -> MessageBatch | None:
        """Read record ``k`` back (from memory for a non-durable segment); None for a
        transient record freed because all of it was acknowledged. Raises
        ``CorruptRecord`` if it fails its checks, ``OSError`` if the file cannot be read."""
        if self.fd is None:
            return self.batches[k]
        pos = self.positions[k]
        if pos < 0:
            return None
        pcrc, length, first, count = self._checked_header(k)
        payload = os.pread(self.fd, length, pos + RECORD_HEADER.size)
        if len(payload) != length or (verify and crc32([payload]) != pcrc):
            raise CorruptRecord(f"{self.path}: record at byte {pos} fails its checksum")
        return decode_payload(payload, first, count)

    def verify_record(self, k: int) -> int:
        """Check record ``k``'s header and payload CRCs; returns the bytes read. Raises
        ``CorruptRecord`` if it fails (a memory record always passes)."""
        if self.fd is None or self.positions[k] < 0:
            return 0
        self.read_record(k)
        return self.record_end(k) - self.positions[k]

    def free_acked_records(self, lo: int, hi: int) -> None:
        """Drop in-memory records within offsets [lo, hi] whose messages are all
        acknowledged: a transient segment holds memory only for what is still queued."""
        if self.fd is not None:
            return
        for k in range(max(0, self.record_index(lo)), self.record_index(hi) + 1):
            rec = self.batches[k]
            if rec is None:
                continue
            start = rec.first_offset - self.base_offset
            if self._acked[start : start + len(rec)].all():
                self.batches[k] = None
                self.memory_bytes -= rec.nbytes

    def read_properties(self, k: int) -> MessageBatch | None:
        """Record ``k``'s timestamps and properties only, as a batch with empty bodies.

        Two preads skip the bodies. The header is checked (its CRC, salt and position),
        and the offset arrays for consistency, but the payload CRC covers the whole
        payload, so these bytes are not checksummed: they only decide matching;
        delivery reads and checks the whole record, and so does a decision to hold a
        message back (a delivery time: ``Reader.confirm``; an expiry: the mover).
        """
        if self.fd is None:
            return self.batches[k]
        pos = self.positions[k]
        if pos < 0:
            return None
        _pcrc, length, first, n = self._checked_header(k)
        head_len = 8 * n + 16 * (n + 1)
        if head_len > length:
            raise CorruptRecord(f"{self.path}: record at byte {pos} is inconsistent")
        head = np.frombuffer(os.pread(self.fd, head_len, pos + RECORD_HEADER.size), np.uint8)
        if len(head) != head_len:
            raise CorruptRecord(f"{self.path}: record at byte {pos} is cut short")
        ts = head[: 8 * n].view(np.int64)
        bo = head[8 * n : 8 * n + 8 * (n + 1)].view(np.int64)
        po = head[8 * n + 8 * (n + 1) :].view(np.int64)
        body_len, props_len = int(bo[-1]), int(po[-1])
        if (
            bo[0] != 0
            or po[0] != 0
            or body_len < 0
            or props_len < 0
            or head_len + body_len + props_len != length
            or (n > 1 and (np.diff(po) < 0).any())
        ):
            raise CorruptRecord(f"{self.path}: record at byte {pos} has inconsistent offsets")
        props = os.pread(self.fd, props_len, pos + RECORD_HEADER.size + head_len + body_len)
        if len(props) != props_len:
            raise CorruptRecord(f"{self.path}: record at byte {pos} is cut short")
        return MessageBatch(
            np.zeros(n + 1, dtype=np.int64), np.zeros(0, np.uint8), po, as_u8(props), ts, first
        )

    def note_properties(self, groups: PropertyGroups) -> None:
        """Add a published record's properties to the segment's summary."""
        summary = self.summary
        if summary is None:
            return
        for blob, count in zip(groups.distinct, groups.counts.tolist(), strict=True):
            summary[blob] = summary.get(blob, 0) + count
        if len(summary) > SUMMARY_MAX_DISTINCT:
            self.summary = None
            self.summary_overflow = True


def _base_offset(segment: Segment) -> int:
    return segment.base_offset


class Segments(list):
    """The live segments of a queue in offset order (a list), with lookups by offset."""

    def bases(self) -> np.ndarray:
        """First offsets of the live segments, ascending."""
        return np.fromiter((s.base_offset for s in self), dtype=np.int64, count=len(self))

    def index_at(self, offset: int) -> int:
        """Index of the first segment that may hold ``offset`` or anything after it.
        A bisection over the segments themselves: every fetch, read and holding() asks,
        and ``bases()`` costs an array of all segments each time (a deep backlog has
        thousands)."""
        return max(0, bisect_right(self, offset, key=_base_offset) - 1)

    def holding(self, offset: int) -> Segment | None:
        """The live segment holding ``offset``, if any."""
        if not self:
            return None
        seg = self[self.index_at(offset)]
        return seg if seg.base_offset <= offset < seg.end_offset else None
