"""Replay from retention: a subscription reads a paged backlog of a million messages, then
seeks back and reads it all again from disk; the replay rate against the first read's
(the baseline, same run), how long a seek takes, and a new subscription that starts at
a time in the middle.

    python -m bench.replay [--messages 1000000] [--size 1024]
"""

from __future__ import annotations

import argparse
import datetime
import time

from bench.common import console, fill, print_table, start_broker, stop_broker

BATCH = 1000


def read_all(sub, n: int) -> float:
    """Receive and ack ``n`` messages from a new consumer of ``sub``; messages per second."""
    t0 = time.perf_counter()
    got = 0
    with sub.consumer(prefetch=10 * BATCH) as c:
        while got < n:
            batch = c.receive_batch(BATCH, timeout=30)
            if not batch.num_rows:
                raise RuntimeError(f"stalled after {got} of {n}")
            c.ack(batch, wait=False)
            got += batch.num_rows
        c.flush()
    return n / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--size", type=int, default=1024, help="body bytes")
    args = parser.parse_args()
    n = args.messages - args.messages % (2 * BATCH)
    broker = start_broker("raymq-bench-replay")
    try:
        events = broker.create_address("events", retention_s=3600)
        reader = events.create_subscription("reader")
        fill(events, n // 2, args.size, BATCH)
        middle = datetime.datetime.now()
        fill(events, n // 2, args.size, BATCH)
        first = read_all(reader, n)
        retained = events.stats()
        t0 = time.perf_counter()
        events.subscription("reader").seek(0)
        seek_ms = (time.perf_counter() - t0) * 1000
        replay = read_all(reader, n)
        t0 = time.perf_counter()
        late = events.create_subscription("late", start=middle)
        create_ms = (time.perf_counter() - t0) * 1000
        from_time = read_all(late, n // 2)
    finally:
        stop_broker(broker)
    print_table(
        f"{n:,} messages of {args.size} B on an address that retains"
        f" ({retained['bytes_on_disk'] / 2**20:,.0f} MiB on disk, {retained['retained']:,}"
        " retained after the first read)",
        ["read", "msg/s", "ratio to the first read"],
        [
            ["first read (baseline)", f"{first:,.0f}", "1.00"],
            ["replay after seek(0)", f"{replay:,.0f}", f"{replay / first:.2f}"],
            [f"new subscription from a time ({n // 2:,})", f"{from_time:,.0f}",
             f"{from_time / first:.2f}"],
        ],
    )  # fmt: skip
    console.print(
        f"seek(0) took {seek_ms:,.1f} ms; create_subscription(start=<datetime>) {create_ms:,.1f} ms"
    )


if __name__ == "__main__":
    main()
