"""One segment (page) file: framing, reading back, and scanning after a crash.

A segment holds whole records, each one MessageBatch of consecutive offsets. The
in-memory index per segment is two int64 arrays (first offset and file position of each
record) and an ack bitmap of one byte per message: no Python object per message.
"""

from __future__ import annotations

import contextlib
import os
from array import array
from bisect import bisect_right
from dataclasses import dataclass, field

import numpy as np

from raymq.batch import MessageBatch, PropertyGroups, as_u8
from raymq.storage.format import (
    RECORD_HEADER,
    RECORD_MAGIC,
    RECORD_MAGIC_BYTES,
    SEGMENT_HEADER,
    SEGMENT_MAGIC,
    SEGMENT_VERSION,
    crc32,
    segment_name,
)

#: A segment summary keeps at most this many distinct property maps.
SUMMARY_MAX_DISTINCT = 256


class CorruptRecord(Exception):
    """A record failed its checksum or framing checks (internal to storage)."""


def encode_record(batch: MessageBatch) -> list[bytes | memoryview]:
    """Frame ``batch`` as a record: the header followed by the payload buffers.

    Returned as a list for ``os.writev`` so that bodies are never joined into a copy.
    """
    n = len(batch)
    payload = [
        memoryview(batch.timestamps),
        memoryview(batch.body_offsets),
        memoryview(batch.prop_offsets),
        memoryview(batch.body_data),
        memoryview(batch.prop_data),
    ]
    length = sum(p.nbytes for p in payload)
    pcrc = crc32(payload)
    tail = RECORD_HEADER.pack(RECORD_MAGIC, 0, pcrc, length, batch.first_offset, n, 0)[8:]
    header = RECORD_HEADER.pack(RECORD_MAGIC, crc32([tail]), pcrc, length, batch.first_offset, n, 0)
    return [header, *payload]


def parse_header(buf: bytes | memoryview, pos: int) -> tuple[int, int, int, int] | None:
    """Return (payload crc, length, first offset, count) of a valid header at ``pos``."""
    if len(buf) - pos < RECORD_HEADER.size:
        return None
    magic, hcrc, pcrc, length, first, count, _flags = RECORD_HEADER.unpack_from(buf, pos)
    if magic != RECORD_MAGIC or crc32([buf[pos + 8 : pos + RECORD_HEADER.size]]) != hcrc:
        return None
    return pcrc, length, first, count


def decode_payload(payload: bytes | memoryview, first: int, count: int) -> MessageBatch:
    """Turn a record payload back into a MessageBatch without copying the bodies."""
    u8 = np.frombuffer(payload, dtype=np.uint8)
    n = count
    p = 0
    ts = u8[p : p + 8 * n].view(np.int64)
    p += 8 * n
    bo = u8[p : p + 8 * (n + 1)].view(np.int64)
    p += 8 * (n + 1)
    po = u8[p : p + 8 * (n + 1)].view(np.int64)
    p += 8 * (n + 1)
    if bo[0] != 0 or po[0] != 0 or p + bo[-1] + po[-1] != len(u8):
        raise CorruptRecord(f"record at offset {first}: payload layout is inconsistent")
    body = u8[p : p + bo[-1]]
    props = u8[p + bo[-1] :]
    return MessageBatch(bo, body, po, props, ts, first)


@dataclass
class ScanResult:
    """What a scan of a segment's bytes found."""

    #: (first offset, count, file position) of each valid record, in order.
    records: list[tuple[int, int, int]] = field(default_factory=list)
    #: File position after the last valid record: the file is truncated here.
    valid_end: int = 0
    #: Human-readable reports of damage found (skipped records, torn tail).
    damage: list[str] = field(default_factory=list)
    #: Offset ranges [start, end) lost to damage in the middle of the segment.
    lost: list[tuple[int, int]] = field(default_factory=list)
    truncated_bytes: int = 0


def scan(buf: bytes, start: int, path: str) -> ScanResult:
    """Validate the records of a segment file image from byte ``start`` on.

    A damaged record followed by valid ones is skipped and reported; a damaged or
    partial record with nothing valid after it is the torn tail of a crash and is cut.
    """
    result = ScanResult(valid_end=start)
    pos = start
    while pos < len(buf):
        rec = _valid_record_at(buf, pos)
        if rec is not None:
            first, count, end = rec
            result.records.append((first, count, pos))
            pos = result.valid_end = end
            continue
        nxt = _resync(buf, pos + 1)
        if nxt is None:
            break  # nothing valid follows: a torn tail
        lost_start = _next_offset(result, buf, pos)
        lost_end = _valid_record_at_unchecked_first(buf, nxt)
        result.damage.append(
            f"{path}: damaged bytes {pos}..{nxt} skipped (offsets {lost_start}..{lost_end})"
        )
        if lost_start is not None and lost_end > lost_start:
            result.lost.append((lost_start, lost_end))
        pos = nxt
    if result.valid_end < len(buf):
        result.truncated_bytes = len(buf) - result.valid_end
        result.damage.append(
            f"{path}: torn tail of {result.truncated_bytes} bytes at {result.valid_end} truncated"
        )
    return result


def _valid_record_at(buf: bytes, pos: int) -> tuple[int, int, int] | None:
    hdr = parse_header(buf, pos)
    if hdr is None:
        return None
    pcrc, length, first, count = hdr
    start, end = pos + RECORD_HEADER.size, pos + RECORD_HEADER.size + length
    if end > len(buf) or crc32([memoryview(buf)[start:end]]) != pcrc:
        return None
    return first, count, end


