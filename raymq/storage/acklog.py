"""The ack log: acknowledged offset ranges, appended and fsynced in groups.

One file per generation; a checkpoint names the first generation still to replay, so
older files are deleted once a newer checkpoint is on disk. Every file starts with the
queue's next offset when it was started, and every record with the next offset when it
was written (an empty range), so the ack log alone knows the highest offset ever given.

Room for acks is reserved when a file is started (``ACK_RESERVE_BYTES``, allocated
without changing the file's size): acks keep reaching the disk when it is full, so
consumers can free the space producers filled.
"""

from __future__ import annotations

import contextlib
import errno
import os
import struct
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np

from raymq.storage.files import create_file, fsync_directory, reserve
from raymq.storage.format import (
    ACK_HEADER,
    ACK_HEADER_V1,
    ACK_MAGIC,
    ACK_PREFIX,
    ACK_RECORD_HEADER,
    ACK_RECORD_MAGIC,
    ACK_SUFFIX,
    ACK_VERSION,
    ack_log_name,
    crc32,
)

#: First element of the pair that starts a subscription's ranges in an ack record.
SUBSCRIPTION_MARK = -1
#: First element of the pair (-2, due µs) that starts ranges of nacked offsets not to
#: be delivered again before that time; these sections end every record.
DELAY_MARK = -2

#: First element of the pair (-3, n) that starts ranges of offsets delivered n times
#: so far (n counts the delivery it records; a give-back not counted as a delivery
#: writes the count it returns to); these sections follow the delays. The latest
#: count of an offset wins.
DELIVERY_MARK = -3
#: The markers of the sections that end a record, in the order they are written.
_TAIL_MARKS = (DELAY_MARK, DELIVERY_MARK)

#: Bytes of disk reserved ahead of the ack log's end (about 6,000 group commits of
#: contiguous acks, 44 bytes each with the high-water pair).
ACK_RESERVE_BYTES = 256 * 1024


#: Up to this many offsets, ``to_ranges`` walks them in Python: a group commit's acks at
#: low rates are a few offsets, for which numpy's seven array operations cost 20-35 µs
#: and the walk 2-4 µs (32 offsets with a gap after each: about 20 µs).
SMALL_RANGES = 32


def to_ranges(offsets: np.ndarray) -> np.ndarray:
    """Offsets (any order, repeats allowed) as a (k, 2) int64 array of the [start, end)
    ranges they cover, ascending."""
    if len(offsets) == 0:
        return np.zeros((0, 2), dtype=np.int64)
    o = offsets.astype(np.int64, copy=False)
    if len(o) <= SMALL_RANGES:
        return _small_ranges(o.tolist())
    if len(o) > 1 and not (o[1:] > o[:-1]).all():  # acks come sorted: skip the hash/sort
        o = np.unique(o)
    breaks = np.flatnonzero(np.diff(o) != 1) + 1
    starts = np.concatenate(([o[0]], o[breaks]))
    ends = np.concatenate((o[breaks - 1], [o[-1]])) + 1
    return np.stack([starts, ends], axis=1)


def _small_ranges(o: list[int]) -> np.ndarray:
    """``to_ranges`` of a few offsets, as a Python walk."""
    if any(b <= a for a, b in pairwise(o)):  # acks come sorted: sort only if not
        o = sorted(set(o))
    ranges = []
    start = prev = o[0]
    for x in o[1:]:
        if x != prev + 1:
            ranges.append((start, prev + 1))
            start = x
        prev = x
    ranges.append((start, prev + 1))
    return np.array(ranges, dtype=np.int64)


def deliveries_as_ranges(counts: dict[int, int]) -> list[tuple[int, np.ndarray]]:
    """offset -> count as (count, ranges) sections, counts ascending."""
    if not counts:
        return []
    offsets = np.fromiter(counts, dtype=np.int64, count=len(counts))
    values = np.fromiter(counts.values(), dtype=np.int64, count=len(counts))
    order = np.lexsort((offsets, values))
    offsets, values = offsets[order], values[order]
    cuts = np.flatnonzero(np.diff(values)) + 1
    return [
        (int(v[0]), to_ranges(o))
        for o, v in zip(np.split(offsets, cuts), np.split(values, cuts), strict=True)
    ]


