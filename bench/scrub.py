"""The background scrub's cost: CPU per record checked and the event-loop stall of one
step, with neighbouring records read together (``Scrubber.step``) beside the baseline
of a read per record (``Segment.verify_record`` on each, what a step did before), in
the same run, on the same files.

The scrub runs in every durable queue actor's event loop, ``SCRUB_STEP_SECONDS`` (50 ms)
apart, reading ``scrub_bytes_per_second`` (4 MiB/s) in all: a step's time is how long
sends, fetches and deliveries wait behind it, and the seconds a second are what a queue
with a backlog spends on it for ever (the scrub walks round and round).

    python -m bench.scrub [--messages 100000] [--per-record 1 8] [--size 1024]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from bench.common import console, print_table
from raymq.batch import MessageBatch
from raymq.config import BrokerConfig
from raymq.core.scrub_pacer import SCRUB_STEP_SECONDS
from raymq.storage import SegmentLog


def fill(directory: str, messages: int, per_record: int, size: int) -> SegmentLog:
    """A durable log of ``messages`` of ``size`` bytes, ``per_record`` to a record (a
    batch a record: single sends store a record each)."""
    log, _ = SegmentLog.open(directory, queue="scrub", page_size_bytes=64 * 2**20, durable=True)
    body = b"x" * size
    records = messages // per_record
    for start in range(0, records, 256):  # 256 records a group commit: a quick fill
        batches = [
            MessageBatch.from_bodies([body] * per_record, None, max_message_size=2**30)
            for _ in range(min(256, records - start))
        ]
        prepared = log.prepare(batches, time.time_ns() // 1000)
        log.write(prepared)
        log.publish(prepared)
    return log


def scrub_pass(log: SegmentLog, step_bytes: int) -> tuple[float, list[float]]:
    """One whole pass of ``Scrubber.step`` calls; (CPU seconds, each step's seconds)."""
    steps: list[float] = []
    passes = log.scrub_passes
    cpu = time.process_time()
    while log.scrub_passes == passes:
        t0 = time.perf_counter()
        log.scrub_step(step_bytes)
        steps.append(time.perf_counter() - t0)
    return time.process_time() - cpu, steps


def verify_each(log: SegmentLog, step_bytes: int) -> tuple[float, list[float]]:
    """The baseline: every record read and checked alone, its pages dropped from the
    cache first (as the scrub does: it checks the disk), in steps of ``step_bytes``."""
    steps: list[float] = []
    cpu = time.process_time()
    done, t0 = 0, time.perf_counter()
    for seg in log.segments:
        for k in range(len(seg.firsts)):
            if seg.positions[k] < 0:
                continue
            pos, stop = seg.positions[k], seg.record_end(k)
            os.posix_fadvise(seg.fd, pos, stop - pos, os.POSIX_FADV_DONTNEED)  # as it did
            done += seg.verify_record(k)
            if done >= step_bytes:
                steps.append(time.perf_counter() - t0)
                done, t0 = 0, time.perf_counter()
    return time.process_time() - cpu, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=100_000, help="messages stored")
    parser.add_argument("--size", type=int, default=1024, help="body bytes")
    parser.add_argument("--per-record", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.size < 1 or args.rounds < 1 or min(args.per_record) < 1:
        parser.error("--size, --rounds and --per-record must be at least 1")
    if args.messages < max(args.per_record):
        parser.error(f"--messages must be at least --per-record ({max(args.per_record)})")
    rate = BrokerConfig().scrub_bytes_per_second
    step_bytes = int(rate * SCRUB_STEP_SECONDS)
    rows = []
    for per_record in args.per_record:
        with tempfile.TemporaryDirectory(dir="/tmp") as directory:
            console.print(f"storing {args.messages:,} messages, {per_record} a record ...")
            log = fill(directory, args.messages, per_record, args.size)
            records = args.messages // per_record
            figures: dict[str, list[tuple[float, float]]] = {"run": [], "each": []}
            for r in range(args.rounds):  # interleaved: the same disk and cache state
                for name, fn in (("each", verify_each), ("run", scrub_pass)):
                    cpu, steps = fn(log, step_bytes)
                    figures[name].append((cpu, statistics.median(steps)))
                    console.print(f"round {r + 1} {name}: {cpu:.2f} CPU s")
            log.close()
        each_cpu = statistics.median(c for c, _ in figures["each"])
        run_cpu = statistics.median(c for c, _ in figures["run"])
        each_step = statistics.median(s for _, s in figures["each"])
        run_step = statistics.median(s for _, s in figures["run"])
        for name, cpu, step in (
            ("record by record (before)", each_cpu, each_step),
            ("runs, one read each", run_cpu, run_step),
        ):
            rows.append(
                [
                    str(per_record),
                    name,
                    f"{1e6 * cpu / records:.1f}",
                    f"{1e3 * step:.2f}",
                    f"{100 * cpu / records * rate / (args.messages * args.size / records):.1f}",
                    f"{each_cpu / cpu:.1f}x",
                ]
            )
    print_table(
        f"scrub of {args.size} B messages at {rate / 2**20:.0f} MiB/s, in"
        f" {SCRUB_STEP_SECONDS * 1e3:.0f} ms steps of {step_bytes / 1024:.0f} KiB (step ms:"
        " median; % of a core: at that rate)",
        [
            "msg/record",
            "path",
            "CPU us/record",
            "step ms",
            "% of a core",
            "vs before",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