def _resync(buf: bytes, pos: int) -> int | None:
    """Position of the next fully valid record at or after ``pos``, if any."""
    while True:
        pos = buf.find(RECORD_MAGIC_BYTES, pos)
        if pos < 0:
            return None
        if _valid_record_at(buf, pos) is not None:
            return pos
        pos += 1


def _next_offset(result: ScanResult, buf: bytes, pos: int) -> int | None:
    if result.records:
        first, count, _ = result.records[-1]
        return first + count
    hdr = parse_header(buf, pos)  # header intact, payload damaged
    return hdr[2] if hdr else None


def _valid_record_at_unchecked_first(buf: bytes, pos: int) -> int:
    hdr = parse_header(buf, pos)
    assert hdr is not None
    return hdr[2]


class Segment:
    """One page file of a queue and its in-memory index and ack bitmap.

    For a non-durable queue there is no file: records stay in ``self.batches``.
    ``size`` is the published (readable) length in bytes; ``planned_size`` includes a
    write in flight.
    """

    def __init__(self, directory: str | None, base_offset: int, *, fd: int | None = None):
        self.directory = directory
        self.base_offset = base_offset
        self.path = os.path.join(directory, segment_name(base_offset)) if directory else None
        self.fd = fd
        self.firsts = array("q")
        self.positions = array("q")
        self.batches: list[MessageBatch | None] = []  # in memory (transient) only
        self.count = 0  # messages published
        self.size = SEGMENT_HEADER.size if directory else 0
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

    # -- files -----------------------------------------------------------------------

    @classmethod
    def create(cls, directory: str, base_offset: int) -> Segment:
        """Create the file with its header (not yet fsynced: the first write syncs it)."""
        path = os.path.join(directory, segment_name(base_offset))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, SEGMENT_HEADER.pack(SEGMENT_MAGIC, SEGMENT_VERSION, 0, base_offset))
        return cls(directory, base_offset, fd=fd)

    @classmethod
    def open_existing(cls, directory: str, base_offset: int) -> tuple[Segment, bytes]:
        """Open a file for recovery; returns the segment and the file's bytes."""
        path = os.path.join(directory, segment_name(base_offset))
        fd = os.open(path, os.O_RDWR)
        with open(fd, "rb", closefd=False) as f:
            data = f.read()
        seg = cls(directory, base_offset, fd=fd)
        if len(data) < SEGMENT_HEADER.size:
            raise CorruptRecord(f"{path}: header missing ({len(data)} bytes)")
        magic, version, _r, base = SEGMENT_HEADER.unpack_from(data, 0)
        if magic != SEGMENT_MAGIC or version != SEGMENT_VERSION or base != base_offset:
            raise CorruptRecord(f"{path}: bad header (magic {magic!r}, version {version})")
        return seg, data

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

    def add_record(self, first: int, count: int, position: int) -> None:
        """Index a published record (offsets may skip ahead after lost records)."""
        if first > self.end_offset:  # a gap left by a damaged record
            self._mark_lost(self.end_offset, first)
        self.firsts.append(first)
        self.positions.append(position)
        self.count = first + count - self.base_offset
        self._grow(self.count)

    def _mark_lost(self, start: int, end: int) -> None:
        self._grow(end - self.base_offset)
        self.count = max(self.count, end - self.base_offset)
        sl = self._acked[start - self.base_offset : end - self.base_offset]
        self.lost_n += int((~sl).sum())
        self.acked_n += int((~sl).sum())
        sl[:] = True

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

    def record_index(self, offset: int) -> int:
        """Index of the record holding ``offset``."""
        return bisect_right(self.firsts, offset) - 1

    def read_record(self, k: int, *, verify: bool = True) -> MessageBatch | None:
        """Read record ``k`` back (from memory for a non-durable segment); None for a
        transient record freed because all of it was acknowledged."""
        if self.fd is None:
            return self.batches[k]
        pos = self.positions[k]
        if pos < 0:
            return None
        header = os.pread(self.fd, RECORD_HEADER.size, pos)
        hdr = parse_header(header, 0)
        if hdr is None:
            raise CorruptRecord(f"{self.path}: bad record header at byte {pos}")
        pcrc, length, first, count = hdr
        payload = os.pread(self.fd, length, pos + RECORD_HEADER.size)
        if len(payload) != length or (verify and crc32([payload]) != pcrc):
            raise CorruptRecord(f"{self.path}: record at byte {pos} fails its checksum")
        return decode_payload(payload, first, count)

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

        Two preads skip the bodies. The payload CRC covers the whole payload, so these
        bytes are not checksummed: they only decide matching; delivery reads and checks
        the whole record.
        """
        if self.fd is None:
            return self.batches[k]
        pos = self.positions[k]
        if pos < 0:
            return None
        _magic, _h, _p, _length, first, n, _flags = RECORD_HEADER.unpack(
            os.pread(self.fd, RECORD_HEADER.size, pos)
        )
        head_len = 8 * n + 16 * (n + 1)
        head = np.frombuffer(os.pread(self.fd, head_len, pos + RECORD_HEADER.size), np.uint8)
        if len(head) != head_len:
            raise CorruptRecord(f"{self.path}: record at byte {pos} is cut short")
        ts = head[: 8 * n].view(np.int64)
        bo = head[8 * n : 8 * n + 8 * (n + 1)].view(np.int64)
        po = head[8 * n + 8 * (n + 1) :].view(np.int64)
        props = os.pread(self.fd, int(po[-1]), pos + RECORD_HEADER.size + head_len + int(bo[-1]))
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
