"""Constants of the on-disk format shared by writers and readers. See docs/FORMAT.md.

Format version 2: segment headers carry a random salt, and every record header's CRC
covers the salt and the record's own file position, so a record copied into a payload
(or anywhere else) is never valid. Version-1 files are still read.
"""

from __future__ import annotations

import struct
import zlib

try:  # ISA-L computes the same CRC-32 as zlib, ~16x faster here (41 vs 2.5 GiB/s)
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # a platform without isal wheels: same values, slower
    _crc32 = zlib.crc32

#: Segment file header (version 2): magic, version, flags (0), base offset, salt, CRC of
#: the 32 bytes before it, reserved (0).
SEGMENT_MAGIC = b"RAYMQSEG"
SEGMENT_VERSION = 2
SEGMENT_HEADER = struct.Struct("<8sIIQQII")  # 40 bytes
#: Version-1 segment header: magic, version, reserved, base offset (no salt, no CRC).
SEGMENT_HEADER_V1 = struct.Struct("<8sIIQ")  # 24 bytes
#: Magic and version, the same place in both versions.
SEGMENT_PREFIX = struct.Struct("<8sI")

#: Record header: magic, header CRC, payload CRC, payload length, first offset, message
#: count, flags (0). The header CRC covers bytes 8..32; in version 2 it starts from the
#: CRC of RECORD_SEED (segment salt, file position of the record) instead of 0.
RECORD_MAGIC = 0x424D5152  # b"RQMB" little-endian
RECORD_MAGIC_BYTES = struct.pack("<I", RECORD_MAGIC)
RECORD_HEADER = struct.Struct("<IIIIQII")  # 32 bytes
RECORD_SEED = struct.Struct("<QQ")  # 16 bytes

#: Ack log file header (version 2): magic, version, reserved, generation, next offset
#: when the file was started, CRC of the 32 bytes before it, reserved.
ACK_MAGIC = b"RAYMQACK"
ACK_VERSION = 2
ACK_HEADER = struct.Struct("<8sIIQQII")  # 40 bytes
ACK_HEADER_V1 = struct.Struct("<8sIIQ")  # 24 bytes
#: Ack record header: magic, CRC of payload, payload length; payload is int64 pairs.
ACK_RECORD_MAGIC = 0x4B434152  # b"RACK"
ACK_RECORD_HEADER = struct.Struct("<III")  # 12 bytes

#: Header of a framed file (the checkpoint, an address's ``subscriptions``): magic,
#: version, CRC of the body, body length; the body (msgpack) follows. See ``frame``.
CHECKPOINT_HEADER = struct.Struct("<8sIIQ")  # 24 bytes
CHECKPOINT_MAGIC = b"RAYMQCKP"
CHECKPOINT_VERSION = 1

SEGMENT_SUFFIX = ".seg"
#: A damaged region of a segment, copied aside: ``<segment file>.damaged-<position>``.
DAMAGED_SUFFIX = ".damaged"
ACK_PREFIX, ACK_SUFFIX = "acks-", ".log"
CHECKPOINT_NAME = "checkpoint"
QUEUE_CONFIG_NAME = "queue.json"

#: Permissions of every file and directory the storage creates, whatever the umask.
FILE_MODE = 0o600
DIRECTORY_MODE = 0o700


def segment_name(base_offset: int) -> str:
    """File name of the segment whose first message has ``base_offset``."""
    return f"{base_offset:020d}{SEGMENT_SUFFIX}"


def ack_log_name(generation: int) -> str:
    """File name of the ack log of ``generation``."""
    return f"{ACK_PREFIX}{generation:010d}{ACK_SUFFIX}"


def crc32(buffers, crc: int = 0) -> int:
    """CRC-32 (zlib's polynomial) over a sequence of bytes-like buffers."""
    for buf in buffers:
        crc = _crc32(buf, crc)
    return crc


class DamagedFile(ValueError):
    """A framed file whose frame does not hold; the message names the file and why."""


def frame(magic: bytes, version: int, body: bytes) -> bytes:
    """A framed file's bytes: ``CHECKPOINT_HEADER`` (``magic``, ``version``, the CRC
    and length of ``body``), then ``body``."""
    return CHECKPOINT_HEADER.pack(magic, version, crc32([body]), len(body)) + body


def unframe(data: bytes, magic: bytes, version: int, path: str) -> bytes:
    """The body of the framed file ``path`` whose bytes are ``data`` (see ``frame``).
    Raises ``DamagedFile`` naming the file if it is too short for its header or its
    body, or its magic, version or CRC is not the one expected."""
    hs = CHECKPOINT_HEADER.size
    if len(data) < hs:
        raise DamagedFile(f"{path} is damaged ({len(data)} bytes, shorter than a header)")
    got_magic, got_version, crc, length = CHECKPOINT_HEADER.unpack_from(data, 0)
    body = data[hs : hs + length]
    if got_magic != magic:
        why = f"magic {got_magic!r}, not {magic!r}"
    elif got_version != version:
        why = f"version {got_version}, not {version}"
    elif len(body) != length:
        why = f"{len(body)} bytes of body where its header says {length}"
    elif crc32([body]) != crc:
        why = "its CRC does not match"
    else:
        return body
    raise DamagedFile(f"{path} is damaged ({why})")


def record_seed(salt: int | None, position: int) -> int:
    """Initial CRC of a record header at file ``position`` of a segment with ``salt``
    (None for a version-1 segment: 0, the plain CRC)."""
    if salt is None:
        return 0
    return _crc32(RECORD_SEED.pack(salt, position))
