"""Slow subscriber: four queues, four consumers, one of them stopped.

A producer keeps sending to all four transient queues under a small
``flow_to_disk_threshold``. Run A (baseline, same run): all four consumers keep up.
Run B: the consumer of the fourth queue stops receiving, so its backlog grows past the
threshold and flows to disk. Target: the other three consume at least 90 % of their
rate of run A (Artemis's weakness is that one slow subscriber pushes the whole address
into paging and slows everyone).

    python bench/slow_subscriber.py [--seconds 15] [--threshold-mib 32]
"""

from __future__ import annotations

import argparse
import threading
import time

from bench.common import console, print_table, start_broker, stop_broker

MIB = 2**20
BATCH = 1000


def run(broker, tag: str, seconds: float, slow: bool) -> dict:
    """Produce to four queues and consume for ``seconds``; returns rates and stats."""
    queues = [broker.create_queue(f"{tag}{k}", durable=False) for k in range(4)]
    consumers = [q.consumer(prefetch=2 * BATCH) for q in queues]
    counts = [0, 0, 0, 0]
    stop = threading.Event()
    body = b"x" * 1024

    def produce() -> None:
        while not stop.is_set():
            for q in queues:
                q.send_batch([body] * BATCH)

    def consume(k: int) -> None:
        c = consumers[k]
        while not stop.is_set():
            batch = c.receive_batch(BATCH, timeout=0.1)
            if batch.num_rows:
                c.ack(batch)
                counts[k] += batch.num_rows

    workers = [threading.Thread(target=produce)]
    workers += [threading.Thread(target=consume, args=(k,)) for k in range(3 if slow else 4)]
    for w in workers:
        w.start()
    time.sleep(seconds)  # the measuring window itself, not a synchronisation
    stop.set()
    for w in workers:
        w.join()
    stats = [q.stats() for q in queues]
    for c in consumers:
        c.close()
    for q in queues:
        broker.delete_queue(q.name)
    return {
        "fast_rate": sum(counts[:3]) / seconds,
        "fourth_depth": stats[3]["depth"],
        "fourth_flowed": stats[3]["messages_flowed_to_disk"],
        "fast_flowed": sum(s["messages_flowed_to_disk"] for s in stats[:3]),
        "fast_depth": sum(s["depth"] for s in stats[:3]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--threshold-mib", type=int, default=32)
    args = parser.parse_args()

    broker = start_broker(
        namespace="raymq-bench-slow",
        flow_to_disk_threshold=args.threshold_mib * MIB,
        housekeeping_period=1.0,
    )
    try:
        console.print(f"run A: four consumers keep up, {args.seconds:.0f} s ...")
        a = run(broker, "a", args.seconds, slow=False)
        console.print(f"run B: the fourth consumer stopped, {args.seconds:.0f} s ...")
        b = run(broker, "b", args.seconds, slow=True)
    finally:
        stop_broker(broker)
    rows = [
        ["3 consumers, all keep up (msg/s, baseline)", f"{a['fast_rate']:,.0f}", "-"],
        ["3 consumers, fourth stopped (msg/s)", f"{b['fast_rate']:,.0f}", "-"],
        ["  ratio", f"{b['fast_rate'] / a['fast_rate']:.2f}", ">= 0.90"],
        ["stopped queue: backlog (messages)", f"{b['fourth_depth']:,}", "-"],
        ["stopped queue: flowed to disk (messages)", f"{b['fourth_flowed']:,}", "> 0"],
        ["other queues: flowed to disk (messages)", f"{b['fast_flowed']:,}", "0"],
        ["  same, all four keep up (baseline)", f"{a['fast_flowed']:,}", "-"],
        ["other queues: backlog at the end (messages)", f"{b['fast_depth']:,}", "-"],
        ["  same, all four keep up (baseline)", f"{a['fast_depth']:,}", "-"],
    ]
    print_table(
        f"slow subscriber, {time.strftime('%Y-%m-%d')}", ["measure", "RayMQ", "target"], rows
    )


if __name__ == "__main__":
    main()
