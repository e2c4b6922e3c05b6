"""Memory used only where it helps: the default ``flow_to_disk_threshold`` (75 % of the
object store) against a 64 MiB one, measured in one run.

For each threshold, on a broker of its own (same Ray): fill one durable queue with N x
1 KiB messages (``send_batch(1000)``, no consumer), let the MemoryGovernor run a round,
then measure

* the fill rate (msg/s);
* the queue actor's RSS and PSS after the fill;
* the first message for a new consumer on that backlog (``consumer()`` to the first
  ``receive``);
* a clean restart (``Broker.shutdown()``, ``raymq.connect`` again on the same files):
  connect plus ``get_queue`` (the queue actor opens its files), then the first message
  for a new consumer; and the queue actor's RSS/PSS once the governor has spoken again.

Ratios are default / 64 MiB (rates: higher is better; times and memory: lower is better).

    python -m bench.memory_defaults [--messages 1000000] [--repeat 1]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time

import psutil
import ray

import raymq
from bench.common import bench_ray_address, console, print_table, process_cpu_seconds

MIB = 2**20
BATCH = 1000


def _memory(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of process ``pid`` in bytes."""
    info = psutil.Process(pid).memory_full_info()
    return info.rss, info.pss


def _settle(broker) -> None:
    """Two governor rounds now (the second sees what the first's budgets left)."""
    broker.rebalance()
    broker.rebalance()


def _first_message(q) -> tuple[float, float]:
    """Seconds from ``consumer()`` to the first received message of a new consumer, and
    of that the first ``receive`` alone (the queue's part: the rest is the consumer's
    TargetList actor starting)."""
    t0 = time.perf_counter()
    c = q.consumer()
    t1 = time.perf_counter()
    got = c.receive(1, timeout=30)
    t2 = time.perf_counter()
    if not got:
        raise RuntimeError(f"queue {q.name!r}: no message within 30 s")
    c.close()  # not acknowledged: delivered again later, the backlog stays whole
    return t2 - t0, t2 - t1


def run_one(label: str, threshold: int | None, messages: int, namespace: str) -> dict:
    """Fill, measure, restart and measure again; returns the figures."""
    paging = tempfile.mkdtemp(prefix="raymq-memdef-", dir=os.environ.get("RAYMQ_BENCH_DIR"))
    settings = {"paging_directory": paging, "flow_to_disk_threshold": threshold}
    out: dict = {"label": label}
    broker = raymq.connect(namespace=namespace, **settings)
    try:
        q = broker.create_queue("memdef")
        body = b"x" * 1024
        q.send_batch([body] * BATCH)  # the actor and the send path are warm
        pid = ray.get(q._actor.pid.remote())
        t0, cpu0 = time.perf_counter(), process_cpu_seconds(pid)
        for i in range(BATCH, messages, BATCH):
            q.send_batch([body] * min(BATCH, messages - i))
        out["fill_rate"] = (messages - BATCH) / (time.perf_counter() - t0)
        # CPU of the queue actor per million messages: less at the mercy of a busy machine.
        out["fill_cpu"] = (process_cpu_seconds(pid) - cpu0) * 1e6 / (messages - BATCH)
        _settle(broker)
        out["rss"], out["pss"] = _memory(pid)
        s = q.stats()
        out["head_cache"] = s["head_cache_bytes"]
        out["budget"] = s["memory_budget"]
        out["first_new"], out["first_new_receive"] = _first_message(q)
        broker.shutdown()
        t0 = time.perf_counter()
        broker = raymq.connect(namespace=namespace, **settings)
        q = broker.get_queue("memdef")
        out["reopen"] = time.perf_counter() - t0
        out["first_restart"], out["first_restart_receive"] = _first_message(q)
        _settle(broker)
        out["first_restart_settled"], out["first_restart_settled_receive"] = _first_message(q)
        pid = ray.get(q._actor.pid.remote())
        out["rss_restart"], out["pss_restart"] = _memory(pid)
        out["recovery_seconds"] = q.stats()["recovery_seconds"]
    finally:
        with contextlib.suppress(Exception):
            broker.shutdown()
        shutil.rmtree(paging, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=1, help="runs of each, interleaved")
    args = parser.parse_args()
    address = bench_ray_address()
    own = {"include_dashboard": False} if address == "local" else {}
    ray.init(address=address, log_to_driver=False, configure_logging=False, **own)
    try:
        runs: dict[str, list[dict]] = {"default": [], "64 MiB": []}
        for r in range(args.repeat):
            for label, threshold in (("default", None), ("64 MiB", 64 * MIB)):
                console.print(f"run {r + 1}: {label} threshold, {args.messages:,} x 1 KiB ...")
                runs[label].append(
                    run_one(label, threshold, args.messages, f"raymq-memdef-{r}-{label[:2]}")
                )
    finally:
        ray.shutdown()

    def med(label: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[label])

    measures = [
        ("fill (msg/s)", "fill_rate", "{:,.0f}", 1),
        ("  queue actor CPU per 1M messages (s)", "fill_cpu", "{:,.2f}", 1),
        ("queue actor RSS after fill (MiB)", "rss", "{:,.0f}", MIB),
        ("queue actor PSS after fill (MiB)", "pss", "{:,.0f}", MIB),
        ("HeadQueueCache after fill (MiB)", "head_cache", "{:,.1f}", MIB),
        ("queue actor budget (MiB)", "budget", "{:,.1f}", MIB),
        ("first message, new consumer (ms)", "first_new", "{:,.1f}", 1e-3),
        ("  its first receive (ms)", "first_new_receive", "{:,.1f}", 1e-3),
        ("restart: connect + get_queue (ms)", "reopen", "{:,.0f}", 1e-3),
        ("  recovery_seconds in it (ms)", "recovery_seconds", "{:,.1f}", 1e-3),
        ("restart: first message (ms)", "first_restart", "{:,.1f}", 1e-3),
        ("  its first receive (ms)", "first_restart_receive", "{:,.1f}", 1e-3),
        ("restart: first message after a round (ms)", "first_restart_settled", "{:,.1f}", 1e-3),
        ("  its first receive (ms)", "first_restart_settled_receive", "{:,.1f}", 1e-3),
        ("queue actor RSS after restart (MiB)", "rss_restart", "{:,.0f}", MIB),
        ("queue actor PSS after restart (MiB)", "pss_restart", "{:,.0f}", MIB),
    ]
    rows = []
    for title, key, fmt, unit in measures:
        d, s = med("default", key), med("64 MiB", key)
        ratio = f"{d / s:.2f}" if s > 0 else "-"
        spread = ", ".join(fmt.format(x[key] / unit) for x in runs["default"])
        rows.append([title, fmt.format(d / unit), fmt.format(s / unit), ratio, spread])
    print_table(
        f"default threshold vs 64 MiB, {args.messages:,} x 1 KiB, median of {args.repeat}",
        ["measure", "default", "64 MiB", "ratio default/64MiB", "default, each run"],
        rows,
    )
    console.print(
        "targets: fill ratio >= 1.0 (noise allowing), memory ratios near 1, "
        "first message after restart < 100 ms"
    )


if __name__ == "__main__":
    main()
