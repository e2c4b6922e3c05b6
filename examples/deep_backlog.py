"""A backlog many times the memory budget, printing memory and disk as it goes.

200,000 x 1 KiB messages (about 200 MiB) are sent with no consumer, then consumed in
order. Memory stays within the budget the MemoryGovernor gives the queue; the rest is
on disk and still delivered in order.

``python examples/deep_backlog.py`` runs it on an embedded local Ray of its own, with a
broker whose ``flow_to_disk_threshold`` is 16 MiB, so most of the backlog is on disk
only. ``ray job submit --working-dir examples -- python deep_backlog.py`` (or ``--join``)
joins the running broker instead, and that broker's settings apply: with its default
threshold (75 % of the object stores) the 200 MiB may fit in memory; start it with
``raymq start --flow-to-disk-threshold 16MiB`` to watch it page. Either way its queue
``example.deep_backlog`` is deleted at the end.
"""

from __future__ import annotations

from _common import example_broker

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
    with example_broker(
        "deep-backlog", flow_to_disk_threshold=16 * MIB, housekeeping_period=0.5
    ) as example:
        broker = example.broker
        threshold = broker.rebalance()["threshold"]  # a governor round now: its plan
        print(f"the broker's flow_to_disk_threshold: {threshold / MIB:,.0f} MiB")
        q = broker.create_queue("example.deep_backlog", page_size_bytes=4 * MIB)
        try:
            body = b"x" * 1024
            for sent in range(BATCH, MESSAGES + 1, BATCH):
                q.send_batch([body] * BATCH)
                if sent % 50_000 == 0:
                    broker.rebalance()  # as the governor does every housekeeping period
                    show(q, f"sent {sent:,}")
            received, expected = 0, q.stats()["next_offset"] - MESSAGES
            with q.consumer(prefetch=BATCH) as consumer:
                while received < MESSAGES:
                    batch = consumer.receive_batch(BATCH, timeout=10)
                    if batch.num_rows == 0:
                        break
                    offsets = batch.column("offset").to_pylist()
                    assert offsets == list(range(expected, expected + len(offsets))), "disorder"
                    expected += len(offsets)
                    consumer.ack(batch)
                    received += batch.num_rows
                    if received % 50_000 == 0:
                        show(q, f"received {received:,}")
            rounds = broker.governor_stats()["rounds"]
            print(f"received all {received:,} in order; {rounds} governor rounds")
            assert received == MESSAGES, f"received {received:,} of {MESSAGES:,}"
        finally:
            broker.delete_queue("example.deep_backlog")  # 200 MiB: not left on a cluster


if __name__ == "__main__":
    main()
