"""Queues and Ray Data, both ways, acknowledging only what is safe.

- ``QueueReader`` (``raymq.queue_reader``): a queue leased and read by Ray Data's read
  tasks in parallel, acknowledged on ``commit()``, given back on ``abort()`` or when
  the driver dies;
- ``QueueDatasink`` (``raymq.queue_sink``): a Dataset written into a queue, each row
  once however often Ray Data retries;
- ``read_queue``: a reader committed once its Dataset is materialized.

The Arrow side (columns, schemas, encoding) is ``raymq.arrow_messages``; the names
callers use from it are here too.
"""

from __future__ import annotations

import pyarrow as pa
import ray

from raymq.arrow_messages import (
    DEFAULT_BATCH_ROWS,
    HEADER_COLUMNS,
    conform,
    delivery_to_table,
    encode_arrow,
    progress_bar,
    resolve_queue,
    unify_schemas,
)
from raymq.client import Broker, Queue
from raymq.queue_reader import QueueReader, leased_blocks
from raymq.queue_sink import QueueDatasink

__all__ = [
    "DEFAULT_BATCH_ROWS",
    "HEADER_COLUMNS",
    "QueueDatasink",
    "QueueReader",
    "conform",
    "delivery_to_table",
    "encode_arrow",
    "progress_bar",
    "read_queue",
    "resolve_queue",
    "unify_schemas",
]


def read_queue(
    queue: Queue | str,
    selector: str | None = None,
    max_messages: int | None = None,
    *,
    broker: Broker | None = None,
    timeout: float = 2.0,
    batch_rows: int = DEFAULT_BATCH_ROWS,
    headers: bool = True,
    progress: bool = True,
) -> ray.data.Dataset:
    """Consume (and acknowledge) what a queue holds into a materialized Ray Dataset.

    A ``QueueReader`` leases the messages (``selector``: a JMS selector over the
    properties; at most ``max_messages``; when the queue has none for the reader, it
    waits up to ``timeout`` seconds for a first one), Ray Data's read tasks read them
    into object-store blocks of ``batch_rows`` messages with one schema (columns
    ``offset``, ``timestamp`` (when stored, µs UTC), ``body``, then one per property;
    ``headers=False`` leaves out offset and timestamp), and only then are they
    acknowledged: a read that fails on the way, or a driver that dies, leaves them in
    the queue. Nothing passes through the driver but offsets.
    """
    reader = QueueReader(
        resolve_queue(queue, broker),
        selector=selector,
        max_messages=max_messages,
        batch_rows=batch_rows,
        headers=headers,
        progress=progress,
        timeout=timeout,
    )
    with leased_blocks(reader) as got:
        if got.refs:
            ds = ray.data.from_arrow_refs(got.refs)
        else:
            ds = ray.data.from_arrow(pa.Table.from_pylist([], schema=got.schema))
        reader.commit()
    return ds
