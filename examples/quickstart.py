"""Quickstart: create a durable queue, send, consume and acknowledge.

``python examples/quickstart.py`` runs it on an embedded local Ray of its own (``make
demo``). On a cluster, ``ray job submit --working-dir examples -- python quickstart.py``
runs it as a Ray job that joins the broker ``raymq start`` started (as does ``--join``
on a machine of the cluster): its queue ``example.orders`` stays there, and
``raymq status`` shows what went through it.
"""

from __future__ import annotations

from _common import example_broker

SENT = 1 + 1000


def main() -> None:
    with example_broker("quickstart") as example:
        orders = example.broker.create_queue("example.orders")

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
            while True:  # on a shared queue: until nothing is left for this consumer
                batch = consumer.receive_batch(500, timeout=5)  # an Arrow RecordBatch
                if batch.num_rows == 0:
                    if received >= SENT or consumer.backlog() == 0:
                        break
                    continue
                consumer.ack(batch)
                received += batch.num_rows
            print(f"received and acknowledged {received} messages")

        stats = orders.stats()
        print(
            f"queue {stats['name']}: depth {stats['depth']}, {stats['segment_files']} segment"
            f" files, {stats['bytes_on_disk']} bytes on disk"
        )
        assert received >= SENT, f"quickstart received {received} of the {SENT} it sent"
        assert example.joined or stats["depth"] == 0, "quickstart did not consume everything"
        if example.joined:
            print("example.orders stays in the running broker: see it with `raymq status`")


if __name__ == "__main__":
    main()
