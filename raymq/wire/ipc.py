"""Arrow IPC streams: how deliveries travel inline on the fetch and delivery protocols."""

from __future__ import annotations

import pyarrow as pa

#: The stream writer's options, made once: without them pyarrow reads two environment
#: variables for every stream it writes (a fifth of a small delivery's encoding).
_WRITE_OPTIONS = pa.ipc.IpcWriteOptions()


def to_ipc(batch: pa.RecordBatch) -> pa.Buffer:
    """``batch`` as an Arrow IPC stream (a slice writes only its rows)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.RecordBatchStreamWriter(sink, batch.schema, options=_WRITE_OPTIONS) as writer:
        writer.write_batch(batch)
    return sink.getvalue()


def from_ipc(data: bytes | bytearray | memoryview | pa.Buffer) -> pa.RecordBatch:
    """The first RecordBatch of an IPC stream (its buffers point into ``data``).
    Raises ``pyarrow.ArrowInvalid`` (or ``OSError``) for what is not such a stream."""
    try:
        return pa.ipc.open_stream(pa.py_buffer(data)).read_next_batch()
    except StopIteration:  # a stream that ends before its batch
        raise pa.ArrowInvalid("an Arrow IPC stream without a record batch") from None
