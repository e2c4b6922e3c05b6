"""Synchronous single sends: 8 threads each waiting on ``send()``, 1 KiB, durable.

Each workload is measured ``--rounds`` times, interleaved, in one run, beside two
baselines: one thread waiting on ``send()`` (no gathering possible), and one thread
waiting on ``send_batch`` of 8 messages (the one round trip and one commit per 8
messages that 8 waiting threads can at best share). Per workload it prints messages
per second, the ratio to the one-thread baseline, CPU microseconds per message in the
queue actor and in this (the producers') process, both from /proc, and the messages
each group commit took (``QueueStats.group_commits``).

    python bench/sync_sends.py [--messages 16000] [--threads 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from dataclasses import dataclass

import ray
from rich.console import Console
from rich.table import Table

from bench.common import console, process_cpu_seconds, start_broker, stop_broker

BODY = b"x" * 1024


@dataclass
class Figures:
    """One measured run of one workload."""

    rate: float  # messages per second
    actor_us: float  # queue actor CPU microseconds per message
    client_us: float  # this process's CPU microseconds per message (all its threads)
    per_commit: float  # messages per group commit


def run(q, pid: int, threads: int, messages: int, send_one) -> Figures:
    """``send_one()`` from ``threads`` threads until ``messages`` are sent in all."""
    per = messages // threads
    before = q.stats()
    start = threading.Barrier(threads + 1)

    def work() -> None:
        start.wait()
        for _ in range(per):
            send_one()

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for t in workers:
        t.start()
    cpu0, mine0 = process_cpu_seconds(pid), process_cpu_seconds(os.getpid())
    start.wait()
    t0 = time.perf_counter()
    for t in workers:
        t.join()
    dt = time.perf_counter() - t0
    cpu1, mine1 = process_cpu_seconds(pid), process_cpu_seconds(os.getpid())
    after = q.stats()
    stored = after["messages_in"] - before["messages_in"]
    commits = max(after["group_commits"] - before["group_commits"], 1)
    return Figures(
        rate=stored / dt,
        actor_us=(cpu1 - cpu0) / stored * 1e6,
        client_us=(mine1 - mine0) / stored * 1e6,
        per_commit=stored / commits,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=16_000, help="messages per run")
    parser.add_argument("--threads", type=int, default=8, help="waiting sender threads")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each workload")
    args = parser.parse_args()

    broker = start_broker(namespace="raymq-bench-sync")
    try:
        q = broker.create_queue("sync-sends", durable=True)
        pid = ray.get(q._actor.pid.remote())
        for _ in range(200):  # connect the send channel, warm both ends up
            q.send(BODY)
        batch8 = [BODY] * 8
        workloads = {
            "1 thread, send()": (1, lambda: q.send(BODY), 1),
            f"{args.threads} threads, send()": (args.threads, lambda: q.send(BODY), 1),
            "1 thread, send_batch(8)": (1, lambda: q.send_batch(batch8), 8),
        }
        results: dict[str, list[Figures]] = {k: [] for k in workloads}
        for r in range(args.rounds):
            for label, (threads, send_one, per_call) in workloads.items():
                calls = args.messages // per_call
                if threads == 1:
                    calls //= 4  # one waiting thread is slow: a quarter of the messages
                results[label].append(run(q, pid, threads, calls, send_one))
                f = results[label][-1]
                console.print(
                    f"round {r + 1} {label}: {f.rate:,.0f} msg/s, actor {f.actor_us:.0f} us/msg,"
                    f" client {f.client_us:.0f} us/msg, {f.per_commit:.1f} msg/commit"
                )
        base = statistics.median(f.rate for f in results["1 thread, send()"])
        rows = []
        for label, runs in results.items():
            med = statistics.median(f.rate for f in runs)
            rows.append(
                [
                    label,
                    f"{med:,.0f}",
                    f"{min(f.rate for f in runs):,.0f}-{max(f.rate for f in runs):,.0f}",
                    f"{med / base:.2f}x",
                    f"{statistics.median(f.actor_us for f in runs):.0f}",
                    f"{statistics.median(f.client_us for f in runs):.0f}",
                    f"{statistics.median(f.per_commit for f in runs):.1f}",
                ]
            )
        table = Table(
            title=f"1 KiB durable sends, {args.rounds} rounds, {time.strftime('%Y-%m-%d %H:%M')}"
        )
        for c in ["workload", "msg/s (median)", "range", "vs 1 thread", "actor CPU us/msg"]:
            table.add_column(c, justify="left" if c == "workload" else "right")
        for c in ["client CPU us/msg", "msg/commit"]:
            table.add_column(c, justify="right")
        for r in rows:
            table.add_row(*r)
        Console(width=140).print(table)  # wide enough for every column, piped or not
        broker.delete_queue("sync-sends")
    finally:
        stop_broker(broker)


if __name__ == "__main__":
    main()
