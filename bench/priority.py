"""A priority-9 message sent behind a paged backlog of a million priority-0 ones: how
long until a consumer working through the backlog receives it, against how long a
priority-0 message sent then would wait (the baseline: the backlog ahead of it at the
consume rate measured in the same run).

A consumer receives 100 messages at a time and spends ``--work-ms`` on each batch (its
application's work), acking as it goes; every ``--every`` seconds a priority-9 message
is sent carrying its send time. Its prefetched messages come first, so the figure is
given for two prefetches.

    python -m bench.priority [--messages 1000000] [--size 1024] [--jumps 20]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from bench.common import console, fill, print_table, start_broker, stop_broker

BATCH = 1000
SENT_AT = "sent_at"


def run(q, prefetch: int, jumps: int, every: float, work_s: float) -> dict:
    """Consume with ``prefetch`` while ``jumps`` priority-9 messages are sent; their
    latencies (seconds) and the consume rate (messages per second)."""
    latencies: list[float] = []
    received = 0
    done = threading.Event()

    def consume() -> None:
        nonlocal received
        with q.consumer(prefetch=prefetch) as c:
            while not done.is_set() or len(latencies) < jumps:
                got = c.receive(100, timeout=1)
                now = time.time()
                for m in got:
                    sent = (m.properties or {}).get(SENT_AT)
                    if sent is not None:
                        latencies.append(now - sent)
                received += len(got)
                c.ack(got)
                time.sleep(work_s)  # the application's work on the batch

    t = threading.Thread(target=consume)
    t0 = time.perf_counter()
    t.start()
    time.sleep(1.0)  # the consumer is under way, its prefetch full
    for _ in range(jumps):
        q.send(b"urgent", {SENT_AT: time.time()}, priority=9)
        time.sleep(every)
    done.set()
    t.join(timeout=120)
    seconds = time.perf_counter() - t0
    return {"latencies": sorted(latencies), "rate": received / seconds, "received": received}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--size", type=int, default=1024, help="body bytes")
    parser.add_argument("--jumps", type=int, default=20)
    parser.add_argument("--every", type=float, default=0.1, help="seconds between jumps")
    parser.add_argument("--work-ms", type=float, default=2.0, help="per 100 messages")
    args = parser.parse_args()
    n = args.messages - args.messages % BATCH
    broker = start_broker("raymq-bench-priority")
    try:
        q = broker.create_queue("ranked", max_priority=9)
        fill(q, n, args.size, BATCH)
        on_disk = q.stats()["bytes_on_disk"]
        cases = {p: run(q, p, args.jumps, args.every, args.work_ms / 1000) for p in (1000, 100)}
    finally:
        stop_broker(broker)
    rows = []
    consumed = 0
    for prefetch, c in cases.items():
        lat = c["latencies"]
        consumed += c["received"]
        ahead = max(0, n - consumed)  # what a priority-0 one sent at the end waits behind
        rows.append(
            [
                f"{prefetch:,}",
                f"{len(lat)}",
                f"{statistics.median(lat) * 1000:,.1f}",
                f"{lat[max(0, int(len(lat) * 0.99) - 1)] * 1000:,.1f}",
                f"{lat[-1] * 1000:,.1f}",
                f"{c['rate']:,.0f}",
                f"{ahead / c['rate']:,.1f}",
            ]
        )
    print_table(
        f"priority 9 behind {n:,} messages of {args.size} B at priority 0"
        f" ({on_disk / 2**20:,.0f} MiB on disk)",
        ["prefetch", "jumps", "median ms", "p99 ms", "max ms", "consumed msg/s",
         "a priority-0 one would wait s (baseline)"],
        rows,
    )  # fmt: skip
    worst = max(c["latencies"][-1] for c in cases.values())
    console.print(f"slowest jump: {worst * 1000:,.1f} ms (target: under 100 ms)")


if __name__ == "__main__":
    main()
