"""Pipelined single sends: one thread, ``send(wait=False)`` then ``flush()``, 1 KiB, durable.

Measured ``--rounds`` times, interleaved, in one run, beside the baseline
``send_batch(1000)`` from one thread (the tuned path) and 8 threads each waiting on
``send()`` (the synchronous path, which pipelining must not slow), and 64 asyncio tasks
awaiting ``send_async`` (over the send channel). Prints messages per
second per round, the median, the ratio to ``send_batch(1000)``, the producer's batches
(messages per batch) and this process's CPU microseconds per message.

    python bench/producer.py [--messages 200000] [--sync-messages 8000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

from bench.common import console, print_table, process_cpu_seconds, start_broker, stop_broker

BODY = b"x" * 1024


def pipelined(q, n: int) -> tuple[float, float]:
    """(seconds, batches) for ``n`` ``send(wait=False)`` and a ``flush`` from one thread."""
    send = q.send
    before = q.producer_stats()
    t0 = time.perf_counter()
    for _ in range(n):
        send(BODY, wait=False)
    q.flush()
    dt = time.perf_counter() - t0
    after = q.producer_stats()
    return dt, after.batches - (before.batches if before else 0)


def batched(q, n: int) -> tuple[float, float]:
    """(seconds, batches) for ``send_batch`` of 1,000 from one thread."""
    bodies = [BODY] * 1000
    t0 = time.perf_counter()
    for _ in range(n // 1000):
        q.send_batch(bodies)
    return time.perf_counter() - t0, n // 1000


def sync_threads(q, n: int, threads: int = 8) -> tuple[float, float]:
    """(seconds, 0) for ``n`` waiting ``send()`` from ``threads`` threads."""
    per = n // threads
    start = threading.Barrier(threads + 1)

    def work() -> None:
        start.wait()
        for _ in range(per):
            q.send(BODY)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for t in workers:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in workers:
        t.join()
    return time.perf_counter() - t0, 0


def async_tasks(q, n: int, tasks: int = 64) -> tuple[float, float]:
    """(seconds, 0) for ``n`` ``send_async`` from ``tasks`` asyncio tasks of one loop."""
    import asyncio

    async def run() -> float:
        async def work(k: int) -> None:
            for _ in range(n // tasks):
                await q.send_async(BODY)

        t0 = time.perf_counter()
        await asyncio.gather(*(work(k) for k in range(tasks)))
        return time.perf_counter() - t0

    return asyncio.run(run()), 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--sync-messages", type=int, default=8_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    broker = start_broker("bench-producer")
    try:
        workloads = {
            "send_batch(1000), 1 thread (baseline)": (batched, args.messages),
            "send(wait=False) + flush, 1 thread": (pipelined, args.messages),
            "send() waiting, 8 threads": (sync_threads, args.sync_messages),
            "send_async, 64 tasks": (async_tasks, args.sync_messages),
        }
        rates: dict[str, list[float]] = {k: [] for k in workloads}
        cpu: dict[str, list[float]] = {k: [] for k in workloads}
        per_batch: dict[str, list[float]] = {k: [] for k in workloads}
        q = broker.create_queue("producer-bench")
        q.send_batch([BODY] * 1000)  # warm: channel open, files made
        q.send(BODY, wait=False).result()
        me = os.getpid()
        for r in range(args.rounds):
            for name, (fn, n) in workloads.items():
                mine0 = process_cpu_seconds(me)
                dt, batches = fn(q, n)
                mine1 = process_cpu_seconds(me)
                rates[name].append(n / dt)
                cpu[name].append((mine1 - mine0) / n * 1e6)
                per_batch[name].append(n / batches if batches else 0)
                console.print(f"round {r + 1}: {name}: {n / dt:,.0f} msg/s")
        base = statistics.median(rates["send_batch(1000), 1 thread (baseline)"])
        rows = []
        for name in workloads:
            med = statistics.median(rates[name])
            rows.append(
                [
                    name,
                    " / ".join(f"{x:,.0f}" for x in rates[name]),
                    f"{med:,.0f}",
                    f"{med / base:.2f}x",
                    f"{statistics.median(per_batch[name]):,.0f}" if per_batch[name][0] else "-",
                    f"{statistics.median(cpu[name]):.1f}",
                ]
            )
        print_table(
            "1 KiB durable messages, one run",
            ["workload", "msg/s per round", "median", "vs batch", "msgs/batch", "client us/msg"],
            rows,
        )
    finally:
        stop_broker(broker)


if __name__ == "__main__":
    main()
