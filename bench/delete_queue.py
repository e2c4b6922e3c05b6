"""Deleting a queue: a hibernated one against a running one of the same backlog (the
baseline, in the same run, rounds interleaved).

A hibernated queue is deleted without starting its actor (``Hibernator.delete``); before
stop 64 its deletion revived it first, its recovery included. Each round creates a
durable queue of ``--messages`` 1 KiB messages, hibernates it or not, and times
``broker.delete_queue`` (ms). Printed: the median and max of each, their ratio
(hibernated / running), and the revivals the hibernated ones' deletions caused (0).

    python -m bench.delete_queue [--messages 300000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.common import console, fill, print_table, start_broker, stop_broker

STATES = ("running", "hibernated")
#: Messages per ``send_batch`` of the fill (``bench.common.fill``'s default).
FILL_BATCH = 1000


def delete_once(broker, name: str, messages: int, hibernated: bool) -> float:
    """Create queue ``name`` with ``messages`` 1 KiB messages, hibernate it if
    ``hibernated``, then delete it; the deletion's seconds."""
    q = broker.create_queue(name)
    fill(q, messages, 1024, batch=FILL_BATCH)
    if hibernated and not broker.hibernate(name):
        raise RuntimeError(f"queue {name!r} did not hibernate (busy?)")
    t0 = time.perf_counter()
    broker.delete_queue(name)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=300_000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if args.messages < FILL_BATCH or args.messages % FILL_BATCH:
        p.error(f"--messages must be a positive multiple of {FILL_BATCH} (sent in batches)")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    broker = start_broker("bench-delete-queue")
    try:
        seconds: dict[str, list[float]] = {s: [] for s in STATES}
        revivals = broker.hibernation_stats()["revivals"]
        for r in range(args.rounds):
            order = STATES if r % 2 == 0 else STATES[::-1]
            for state in order:
                took = delete_once(broker, f"del-{state}-{r}", args.messages, state != "running")
                seconds[state].append(took)
                console.print(f"round {r + 1}/{args.rounds}: {state} {took * 1e3:.0f} ms")
        revived = broker.hibernation_stats()["revivals"] - revivals
    finally:
        stop_broker(broker)
    base = statistics.median(seconds["running"])
    rows = []
    for state in STATES:
        med = statistics.median(seconds[state])
        rows.append([state, f"{med * 1e3:.0f}", f"{max(seconds[state]) * 1e3:.0f}",
                     f"{med / base:.2f}x"])  # fmt: skip
    print_table(
        f"delete_queue of a durable queue of {args.messages:,} x 1 KiB (ms, {args.rounds} rounds)",
        ["queue", "median", "max", "vs running"],
        rows,
    )
    console.print(f"revivals caused by deleting hibernated queues: {revived}")


if __name__ == "__main__":
    main()
