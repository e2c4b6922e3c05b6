"""Finding the producer ids of stored messages again after a restart.

A message sent with an id carries it as its ``_AMQ_DUPL_ID`` property
(``raymq.core.duplicate_ids``). After a restart the queue remembers the ids of the
messages it stored within its ``dedup_window_s``: those the checkpoint lists (the only
record of ids whose segment was deleted since) and those of the live segments, read
here from the stored properties (never the bodies), newest segment first, until a
segment older than the window.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from raymq.batch import MessageBatch
from raymq.properties import ID_KEY_BYTES, id_in_properties
from raymq.storage.record import CorruptRecord
from raymq.storage.segment import Segment


def ids_in_batch(batch: MessageBatch, since_us: int) -> list[tuple[str, int, float]]:
    """(id, offset, seconds since the epoch) of the messages of ``batch`` (timestamps
    set) stored at ``since_us`` (µs since the epoch) or later that carry an id."""
    if not len(batch.prop_data) or ID_KEY_BYTES not in batch.prop_data.tobytes():
        return []
    out = []
    ts = batch.timestamps if batch.timestamps is not None else np.zeros(len(batch), np.int64)
    for i, blob in enumerate(batch.property_blobs()):
        if not blob or ts[i] < since_us:
            continue
        try:
            mid = id_in_properties(blob)
        except ValueError:  # stored by the queue, so well formed: never seen
            continue
        if mid is not None:
            out.append((mid, batch.first_offset + i, int(ts[i]) / 1e6))
    return out


def segment_ids(seg: Segment) -> list[tuple[str, int, float]]:
    """The ids stored in one segment (a record that cannot be read has none)."""
    out: list[tuple[str, int, float]] = []
    for k in range(len(seg.firsts)):
        try:
            batch = seg.read_properties(k)
        except (CorruptRecord, OSError):
            continue
        if batch is not None:
            out.extend(ids_in_batch(batch, 0))
    return out


def stored_ids(segments: Iterable[Segment], since_us: int) -> list[tuple[str, int, float]]:
    """The ids of the messages in ``segments`` stored at ``since_us`` (µs since the
    epoch) or later, newest segment first, until a segment older than that. A damaged
    record has none (reads quarantine it later); ``OSError`` is raised: recovery, which
    calls this, fails and is retried, before it hides the damage it found."""
    out: list[tuple[str, int, float]] = []
    for seg in reversed(list(segments)):
        older = True
        damaged = seg.damaged_records
        for k in range(len(seg.firsts)):
            if damaged and k in damaged:
                continue
            try:
                batch = seg.read_properties(k)
            except CorruptRecord:
                continue
            if batch is None or not len(batch) or batch.timestamps is None:
                continue
            if batch.timestamps[-1] >= since_us:
                older = False
                out.extend(ids_in_batch(batch, since_us))
        if seg.count and older:  # offsets are given in time order: older ones are older
            break
    return out
