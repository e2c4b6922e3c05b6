"""The checkpoint: every live segment's index and ack flags, and where to replay from.

Written atomically: ``stage_checkpoint`` (``checkpoint.tmp``, 0600, fsync) then
``commit_checkpoint`` (rename, directory fsync); see docs/FORMAT.md, "Checkpoint".
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import msgpack
import numpy as np

from raymq.storage.files import fsync_directory, write_synced
from raymq.storage.format import (
    CHECKPOINT_MAGIC,
    CHECKPOINT_NAME,
    CHECKPOINT_VERSION,
    DamagedFile,
    frame,
    unframe,
)
from raymq.storage.segment import Segment


def encode_checkpoint(
    segments: Iterable[Segment],
    next_offset: int,
    ack_generation: int,
    deleted: Iterable[int] = (),
    subscriptions: dict[int, bytes] | None = None,
    routed_to: int | None = None,
    duplicate_ids: list[tuple[str, int, float]] | None = None,
    delayed: list[tuple[int, int]] | None = None,
    delivered: list[tuple[int, np.ndarray]] | None = None,
) -> bytes:
    """The checkpoint file's bytes for the current state of ``segments``; ``deleted``:
    base offsets of deleted segments whose file could not be unlinked; ``subscriptions``:
    an address's acknowledged ranges per subscription id (``AckRanges.to_bytes``), and
    ``routed_to``: its filters' decisions below it are in them; ``duplicate_ids``:
    producer ids remembered (id, offset, seconds since the epoch), stored as whole
    microseconds."""
    extra: dict = {}
    if subscriptions is not None:
        extra = {"subscriptions": sorted(subscriptions.items()), "routed_to": routed_to}
    if duplicate_ids:
        extra["duplicate_ids"] = [[m, o, round(t * 1e6)] for m, o, t in duplicate_ids]
    if delayed:  # (offset, due µs) of nacked messages waiting out a delay
        extra["delayed"] = [[o, due] for o, due in delayed]
    if delivered:  # (count, [start, end) ranges) of unacknowledged messages delivered
        extra["delivered"] = [
            [n, r.astype("<i8", copy=False).tobytes()] for n, r in delivered if len(r)
        ]
    body = msgpack.packb(
        {
            **extra,
            "next_offset": next_offset,
            "ack_generation": ack_generation,
            "deleted": sorted(deleted),
            "segments": [
                {
                    "base": s.base_offset,
                    "size": s.size,
                    "count": s.count,
                    "acked_n": s.acked_n,
                    "lost_n": s.lost_n,
                    "firsts": s.firsts.tobytes(),
                    "positions": s.positions.tobytes(),
                    "acked": np.packbits(s.acked).tobytes(),
                }
                for s in segments
                if s.count
            ],
        }
    )
    return frame(CHECKPOINT_MAGIC, CHECKPOINT_VERSION, body)


def checkpoint_path(directory: str) -> str:
    """Path of the checkpoint file in a queue directory."""
    return os.path.join(directory, CHECKPOINT_NAME)


def stage_checkpoint(directory: str, data: bytes) -> str:
    """Write ``data`` to ``checkpoint.tmp`` and fsync it; returns its path."""
    tmp = checkpoint_path(directory) + ".tmp"
    write_synced(tmp, data)
    return tmp


def commit_checkpoint(directory: str) -> None:
    """Rename the staged checkpoint over the current one and fsync the directory."""
    os.replace(checkpoint_path(directory) + ".tmp", checkpoint_path(directory))
    fsync_directory(directory)


def write_checkpoint(directory: str, data: bytes) -> None:
    """Replace the checkpoint atomically with ``data`` (fsynced, directory too)."""
    stage_checkpoint(directory, data)
    commit_checkpoint(directory)


def read_checkpoint(directory: str) -> tuple[dict | None, str | None]:
    """The checkpoint's contents (None if absent or damaged) and a report of damage."""
    path = checkpoint_path(directory)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None, None
    try:
        return msgpack.unpackb(unframe(data, CHECKPOINT_MAGIC, CHECKPOINT_VERSION, path)), None
    except DamagedFile as exc:
        why = str(exc)
    except (ValueError, msgpack.UnpackException) as exc:
        why = f"{path} is damaged (its body: {exc})"
    return None, f"{why}; checkpoint ignored, all files rescanned"


def duplicate_id_entries(ckpt: dict | None) -> list[tuple[str, int, float]]:
    """The checkpoint's remembered producer ids as (id, offset, seconds since the epoch)."""
    if not ckpt:
        return []
    return [(m, int(o), us / 1e6) for m, o, us in ckpt.get("duplicate_ids", ())]


def subscription_sections(ckpt: dict | None) -> dict[int, bytes]:
    """An address checkpoint's acknowledged ranges per subscription id (bytes of
    little-endian int64 pairs); empty for a queue's."""
    return {int(sid): data for sid, data in (ckpt or {}).get("subscriptions", ())}


def restore_segment(seg: Segment, saved: dict) -> None:
    """Restore a segment's index and ack flags from its checkpoint entry."""
    seg.firsts.frombytes(saved["firsts"])
    seg.positions.frombytes(saved["positions"])
    seg.count = saved["count"]
    packed = np.frombuffer(saved["acked"], dtype=np.uint8)
    flags = np.unpackbits(packed, count=saved["count"])
    seg.set_acked(flags.astype(np.bool_), saved["acked_n"])
    seg.lost_n = saved["lost_n"]
