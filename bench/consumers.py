"""Consumers and selectors: latency through a deep blue backlog, first message on a deep
queue, competing and selective consume rates, and memory of CacheReferences.

Baselines measured in the same run: ray.util.queue draining the same number of
messages with get_nowait_batch (for rates), and a plain consumer (no selector) for the
latencies.

    python bench/consumers.py [--messages 1000000]
"""

from __future__ import annotations

import argparse
import threading
import time

import psutil
from ray.util.queue import Queue as RayQueue
from raymq.placement import spares
from rich.progress import track

from bench.common import console, print_table, start_broker, stop_broker
from raymq.core.offset_set import OffsetSet

BODY = b"x" * 100
BATCH = 1000


def fill(q, n: int, props) -> None:
    """Send ``n`` messages in batches of 1,000 (``props`` one dict or a function of i)."""
    for i in range(0, n, BATCH):
        k = min(BATCH, n - i)
        p = [props(i + j) for j in range(k)] if callable(props) else props
        q.send_batch([BODY] * k, p)


def first_message_seconds(q, **consumer_args) -> float:
    """Seconds from creating a consumer to holding its first message.

    Waits first for the spare TargetList process (``raymq.placement.spares``) that the
    previous consumer started: what is measured is the queue finding the consumer its
    messages, not Ray starting a worker process (~1 s of CPU here), which a consumer
    made within a second of another still pays."""
    spares.wait_warm(timeout=30)
    t0 = time.perf_counter()
    with q.consumer(**consumer_args) as c:
        got = c.receive(timeout=60)
        dt = time.perf_counter() - t0
    assert got, "no message arrived"
    return dt


def red_behind_blue(broker, n: int) -> dict[str, float]:
    q = broker.create_queue("bench-red", page_size_bytes=2**20)
    c = q.consumer(selector="color = 'red'", prefetch=10)
    console.print(f"  sending {n:,} blue ...")
    fill(q, n, {"color": "blue"})
    t0 = time.perf_counter()
    q.send(b"red", {"color": "red"})
    got = c.receive(timeout=60)
    early = time.perf_counter() - t0
    assert [m.body for m in got] == [b"red"]
    c.close()  # nack: the red one is there again for the late consumer
    late = first_message_seconds(q, selector="color = 'red'")
    plain = first_message_seconds(q)
    broker.delete_queue("bench-red")
    return {"early": early, "late": late, "plain": plain}


def new_consumers(q, n: int, selector: str | None = None) -> list:
    """Consumers after throughput: 10 batches of credit each, as in bench.throughput;
    returns once the spare TargetList process each one started is up (as
    bench.throughput, the clock measures consuming, not processes starting)."""
    consumers = [q.consumer(selector=selector, prefetch=10 * BATCH) for _ in range(n)]
    spares.wait_warm(timeout=30)
    return consumers


def consume_rate(consumers: list, total: int, since: float | None = None) -> float:
    """Messages/s received (and acked) by one thread per consumer until ``total``
    arrived, timed from ``since`` (a ``time.perf_counter()``) if given, else from now."""
    count = [0]
    lock = threading.Lock()

    deadline = time.monotonic() + 120

    def work(c) -> None:
        # Short waits: near the end the rest may sit in another consumer's prefetch.
        while time.monotonic() < deadline:
            with lock:
                if count[0] >= total:
                    return
            batch = c.receive_batch(BATCH, timeout=0.05)
            if batch.num_rows == 0:
                continue
            c.ack(batch, wait=False)  # pipelined, as a consumer after throughput acks
            with lock:
                count[0] += batch.num_rows
        c.flush()  # every ack durable before the clock stops

    threads = [threading.Thread(target=work, args=(c,)) for c in consumers]
    t0 = time.perf_counter() if since is None else since
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    for c in consumers:
        c.close()
    return count[0] / dt


def late_selector_rate(q, total: int, selector: str) -> float:
    """A selector consumer arriving after the messages: timed from its creation, so
    the scan of the stored properties is inside the clock."""
    spares.wait_warm(timeout=30)  # the spare it takes is up; the one it starts is not
    t0 = time.perf_counter()
    c = q.consumer(selector=selector, prefetch=10 * BATCH)
    return consume_rate([c], total, since=t0)


def rss(pid: int) -> int:
    """Resident set size of a process (bytes)."""
    return psutil.Process(pid).memory_info().rss