def encode_ack_record(
    ranges: np.ndarray,
    high: int,
    subscriptions: dict[int, np.ndarray] | None = None,
    delays: list[tuple[int, np.ndarray]] | None = None,
    deliveries: list[tuple[int, np.ndarray]] | None = None,
) -> tuple[bytes, bytes]:
    """(header, payload) of one ack record: the empty range (high, high), ``ranges``,
    then each subscription's ranges after its marker (-1, id), then each delay's
    ranges after its marker (-2, due µs since the epoch), then each delivery count's
    after its marker (-3, count)."""
    parts = [np.array([[high, high]], dtype=np.int64), ranges.reshape(-1, 2)]
    for sid, sub_ranges in (subscriptions or {}).items():
        parts.append(np.array([[SUBSCRIPTION_MARK, sid]], dtype=np.int64))
        parts.append(sub_ranges.reshape(-1, 2))
    for due_us, delayed in delays or ():
        parts.append(np.array([[DELAY_MARK, due_us]], dtype=np.int64))
        parts.append(delayed.reshape(-1, 2))
    for count, delivered in deliveries or ():
        parts.append(np.array([[DELIVERY_MARK, count]], dtype=np.int64))
        parts.append(delivered.reshape(-1, 2))
    payload = np.concatenate(parts).astype(np.int64, copy=False).tobytes()
    return ACK_RECORD_HEADER.pack(ACK_RECORD_MAGIC, crc32([payload]), len(payload)), payload


def ack_file_header(generation: int, next_offset: int) -> bytes:
    """A version-2 ack log header."""
    head = ACK_HEADER.pack(ACK_MAGIC, ACK_VERSION, 0, generation, next_offset, 0, 0)[:32]
    return head + struct.pack("<II", crc32([head]), 0)


