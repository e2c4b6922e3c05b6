"""A backlog many times the memory budget, printing memory and disk as it goes.

With ``flow_to_disk_threshold`` of 16 MiB, 200,000 x 1 KiB messages (about 200 MiB)
are sent with no consumer, then consumed. Memory stays within the budget the
MemoryGovernor gives the queue; the rest is on disk and still delivered in order.

Run it on an embedded local Ray with ``python examples/deep_backlog.py``, or against a
cluster with ``ray job submit --working-dir . -- python examples/deep_backlog.py``
(on a cluster the running broker's settings apply).
"""

from __future__ import annotations

import shutil
import tempfile

import raymq

MIB = 2**20
MESSAGES = 200_000
BATCH = 2_000


def show(queue, what: str) -> None:
    s = queue.stats()
    memory = s["head_cache_bytes"] + s["bytes_in_memory"] + s["index_bytes"]
    budget = "not yet" if s["memory_budget"] < 0 else f"{s['memory_budget'] / MIB:.1f} MiB"
    print(
        f"{what:>28}: depth {s['depth']:>7,}  memory {memory / MIB:6.1f} MiB"
        f" (budget {budget})  disk {s['bytes_on_disk'] / MIB:6.1f} MiB"
        f" in {s['segment_files']} files"
    )


def main() -> None:
    paging = tempfile.mkdtemp(prefix="raymq-deep-")
    broker = raymq.connect(
        namespace="raymq-deep-backlog",
        paging_directory=paging,
        flow_to_disk_threshold=16 * MIB,
        housekeeping_period=0.5,
    )
    try:
        q = broker.create_queue("deep", page_size_bytes=4 * MIB)
        body = b"x" * 1024
        for sent in range(BATCH, MESSAGES + 1, BATCH):
            q.send_batch([body] * BATCH)
            if sent % 50_000 == 0:
                broker.rebalance()  # as the governor does every housekeeping period
                show(q, f"sent {sent:,}")
        received, expected = 0, 0
        with q.consumer(prefetch=BATCH) as consumer:
            while received < MESSAGES:
                batch = consumer.receive_batch(BATCH, timeout=10)
                if batch.num_rows == 0:
                    break
                offsets = batch.column("offset").to_pylist()
                assert offsets == list(range(expected, expected + len(offsets))), "out of order"
                expected += len(offsets)
                consumer.ack(batch)
                received += batch.num_rows
                if received % 50_000 == 0:
                    show(q, f"received {received:,}")
        print(f"received all {received:,} in order; {broker.governor_stats()['rounds']} rounds")
    finally:
        broker.delete_queue("deep")
        broker.shutdown()
        shutil.rmtree(paging, ignore_errors=True)


if __name__ == "__main__":
    main()
