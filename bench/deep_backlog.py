"""Deep backlog under a small budget: 5,000,000 x 1 KiB durable messages sent with no
consumer, then consumed, with ``flow_to_disk_threshold`` 64 MiB.

Every second it samples the RSS of every broker actor process (broker, governor, queue,
TargetList), the object store bytes in use and the message memory the broker accounts
for (HeadQueueCache, read cache, transient messages, indexes, direct references,
PendingCache). Baselines measured in the same run: the produce rate while the backlog
still fits in memory (its first 50,000 messages), and the disk alone writing as many
bytes as the paged part, with an fdatasync per MiB (gigabytes written in a row go at
the device's sustained rate, not at the page cache's: that, not paging, is what slows
a durable producer down past the first gigabyte).

    python bench/deep_backlog.py [--messages 5000000] [--threshold-mib 64]
"""

from __future__ import annotations

import argparse
import os
import time

import ray
from raymq.actors.names import BROKER_ACTOR_NAME, GOVERNOR_ACTOR_NAME

from bench.common import (
    Sampler,
    console,
    fdatasync_bandwidth,
    plasma_bytes,
    print_table,
    rss_of,
    start_broker,
    stop_broker,
)

MIB = 2**20
BATCH = 1000
IN_MEMORY_PART = 50_000
#: Bytes one 1 KiB message takes in a segment: body, timestamp, two offsets (FORMAT.md).
ON_DISK = 1024 + 3 * 8


def actor_pid(name: str, namespace: str) -> int:
    actor = ray.get_actor(name, namespace=namespace)
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=5_000_000)
    parser.add_argument("--threshold-mib", type=int, default=64)
    args = parser.parse_args()
    threshold = args.threshold_mib * MIB
    n = args.messages

    paged_bytes = max(n - 1_000_000, 0) * ON_DISK  # bodies and their framing
    console.print(f"the disk alone: {paged_bytes / 2**30:.1f} GiB with fdatasync per MiB ...")
    disk = fdatasync_bandwidth(total_bytes=max(paged_bytes, 64 * MIB))
    ns = "raymq-bench-deep"
    broker = start_broker(
        namespace=ns,
        flow_to_disk_threshold=threshold,
        housekeeping_period=1.0,
    )
    try:
        q = broker.create_queue("deep")
        pids = [
            actor_pid(BROKER_ACTOR_NAME, ns),
            actor_pid(GOVERNOR_ACTOR_NAME, ns),
            ray.get(q._actor.pid.remote()),
        ]
        consumer_stats: list = [None]

        def sample() -> dict:
            s = q.stats()
            c = consumer_stats[0]() if consumer_stats[0] else {}
            accounted = (
                s["head_cache_bytes"]
                + s["read_cache_bytes"]
                + s["transient_bytes_in_memory"]
                + s["index_bytes"]
                + c.get("direct_bytes", 0)
                + c.get("pending_cache_bytes", 0)
            )
            return {
                "depth": s["depth"],
                "rss": rss_of(pids),
                "plasma": plasma_bytes(),
                "accounted": accounted,
                "budget": s["memory_budget"],
            }

        body = b"x" * 1024
        with Sampler(sample) as sampler:
            console.print(f"sending {n:,} x 1 KiB durable messages, no consumer ...")
            marks: dict[int, float] = {}
            t0 = time.perf_counter()
            for i in range(0, n, BATCH):
                q.send_batch([body] * min(BATCH, n - i))
                sent = i + BATCH
                if sent in (IN_MEMORY_PART, 1_000_000, n) or sent >= n:
                    marks[min(sent, n)] = time.perf_counter() - t0
                if sent % 500_000 == 0:
                    console.print(f"  {sent:,} sent, {sent / (time.perf_counter() - t0):,.0f}/s")
            produce_seconds = time.perf_counter() - t0
            produced_samples = len(sampler.samples)

            console.print("consuming from disk ...")
            c = q.consumer(prefetch=4 * BATCH)
            consumer_stats[0] = c.stats
            pids.append(ray.get(c.target_list.__ray_call__.remote(lambda self: os.getpid())))
            got = 0
            t1 = time.perf_counter()
            while got < n:
                batch = c.receive_batch(4 * BATCH, timeout=30)
                if batch.num_rows == 0:
                    break
                c.ack(batch)
                got += batch.num_rows
            consume_seconds = time.perf_counter() - t1
            c.close()
        samples = [s for s in sampler.samples if "error" not in s]
        errors = [s for s in sampler.samples if "error" in s]
    finally:
        stop_broker(broker)

    base_rate = IN_MEMORY_PART / marks[IN_MEMORY_PART]
    start_1m = marks.get(1_000_000, produce_seconds)
    paging_rate = (n - 1_000_000) / (produce_seconds - start_1m) if n > 1_000_000 else 0.0
    consume_rate = got / consume_seconds
    during = samples[:produced_samples]
    rss_1m = next((s["rss"] for s in during if s["depth"] >= min(1_000_000, n)), during[-1]["rss"])
    rss_end = during[-1]["rss"]
    message_memory = max(s["accounted"] for s in samples)
    store_produce = max(s["plasma"] for s in samples[:produced_samples])
    store_consume = max((s["plasma"] for s in samples[produced_samples:]), default=0)
    rows = [
        ["flow_to_disk_threshold (MiB)", f"{threshold / MIB:.0f}", "-"],
        ["peak message memory accounted (MiB)", f"{message_memory / MIB:.1f}", "<= 70.4"],
        ["  ratio to threshold", f"{message_memory / threshold:.2f}", "<= 1.10"],
        ["peak object store in use, producing (MiB)", f"{store_produce / MIB:.1f}", "-"],
        ["peak object store in use, consuming (MiB)", f"{store_consume / MIB:.1f}", "-"],
        ["broker RSS at 1M backlog (MiB)", f"{rss_1m / MIB:.0f}", "-"],
        [f"broker RSS at {n:,} backlog (MiB)", f"{rss_end / MIB:.0f}", "-"],
        ["  RSS growth 1M -> end", f"{(rss_end - rss_1m) / rss_1m:+.1%}", "< 5 %"],
        ["produce, backlog in memory (msg/s, baseline)", f"{base_rate:,.0f}", "-"],
        ["produce, backlog > 1M paged (msg/s)", f"{paging_rate:,.0f}", ">= half baseline"],
        ["  ratio paging / baseline", f"{paging_rate / base_rate:.2f}", ">= 0.50"],
        ["disk alone, same bytes sustained (MiB/s)", f"{disk / MIB:,.0f}", "-"],
        ["  paged produce, share of it", f"{paging_rate * ON_DISK / disk:.0%}", "-"],
        [f"consume {got:,} from disk (msg/s)", f"{consume_rate:,.0f}", ">= 150,000"],
        ["samples (errors)", f"{len(samples)} ({len(errors)})", "-"],
    ]
    print_table(f"deep backlog, {time.strftime('%Y-%m-%d')}", ["measure", "RayMQ", "target"], rows)


if __name__ == "__main__":
    main()
