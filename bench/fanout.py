"""Fan-out: one address with ten subscriptions against one queue, measured in one run.

1. One copy: N x 1 KiB sent in batches to a queue, then to an address with 10
   subscriptions. Produce rate (target >= 0.9x the queue's), bytes on disk after the
   sends (target <= 1.1x the queue's) and the total delivered over the 10
   subscriptions, consumed at once by 10 consumers (target >= 5x the queue's consume
   rate: each delivery is a reference, not a new write).
2. Artemis's case: 10 subscriptions, a steady producer, an address that pages beyond
   ``max_size_bytes`` (32 MiB, PAGE). Run A:
   all 10 consume. Run B: one is stopped. Target: the 9 keep >= 0.9x their run-A rate
   and >= 95 % of their deliveries come from memory (HeadQueueCache hits); then the
   stopped one drains everything from the pages.
3. ``start="earliest"`` on an address holding M messages: time from the call to the
   first message (target < 100 ms), against a new consumer's first message on a
   subscription that exists (the same consumer start, in the same run).

    python bench/fanout.py [--messages 1000000] [--seconds 15] [--earliest 5000000]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import ray
from raymq.placement import spares

from bench.common import (
    console,
    machine_cpu_seconds,
    print_table,
    process_cpu_seconds,
    start_broker,
    stop_broker,
    timed,
)

BODY = b"x" * 1024
BATCH = 1000
SUBSCRIPTIONS = 10
#: Part 2's address pages beyond this (bytes): the stopped subscription's backlog
#: outgrows it within seconds.
STEADY_MAX_SIZE_BYTES = 32 * 2**20


def send_all(target, messages: int) -> int:
    """Send ``messages`` in batches of ``BATCH`` from 4 threads; returns the count."""
    bodies = [BODY] * BATCH
    per = messages // (4 * BATCH)

    def work() -> None:
        for _ in range(per):
            target.send_batch(bodies)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return per * 4 * BATCH


def consumers_of(handles: list, prefetch: int = 10 * BATCH) -> list:
    """A consumer of each handle, made before a clock starts (a TargetList actor's
    process takes about a second to start: not what is measured)."""
    out = []
    for h in handles:
        spares.wait_warm(timeout=30)
        out.append(h.consumer(prefetch=prefetch))
    return out


def consume(c, n: int) -> int:
    """Receive and ack ``n`` messages with consumer ``c``."""
    got = 0
    while got < n:
        batch = c.receive_batch(BATCH, timeout=30)
        if batch.num_rows == 0:
            raise RuntimeError(f"{c.queue.name}: stalled after {got} of {n} messages")
        c.ack(batch, wait=False)
        got += batch.num_rows
    c.flush()
    return got


def consume_all(consumers: list, n: int) -> int:
    """``consume(c, n)`` for every consumer at once (a thread each); returns the total."""
    counts = [0] * len(consumers)

    def work(k: int) -> None:
        counts[k] = consume(consumers[k], n)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(consumers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts)


def close_all(consumers: list) -> None:
    for c in consumers:
        c.close()


def costed(target, fn) -> tuple[float, float, float]:
    """Run ``fn`` (it returns a count); returns its rate (per second), and the CPU
    microseconds per unit that ``target``'s queue actor and the whole machine used."""
    pid = ray.get(target._actor.pid.remote())
    actor0, machine0 = process_cpu_seconds(pid), machine_cpu_seconds()
    seconds, rate = timed(fn)
    n = rate * seconds
    actor = process_cpu_seconds(pid) - actor0
    machine = machine_cpu_seconds() - machine0
    return rate, actor / n * 1e6, machine / n * 1e6


