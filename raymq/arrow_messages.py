"""Messages as Arrow: deliveries to tables with one column per property, many blocks to
one schema, tables to the bytes ``send_batch`` writes; shared by ``raymq.data``
(``QueueReader``, ``QueueDatasink``, ``read_queue``) and ``raymq.spark``.

Columns: ``offset`` (int64), ``timestamp`` (when the queue stored the message,
timestamp[us, UTC]), ``body`` (binary), then one column per property name in order of
first appearance. A property missing from a message is null in its row. A property whose
values have one type across the read keeps it (str, int64, float64, bool); ints mixed
with floats become float64, other mixtures strings (``true``/``false`` for bools).
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from raymq.batch import MessageBatch
from raymq.client import Broker, Queue
from raymq.errors import InvalidSetting
from raymq.properties import encode_properties

#: Columns every block read from a queue starts with, before the property columns.
HEADER_COLUMNS = ("offset", "timestamp", "body")
_HEADER_TYPES = {
    "offset": pa.int64(),
    "timestamp": pa.timestamp("us", tz="UTC"),
    "body": pa.binary(),
}
#: Messages per block unless told otherwise: large enough that per-block costs (an
#: object-store put, a Spark partition) are small, small enough to stay a few MiB.
DEFAULT_BATCH_ROWS = 50_000


def resolve_queue(queue: Queue | str, broker: Broker | None = None) -> Queue:
    """A ``Queue`` handle from a handle, or from a name together with ``broker``.

    Raises ``TypeError`` for a name without a broker (RayMQ never guesses which broker
    a name belongs to) and ``QueueNotFound`` for a name the broker does not know.
    """
    if isinstance(queue, Queue):
        return queue
    if isinstance(queue, str):
        if broker is None:
            raise TypeError(
                f"queue {queue!r} given by name: pass broker= (from raymq.connect()) "
                "or a Queue handle"
            )
        return broker.get_queue(queue)
    raise TypeError(f"queue must be a raymq Queue or a queue name, not {type(queue).__name__}")


# -- decoding deliveries -----------------------------------------------------------


def _property_dicts(props: pa.Array) -> list[dict[str, Any]]:
    """Decode a delivery batch's msgpack ``properties`` column into one dict per row."""
    n = len(props)
    if n == 0:
        return []
    bufs = props.buffers()
    width = np.int64 if pa.types.is_large_binary(props.type) else np.int32
    offsets = np.frombuffer(bufs[1], dtype=width)[props.offset : props.offset + n + 1]
    start, end = int(offsets[0]), int(offsets[-1])
    if bufs[2] is not None and np.diff(offsets).min() > 0:
        # Every row has properties: the maps lie back to back in one buffer, and one
        # streaming unpacker over it is about twice as fast as unpacking row by row.
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(end - start, 1))
        unpacker.feed(memoryview(bufs[2])[start:end])
        return list(unpacker)
    return [msgpack.unpackb(b, raw=False) if b else {} for b in props.to_pylist()]


def _text(value: Any) -> str | None:
    """A property value as text, spelled as pyarrow casts it (bools as true/false)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _property_array(values: list[Any]) -> pa.Array:
    """One property column from Python values: typed when the values agree."""
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        pass
    numeric = all(
        v is None or (isinstance(v, int | float) and not isinstance(v, bool)) for v in values
    )
    if numeric:  # ints too large for a double's mantissa mixed with floats
        return pa.array([None if v is None else float(v) for v in values], pa.float64())
    return pa.array([_text(v) for v in values], pa.string())


def delivery_to_table(batch: pa.RecordBatch | pa.Table, *, headers: bool = True) -> pa.Table:
    """A ``Consumer.receive_batch`` result as a table with one column per property.

    Columns: ``offset`` and ``timestamp`` (unless ``headers`` is False), ``body``
    (binary), then the properties in order of first appearance (null where a message
    lacks one). Raises ``InvalidSetting`` if a property is named like a header column.
    """
    if isinstance(batch, pa.Table):
        batch = batch.combine_chunks().to_batches()[0] if batch.num_rows else None
    if batch is None or batch.num_rows == 0:
        names = HEADER_COLUMNS if headers else ("body",)
        return pa.table({c: pa.array([], _HEADER_TYPES[c]) for c in names})
    dicts = _property_dicts(batch.column("properties"))
    keys: dict[str, None] = {}
    for d in dicts:
        for k in d:
            if k not in keys:
                keys[k] = None
    columns: dict[str, pa.Array] = {}
    if headers:
        columns["offset"] = batch.column("offset")
        columns["timestamp"] = batch.column("timestamp").cast(_HEADER_TYPES["timestamp"])
    columns["body"] = batch.column("body").cast(pa.binary())
    for key in keys:
        if key in columns:
            raise InvalidSetting(
                f"property {key!r} has the name of a header column; read with headers=False"
            )
        columns[key] = _property_array([d.get(key) for d in dicts])
    return pa.table(columns)


def unify_schemas(schemas: list[pa.Schema]) -> pa.Schema:
    """One schema for blocks whose property columns may differ in presence and type.

    Header columns keep their types; a property's type is the one all blocks agree on
    (null-only blocks do not count), float64 for ints mixed with floats, else string.
    """
    types: dict[str, list[pa.DataType]] = {}
    for schema in schemas:
        for f in schema:
            types.setdefault(f.name, []).append(f.type)
    fields = []
    for name, seen in types.items():
        if name in _HEADER_TYPES:
            fields.append(pa.field(name, _HEADER_TYPES[name]))
            continue
        kinds = {t for t in seen if not pa.types.is_null(t)}
        if not kinds:
            kind = pa.string()  # only ever null: a string column of nulls, which Spark accepts
        elif len(kinds) == 1:
            kind = kinds.pop()
        elif kinds == {pa.int64(), pa.float64()}:
            kind = pa.float64()
        else:
            kind = pa.string()
        fields.append(pa.field(name, kind))
    return pa.schema(fields)


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` with exactly ``schema``'s columns: missing ones null, types cast."""
    if table.schema == schema:
        return table
    columns = []
    for f in schema:
        if f.name not in table.column_names:
            columns.append(pa.nulls(table.num_rows, f.type))
            continue
        col = table.column(f.name)
        if col.type == f.type:
            columns.append(col)
        elif pa.types.is_boolean(col.type) and pa.types.is_string(f.type):
            columns.append(pa.array([_text(v) for v in col.to_pylist()], pa.string()))
        else:
            columns.append(col.cast(f.type, safe=False))
    return pa.Table.from_arrays(columns, schema=schema)