class AckLog:
    """Appends ack ranges to ``acks-<generation>.log`` in ``directory``.

    ``create`` starts the file; ``write`` appends one record and fdatasyncs it. A failed
    append is cut off again (``repair``) before the next one, so that a record that
    failed never sits in front of later ones.
    """

    def __init__(self, directory: str, generation: int):
        self.directory = directory
        self.generation = generation
        self.path = os.path.join(directory, ack_log_name(generation))
        self.fd: int | None = None
        self.size = 0  # bytes known good (header and whole records)
        self._reserved_to = 0
        self._dirty = False  # a failed append may have left bytes after ``size``

    def create(self, next_offset: int, *, strict: bool = True) -> None:
        """Start the file (replacing any left by an earlier failed attempt): header,
        reserved room (``strict`` False: what the disk has), fdatasync, then fsync the
        directory. Raises ``OSError`` if the header cannot be written, the room cannot
        be reserved (``strict``) on a file system that
        supports it, or the name cannot be made durable."""
        self.fd = create_file(self.path, exclusive=False, append=True)
        try:
            header = ack_file_header(self.generation, next_offset)
            os.write(self.fd, header)
            self.size = len(header)
            self._reserve(strict=strict)
            os.fdatasync(self.fd)
            # Its name too: acks written here are answered as durable, and a crash must
            # not lose the file that holds them (found by the fault simulator).
            fsync_directory(self.directory)
        except OSError:
            self.close()
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            raise

    @classmethod
    def reopen(cls, directory: str, generation: int, good_end: int) -> AckLog:
        """Append to an existing (version-2) file again, after its last valid record
        (bytes after it are cut off). Recovery does this when a new file cannot be
        started, e.g. on a full disk: the file keeps the room reserved for it."""
        self = cls(directory, generation)
        self.fd = os.open(self.path, os.O_RDWR | os.O_APPEND)
        try:
            if os.fstat(self.fd).st_size > good_end:
                os.ftruncate(self.fd, good_end)
                os.fdatasync(self.fd)
        except OSError:
            self.close()
            raise
        self.size = good_end
        return self

    def _reserve(self, *, strict: bool = False) -> None:
        """Reserve room ahead of the end; ``strict``: raise ``OSError`` if the disk is
        full (otherwise what is left of the reservation serves until the next try)."""
        try:
            if reserve(self.fd, self.size, ACK_RESERVE_BYTES):
                self._reserved_to = self.size + ACK_RESERVE_BYTES
        except OSError:
            if strict:
                raise

    def write(
        self,
        ranges: np.ndarray,
        high: int,
        subscriptions: dict[int, np.ndarray] | None = None,
        delays: list[tuple[int, np.ndarray]] | None = None,
        deliveries: list[tuple[int, np.ndarray]] | None = None,
    ) -> None:
        """Append one record of ranges, led by the empty range (high, high) that records
        the queue's next offset, then each subscription's ranges after its marker
        (-1, id), then the delay and delivery-count sections, and fdatasync it. Raises
        ``OSError``; the failed record is cut off before the next write."""
        if self._dirty:
            self.repair()
        header, payload = encode_ack_record(ranges, high, subscriptions, delays, deliveries)
        self._dirty = True
        written = os.writev(self.fd, [header, payload])
        os.fdatasync(self.fd)
        if written != len(header) + len(payload):
            raise OSError(errno.ENOSPC, "short write to the ack log", self.path)
        self.size += written
        self._dirty = False
        if self.size + ACK_RESERVE_BYTES // 2 > self._reserved_to:
            self._reserve()  # best effort: the rest of the reservation still serves

    def repair(self) -> None:
        """Cut the file back to its last good length and fdatasync it."""
        os.ftruncate(self.fd, self.size)
        os.fdatasync(self.fd)
        self._dirty = False
        self._reserved_to = 0  # truncating freed the reservation beyond the end
        self._reserve()

    def close(self) -> None:
        """Close the file (it stays until a checkpoint makes it obsolete)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def list_generations(directory: str) -> list[int]:
    """Generations of the ack log files present, ascending."""
    gens = []
    for name in os.listdir(directory):
        if name.startswith(ACK_PREFIX) and name.endswith(ACK_SUFFIX):
            try:
                gens.append(int(name[len(ACK_PREFIX) : -len(ACK_SUFFIX)]))
            except ValueError:
                continue
    return sorted(gens)


@dataclass
class AckLogContents:
    """What one ack log file holds."""

    ranges: np.ndarray
    #: Highest next offset it records (header and records), 0 if none.
    high: int = 0
    damage: list[str] = field(default_factory=list)
    #: Position after the last valid record (where appending may continue).
    end: int = 0
    #: The file has a valid version-2 header (it may be appended to).
    header_ok: bool = False
    #: Ranges acknowledged by each subscription of an address, by subscription id.
    subscriptions: dict[int, np.ndarray] = field(default_factory=dict)
    #: Damaged records were skipped (their acks lost).
    skipped: bool = False
    #: Delays of nacked messages, in file order: (due µs since the epoch, ranges).
    delays: list[tuple[int, np.ndarray]] = field(default_factory=list)
    #: Delivery counts, in file order: (count, ranges); a later one replaces an earlier.
    deliveries: list[tuple[int, np.ndarray]] = field(default_factory=list)


def read_ack_log(path: str) -> AckLogContents:
    """All valid ranges of one ack log file, the highest next offset it records, and
    reports of damage. A damaged record is skipped (its acks are lost: those messages
    are delivered again); a torn tail ends the file. The file is not changed."""
    with open(path, "rb") as f:
        data = f.read()
    out = AckLogContents(np.zeros((0, 2), dtype=np.int64))
    tagged: dict[int, list[np.ndarray]] = {}
    start = _header_end(data, out, path)
    pos, chunks = start, []
    out.end = start
    while pos < len(data):
        rec = _ack_record_at(data, pos)
        if rec is None:
            nxt = _next_ack_record(data, pos + 1)
            if nxt is None:
                out.damage.append(f"{path}: torn tail of {len(data) - pos} bytes at {pos} ignored")
                break
            out.damage.append(f"{path}: damaged bytes {pos}..{nxt} skipped (acks lost)")
            out.skipped = True
            pos = nxt
            continue
        pairs, pos = rec
        out.end = pos
        plain = _split_subscriptions(_split_tail(pairs, out), tagged)
        chunks.append(plain)
    out.header_ok = _v2_header_ok(data)
    if chunks:
        ranges = np.concatenate(chunks)
        out.high = max(out.high, int(ranges[:, 1].max()))
        out.ranges = ranges[ranges[:, 1] > ranges[:, 0]]
    for sid, parts in tagged.items():
        ranges = np.concatenate(parts)
        out.high = max(out.high, int(ranges[:, 1].max(initial=0)))
        out.subscriptions[sid] = ranges[ranges[:, 1] > ranges[:, 0]]
    return out


def _split_tail(pairs: np.ndarray, out: AckLogContents) -> np.ndarray:
    """The record without its delay and delivery-count sections (they end it), which
    go to ``out.delays`` and ``out.deliveries``."""
    marks = np.flatnonzero(np.isin(pairs[:, 0], _TAIL_MARKS))
    if not len(marks):
        return pairs
    for i, mark in enumerate(marks.tolist()):
        end = int(marks[i + 1]) if i + 1 < len(marks) else len(pairs)
        into = out.delays if pairs[mark, 0] == DELAY_MARK else out.deliveries
        into.append((int(pairs[mark, 1]), pairs[mark + 1 : end]))
    return pairs[: marks[0]]


def _split_subscriptions(pairs: np.ndarray, tagged: dict[int, list[np.ndarray]]) -> np.ndarray:
    """The record's own ranges; each subscription's (after its marker) go to ``tagged``."""
    marks = np.flatnonzero(pairs[:, 0] == SUBSCRIPTION_MARK)
    if not len(marks):
        return pairs
    for i, mark in enumerate(marks.tolist()):
        end = int(marks[i + 1]) if i + 1 < len(marks) else len(pairs)
        tagged.setdefault(int(pairs[mark, 1]), []).append(pairs[mark + 1 : end])
    return pairs[: marks[0]]


def _v2_header_ok(data: bytes) -> bool:
    if len(data) < ACK_HEADER.size or data[:8] != ACK_MAGIC:
        return False
    version, hcrc = ACK_HEADER.unpack_from(data, 0)[1], ACK_HEADER.unpack_from(data, 0)[5]
    return version == ACK_VERSION and crc32([data[:32]]) == hcrc


def _header_end(data: bytes, out: AckLogContents, path: str) -> int:
    """Position of the first record; notes the header's next offset in ``out``."""
    if len(data) >= ACK_HEADER.size and data[:8] == ACK_MAGIC:
        _m, version, _r, _gen, next_offset, hcrc, _r2 = ACK_HEADER.unpack_from(data, 0)
        if version == ACK_VERSION and crc32([data[:32]]) == hcrc:
            out.high = next_offset
            return ACK_HEADER.size
    v1 = len(data) >= ACK_HEADER_V1.size and data[:8] == ACK_MAGIC
    if v1 and ACK_HEADER_V1.unpack_from(data, 0)[1] == 1:
        return ACK_HEADER_V1.size
    if data:
        out.damage.append(f"{path}: bad header; its records are read all the same")
    # The records after a damaged header still count: look for the first one.
    first = _next_ack_record(data, 0)
    return len(data) if first is None else first


def _ack_record_at(data: bytes, pos: int) -> tuple[np.ndarray, int] | None:
    if len(data) - pos < ACK_RECORD_HEADER.size:
        return None
    magic, crc, length = ACK_RECORD_HEADER.unpack_from(data, pos)
    start = pos + ACK_RECORD_HEADER.size
    payload = data[start : start + length]
    if magic != ACK_RECORD_MAGIC or len(payload) != length or length % 16 or not length:
        return None
    if crc32([payload]) != crc:
        return None
    return np.frombuffer(payload, dtype=np.int64).reshape(-1, 2), start + length


def _next_ack_record(data: bytes, pos: int) -> int | None:
    magic = struct.pack("<I", ACK_RECORD_MAGIC)
    while True:
        pos = data.find(magic, pos)
        if pos < 0:
            return None
        if _ack_record_at(data, pos) is not None:
            return pos
        pos += 1
