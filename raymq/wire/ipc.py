"""Arrow IPC streams: how deliveries travel inline on the fetch and delivery protocols."""

from __future__ import annotations

import pyarrow as pa


def to_ipc(batch: pa.RecordBatch) -> pa.Buffer:
    """``batch`` as an Arrow IPC stream (a slice writes only its rows)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue()


def from_ipc(data: bytes | bytearray | memoryview) -> pa.RecordBatch:
    """The one RecordBatch of an IPC stream (its buffers point into ``data``)."""
    return pa.ipc.open_stream(pa.py_buffer(data)).read_next_batch()
