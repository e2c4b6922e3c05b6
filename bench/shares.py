"""Proportional shares: three queues of different sizes under one flow_to_disk_threshold.

Each queue's share should follow its size (Qpid) within one housekeeping period: after
the queues are filled (sizes 1 : 2 : 4), and again after the largest one is drained.
Baseline: the housekeeping period itself.

    python bench/shares.py [--unit 20000] [--threshold-mib 64] [--period 1.0]
"""

from __future__ import annotations

import argparse
import time

from bench.common import console, print_table, start_broker, stop_broker

MIB = 2**20
BATCH = 1000


def wait_for_plan(broker, accept, timeout: float = 30.0) -> tuple[float, dict]:
    """Seconds from now until the end of the first governor round started after now,
    if its plan is one ``accept`` takes; and that plan."""
    changed = time.time()
    while time.time() - changed < timeout:
        stats = broker.governor_stats()
        if stats["round_started"] >= changed:
            if not accept(stats["plan"]):
                raise AssertionError(f"the first round after the change planned {stats['plan']}")
            return stats["round_finished"] - changed, stats["plan"]
        time.sleep(0.02)
    raise TimeoutError("no governor round ran")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unit", type=int, default=20_000, help="messages of the smallest queue")
    parser.add_argument("--threshold-mib", type=int, default=64)
    parser.add_argument("--period", type=float, default=1.0)
    args = parser.parse_args()

    broker = start_broker(
        namespace="raymq-bench-shares",
        flow_to_disk_threshold=args.threshold_mib * MIB,
        housekeeping_period=args.period,
    )
    rows = []
    body = b"x" * 1024
    try:
        queues = {f"q{k}": broker.create_queue(f"q{k}") for k in (1, 2, 4)}
        consumers = {name: q.consumer(prefetch=100) for name, q in queues.items()}
        for k, (name, q) in zip((1, 2, 4), queues.items(), strict=True):
            console.print(f"filling {name} with {k * args.unit:,} x 1 KiB ...")
            for _ in range(k * args.unit // BATCH):
                q.send_batch([body] * BATCH)

        def proportional(plan) -> bool:
            s = {n: plan["queues"][n]["share"] for n in queues}
            return abs(s["q2"] / s["q1"] - 2) < 0.2 and abs(s["q4"] / s["q1"] - 4) < 0.4

        took, plan = wait_for_plan(broker, proportional)
        for name in queues:
            size = queues[name].stats()["bytes_queued"]
            rows.append(
                [
                    f"{name} filled: size / share (MiB)",
                    f"{size / MIB:.1f} / {plan['queues'][name]['share'] / MIB:.1f}",
                    "-",
                ]
            )
        rows.append(["shares follow sizes after (s)", f"{took:.2f}", f"<= {args.period} + round"])

        console.print("draining q4 ...")
        c = consumers["q4"]
        while True:
            batch = c.receive_batch(BATCH, timeout=1)
            if batch.num_rows == 0:
                break
            c.ack(batch)

        def drained(plan) -> bool:
            s = {n: plan["queues"][n]["share"] for n in queues}
            return s["q4"] < s["q1"] < s["q2"]

        took, plan = wait_for_plan(broker, drained)
        for name in queues:
            rows.append(
                [
                    f"{name} after draining q4: share (MiB)",
                    f"{plan['queues'][name]['share'] / MIB:.1f}",
                    "-",
                ]
            )
        rows.append(
            ["shares follow the drain after (s)", f"{took:.2f}", f"<= {args.period} + round"]
        )
        rows.append(["housekeeping period (s, baseline)", f"{args.period}", "-"])
        for c in consumers.values():
            c.close()
    finally:
        stop_broker(broker)
    print_table(
        f"proportional shares, {time.strftime('%Y-%m-%d')}", ["measure", "RayMQ", "target"], rows
    )


if __name__ == "__main__":
    main()
