"""Quickstart: create a durable queue, send, consume and acknowledge.

Run it on an embedded local Ray with ``python examples/quickstart.py``, or against a
cluster with ``ray job submit --working-dir . -- python examples/quickstart.py``.
"""

from __future__ import annotations

import shutil
import tempfile

import raymq


def main() -> None:
    paging = tempfile.mkdtemp(prefix="raymq-quickstart-")
    broker = raymq.connect(namespace="raymq-quickstart", paging_directory=paging)
    orders = broker.create_queue("orders")

    offset = orders.send(b"first order", {"customer": "ada", "amount": 42.5})
    print(f"sent one message at offset {offset}")
    offsets = orders.send_batch(
        [f"order {i}".encode() for i in range(1000)],
        [{"customer": "bob", "amount": float(i)} for i in range(1000)],
    )
    print(
        f"sent a batch of {len(offsets)} messages (offsets {offsets[0]}..{offsets[-1]})"
        " in one write and one fsync"
    )

    with orders.consumer(prefetch=500) as consumer:
        first = consumer.receive(timeout=5)[0]
        print(
            f"received offset {first.offset}: {first.body!r} {first.properties}"
            f" (delivery {first.delivery_count})"
        )
        consumer.ack(first)
        received = 1
        while received < 1001:
            batch = consumer.receive_batch(500, timeout=5)  # an Arrow RecordBatch
            if batch.num_rows == 0:
                break
            consumer.ack(batch)
            received += batch.num_rows
        print(f"received and acknowledged {received} messages")

    stats = orders.stats()
    print(
        f"queue {stats['name']}: depth {stats['depth']}, {stats['segment_files']} segment"
        f" files, {stats['bytes_on_disk']} bytes on disk"
    )
    assert received == 1001 and stats["depth"] == 0, "quickstart did not consume everything"
    broker.delete_queue("orders")
    broker.shutdown()
    shutil.rmtree(paging, ignore_errors=True)


if __name__ == "__main__":
    main()
