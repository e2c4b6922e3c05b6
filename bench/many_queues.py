"""Many queues on one node: create N durable queues, each receiving one 1 KiB message,
under a cap of running queue actors (the rest hibernate), and print creation time per
queue, the broker's memory (PSS of its processes) in total and per queue, the first
message for a new consumer on random hibernated queues, and what an idle, a busy and a
hibernated queue cost. Baselines measured in the same run: the first queue created on
an empty broker, and a first message on a queue whose actor runs.

    python -m bench.many_queues [--queues 1000] [--max-active 32] [--threads 4] [--samples 5]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from bench.common import console, print_table, process_cpu_seconds, start_broker, stop_broker

BODY = b"m" * 1024


def pss_mib(pids: list[int]) -> float:
    """Summed proportional set size of ``pids`` (MiB, from /proc/<pid>/smaps_rollup):
    shared pages count once across the processes sharing them; gone ones count 0."""
    total_kib = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total_kib += int(line.split()[1])
        except OSError:
            pass
    return total_kib / 1024


def broker_pids(broker) -> dict[str, int]:
    """The broker's processes: its actor, the governor (found among the broker's
    sibling workers by its process title), each running queue actor."""
    import psutil
    import ray
    from raymq.actors.names import queue_actor_name

    from raymq.client.calls import _call

    pids = {"broker": _call(broker._actor.pid)}
    with contextlib.suppress(psutil.Error):
        for proc in psutil.Process(pids["broker"]).parent().children():
            if "MemoryGovernorActor" in " ".join(proc.cmdline()):
                pids["governor"] = proc.pid
    for name in broker.list_queues():
        try:
            handle = ray.get_actor(queue_actor_name(name), namespace=broker.namespace)
        except ValueError:
            continue  # hibernated
        pids[name] = _call(handle.pid)
    return pids


def first_message_seconds(broker, name: str, starts: list[float] | None = None) -> float | None:
    """From ``get_queue`` to the first message in hand of a new consumer (seconds);
    None if none came within 60 s (printed as a failure). ``starts`` gets the part
    that ``get_queue`` took (a hibernated queue's revival: its process start)."""
    t0 = time.perf_counter()
    queue = broker.get_queue(name)
    if starts is not None:
        starts.append(time.perf_counter() - t0)
    with queue.consumer(prefetch=10) as consumer:
        got = consumer.receive(1, timeout=60)
        dt = time.perf_counter() - t0
        if not got:
            console.print(f"[red]queue {name!r}: no message for a new consumer in 60 s")
            return None
        consumer.nack(got)  # left for the next sample
    return dt


def _ms(samples: list[float | None]) -> str:
    ok = [x for x in samples if x is not None]
    if not ok:
        return "no message came (FAILED)"
    failed = f", {len(samples) - len(ok)} FAILED" if len(ok) < len(samples) else ""
    return f"median {statistics.median(ok) * 1000:.0f} ms, max {max(ok) * 1000:.0f} ms{failed}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--queues", type=int, default=1000)
    ap.add_argument("--max-active", type=int, default=32, help="running queue actors per node")
    ap.add_argument("--samples", type=int, default=5, help="first-message samples")
    ap.add_argument("--threads", type=int, default=4, help="clients creating queues")
    ap.add_argument("--busy-messages", type=int, default=100_000)
    args = ap.parse_args()

    broker = start_broker(f"bench-many-{uuid.uuid4().hex[:6]}")
    try:
        broker.set_hibernation(max_active_queues=args.max_active, hibernate_after_seconds=None)
        idle_broker_mib = pss_mib([broker_pids(broker)["broker"]])

        # Baseline: one queue on an empty broker (a Ray worker process started for it).
        t0 = time.perf_counter()
        broker.create_queue("baseline").send(BODY)
        baseline_create = time.perf_counter() - t0
        baseline_pid = broker_pids(broker)["baseline"]
        idle_queue_mib = pss_mib([baseline_pid])
        baseline_cpu = process_cpu_seconds(baseline_pid)

        def create(i: int) -> float:
            t = time.perf_counter()
            broker.create_queue(f"q{i:04d}").send(BODY)
            return time.perf_counter() - t

        # Created by --threads clients side by side (each queue is a process start,
        # which the broker makes side by side too: one client leaves a core idle).
        t0 = time.perf_counter()
        times = []
        with ThreadPoolExecutor(args.threads) as pool:
            for took in pool.map(create, range(args.queues)):
                times.append(took)
                if len(times) % 50 == 0:
                    console.print(
                        f"{len(times)} queues, {time.perf_counter() - t0:.1f} s,"
                        f" each took {statistics.mean(times[-50:]):.3f} s (last 50)"
                    )
        total = time.perf_counter() - t0
        pids = broker_pids(broker)
        running = [n for n in pids if n not in ("broker", "governor")]
        memory = pss_mib(list(pids.values()))
        broker_mib = pss_mib([pids["broker"]])
        hib = broker.hibernation_stats()
        console.print(
            f"created {args.queues} queues in {total:.1f} s ({total / args.queues * 1000:.0f}"
            f" ms/queue, first queue {baseline_create:.2f} s); {len(running)} running;"
            f" broker memory {memory:.0f} MiB PSS ({memory / args.queues:.2f} MiB/queue)"
        )

        # First message for a new consumer: a running queue (baseline), hibernated ones.
        warm = first_message_seconds(broker, running[-1])
        hibernated = hib["hibernated"]
        asleep = random.Random(1).sample(hibernated, min(args.samples, len(hibernated)))
        revivals: list[float] = []
        firsts = [first_message_seconds(broker, name, revivals) for name in asleep]

        # A busy queue: a backlog with a consumer holding its prefetch.
        busy = broker.create_queue("busy")
        for _ in range(args.busy_messages // 1000):
            busy.send_batch([BODY] * 1000)
        consumer = busy.consumer(prefetch=10_000)
        consumer.receive(1000, timeout=60)
        busy_mib = pss_mib([broker_pids(broker)["busy"]])
        consumer.close()

        disk = 0
        for root, _dirs, files in os.walk(os.path.join(broker.config.paging_directory, "q0000")):
            disk += sum(os.path.getsize(os.path.join(root, f)) for f in files)
        n = args.queues
        rows = [
            ["queues created (1 message each)", f"{n}", ""],
            [
                "total creation time",
                f"{total:.1f} s",
                f"target < 120 s; {args.threads} client(s) side by side",
            ],
            [
                "creation per queue",
                f"{total / n * 1000:.0f} ms",
                f"{total / n / baseline_create:.2f}x the first queue ({baseline_create:.2f} s)",
            ],
            ["running queue actors at the end", f"{len(running)}", f"cap {args.max_active}"],
            [
                "broker memory (PSS: broker, governor, running queues)",
                f"{memory:.0f} MiB",
                "target < 4096 MiB",
            ],
            ["  per queue", f"{memory / n:.2f} MiB", ""],
            [
                "  broker actor",
                f"{broker_mib:.0f} MiB",
                f"{broker_mib - idle_broker_mib:+.0f} MiB"
                f" since empty ({(broker_mib - idle_broker_mib) * 1024 / n:.1f} KiB/queue)",
            ],
            [
                "idle running queue actor",
                f"{idle_queue_mib:.0f} MiB",
                f"{baseline_cpu:.2f} CPU s to start",
            ],
            [
                f"busy queue actor ({args.busy_messages:,} msgs, consumer holding 10k)",
                f"{busy_mib:.0f} MiB",
                f"{busy_mib / idle_queue_mib:.2f}x idle",
            ],
            ["hibernated queue", "0 MiB, no process", f"{disk / 1024:.0f} KiB of files"],
            ["first message, running queue", _ms([warm]), "baseline"],
            [
                f"first message, hibernated queue ({len(firsts)} samples)",
                _ms(firsts),
                "target < 1000 ms"
                + (
                    f"; {statistics.median(ok) / warm:.1f}x running"
                    if warm and (ok := [x for x in firsts if x is not None])
                    else ""
                ),
            ],
            [
                "  of which get_queue (the revival: a process start)",
                _ms(revivals),
                f"{baseline_cpu:.2f} CPU s to start a queue actor",
            ],
            [
                "hibernations / revivals / over cap",
                f"{hib['hibernations']} / {hib['revivals']} / {hib['over_cap']}",
                "",
            ],
        ]
        print_table(
            f"{n} queues, max_active_queues={args.max_active}", ["measure", "value", "note"], rows
        )
    finally:
        stop_broker(broker)


if __name__ == "__main__":
    main()