def one_copy(broker, messages: int) -> list[list[str]]:
    """Part 1: a queue, then a 10-subscription address, same messages."""
    queue = broker.create_queue("fanout-queue")
    _, queue_in = timed(lambda: send_all(queue, messages))
    queue_disk = queue.stats()["bytes_on_disk"]
    consumers = consumers_of([queue])
    queue_out, queue_actor, queue_machine = costed(queue, lambda: consume(consumers[0], messages))
    close_all(consumers)
    address = broker.create_address("fanout")
    subs = [address.create_subscription(f"s{k}") for k in range(SUBSCRIPTIONS)]
    _, address_in = timed(lambda: send_all(address, messages))
    address_disk = address.stats()["bytes_on_disk"]
    consumers = consumers_of(subs)
    delivered, address_actor, address_machine = costed(
        address, lambda: consume_all(consumers, messages)
    )
    close_all(consumers)
    left = address.stats()
    broker.delete_queue("fanout-queue")
    broker.delete_address("fanout")
    return [
        ratio_row("produce (msg/s)", queue_in, address_in, ">= 0.9x"),
        ratio_row("bytes on disk after sending", queue_disk, address_disk, "<= 1.1x"),
        ratio_row("delivered (msg/s, all subscriptions)", queue_out, delivered, ">= 5x"),
        # Where the rate is bounded by the machine's cores (every consumer, TargetList
        # and the queue actor share 2 here), these say what more cores would give:
        # one queue actor's ceiling is 1 / its CPU per delivery.
        ratio_row("queue actor CPU per delivery (us)", queue_actor, address_actor, "-", 2),
        ratio_row("machine CPU per delivery (us)", queue_machine, address_machine, "-", 2),
        [
            "shared batches (object store puts)",
            "-",
            f"{left['head_cache_shared_batches']:,}",
            "-",
            f"{messages // BATCH:,} (one per batch sent)",
        ],
        ["depth left after consuming", "0", f"{left['depth']:,}", "-", "0"],
    ]


def ratio_row(figure: str, base: float, value: float, target: str, digits: int = 0) -> list[str]:
    """A table row: the figure, its baseline, its value, their ratio and the target."""
    ratio = f"{value / max(base, 1e-9):.2f}x"
    return [figure, f"{base:,.{digits}f}", f"{value:,.{digits}f}", ratio, target]


def steady(broker, seconds: float, stopped: bool, tag: str, prefetch: int) -> dict:
    """Part 2: a producer at a steady pace, 10 subscriptions, one stopped if
    ``stopped``; returns the 9 others' rate and HeadQueueCache hit ratio."""
    # Artemis's case pages: beyond max_size_bytes messages are on disk only, and the
    # memory for them (HeadQueueCache, read cache) is bounded by it.
    address = broker.create_address(
        f"steady-{tag}", max_size_bytes=STEADY_MAX_SIZE_BYTES, address_full_policy="PAGE"
    )
    subs = [address.create_subscription(f"s{k}") for k in range(SUBSCRIPTIONS)]
    running = subs[1:] if stopped else subs
    consumers = dict(zip([s.name for s in running], consumers_of(running, prefetch), strict=True))
    stop = threading.Event()
    counts = {s.name: 0 for s in running}
    sent = [0]

    def produce() -> None:
        bodies = [BODY] * BATCH
        while not stop.is_set():
            address.send_batch(bodies)
            sent[0] += BATCH
            time.sleep(0.02)  # steady: ~50 batches a second at most

    def work(sub) -> None:
        c = consumers[sub.name]
        while not stop.is_set():
            batch = c.receive_batch(BATCH, timeout=0.5)
            if batch.num_rows:
                c.ack(batch, wait=False)
                counts[sub.name] += batch.num_rows
        c.flush()

    threads = [threading.Thread(target=produce)] + [
        threading.Thread(target=work, args=(s,)) for s in running
    ]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    close_all(consumers.values())
    keeping = subs[1:]  # the same nine in both runs
    hits = misses = 0
    for s in keeping:
        st = s.stats()
        hits += st["head_cache_hits"]
        misses += st["head_cache_misses"]
    paged = address.stats()
    out = {
        "paged": (paged["bytes_on_disk"], paged["head_cache_bytes"]),
        "rate": sum(counts[s.name] for s in keeping) / seconds,
        # What the nine received of what was sent: the producer's pace varies with the
        # machine's load, this does not.
        "kept_up": sum(counts[s.name] for s in keeping) / max(1, 9 * sent[0]),
        "hit_ratio": hits / max(1, hits + misses),
        "sent": sent[0],
        "address": address,
        "stopped": subs[0],
    }
    if stopped:
        depth = subs[0].stats()["depth"]
        late = consumers_of([subs[0]])
        _, rate = timed(lambda: consume(late[0], depth))
        close_all(late)
        out["drained"] = (depth, rate)
    broker.delete_address(address.name)
    return out


def first_message(sub) -> float:
    """Seconds from a new consumer of ``sub`` to its first message (offset 0)."""
    spares.wait_warm(timeout=30)  # the consumer's process: not what is measured
    t0 = time.perf_counter()
    with sub.consumer(prefetch=BATCH) as c:
        first = c.receive(1, timeout=30)
        took = time.perf_counter() - t0
    assert first and first[0].offset == 0, first
    return took