def target_list_memory(broker, n: int) -> list[list[str]]:
    """RSS of a real TargetList actor (and its queue actor) before and after ``n``
    matching messages pile up beyond its watermark (1,000): rows for the table."""
    from raymq.client.calls import _call

    console.print(f"a TargetList with {n:,} matching messages beyond its watermark ...")
    q = broker.create_queue("bench-tl")
    with q.consumer(selector="color = 'red'", prefetch=1000) as c:
        tl_pid, q_pid = _call(c.target_list.pid), _call(q._actor.pid)
        c.stats()  # the consumer is registered and idle: its memory as a baseline
        tl_empty, q_empty = rss(tl_pid), rss(q_pid)
        bodies, props = [b"r" * 10] * 10_000, {"color": "red"}
        for _ in track(range(n // 10_000), description="  sending"):
            q.send_batch(bodies, props)
        while (stats := c.stats())["watermark"] < 1000:  # loaded up to its watermark
            time.sleep(0.05)
        tl_full, q_full = rss(tl_pid), rss(q_pid)
        qs = q.stats()
    broker.delete_queue("bench-tl")
    mib = 2**20
    return [
        [
            f"TargetList actor RSS, empty -> {stats['cache_references']:,} beyond watermark (MiB)",
            f"{tl_empty / mib:.0f} -> {tl_full / mib:.0f}",
            "-",
        ],
        ["  TargetList actor RSS growth (MiB)", f"{(tl_full - tl_empty) / mib:.1f}", "50"],
        [
            "  their CacheReferences: bitmap in the queue actor (KiB)",
            f"{stats['cache_reference_bytes'] / 1024:.0f}",
            "-",
        ],
        ["  queue actor RSS growth (MiB)", f"{(q_full - q_empty) / mib:.1f}", "-"],
        [
            "    of which HeadQueueCache + read cache / indexes (MiB, its budget)",
            f"{(qs['head_cache_bytes'] + qs['read_cache_bytes']) / mib:.1f}"
            f" / {qs['index_bytes'] / mib:.1f} ({qs['memory_budget'] / mib:.0f})",
            "-",
        ],
    ]


def ray_queue_rate(total: int) -> float:
    rq = RayQueue(maxsize=0)
    for _ in range(total // BATCH):
        rq.put_nowait_batch([BODY] * BATCH)
    t0 = time.perf_counter()
    got = 0
    while got < total:
        got += len(rq.get_nowait_batch(min(BATCH, total - got)))
    dt = time.perf_counter() - t0
    rq.shutdown()
    return total / dt


def offset_set_memory(n: int) -> tuple[int, int]:
    """(bitmap bytes, RSS growth bytes) of an OffsetSet holding ``n`` offsets."""
    proc = psutil.Process()
    before = proc.memory_info().rss
    s = OffsetSet()
    for start in range(0, n, 1 << 20):
        s.add_range(start, min(n, start + (1 << 20)))
    after = proc.memory_info().rss
    assert len(s) == n
    return s.nbytes, after - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--rate-messages", type=int, default=1_000_000)
    parser.add_argument("--tl-messages", type=int, default=10_000_000)
    args = parser.parse_args()

    broker = start_broker(namespace="raymq-bench-consumers")
    rows = []
    try:
        console.print(f"red behind {args.messages:,} blue ...")
        red = red_behind_blue(broker, args.messages)
        rows.append(["red behind blue, consumer first (ms)", f"{red['early'] * 1e3:.1f}", "100"])
        rows.append(["red behind blue, consumer after (ms)", f"{red['late'] * 1e3:.1f}", "2000"])
        rows.append(["first message, plain consumer (ms)", f"{red['plain'] * 1e3:.1f}", "-"])

        console.print(f"first message on a {args.messages:,}-message backlog ...")
        q = broker.create_queue("bench-deep", page_size_bytes=10 * 2**20)
        fill(q, args.messages, None)
        deep = first_message_seconds(q)
        rows.append([f"first message, {args.messages:,} backlog (ms)", f"{deep * 1e3:.1f}", "100"])
        broker.delete_queue("bench-deep")

        n = args.rate_messages
        console.print(f"consume rates over {n:,} messages ...")
        base = ray_queue_rate(n)
        q = broker.create_queue("bench-rate")
        fill(q, n, lambda i: {"bucket": i % 10})
        r4 = consume_rate(new_consumers(q, 4), n)
        rows.append(["4 competing consumers (msg/s)", f"{r4:,.0f}", "200,000"])
        fill(q, n, lambda i: {"bucket": i % 10})
        rsel = late_selector_rate(q, n // 10, "bucket = 3")
        rows.append(["selector matching 10 %, consumer after (msg/s)", f"{rsel:,.0f}", "200,000"])
        broker.delete_queue("bench-rate")
        q = broker.create_queue("bench-rate")
        early = new_consumers(q, 1, "bucket = 3")
        fill(q, n, lambda i: {"bucket": i % 10})
        rsel = consume_rate(early, n // 10)
        rows.append(["selector matching 10 %, consumer first (msg/s)", f"{rsel:,.0f}", "200,000"])
        rows.append(["ray.util.queue get_nowait_batch (msg/s)", f"{base:,.0f}", "baseline"])
        rows.append(["  ratio 4 competing / baseline", f"{r4 / base:.2f}x", "-"])
        broker.delete_queue("bench-rate")

        console.print("CacheReference memory ...")
        bits, rss = offset_set_memory(10_000_000)
        rows.append(["10,000,000 CacheReferences: bitmap (MiB)", f"{bits / 2**20:.1f}", "50"])
        rows.append(["10,000,000 CacheReferences: RSS growth (MiB)", f"{rss / 2**20:.1f}", "50"])
        rows += target_list_memory(broker, args.tl_messages)
    finally:
        stop_broker(broker)
    print_table(
        f"consumers and selectors, {time.strftime('%Y-%m-%d')}",
        ["measure", "RayMQ", "target"],
        rows,
    )


if __name__ == "__main__":
    main()
