"""Record framing: one MessageBatch as header + payload, and reading it back.

docs/FORMAT.md, "Segment files", describes the bytes; the constants are in ``format.py``.
In a version-2 segment a header is valid only with its segment's salt and at its own
file position (``record_seed``): bytes copied from elsewhere never frame a record.
"""

from __future__ import annotations

import numpy as np

from raymq.batch import MessageBatch
from raymq.storage.format import RECORD_HEADER, RECORD_MAGIC, crc32, record_seed


class CorruptRecord(Exception):
    """A record failed its checksum or framing checks (internal to storage)."""


def record_payload(batch: MessageBatch) -> tuple[list[memoryview], int, int]:
    """The payload buffers of ``batch`` (no copy), their length and their CRC."""
    payload = [
        memoryview(batch.timestamps),
        memoryview(batch.body_offsets),
        memoryview(batch.prop_offsets),
        memoryview(batch.body_data),
        memoryview(batch.prop_data),
    ]
    return payload, sum(p.nbytes for p in payload), crc32(payload)


def record_header(
    pcrc: int, length: int, first: int, count: int, salt: int | None, position: int
) -> bytes:
    """The header of a record at file ``position`` of a segment with ``salt``."""
    tail = RECORD_HEADER.pack(RECORD_MAGIC, 0, pcrc, length, first, count, 0)[8:]
    hcrc = crc32([tail], record_seed(salt, position))
    return RECORD_HEADER.pack(RECORD_MAGIC, hcrc, pcrc, length, first, count, 0)


def encode_record(batch: MessageBatch, salt: int | None, position: int) -> list:
    """Frame ``batch`` as a record at ``position``: the header, then the payload buffers
    (a list for ``os.pwritev``, so that bodies are never joined into a copy)."""
    payload, length, pcrc = record_payload(batch)
    return [record_header(pcrc, length, batch.first_offset, len(batch), salt, position), *payload]


def parse_header(
    buf: bytes | memoryview, at: int, salt: int | None, position: int
) -> tuple[int, int, int, int] | None:
    """(payload crc, length, first offset, count) of a valid header at index ``at`` of
    ``buf``, which is file ``position`` of a segment with ``salt``; None if invalid."""
    if len(buf) - at < RECORD_HEADER.size:
        return None
    magic, hcrc, pcrc, length, first, count, _flags = RECORD_HEADER.unpack_from(buf, at)
    if magic != RECORD_MAGIC:
        return None
    if crc32([buf[at + 8 : at + RECORD_HEADER.size]], record_seed(salt, position)) != hcrc:
        return None
    return pcrc, length, first, count


def decode_payload(payload: bytes | memoryview, first: int, count: int) -> MessageBatch:
    """Turn a record payload back into a MessageBatch without copying the bodies."""
    u8 = np.frombuffer(payload, dtype=np.uint8)
    n = count
    p = 0
    if len(u8) < 8 * n + 16 * (n + 1):
        raise CorruptRecord(f"record at offset {first}: payload shorter than its arrays")
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
