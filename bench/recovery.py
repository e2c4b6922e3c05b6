"""Restart time of a deep queue: open a SegmentLog holding N messages, with and without
its checkpoint (the full scan is the baseline), and a full scan that meets a damaged
record (skipped, its bytes copied aside), measured in one run.

    python -m bench.recovery [--messages 5000000] [--body 100]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np
from rich.progress import track

from bench.common import console, print_table
from raymq.batch import MessageBatch
from raymq.storage import SegmentLog
from raymq.storage.duplicate_ids import stored_ids
from raymq.storage.format import CHECKPOINT_NAME, SEGMENT_SUFFIX


def fill(directory: str, messages: int, body: int, batch: int = 1000) -> None:
    log, _ = SegmentLog.open(directory, queue="deep", page_size_bytes=10 * 2**20)
    bodies = [b"r" * body] * batch
    for i in track(range(messages // batch), description=f"writing {messages:,} messages"):
        b = MessageBatch.from_bodies(bodies, None, max_message_size=2**20)
        if i % 10 == 1:  # acknowledge a scattering, so ack state is non-trivial
            log.ack(np.arange((i - 1) * batch, i * batch, 7))
        p = log.prepare([b], int(time.time() * 1e6), checkpoint=(i % 500 == 0))
        log.write(p)
        log.publish(p)
    p = log.prepare([], int(time.time() * 1e6), checkpoint=True)
    log.write(p)
    log.publish(p)
    log.close()


def reopen(directory: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    log, report = SegmentLog.open(directory, queue="deep", page_size_bytes=10 * 2**20)
    first = log.unacked(0, 1)  # serving: the first deliverable message is found and read
    log.read(int(first[0]), int(first[0]) + 1)
    dt = time.perf_counter() - t0
    log.close()
    return dt, report.depth


def id_scan(directory: str) -> tuple[float, int]:
    """What a queue actor adds to its start for producer ids (``QueueCore``): the live
    segments' stored properties read, newest first, for ids within the window; the
    window here covers every message (all were written just now): the worst case."""
    log, _ = SegmentLog.open(directory, queue="deep", page_size_bytes=10 * 2**20)
    try:
        t0 = time.perf_counter()
        found = stored_ids(log.segments, log.properties, 0)
        return time.perf_counter() - t0, len(found)
    finally:
        log.close()


def damage_one_record(directory: str) -> None:
    """Flip a byte in the middle of the first segment file (inside some record)."""
    name = min(f for f in os.listdir(directory) if f.endswith(SEGMENT_SUFFIX))
    path = os.path.join(directory, name)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=5_000_000)
    parser.add_argument("--body", type=int, default=100, help="body size, bytes")
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="raymq-recovery-", dir=os.environ.get("RAYMQ_BENCH_DIR"))
    try:
        fill(directory, args.messages, args.body)
        with_ckpt, depth = reopen(directory)
        ids_seconds, ids = id_scan(directory)
        os.unlink(os.path.join(directory, CHECKPOINT_NAME))
        full_scan, depth2 = reopen(directory)
        os.unlink(os.path.join(directory, CHECKPOINT_NAME))
        damage_one_record(directory)
        damaged, depth3 = reopen(directory)
        # Without the checkpoint, acks older than its ack generation are gone (they live
        # only in the checkpoint): those messages count as unacked, i.e. redelivered.
        print_table(
            f"restart of a queue of {args.messages:,} x {args.body} B",
            ["open to first message", "seconds", "ratio to full scan", "depth found"],
            [
                [
                    "with checkpoint",
                    f"{with_ckpt:.3f}",
                    f"{with_ckpt / full_scan:.2f}",
                    f"{depth:,}",
                ],
                [
                    "producer ids scan, after it (none stored)",
                    f"{ids_seconds:.3f}",
                    f"{ids_seconds / full_scan:.2f}",
                    f"{ids:,} ids",
                ],
                ["full scan (no checkpoint)", f"{full_scan:.3f}", "1.00", f"{depth2:,}"],
                [
                    "full scan, one record damaged",
                    f"{damaged:.3f}",
                    f"{damaged / full_scan:.2f}",
                    f"{depth3:,}",
                ],
            ],
        )
        console.print("target: serving within 2 s with 5,000,000 messages")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
