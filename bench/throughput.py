"""Produce and consume rates of RayMQ against ray.util.queue.Queue, measured in one run.

1 KiB messages; durable and non-durable queues; single sends from 8 concurrent
producers and batches of 1,000. Then the default consume paths (``consumer()`` with
default settings: ``receive(max_messages=1000)`` + ``ack(msgs)``, and ``for message in
consumer``) beside the tuned one, as ratios. Each RayMQ figure is printed with its ratio to
ray.util.queue doing the same work in memory, and durable figures also as a fraction
of this disk's sequential fdatasync bandwidth, measured first.

    python bench/throughput.py [--messages 200000] [--single 16000]
    python bench/throughput.py --consume-only [--repeat 3]   # the consume ratios only
"""

from __future__ import annotations

import argparse
import contextlib
import threading
import time

from ray.util.queue import Queue as RayQueue
from raymq.placement import spares

from bench.common import console, fdatasync_bandwidth, print_table, start_broker, stop_broker, timed

BODY = b"x" * 1024
BATCH = 1000


def in_threads(n_threads: int, total: int, work) -> int:
    """Split ``total`` items over threads running ``work(count)``; returns ``total``."""
    per = total // n_threads
    threads = [threading.Thread(target=work, args=(per,)) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return per * n_threads


def measure(
    send_batch, consume, send_one, messages: int, single: int, consuming=contextlib.nullcontext
) -> dict[str, float]:
    """Rates of one system: batched produce (4 threads), batched consume, single sends
    from 8 threads. ``consume(n)`` must receive n messages and return n; it runs
    inside ``with consuming():``, untimed (where a consumer is made and closed)."""
    bodies = [BODY] * BATCH
    messages -= messages % (4 * BATCH)  # whole batches for each of the 4 producer threads

    def produce_batches(count: int) -> None:
        for _ in range(count // BATCH):
            send_batch(bodies)

    def produce_single(count: int) -> None:
        for _ in range(count):
            send_one(BODY)

    _, batched_in = timed(lambda: in_threads(4, messages, produce_batches))
    with consuming():
        _, batched_out = timed(lambda: consume(messages))
    _, single_in = timed(lambda: in_threads(8, single, produce_single))
    return {
        "batched produce": batched_in,
        "batched consume": batched_out,
        "single produce (8 producers)": single_in,
    }


def raymq_rates(broker, durable: bool, messages: int, single: int) -> dict[str, float]:
    """RayMQ: send_batch / receive_batch + ack / send."""
    name = f"bench-{'durable' if durable else 'memory'}"
    q = broker.create_queue(name, durable=durable)

    consumers = []

    @contextlib.contextmanager
    def consuming():
        # Made before the clock starts, as the ray.util.queue baseline has nothing to
        # make; a consumer after throughput: 10 batches of credit (10 MiB of 1 KiB).
        with q.consumer(prefetch=10 * BATCH) as c:
            consumers.append(c)
            spares.wait_warm(timeout=30)  # the next consumer's process, started meanwhile
            yield

    def consume(n: int) -> int:
        c = consumers[-1]
        got = tuned(c, n)
        c.flush()  # every ack durable before the clock stops
        return got

    rates = measure(q.send_batch, consume, q.send, messages, single, consuming)
    rates.update(default_consume_rates(q, messages))
    broker.delete_queue(name)
    return rates


def tuned(c, n: int) -> int:
    """The tuned consume loop: ``receive_batch(1000)`` + ``ack(batch, wait=False)``."""
    got = 0
    while got < n:
        batch = c.receive_batch(BATCH, timeout=10)
        if batch.num_rows == 0:
            raise RuntimeError(f"consumer stalled after {got} messages")
        c.ack(batch, wait=False)  # pipelined: the next receive overlaps its fsync
        got += batch.num_rows
    return got


def receive_and_ack(c, n: int) -> int:
    """The default loop: ``receive(max_messages=1000)`` + a plain ``ack(msgs)``."""
    got = 0
    while got < n:
        msgs = c.receive(max_messages=BATCH, timeout=10)
        if not msgs:
            raise RuntimeError(f"consumer stalled after {got} messages")
        c.ack(msgs)
        got += len(msgs)
    return got


def receive_read_and_ack(c, n: int) -> int:
    """``receive_and_ack`` reading each message's body and offset first, as an
    application does (each ``Message`` is made when it is reached)."""
    got = 0
    while got < n:
        msgs = c.receive(max_messages=BATCH, timeout=10)
        if not msgs:
            raise RuntimeError(f"consumer stalled after {got} messages")
        for m in msgs:
            _ = m.body, m.offset
        c.ack(msgs)
        got += len(msgs)
    return got


def iterate(c, n: int) -> int:
    """The default loop: ``for message in consumer`` acking each."""
    got = 0
    for message in c:
        c.ack(message)
        got += 1
        if got == n:
            break
    return got


DEFAULT_PATHS = {
    "default consume: receive(1000) + ack": receive_and_ack,
    "default consume: for message in consumer": iterate,
}


def consume_rate(q, consume, messages: int, **settings) -> tuple[float, float]:
    """Drain ``messages`` sent beforehand (untimed) with ``consume`` on a new consumer
    (``settings``; none: the defaults), every ack durable before the clock stops.
    Returns (messages/s, this process's CPU µs per message)."""
    bodies = [BODY] * BATCH
    for _ in range(messages // BATCH):
        q.send_batch(bodies)
    with q.consumer(**settings) as c:
        spares.wait_warm(timeout=30)

        def drain() -> int:
            got = consume(c, messages)
            c.flush()
            return got

        cpu = time.process_time()
        _, rate = timed(drain)
        return rate, (time.process_time() - cpu) / messages * 1e6


def default_consume_rates(q, messages: int) -> dict[str, float]:
    """The consume paths most users write first, with default settings:
    ``receive(max_messages=1000)`` and a plain ``ack(msgs)``, then ``for message in
    consumer`` acking each. Each drains ``messages`` sent beforehand (untimed)."""
    return {label: consume_rate(q, path, messages)[0] for label, path in DEFAULT_PATHS.items()}


def consume_only(broker, messages: int, repeat: int) -> None:
    """The consume paths only, tuned and default interleaved ``repeat`` times on each
    kind of queue: a ratio per round against the tuned rate of the same round, and
    this (client) process's CPU per message, which a busy machine disturbs less."""
    paths = {
        "tuned: receive_batch + ack(wait=False)": tuned,
        **DEFAULT_PATHS,
        "default consume: receive(1000), read each, ack": receive_read_and_ack,
    }
    rows = []
    for durable in (True, False):
        kind = "durable" if durable else "memory"
        name = f"bench-consume-{kind}"
        q = broker.create_queue(name, durable=durable)
        for r in range(repeat):
            console.print(f"{kind} round {r + 1} ...")
            base = None
            for label, path in paths.items():
                settings = {"prefetch": 10 * BATCH} if path is tuned else {}
                rate, cpu = consume_rate(q, path, messages, **settings)
                base = base or rate
                rows.append(
                    [
                        f"{kind} #{r + 1} {label}",
                        f"{rate:,.0f}",
                        f"{rate / base:.2f}x",
                        f"{cpu:.2f}",
                    ]
                )
        broker.delete_queue(name)
    print_table(
        f"default consume paths beside the tuned one, {messages:,} x 1 KiB per run",
        ["workload", "msg/s", "of tuned (same round)", "client CPU µs/msg"],
        rows,
    )


def ray_queue_rates(messages: int, single: int) -> dict[str, float]:
    """ray.util.queue: put_nowait_batch / get_nowait_batch / put."""
    rq = RayQueue(maxsize=0)

    def consume(n: int) -> int:
        got = 0
        while got < n:
            got += len(rq.get_nowait_batch(min(BATCH, n - got)))
        return got

    rates = measure(rq.put_nowait_batch, consume, rq.put, messages, single)
    rq.shutdown()
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=200_000, help="messages per batched run")
    parser.add_argument("--single", type=int, default=16_000, help="messages per single-send run")
    parser.add_argument(
        "--consume-only",
        action="store_true",
        help="only the default consume paths beside the tuned one, --repeat rounds",
    )
    parser.add_argument("--repeat", type=int, default=3, help="rounds of --consume-only")
    args = parser.parse_args()
    if args.consume_only:
        broker = start_broker(namespace="raymq-bench")
        try:
            consume_only(broker, args.messages, args.repeat)
        finally:
            stop_broker(broker)
        return

    console.print("measuring sequential fdatasync bandwidth ...")
    disk = fdatasync_bandwidth()
    console.print(f"disk: {disk / 2**20:.0f} MiB/s sequential with fdatasync per MiB")

    broker = start_broker(namespace="raymq-bench")
    try:
        console.print("ray.util.queue baseline ...")
        base = ray_queue_rates(args.messages, args.single)
        rows, default_rows = [], []
        for durable in (True, False):
            kind = "durable" if durable else "memory"
            console.print(f"RayMQ {'durable' if durable else 'non-durable'} ...")
            rates = raymq_rates(broker, durable, args.messages, args.single)
            tuned = rates["batched consume"]
            default_rows.append(
                [f"{kind} tuned: receive_batch + ack(wait=False)", f"{tuned:,.0f}", "1.00x"]
            )
            for k in [k for k in rates if k.startswith("default")]:
                v = rates.pop(k)
                default_rows.append([f"{kind} {k}", f"{v:,.0f}", f"{v / tuned:.2f}x"])
            for k, v in rates.items():
                disk_share = f"{v * len(BODY) / disk:.0%}" if durable and "produce" in k else "-"
                rows.append(
                    [
                        f"{'durable' if durable else 'memory'} {k}",
                        f"{v:,.0f}",
                        f"{base[k]:,.0f}",
                        f"{v / base[k]:.2f}x",
                        disk_share,
                    ]
                )
        print_table(
            f"1 KiB messages, {args.messages:,} batched / {args.single:,} single, "
            f"{time.strftime('%Y-%m-%d')}",
            ["workload", "RayMQ msg/s", "ray.util.queue msg/s", "ratio", "of disk bw"],
            rows,
        )
        print_table(
            "default consume paths beside the tuned one (target: 0.8x)",
            ["workload", "msg/s", "of tuned"],
            default_rows,
        )
    finally:
        stop_broker(broker)


if __name__ == "__main__":
    main()
