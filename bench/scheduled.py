"""A million scheduled messages: the queue actor's memory with them set aside, and how
long a consumer takes to reach the messages sent behind them, against the same backlog
unscheduled (the baseline, same run).

A backlog of ``--messages`` messages, then 1,000 plain ones; in the scheduled case the
backlog is due in an hour, so a new consumer must pass all of it (the queue reads the
stored properties, sets the backlog aside as runs) to get the plain ones.

    python -m bench.scheduled [--messages 1000000] [--size 1024]
"""

from __future__ import annotations

import argparse
import time

from bench.common import console, fill, print_table, rss_of, start_broker, stop_broker
from raymq.client.calls import _call

BATCH = 1000
BEHIND = 1000


def case(broker, name: str, messages: int, size: int, delay: float | None) -> dict:
    """Fill, then time a new consumer until it has the plain messages behind."""
    q = broker.create_queue(name)
    fill(q, messages, size, BATCH, delay=delay)
    q.send_batch([b"behind"] * BEHIND)
    pid = _call(q._actor.pid)
    idle = rss_of([pid])
    t0 = time.perf_counter()
    got = 0
    with q.consumer(prefetch=BEHIND) as c:
        first = None
        while got < BEHIND:
            batch = c.receive_batch(BEHIND, timeout=60)
            if first is None and batch.num_rows:
                first = time.perf_counter() - t0
            got += batch.num_rows
            c.ack(batch)  # (the baseline acks the head of its backlog instead)
        seconds = time.perf_counter() - t0
    stats = q.stats()
    after = rss_of([pid])
    broker.delete_queue(name)
    return {
        "first": first,
        "seconds": seconds,
        "rss": (idle, after),
        "scheduled": stats["scheduled"],
        "index": stats["index_bytes"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--size", type=int, default=1024, help="body bytes")
    args = parser.parse_args()
    n = args.messages - args.messages % BATCH
    broker = start_broker("raymq-bench-scheduled")
    try:
        cases = {
            "backlog not scheduled (baseline)": case(broker, "plain", n, args.size, None),
            "backlog due in an hour": case(broker, "later", n, args.size, 3600.0),
        }
    finally:
        stop_broker(broker)
    rows = []
    for label, c in cases.items():
        r0, r1 = c["rss"]
        rows.append(
            [
                label,
                f"{c['first'] * 1000:,.1f}",
                f"{c['seconds']:.2f}",
                f"{c['scheduled']:,}",
                f"{c['index'] / 2**20:,.2f}",
                f"{r0 / 2**20:,.0f} -> {r1 / 2**20:,.0f}",
            ]
        )
    print_table(
        f"{n:,} messages of {args.size} B, then {BEHIND:,} more: a new consumer takes {BEHIND:,}",
        ["backlog", "first message ms", "seconds for all", "set aside",
         "queue index MiB", "queue actor RSS MiB (before -> after)"],
        rows,
    )  # fmt: skip
    base = cases["backlog not scheduled (baseline)"]
    sched = cases["backlog due in an hour"]
    extra = (sched["rss"][1] - base["rss"][1]) / 2**20
    console.print(
        f"queue actor RSS with the backlog set aside: {extra:+,.0f} MiB against the baseline"
    )


if __name__ == "__main__":
    main()
