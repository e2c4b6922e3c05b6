"""Synchronous single sends: 8 threads each waiting on ``send()``, 1 KiB, durable.

Each workload is measured ``--rounds`` times, interleaved, in one run, beside three
baselines: one thread waiting on ``send()`` (no gathering possible); 8 threads each
waiting on a bare ``SendChannel.send`` (one frame per message, gathered by the queue
actor only: the path a waiting ``send()`` took before it went through the handle's
producer); and one thread waiting on ``send_batch`` of 8 messages (the one round trip
and one commit per 8 messages that 8 waiting threads can at best share). Per workload
it prints messages per second, the ratios to the one-thread and bare-channel baselines,
CPU microseconds per message in the queue actor and in this (the producers') process,
both from /proc, the messages each group commit took (``QueueStats.group_commits``) and
each producer batch carried.

Then the latency of one thread's waiting ``send()`` at a low rate (``--rate``, default
200 msg/s, ``--latency-seconds`` long each), through the producer and through the bare
channel, interleaved: p50 and p99, and their ratio (the producer must add no delay to
an idle handle's send).

    python bench/sync_sends.py [--messages 16000] [--threads 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import ray
from rich.console import Console
from rich.table import Table

from bench.common import console, print_table, process_cpu_seconds, start_broker, stop_broker
from raymq.client.handles import _send_channel

BODY = b"x" * 1024


@dataclass
class Figures:
    """One measured run of one workload."""

    rate: float  # messages per second
    actor_us: float  # queue actor CPU microseconds per message
    client_us: float  # this process's CPU microseconds per message (all its threads)
    per_commit: float  # messages per group commit
    per_batch: float  # messages per producer batch (0: the producer was not used)


def run(q, pid: int, threads: int, messages: int, send_one) -> Figures:
    """``send_one()`` from ``threads`` threads until ``messages`` are sent in all."""
    per = messages // threads
    before = q.stats()
    produced = q.producer_stats()
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
    now = q.producer_stats()
    batches = (now.batches - produced.batches) if produced is not None else 0
    per_batch = (now.sent - produced.sent) / batches if batches else 0.0
    return Figures(
        rate=stored / dt,
        actor_us=(cpu1 - cpu0) / stored * 1e6,
        client_us=(mine1 - mine0) / stored * 1e6,
        per_commit=stored / commits,
        per_batch=per_batch,
    )


def latencies(send_one: Callable[[], object], rate: float, seconds: float) -> np.ndarray:
    """Seconds each ``send_one()`` took, one thread sending at ``rate`` per second."""
    out = []
    period, t_next = 1.0 / rate, time.perf_counter()
    end = t_next + seconds
    while t_next < end:
        pause = t_next - time.perf_counter()
        if pause > 0:
            time.sleep(pause)  # the schedule of a low-rate producer, not synchronisation
        t0 = time.perf_counter()
        send_one()
        out.append(time.perf_counter() - t0)
        t_next += period
    return np.array(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=16_000, help="messages per run")
    parser.add_argument("--threads", type=int, default=8, help="waiting sender threads")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each workload")
    parser.add_argument("--rate", type=float, default=200.0, help="latency: msg/s")
    parser.add_argument("--latency-seconds", type=float, default=2.0, help="per latency run")
    args = parser.parse_args()

    broker = start_broker(namespace="raymq-bench-sync")
    try:
        q = broker.create_queue("sync-sends", durable=True)
        pid = ray.get(q._actor.pid.remote())
        for _ in range(200):  # connect the send channel, warm both ends up
            q.send(BODY)
        channel = _send_channel(q)
        batch8 = [BODY] * 8
        many = f"{args.threads} threads, send()"
        bare = f"{args.threads} threads, bare channel send (before)"
        workloads = {
            "1 thread, send()": (1, lambda: q.send(BODY), 1),
            many: (args.threads, lambda: q.send(BODY), 1),
            bare: (args.threads, lambda: channel.send(BODY, b"", None), 1),
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
        before = statistics.median(f.rate for f in results[bare])
        rows = []
        for label, runs in results.items():
            med = statistics.median(f.rate for f in runs)
            per_batch = statistics.median(f.per_batch for f in runs)
            rows.append(
                [
                    label,
                    f"{med:,.0f}",
                    f"{min(f.rate for f in runs):,.0f}-{max(f.rate for f in runs):,.0f}",
                    f"{med / base:.2f}x",
                    f"{med / before:.2f}x",
                    f"{statistics.median(f.actor_us for f in runs):.0f}",
                    f"{statistics.median(f.client_us for f in runs):.0f}",
                    f"{statistics.median(f.per_commit for f in runs):.1f}",
                    f"{per_batch:.1f}" if label != bare and per_call_of(label) == 1 else "-",
                ]
            )
        table = Table(
            title=f"1 KiB durable sends, {args.rounds} rounds, {time.strftime('%Y-%m-%d %H:%M')}"
        )
        columns = ["workload", "msg/s (median)", "range", "vs 1 thread", "vs bare channel"]
        columns += ["actor CPU us/msg", "client CPU us/msg", "msg/commit", "msg/batch"]
        for c in columns:
            table.add_column(c, justify="left" if c == "workload" else "right")
        for r in rows:
            table.add_row(*r)
        Console(width=160).print(table)  # wide enough for every column, piped or not

        # Latency of an idle handle's waiting send: the producer against the bare channel.
        lat: dict[str, list[np.ndarray]] = {"send()": [], "bare channel send": []}
        for _ in range(args.rounds):
            lat["send()"].append(latencies(lambda: q.send(BODY), args.rate, args.latency_seconds))
            lat["bare channel send"].append(
                latencies(lambda: channel.send(BODY, b"", None), args.rate, args.latency_seconds)
            )
        p = {k: np.percentile(np.concatenate(v), [50, 99]) * 1e3 for k, v in lat.items()}
        ratio = p["send()"] / p["bare channel send"]
        print_table(
            f"one thread's waiting send at {args.rate:.0f} msg/s, {args.rounds} x"
            f" {args.latency_seconds:.0f} s each",
            ["path", "p50 ms", "p99 ms"],
            [[k, f"{v[0]:.3f}", f"{v[1]:.3f}"] for k, v in p.items()]
            + [["send() / bare", f"{ratio[0]:.2f}x", f"{ratio[1]:.2f}x"]],
        )
        broker.delete_queue("sync-sends")
    finally:
        stop_broker(broker)


def per_call_of(label: str) -> int:
    """Messages per call of a workload (the batch one sends 8)."""
    return 8 if "send_batch" in label else 1


if __name__ == "__main__":
    main()