def earliest(broker, messages: int, rounds: int = 3) -> dict[str, float]:
    """Part 3, on an address holding ``messages`` (medians of ``rounds``, seconds):
    ``baseline``, a new consumer's first message on a subscription that exists (what
    any consumer costs); ``create``, ``create_subscription(start="earliest")`` alone;
    ``total``, from that call to the first message of a new consumer of it."""
    address = broker.create_address("deep")
    keep = address.create_subscription("keep")  # holds every message
    send_all(address, messages)
    base, create, total = [], [], []
    for k in range(rounds):
        base.append(first_message(keep))
        spares.wait_warm(timeout=30)
        t0 = time.perf_counter()
        sub = address.create_subscription(f"late{k}", start="earliest")
        create.append(time.perf_counter() - t0)
        total.append(create[-1] + first_message(sub))
        address.delete_subscription(sub.subscription_name)
    broker.delete_address("deep")
    return {
        "baseline": statistics.median(base),
        "create": statistics.median(create),
        "total": statistics.median(total),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=1_000_000, help="part 1 messages")
    parser.add_argument("--seconds", type=float, default=15.0, help="part 2 run length")
    parser.add_argument("--earliest", type=int, default=5_000_000, help="part 3 messages")
    parser.add_argument("--parts", default="123", help="which parts to run")
    parser.add_argument(
        "--steady-prefetch",
        type=int,
        default=10 * BATCH,
        help="part 2 consumers' prefetch (their references are charged to the address's"
        " budget before its HeadQueueCache)",
    )
    args = parser.parse_args()
    broker = start_broker(namespace="raymq-bench-fanout", head_cache_bytes=32 * 2**20)
    try:
        if "1" in args.parts:
            console.print(f"part 1: {args.messages:,} x 1 KiB, a queue then 10 subscriptions ...")
            rows = one_copy(broker, args.messages)
            print_table(
                "one stored copy (same run)",
                ["figure", "queue", "address, 10 subscriptions", "ratio", "target"],
                rows,
            )
        if "2" in args.parts:
            console.print(f"part 2: {args.seconds:.0f} s with all 10, then with one stopped ...")
            base = steady(broker, args.seconds, False, "a", args.steady_prefetch)
            slow = steady(broker, args.seconds, True, "b", args.steady_prefetch)
            depth, drain_rate = slow["drained"]
            print_table(
                "one stopped subscription (same run)",
                ["figure", "all 10 consume", "one stopped", "ratio", "target"],
                [
                    ratio_row("9 others' rate (msg/s)", base["rate"], slow["rate"], ">= 0.9x"),
                    [
                        "9 others received of what was sent",
                        f"{base['kept_up']:.1%}",
                        f"{slow['kept_up']:.1%}",
                        f"{slow['kept_up'] / max(base['kept_up'], 1e-9):.2f}x",
                        ">= 0.9x",
                    ],
                    [
                        "9 others' HeadQueueCache hits",
                        f"{base['hit_ratio']:.1%}",
                        f"{slow['hit_ratio']:.1%}",
                        "-",
                        ">= 95 %",
                    ],
                    [
                        "address on disk / HeadQueueCache at the end (MiB)",
                        "{:,.0f} / {:,.0f}".format(*(b / 2**20 for b in base["paged"])),
                        "{:,.0f} / {:,.0f}".format(*(b / 2**20 for b in slow["paged"])),
                        "-",
                        f"cache <= {STEADY_MAX_SIZE_BYTES // 2**20}",
                    ],
                    [
                        "stopped one drained afterwards",
                        "-",
                        f"{depth:,} at {drain_rate:,.0f} msg/s",
                        "-",
                        "all",
                    ],
                ],
            )
        if "3" in args.parts:
            console.print(f"part 3: start='earliest' on {args.earliest:,} messages ...")
            took = earliest(broker, args.earliest)
            print_table(
                "a late subscription (medians of 3)",
                ["figure", "value", "target"],
                [
                    [
                        "a new consumer's first message, existing subscription (baseline)",
                        f"{took['baseline'] * 1000:.0f} ms",
                        "-",
                    ],
                    [
                        "create_subscription(start='earliest')",
                        f"{took['create'] * 1000:.0f} ms",
                        "-",
                    ],
                    [
                        "from create_subscription to its first message",
                        f"{took['total'] * 1000:.0f} ms",
                        "< 100 ms",
                    ],
                ],
            )
    finally:
        stop_broker(broker)


if __name__ == "__main__":
    main()