# -- encoding Arrow rows as messages ----------------------------------------------------

_NO_BYTES = pa.scalar(b"", pa.large_binary())
_TRUE, _FALSE = pa.scalar(b"\xc3", pa.large_binary()), pa.scalar(b"\xc2", pa.large_binary())
_NO_DATA = np.zeros(0, dtype=np.uint8)


def _rows_bytes(mat: np.ndarray, lens: np.ndarray) -> pa.Array:
    """Row i's first ``lens[i]`` bytes of the uint8 matrix ``mat``, as a binary array."""
    offsets = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    data = mat[np.arange(mat.shape[1]) < lens[:, None]]
    return pa.Array.from_buffers(
        pa.large_binary(), len(lens), [None, pa.py_buffer(offsets), pa.py_buffer(data)]
    )


def _tagged(
    n: int, be: np.ndarray, classes: list[tuple[np.ndarray, int | None, int]], width: int
) -> pa.Array:
    """msgpack heads: for each (rows, tag, size) class, ``tag`` then the last ``size - 1``
    big-endian bytes of ``be``; a ``None`` tag means a one-byte fix form taken as is."""
    mat = np.zeros((n, width), dtype=np.uint8)
    lens = np.zeros(n, dtype=np.int64)
    for rows, tag, size in classes:
        idx = np.flatnonzero(rows)
        if len(idx) == 0:
            continue
        lens[idx] = size
        if tag is None:
            mat[idx, 0] = be[idx, -1]
        else:
            mat[idx, 0] = tag
            mat[idx, 1:size] = be[idx, be.shape[1] - size + 1 :]
    return _rows_bytes(mat, lens)


def _msgpack_ints(v: np.ndarray) -> pa.Array:
    """int64 values in msgpack's smallest form, as msgpack-python's Packer writes them."""
    be = v.astype(">i8").view(np.uint8).reshape(len(v), 8)
    return _tagged(
        len(v),
        be,
        [
            ((v >= -32) & (v <= 127), None, 1),  # fixint: the low byte is the encoding
            ((v > 127) & (v <= 0xFF), 0xCC, 2),
            ((v > 0xFF) & (v <= 0xFFFF), 0xCD, 3),
            ((v > 0xFFFF) & (v <= 0xFFFFFFFF), 0xCE, 5),
            (v > 0xFFFFFFFF, 0xCF, 9),
            ((v < -32) & (v >= -(2**7)), 0xD0, 2),
            ((v < -(2**7)) & (v >= -(2**15)), 0xD1, 3),
            ((v < -(2**15)) & (v >= -(2**31)), 0xD2, 5),
            (v < -(2**31), 0xD3, 9),
        ],
        9,
    )


def _msgpack_strings(col: pa.Array) -> pa.Array:
    """UTF-8 strings as msgpack str (fixstr, str8, str16, str32) with their bytes."""
    data = col.cast(pa.large_binary())
    lens = pc.binary_length(data).fill_null(0).to_numpy().astype(np.int64)
    be = lens.astype(">u4").view(np.uint8).reshape(len(lens), 4)
    fix = be.copy()
    fix[:, -1] |= 0xA0  # fixstr: 0xa0 | length in one byte
    heads = _tagged(
        len(lens),
        fix,
        [(lens < 32, None, 1)],
        5,
    )
    longer = _tagged(
        len(lens),
        be,
        [
            ((lens >= 32) & (lens < 2**8), 0xD9, 2),
            ((lens >= 2**8) & (lens < 2**16), 0xDA, 3),
            (lens >= 2**16, 0xDB, 5),
        ],
        5,
    )
    return pc.binary_join_element_wise(heads, longer, data, _NO_BYTES)


