"""The ack log: acknowledged offset ranges, appended and fsynced in groups.

One file per generation; a checkpoint names the first generation still to replay, so
older files are deleted once a newer checkpoint is on disk.
"""

from __future__ import annotations

import os

import numpy as np

from raymq.storage.format import (
    ACK_HEADER,
    ACK_MAGIC,
    ACK_PREFIX,
    ACK_RECORD_HEADER,
    ACK_RECORD_MAGIC,
    ACK_SUFFIX,
    ACK_VERSION,
    ack_log_name,
    crc32,
)


def to_ranges(offsets: np.ndarray) -> np.ndarray:
    """Sorted unique offsets as an (k, 2) int64 array of [start, end) ranges."""
    if len(offsets) == 0:
        return np.zeros((0, 2), dtype=np.int64)
    o = offsets.astype(np.int64, copy=False)
    if len(o) > 1 and not (o[1:] > o[:-1]).all():  # acks come sorted: skip the hash/sort
        o = np.unique(o)
    breaks = np.flatnonzero(np.diff(o) != 1) + 1
    starts = np.concatenate(([o[0]], o[breaks]))
    ends = np.concatenate((o[breaks - 1], [o[-1]])) + 1
    return np.stack([starts, ends], axis=1)


class AckLog:
    """Appends ack ranges to ``acks-<generation>.log`` in ``directory``."""

    def __init__(self, directory: str, generation: int):
        self.directory = directory
        self.generation = generation
        self.path = os.path.join(directory, ack_log_name(generation))
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        if os.fstat(self.fd).st_size == 0:
            os.write(self.fd, ACK_HEADER.pack(ACK_MAGIC, ACK_VERSION, 0, generation))

    def write(self, ranges: np.ndarray, *, fsync: bool = True) -> None:
        """Append one record of ranges and (by default) fdatasync it."""
        if len(ranges):
            payload = np.ascontiguousarray(ranges, dtype=np.int64).tobytes()
            header = ACK_RECORD_HEADER.pack(ACK_RECORD_MAGIC, crc32([payload]), len(payload))
            os.writev(self.fd, [header, payload])
        if fsync:
            os.fdatasync(self.fd)

    def close(self) -> None:
        """Close the file (it stays until a checkpoint makes it obsolete)."""
        os.close(self.fd)


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


def read_ack_log(path: str) -> tuple[np.ndarray, list[str]]:
    """All valid ranges of one ack log file, and reports of any damage (torn tail cut)."""
    with open(path, "rb") as f:
        data = f.read()
    damage: list[str] = []
    if len(data) < ACK_HEADER.size or data[:8] != ACK_MAGIC:
        return np.zeros((0, 2), dtype=np.int64), [f"{path}: bad header, ignored"]
    pos, chunks = ACK_HEADER.size, []
    while pos < len(data):
        if len(data) - pos < ACK_RECORD_HEADER.size:
            break
        magic, crc, length = ACK_RECORD_HEADER.unpack_from(data, pos)
        start = pos + ACK_RECORD_HEADER.size
        payload = data[start : start + length]
        if magic != ACK_RECORD_MAGIC or len(payload) != length or length % 16:
            break
        if crc32([payload]) != crc:
            break
        chunks.append(np.frombuffer(payload, dtype=np.int64).reshape(-1, 2))
        pos = start + length
    if pos < len(data):
        damage.append(f"{path}: torn tail of {len(data) - pos} bytes at {pos} truncated")
        with open(path, "r+b") as f:
            f.truncate(pos)
            os.fsync(f.fileno())
    ranges = np.concatenate(chunks) if chunks else np.zeros((0, 2), dtype=np.int64)
    return ranges, damage
