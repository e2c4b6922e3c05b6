"""A consumer's waited calls: ``ack(wait=True)``, ``nack`` and ``reject`` of one message,
over the process's SendChannel to the queue's actor against the same calls through Ray
(``raymq.client.consumer_acks.WAITED_OVER_WIRE`` off: how they went before), in the
same run, rounds interleaved.

A durable queue of 1 KiB messages; one consumer (prefetch 100) receives one message at a
time and settles it with the call measured; ``nack`` uses ``delay=0`` (the message
comes back at once and is received again). Printed: p50 / p99 / max of each call (ms)
and calls a second, and wire / Ray for p50 and p99.

    python -m bench.consumer_calls [--calls 1000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench.common import console, print_table, start_broker, stop_broker
from raymq.client import consumer_acks

BODY = b"x" * 1024
OPS = ("ack", "nack", "reject")


def settle(consumer, op: str, calls: int) -> list[float]:
    """``calls`` receives, each settled by ``op``; the settling call's ms each."""
    out = []
    for _ in range(calls):
        msgs = consumer.receive(1, timeout=30)
        if not msgs:
            raise RuntimeError(f"{op}: no message in 30 s")
        t0 = time.perf_counter()
        if op == "ack":
            consumer.ack(msgs, wait=True)
        elif op == "nack":
            consumer.nack(msgs, delay=0)
        else:
            consumer.reject(msgs)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000, help="calls per op, path and round")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.calls < 1 or args.rounds < 1:
        parser.error("--calls and --rounds must be at least 1")
    broker = start_broker("raymq-bench-consumer-calls")
    try:
        q = broker.create_queue("bench-calls", durable=True, redelivery_delay_s=0)
        # Enough for every ack and reject (a nack's message comes back).
        needed = 2 * args.calls * args.rounds * 2 + 100
        for _ in range(-(-needed // 1000)):
            q.send_batch([BODY] * 1000)
        q.send(BODY)  # opens this process's SendChannel to the queue's actor
        ms: dict[tuple[str, str], list[float]] = {}
        seconds: dict[tuple[str, str], float] = {}
        with q.consumer(prefetch=100) as consumer:
            settle(consumer, "ack", 50)  # warm both paths
            with console.status("settling...") as status:
                for r in range(args.rounds):
                    for op in OPS:
                        for path in ("wire", "Ray"):
                            status.update(f"round {r + 1}/{args.rounds}: {op} over {path}")
                            consumer_acks.WAITED_OVER_WIRE = path == "wire"
                            t0 = time.perf_counter()
                            got = settle(consumer, op, args.calls)
                            seconds[(op, path)] = seconds.get((op, path), 0.0) + (
                                time.perf_counter() - t0
                            )
                            ms.setdefault((op, path), []).extend(got)
            consumer_acks.WAITED_OVER_WIRE = True
            over_wire = consumer.calls_over_wire
        rows = []
        for op in OPS:
            figures = {}
            for path in ("wire", "Ray"):
                a = np.asarray(ms[(op, path)])
                figures[path] = np.percentile(a, [50, 99])
                rows.append(
                    [
                        f"{op} over {path}",
                        f"{figures[path][0]:.2f}",
                        f"{figures[path][1]:.2f}",
                        f"{a.max():.2f}",
                        f"{len(a) / seconds[(op, path)]:,.0f}",
                        "-" if path == "Ray" else "",
                    ]
                )
            ratio = figures["wire"] / figures["Ray"]
            rows[-2][-1] = f"{ratio[0]:.2f}x / {ratio[1]:.2f}x"
        print_table(
            f"waited consumer calls, {args.calls} x {args.rounds} rounds each "
            f"({over_wire:,} went over the wire)",
            ["call", "p50 ms", "p99 ms", "max ms", "receive+call/s", "wire/Ray p50 / p99"],
            rows,
        )
    finally:
        consumer_acks.WAITED_OVER_WIRE = True
        stop_broker(broker)


if __name__ == "__main__":
    main()