def _msgpack_values(col: pa.Array) -> pa.Array | None:
    """Each value of a property column msgpack-encoded, or None for a type this fast path
    does not handle (the caller falls back to ``MessageBatch.from_arrow``)."""
    t = col.type
    n = len(col)
    if pa.types.is_dictionary(t):
        return _msgpack_values(col.dictionary_decode())
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return _msgpack_strings(col)
    if pa.types.is_boolean(t):
        return pc.if_else(col, _TRUE, _FALSE)
    if pa.types.is_integer(t):
        if pa.types.is_uint64(t) and (pc.max(col).as_py() or 0) >= 2**63:
            return None  # out of int64: from_arrow raises InvalidProperties
        return _msgpack_ints(col.cast(pa.int64()).fill_null(0).to_numpy())
    if pa.types.is_floating(t):  # Python floats, so msgpack float 64 whatever the width
        mat = np.empty((n, 9), dtype=np.uint8)
        mat[:, 0] = 0xCB
        f = col.cast(pa.float64()).fill_null(0.0).to_numpy()
        mat[:, 1:] = f.astype(">f8").view(np.uint8).reshape(n, 8)
        return _rows_bytes(mat, np.full(n, 9, dtype=np.int64))
    return None


def encode_arrow(
    data: pa.Table | pa.RecordBatch, *, max_message_size: int, queue: str = "?"
) -> MessageBatch:
    """``MessageBatch.from_arrow`` vectorized: the same messages, byte for byte.

    A ``body`` column (binary or string) and property columns of string, boolean,
    integer or floating type; nulls are absent properties. ``from_arrow`` builds a dict
    per row and packs it with msgpack (about 2.5 µs a row with two properties); this
    writes msgpack's encodings with NumPy and Arrow kernels, several times faster. Other
    column types go to ``from_arrow`` (which raises ``InvalidProperties`` for them).
    """
    if not isinstance(data, pa.Table | pa.RecordBatch):
        raise TypeError(f"expected a pyarrow Table or RecordBatch, not {type(data).__name__}")
    if isinstance(data, pa.RecordBatch):
        data = pa.Table.from_batches([data])
    names = [c for c in data.column_names if c != "body"]
    pieces, count = [], np.zeros(data.num_rows, dtype=np.int64)
    for name in names:
        col = data.column(name).combine_chunks()
        if pa.types.is_null(col.type):
            continue  # every value absent
        values = _msgpack_values(col) if name and len(names) < 2**16 else None
        if values is None:
            return MessageBatch.from_arrow(data, max_message_size=max_message_size, queue=queue)
        valid = col.is_valid()
        count += valid.to_numpy(zero_copy_only=False)
        key = pa.scalar(encode_properties({name: None})[1:-1], pa.large_binary())
        pieces.append(
            pc.if_else(valid, pc.binary_join_element_wise(key, values, _NO_BYTES), _NO_BYTES)
        )
    bodies = MessageBatch.from_arrow(
        data.select(["body"]) if "body" in data.column_names else data,
        max_message_size=max_message_size,
        queue=queue,
    )
    if not pieces:
        return bodies
    # The map header: fixmap up to 15 entries, else map16; no properties at all is b"".
    be = count.astype(">u2").view(np.uint8).reshape(len(count), 2)
    fix = be.copy()
    fix[:, -1] |= 0x80
    head = pc.binary_join_element_wise(
        _tagged(len(count), fix, [((count > 0) & (count <= 15), None, 1)], 3),
        _tagged(len(count), be, [(count > 15, 0xDE, 3)], 3),
        _NO_BYTES,
    )
    props = pc.binary_join_element_wise(head, *pieces, _NO_BYTES)
    bufs = props.buffers()
    offsets = np.frombuffer(bufs[1], dtype=np.int64)[props.offset : props.offset + len(props) + 1]
    start, end = int(offsets[0]), int(offsets[-1])
    prop_data = np.frombuffer(bufs[2], dtype=np.uint8)[start:end] if end > start else _NO_DATA
    return MessageBatch(bodies.body_offsets, bodies.body_data, offsets - start, prop_data)


# -- draining a queue ----------------------------------------------------------------


class _Progress:
    """A rich progress bar of messages (or a no-op), advanced by the caller."""

    def __init__(self, description: str, total: int | None, enabled: bool):
        self._bar = None
        if enabled:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("messages"),
                TimeElapsedColumn(),
            )
            self._task = self._bar.add_task(description, total=total)

    def __enter__(self) -> _Progress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def advance(self, n: int) -> None:
        """Count ``n`` more messages."""
        if self._bar is not None:
            self._bar.advance(self._task, n)

    def set_total(self, total: int | None) -> None:
        """Change the expected number of messages."""
        if self._bar is not None:
            self._bar.update(self._task, total=total)


def progress_bar(description: str, total: int | None, enabled: bool = True) -> _Progress:
    """A rich progress bar counting messages (``total`` None: unknown); a context manager."""
    return _Progress(description, total, enabled)
