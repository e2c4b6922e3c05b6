"""What a receive returns: ``Message`` and ``Messages`` (a zero-copy view of an
Arrow record batch), and the helpers that read delivery batches."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import repeat
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import ray

from raymq.errors import (
    InvalidSetting,
)
from raymq.properties import decode_properties

#: Messages ``for message in consumer`` takes from the buffer at a time: each chunk has
#: a fixed cost (Arrow column conversions) worth about 50-100 ns a message at 256.
ITER_CHUNK_MESSAGES = 1024


class Message(NamedTuple):
    """One delivered message.

    A named tuple: ``receive`` makes one per message, and a tuple is the cheapest
    Python object to make (about 0.3 µs against 0.6 µs for a slotted class, 4 µs for
    the dataclass this was), which kept ``receive()`` at a quarter of ``receive_batch``.
    """

    offset: int
    body: bytes
    delivery_count: int
    #: Seconds since the epoch when the queue stored the message.
    timestamp: float
    #: The properties as stored (a msgpack map; ``b""`` for none).
    raw_properties: bytes = b""

    @property
    def properties(self) -> dict[str, Any]:
        """The message's properties, decoded from ``raw_properties`` on each access."""
        return decode_properties(self.raw_properties)


class Messages(Sequence):
    """What ``receive`` returns: a sequence of ``Message`` (``len``, index, slice,
    iterate, ``==`` and ``+`` with lists; ``list(messages)`` for a list) over the
    received rows.

    Each ``Message`` is made when it is reached (iterating, indexing), not all up front,
    and is not kept: a message the application drops is freed at once. A list of 1,000
    live tuples cost more than making them (Python's garbage collector walked them and,
    as they outlived its youngest generation, the whole heap every few thousand
    messages). ``consumer.ack(messages)`` of the sequence (or a slice of it) takes the
    offsets column as one array, with no work per message."""

    __slots__ = ("_batch", "_columns_cache")

    def __init__(self, batch: pa.RecordBatch | None = None):
        self._batch = batch if batch is not None and batch.num_rows else None
        self._columns_cache: tuple[list, ...] | None = None

    @property
    def offsets(self) -> np.ndarray:
        """The messages' offsets, in order (int64; a view of the received rows)."""
        if self._batch is None:
            return np.zeros(0, dtype=np.int64)
        return np.asarray(self._batch.column("offset").to_numpy(), dtype=np.int64)

    def _columns(self) -> tuple[list, ...]:
        """The rows as Python values, column by column: made once, on first use.

        Column by column: ``RecordBatch.to_pydict`` made a ``datetime`` of every
        timestamp, 4 ms per 1,000 messages, more than receiving them."""
        cols = self._columns_cache
        if cols is None:
            b = self._batch
            if b is None:
                cols = ([], [], [], [], [])
            else:
                # Microseconds as int64 without a compute kernel (a fixed cost per call).
                micros = b.column("timestamp").to_numpy().view(np.int64)
                cols = (
                    b.column("offset").to_numpy().tolist(),
                    b.column("body").to_pylist(),
                    b.column("delivery_count").to_numpy().tolist(),
                    (micros / 1e6).tolist(),
                    # Arrow's C++ conversion: mostly b"" each, made faster than to_pylist.
                    b.column("properties").to_numpy(zero_copy_only=False).tolist(),
                )
            self._columns_cache = cols
        return cols

    def __len__(self) -> int:
        return 0 if self._batch is None else self._batch.num_rows

    def __iter__(self) -> Iterator[Message]:
        # map and zip run in C: no Python code per message.
        return map(_new_tuple, repeat(Message), zip(*self._columns(), strict=True))

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step == 1:
                n = max(stop - start, 0)
                return Messages(None if self._batch is None else self._batch.slice(start, n))
            return [self[i] for i in range(start, stop, step)]
        offsets, bodies, counts, seconds, props = self._columns()
        return _new_tuple(
            Message, (offsets[index], bodies[index], counts[index], seconds[index], props[index])
        )

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Messages | list | tuple):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # compared by value, as a list

    def __add__(self, other: Iterable[Message]) -> list[Message]:
        """A list of both (``got += consumer.receive(...)`` rebinds to a list)."""
        return [*self, *other]

    def __radd__(self, other: Iterable[Message]) -> list[Message]:
        return [*other, *self]

    def __repr__(self) -> str:
        return f"Messages({list(self)!r})"

    def __reduce__(self):
        return Messages, (self._batch,)


_new_tuple = tuple.__new__  # makes a Message from a row tuple without NamedTuple's checks


#: Longest ``Consumer.close`` waits for its TargetList to give back what it held
def _get_batches(refs: list) -> list[pa.RecordBatch | None]:
    """Read delivery batches from the object store (zero-copy on the same node)."""
    lost = (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError)
    try:
        return list(ray.get(refs))
    except lost:
        pass
    out: list[pa.RecordBatch | None] = []
    for ref in refs:
        try:
            out.append(ray.get(ref))
        except lost:
            out.append(None)
    return out


def _messages(batch: pa.RecordBatch) -> Messages:
    """The rows of a delivery batch as ``Message`` tuples (made as they are reached)."""
    return Messages(batch)


def _check_count(name: str, value: object, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidSetting(f"{name}={value!r} must be an int >= {minimum}")


def _offsets_of(messages: Any) -> np.ndarray:
    if isinstance(messages, Messages):  # as received: the column, no work per message
        return messages.offsets
    if isinstance(messages, Message):
        return np.array([messages.offset], dtype=np.int64)
    if isinstance(messages, pa.RecordBatch | pa.Table):
        return np.asarray(messages.column("offset").to_numpy(), dtype=np.int64)
    if isinstance(messages, bool):
        raise TypeError("ack takes messages or offsets, not bool")
    if isinstance(messages, int | np.integer):
        return np.array([int(messages)], dtype=np.int64)
    if isinstance(messages, np.ndarray):
        if messages.dtype.kind not in "iu":
            raise TypeError(f"offsets array must be integer, not {messages.dtype}")
        return messages.astype(np.int64)
    if isinstance(messages, Iterable) and not isinstance(messages, str | bytes):
        out = []
        for m in messages:
            if isinstance(m, Message):
                out.append(m.offset)
            elif isinstance(m, int | np.integer) and not isinstance(m, bool):
                out.append(int(m))
            else:
                raise TypeError(f"ack takes messages or int offsets, not {type(m).__name__}")
        return np.array(out, dtype=np.int64)
    raise TypeError(f"ack takes messages or offsets, not {type(messages).__name__}")
