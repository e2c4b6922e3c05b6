"""Arrow IPC streams: how deliveries travel inline on the fetch and delivery protocols.

A stream is a schema message, record batch messages, and an end-of-stream marker.
Nearly every stream here holds one small batch in ``DELIVERY_SCHEMA``: writing one with
``RecordBatchStreamWriter`` and reading it with ``open_stream`` cost 8 and 12 µs on
these machines, most of it making and parsing the same schema message every time. So
a delivery batch's stream is the schema message serialized once, the batch's own
message and the marker (the same bytes the writer makes), and a stream that starts
with that schema message is read by reading its batch message alone (3 and 7 µs).
Anything else goes the general way.
"""

from __future__ import annotations

import pyarrow as pa

from raymq.batch import DELIVERY_SCHEMA

#: The stream writer's options, made once: without them pyarrow reads two environment
#: variables for every stream it writes (a fifth of a small delivery's encoding).
_WRITE_OPTIONS = pa.ipc.IpcWriteOptions()
#: ``DELIVERY_SCHEMA``'s schema message, as the stream writer writes it.
_SCHEMA_MESSAGE: pa.Buffer = DELIVERY_SCHEMA.serialize()
_SCHEMA_BYTES = _SCHEMA_MESSAGE.size
#: The end-of-stream marker: a continuation token and a zero length.
_END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"
#: Batches up to this many bytes of buffers take the short way out: it copies the
#: batch's message once more (to join it to the schema's), which is nothing for a small
#: batch and not worth it for a large one (bytes).
SHORT_WRITE_BYTES = 64 * 1024


def to_ipc(batch: pa.RecordBatch) -> pa.Buffer:
    """``batch`` as an Arrow IPC stream (a slice writes only its rows)."""
    if batch.get_total_buffer_size() <= SHORT_WRITE_BYTES and batch.schema.equals(
        DELIVERY_SCHEMA, check_metadata=True
    ):
        return pa.py_buffer(b"".join((_SCHEMA_MESSAGE, batch.serialize(), _END_OF_STREAM)))
    sink = pa.BufferOutputStream()
    with pa.ipc.RecordBatchStreamWriter(sink, batch.schema, options=_WRITE_OPTIONS) as writer:
        writer.write_batch(batch)
    return sink.getvalue()


def from_ipc(data: bytes | bytearray | memoryview | pa.Buffer) -> pa.RecordBatch:
    """The first RecordBatch of an IPC stream (its buffers point into ``data``).
    Raises ``pyarrow.ArrowInvalid`` (or ``OSError``) for what is not such a stream."""
    buffer = pa.py_buffer(data)
    try:
        if buffer.size > _SCHEMA_BYTES and buffer.slice(0, _SCHEMA_BYTES).equals(_SCHEMA_MESSAGE):
            return pa.ipc.read_record_batch(buffer.slice(_SCHEMA_BYTES), DELIVERY_SCHEMA)
        return pa.ipc.open_stream(buffer).read_next_batch()
    except (EOFError, StopIteration):  # a stream that ends before its batch
        raise pa.ArrowInvalid("an Arrow IPC stream without a record batch") from None
