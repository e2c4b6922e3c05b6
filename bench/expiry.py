"""Expiring a paged backlog: how fast a queue's background pass takes out a backlog of
expired messages nobody consumes (dropped, or moved to an expiry queue), how much
memory its actor needs meanwhile, and whether the segment files go, against the same
backlog consumed and acknowledged by a consumer (the baseline, same run).

Every message of a case expires at one moment, after the whole backlog is stored (an
absolute ``RayMQExpiration``, as ``send(ttl=)`` stamps it), so the time measured is the
expiry's alone: from that moment until the queue's depth is 0.

    python -m bench.expiry [--messages 1000000] [--size 1024]
"""

from __future__ import annotations

import argparse
import time

from bench.common import console, fill, print_table, rss_of, start_broker, stop_broker
from raymq.client.calls import _call
from raymq.core.expiry import EXPIRATION_PROPERTY

BATCH = 1000
#: Seconds between two looks at the queue's statistics while it works (a poll of a
#: figure, not a synchronisation: the bench measures how long the work takes).
POLL_SECONDS = 0.1


def fill_rate(q, size: int) -> float:
    """Messages per second this machine stores (a short warm-up fill of a scratch queue)."""
    n = 20 * BATCH
    return n / fill(q, n, size, BATCH)


def watch(q, until) -> tuple[float, int]:
    """Poll ``q``'s statistics until ``until(stats)``; (seconds, peak RSS of its actor)."""
    pid = _call(q._actor.pid)
    t0 = time.perf_counter()
    peak = rss_of([pid])
    while not until(q.stats()):
        peak = max(peak, rss_of([pid]))
        time.sleep(POLL_SECONDS)
    return time.perf_counter() - t0, peak


def expire_case(broker, name: str, messages: int, size: int, rate: float, expiry_queue):
    """One case: fill, wait for the shared expiry moment, time the pass."""
    q = broker.create_queue(name, expiry_queue=expiry_queue, message_expiry_scan_period_s=0.2)
    # Everything expires once stored: the fill's expected time, doubled, and 5 s.
    expires_ms = int((time.time() + 2 * messages / rate + 5) * 1000)
    fill_s = fill(q, messages, size, BATCH, {EXPIRATION_PROPERTY: expires_ms})
    files = q.stats()["segment_files"]
    idle_rss = rss_of([_call(q._actor.pid)])
    late = time.time() * 1000 > expires_ms
    while time.time() * 1000 <= expires_ms:  # the backlog's expiry must arrive
        time.sleep(min(1.0, expires_ms / 1000 - time.time() + 0.01))
    seconds, peak = watch(q, lambda s: s["depth"] == 0 and not s["dead_letters_pending"])
    stats = q.stats()
    assert stats["messages_expired"] == messages, stats["messages_expired"]
    broker.delete_queue(name)
    if expiry_queue:
        moved = broker.get_queue(expiry_queue).stats()["depth"]
        assert moved == messages, moved
        broker.delete_queue(expiry_queue)
    return {
        "fill_s": fill_s,
        "seconds": seconds,
        "files": (files, stats["segment_files"]),
        "rss": (idle_rss, peak),
        "late": late,
    }


def consume_case(broker, name: str, messages: int, size: int):
    """The baseline: the same backlog received and acknowledged by one tuned consumer."""
    q = broker.create_queue(name)
    fill(q, messages, size, BATCH)
    files = q.stats()["segment_files"]
    pid = _call(q._actor.pid)
    idle_rss = rss_of([pid])
    t0 = time.perf_counter()
    peak = idle_rss
    with q.consumer(prefetch=10_000) as c:
        got = 0
        while got < messages:
            batch = c.receive_batch(BATCH, timeout=30)
            got += batch.num_rows
            c.ack(batch)
            if got % 100_000 < BATCH:
                peak = max(peak, rss_of([pid]))
        c.flush()
    seconds = time.perf_counter() - t0
    stats = q.stats()
    broker.delete_queue(name)
    return {
        "fill_s": 0.0,
        "seconds": seconds,
        "files": (files, stats["segment_files"]),
        "rss": (idle_rss, peak),
        "late": False,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--size", type=int, default=1024, help="body bytes")
    args = parser.parse_args()
    n = args.messages - args.messages % BATCH
    broker = start_broker("raymq-bench-expiry")
    try:
        rate = fill_rate(broker.create_queue("warm-up"), args.size)
        broker.delete_queue("warm-up")
        cases = {
            "consumed and acked (baseline)": consume_case(broker, "consumed", n, args.size),
            "expired, dropped": expire_case(broker, "dropped", n, args.size, rate, None),
            "expired, to an expiry queue": expire_case(
                broker, "moved", n, args.size, rate, "moved.expired"
            ),
        }
    finally:
        stop_broker(broker)
    base = cases["consumed and acked (baseline)"]["seconds"]
    rows = []
    for label, c in cases.items():
        (f0, f1), (r0, r1) = c["files"], c["rss"]
        rows.append(
            [
                label,
                f"{n:,}",
                f"{c['seconds']:.2f}",
                f"{n / c['seconds']:,.0f}",
                f"{base / c['seconds']:.2f}",
                f"{f0} -> {f1}",
                f"{r0 / 2**20:,.0f} -> {r1 / 2**20:,.0f}",
            ]
        )
    print_table(
        f"Taking out a backlog of {n:,} messages of {args.size} B nobody consumes",
        ["case", "messages", "seconds", "msg/s", "speed vs consuming", "segment files",
         "queue actor RSS MiB (idle -> peak)"],
        rows,
    )  # fmt: skip
    if any(c["late"] for c in cases.values()):
        console.print("[yellow]the fill outlasted the expiry: the pass overlapped it[/]")


if __name__ == "__main__":
    main()
