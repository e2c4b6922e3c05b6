"""What a fetch materializes, without Ray: the delivery rows made from stored batches."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from raymq.batch import MessageBatch
from raymq.core.subscription import Subscription

FIRST = 100


def stored(n: int, first: int = FIRST) -> MessageBatch:
    batch = MessageBatch.from_bodies(
        [f"body {first + i}".encode() for i in range(n)],
        [{"i": first + i} if i % 2 else None for i in range(n)],
        max_message_size=1024,
    )
    batch.first_offset = first
    batch.timestamps = np.arange(first, first + n, dtype=np.int64) * 1000
    return batch


def reader(batches: list[MessageBatch]):
    """``Subscription._read`` over ``batches``: those holding any of [start, end)."""

    def read(start: int, end: int) -> list[MessageBatch]:
        return [b for b in batches if b.first_offset < end and b.first_offset + len(b) > start]

    return read


def expected_rows(batches: list[MessageBatch], offsets: list[int], counts: list[int]) -> list:
    rows = {}
    for b in batches:
        arrow = b.to_arrow()
        for i, offset in enumerate(arrow.column("offset").to_pylist()):
            rows[offset] = arrow.slice(i, 1).to_pylist()[0]
    return [{**rows[o], "delivery_count": c} for o, c in zip(offsets, counts, strict=True)]


@pytest.mark.parametrize("layout", ["one batch", "two batches"])
def test_every_choice_of_rows_is_materialized_with_its_own_counts(layout):
    """Consecutive rows of one batch take the quick way (a slice, one conversion);
    everything else the general one: both give the same rows, bodies, properties,
    timestamps, and the delivery counts of this delivery."""
    batches = [stored(6)] if layout == "one batch" else [stored(3), stored(3, FIRST + 3)]
    sub = Subscription.__new__(Subscription)  # _materialize needs no state with ``read``
    every = range(FIRST, FIRST + 6)
    for k in range(1, 7):
        for chosen in itertools.combinations(every, k):
            offsets = np.array(chosen, dtype=np.int64)
            counts = np.arange(2, 2 + k, dtype=np.int32)
            got = sub._materialize(offsets, counts, read=reader(batches))
            assert got.to_pylist() == expected_rows(batches, list(chosen), counts.tolist())
