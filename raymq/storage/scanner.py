"""Scanning a segment file image after a crash: valid records, damaged regions, tail.

LevelDB's log reader is the model: the scan reports what it cannot use and why; the
loader decides what it means (a torn tail or damage, see ``loader.py``).

In a version-2 segment a record is valid only with the segment's salt and at its own
position, and its offsets must follow the previous record's, so a valid record is never
one copied into a payload: after damage the scan may search forward for the next valid
record (resynchronise) and trust it. A version-1 segment has no such framing: a record
found by searching could be bytes of a message body, so the scan stops at the first
damage and nothing after it is served.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raymq.storage.format import RECORD_HEADER, RECORD_MAGIC_BYTES, crc32
from raymq.storage.record import parse_header


@dataclass
class DamagedRegion:
    """Bytes [start, end) of a segment that hold no valid record, followed by a valid one."""

    start: int
    end: int
    #: Offsets [first, end) the region held.
    lost: tuple[int, int]


@dataclass
class ScanResult:
    """What a scan of a segment's bytes found."""

    #: (first offset, count, file position) of each valid record, in order.
    records: list[tuple[int, int, int]] = field(default_factory=list)
    #: File position after the last valid record.
    valid_end: int = 0
    #: One past the last offset of the valid records (the expected next offset).
    end_offset: int = 0
    #: Damaged regions with valid records after them.
    damaged: list[DamagedRegion] = field(default_factory=list)
    #: Position where bytes without any valid record after them start (None: none).
    tail: int | None = None
    #: Offsets [first, end) named by a valid header at ``tail`` whose payload is bad or
    #: cut short (version 2 only: such a header is trustworthy).
    tail_offsets: tuple[int, int] | None = None
    #: Version 1: something that looks like a valid record follows the tail (so it is
    #: damage, not a torn write), but cannot be trusted.
    tail_followed: bool = False
    #: Version 1: the highest end offset such records claim (within what the file's size
    #: allows); never served, only kept from being given again.
    tail_claimed: int = 0


def scan(buf: bytes, start: int, *, salt: int | None, expected: int) -> ScanResult:
    """Validate the records of a segment file image from byte ``start`` on.

    ``salt`` is the segment's (None for version 1); ``expected`` the first offset the
    next record must have (the segment's base, or its end as a checkpoint knew it).
    """
    result = ScanResult(valid_end=start, end_offset=expected)
    pos = start
    while pos < len(buf):
        rec = _record_at(buf, pos, salt, result.end_offset)
        if rec is not None:
            first, count, end = rec
            result.records.append((first, count, pos))
            pos = result.valid_end = end
            result.end_offset = first + count
            continue
        nxt = _resync(buf, pos + 1, salt, result.end_offset) if salt is not None else None
        if nxt is None:
            result.tail = pos
            if salt is None:
                _untrusted_tail(buf, pos, result)
            else:
                hdr = parse_header(buf, pos, salt, pos)
                if hdr is not None and hdr[2] >= result.end_offset:
                    result.tail_offsets = (hdr[2], hdr[2] + hdr[3])
            break
        first = parse_header(buf, nxt, salt, nxt)[2]
        result.damaged.append(DamagedRegion(pos, nxt, (result.end_offset, first)))
        result.end_offset = first
        pos = nxt
    return result


#: A crash loses or keeps unsynced bytes a page at a time (or cuts the file).
CRASH_PAGE = 4096


def crash_explains_tail(buf: bytes, tail: int, salt: int | None) -> bool:
    """Whether a crash can have left the invalid bytes at ``tail`` (version 2).

    The unsynced part of a file starts at a record (each commit syncs whole records),
    and a crash leaves it cut short, or with pages that never reached the disk reading
    as zeros. So the first invalid record is a torn write if the file ends inside it,
    or if part of it is such a zero page: [max(tail, page start), min(page end, file
    end)) all zeros. A complete record with a bad CRC and no such page (a flipped bit)
    is damage, not a torn write. Version 1 (no salt): always True (no framing to judge).
    """
    if salt is None:
        return True
    hdr = parse_header(buf, tail, salt, tail)
    end = len(buf) if hdr is None else tail + RECORD_HEADER.size + hdr[1]
    if end > len(buf) or len(buf) - tail < RECORD_HEADER.size:
        return True  # cut short
    view = memoryview(buf)
    page = tail - tail % CRASH_PAGE
    while page < end:
        lo, hi = max(tail, page), min(page + CRASH_PAGE, len(buf))
        if hi > lo and view[lo:hi].tobytes().count(0) == hi - lo:
            return True
        page += CRASH_PAGE
    return False


#: A message takes at least 24 bytes of a payload (timestamp and two array entries).
_MIN_MESSAGE_BYTES = 24


def _untrusted_tail(buf: bytes, pos: int, result: ScanResult) -> None:
    """Version 1: note whether records seem to follow the damage and the highest offset
    they claim, bounded by what the file could hold."""
    limit = result.end_offset + len(buf) // _MIN_MESSAGE_BYTES
    nxt = _resync(buf, pos + 1, None, result.end_offset)
    while nxt is not None:
        first, count, end = _record_at(buf, nxt, None, result.end_offset)
        result.tail_followed = True
        if first + count <= limit:
            result.tail_claimed = max(result.tail_claimed, first + count)
        nxt = _resync(buf, end, None, result.end_offset)


def _record_at(
    buf: bytes, pos: int, salt: int | None, expected: int
) -> tuple[int, int, int] | None:
    """(first, count, end) of a valid record at ``pos`` whose offsets start at or after
    ``expected``; None if there is none."""
    hdr = parse_header(buf, pos, salt, pos)
    if hdr is None:
        return None
    pcrc, length, first, count = hdr
    if first < expected or count < 1:
        return None
    start, end = pos + RECORD_HEADER.size, pos + RECORD_HEADER.size + length
    if end > len(buf) or crc32([memoryview(buf)[start:end]]) != pcrc:
        return None
    return first, count, end


def _resync(buf: bytes, pos: int, salt: int | None, expected: int) -> int | None:
    """Position of the next valid record at or after ``pos``, if any."""
    while True:
        pos = buf.find(RECORD_MAGIC_BYTES, pos)
        if pos < 0:
            return None
        if _record_at(buf, pos, salt, expected) is not None:
            return pos
        pos += 1
