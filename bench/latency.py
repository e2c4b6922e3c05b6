"""Latency: ``send()`` until durable, send -> receive at fixed rates, first message.

1 KiB durable messages. For each rate, producer threads send single messages on a fixed
schedule (several threads where one waiting ``send()`` cannot reach the rate; a thread
that falls behind sends at once), each body carrying its send time; one consumer thread
receives them. Printed: p50/p99/p99.9/max of ``send()`` (until durable: it returns after
the fsync) and of send -> receive, for the default consumer (``queue.consumer()``,
``receive()``) and the tuned one (``prefetch=10_000``, ``receive_batch(1000)``).
Baselines measured in the same run: ``send()`` (a message cannot be received before
it is durable, so the delivery path's own cost is about the difference), a plain Ray
actor call's round trip, and the default consumer receiving through Ray calls only
("Ray path": the TargetList's ``take`` then ``ray.get``, as before the
DeliveryChannel), whose send -> receive p99 the others are printed against.

Then the first message for a new consumer on a deep backlog: from ``queue.consumer()``
to its first ``receive()`` returning, for several new consumers in turn (each closed
before the next; the spare TargetList process waited for, as a process starting is not
what is measured). A full ``ray.get`` round trip to an actor is printed beside it.

    python bench/latency.py [--rates 100,1000,10000] [--seconds 4] [--backlog 1000000]
"""

from __future__ import annotations

import argparse
import struct
import threading
import time

import numpy as np
import ray
from raymq.placement import spares

from bench.common import console, print_table, start_broker, stop_broker
from raymq import delivery_channel

BODY = b"x" * 1024
#: ``send()`` calls one thread keeps up with at a steady rate (it waits ~1 ms each).
PER_THREAD_RATE = 400
MAX_THREADS = 32
_STAMP = struct.Struct("<d")


def percentiles(ms: list[float]) -> list[str]:
    """p50, p99, p99.9, max of ``ms`` (milliseconds), formatted."""
    if not ms:
        return ["-"] * 4
    a = np.asarray(ms)
    return [f"{v:.2f}" for v in (*np.percentile(a, [50, 99, 99.9]), a.max())]


def run_rate(
    q, rate: int, seconds: float, tuned: bool, channel: bool = True
) -> tuple[list, list, float]:
    """Send ``rate`` msg/s for ``seconds`` and receive them; returns (send ms,
    send -> receive ms, achieved send rate). ``channel=False``: the consumer receives
    through Ray calls only (the path before the DeliveryChannel, as a baseline)."""
    total = int(rate * seconds)
    threads = min(MAX_THREADS, max(1, -(-rate // PER_THREAD_RATE)))
    send_ms: list[float] = []
    e2e_ms: list[float] = []
    received = threading.Event()
    errors: list[BaseException] = []
    delivery_channel.USE_CHANNEL = channel
    try:
        consumer = q.consumer(prefetch=10_000) if tuned else q.consumer()
    finally:
        delivery_channel.USE_CHANNEL = True
    spares.wait_warm(timeout=30)  # the next spare's process: not what is measured

    def receive() -> None:
        got = 0
        try:
            while got < total:
                if tuned:
                    batch = consumer.receive_batch(1000, timeout=10)
                    now = time.perf_counter()
                    if batch.num_rows == 0:
                        raise RuntimeError(f"stalled after {got} messages")
                    bodies = batch.column("body").to_pylist()
                    e2e_ms.extend((now - _STAMP.unpack_from(b)[0]) * 1e3 for b in bodies)
                    consumer.ack(batch)
                    got += batch.num_rows
                else:
                    msgs = consumer.receive(timeout=10)
                    now = time.perf_counter()
                    if not msgs:
                        raise RuntimeError(f"stalled after {got} messages")
                    e2e_ms.extend((now - _STAMP.unpack_from(m.body)[0]) * 1e3 for m in msgs)
                    consumer.ack(msgs)
                    got += len(msgs)
        except BaseException as exc:
            errors.append(exc)
        finally:
            received.set()

    def produce(index: int, count: int, start: float) -> None:
        interval = threads / rate
        mine = []
        try:
            for i in range(count):
                due = start + (index / rate) + i * interval
                wait = due - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                t0 = time.perf_counter()
                q.send(_STAMP.pack(t0) + BODY[_STAMP.size :])
                mine.append((time.perf_counter() - t0) * 1e3)
        except BaseException as exc:
            errors.append(exc)
        send_ms.extend(mine)

    receiver = threading.Thread(target=receive)
    receiver.start()
    start = time.perf_counter() + 0.05
    per = [total // threads + (1 if i < total % threads else 0) for i in range(threads)]
    producers = [threading.Thread(target=produce, args=(i, per[i], start)) for i in range(threads)]
    for t in producers:
        t.start()
    for t in producers:
        t.join()
    sent_seconds = time.perf_counter() - start
    received.wait()
    receiver.join()
    consumer.close()
    if errors:
        raise errors[0]
    return send_ms, e2e_ms, total / sent_seconds


def first_message(broker, backlog: int, tries: int) -> tuple[list[float], list[float]]:
    """Fill a queue with ``backlog`` messages, then time new consumers: (ms until
    ``consumer()`` returned, ms until its first message)."""
    name = "bench-latency-backlog"
    q = broker.create_queue(name, durable=True)
    bodies = [BODY] * 1000
    for _ in range(backlog // 1000):
        q.send_batch(bodies)
    made, first = [], []
    for _ in range(tries):
        spares.wait_warm(timeout=30)
        t0 = time.perf_counter()
        c = q.consumer()
        t1 = time.perf_counter()
        msgs = c.receive(timeout=30)
        t2 = time.perf_counter()
        if not msgs:
            raise RuntimeError("no first message in 30 s")
        made.append((t1 - t0) * 1e3)
        first.append((t2 - t0) * 1e3)
        c.close()  # not acked: the next consumer gets the same head
    broker.delete_queue(name)
    return made, first


def actor_round_trip(n: int = 200) -> list[float]:
    """ms of ``ray.get`` of a call to a trivial actor: the cost of one Ray hop here."""

    @ray.remote(num_cpus=0)
    class Echo:
        def ping(self) -> int:
            return 0

    echo = Echo.remote()
    ray.get(echo.ping.remote())
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        ray.get(echo.ping.remote())
        out.append((time.perf_counter() - t0) * 1e3)
    ray.kill(echo)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="100,1000,10000")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--backlog", type=int, default=1_000_000)
    parser.add_argument("--tries", type=int, default=5)
    args = parser.parse_args()
    broker = start_broker("raymq-bench-latency")
    try:
        hop = actor_round_trip()
        rows = [["Ray call round trip", "-", "-", *percentiles(hop), "-"]]
        q = broker.create_queue("bench-latency", durable=True)
        for rate in (int(r) for r in args.rates.split(",") if r):
            base_p99 = None
            for tuned, channel in ((False, False), (False, True), (True, True)):
                label = "tuned" if tuned else "default" if channel else "Ray path"
                send_ms, e2e_ms, achieved = run_rate(q, rate, args.seconds, tuned, channel)
                p99 = float(np.percentile(e2e_ms, 99))
                base_p99 = base_p99 or p99  # the Ray path, measured first at this rate
                got = f"{achieved:,.0f}"
                rows.append([f"send(), {label} run", str(rate), got, *percentiles(send_ms), "-"])
                rows.append(
                    [
                        f"send->receive, {label}",
                        str(rate),
                        got,
                        *percentiles(e2e_ms),
                        f"{p99 / base_p99:.2f}x",
                    ]
                )
                console.print(rows[-2], rows[-1])
        broker.delete_queue("bench-latency")
        if args.backlog:
            made, first = first_message(broker, args.backlog, args.tries)
            depth = f"{args.backlog / 1e6:g}M backlog"
            rows.append([f"consumer(), {depth}", "-", "-", *percentiles(made), "-"])
            rows.append([f"first message, {depth}", "-", "-", *percentiles(first), "-"])
        console.width = max(console.width, 120)  # one line per row
        print_table(
            "latency (ms), 1 KiB durable messages; Ray path: receives through Ray calls only",
            ["measure", "rate/s", "achieved/s", "p50", "p99", "p99.9", "max", "p99 vs Ray path"],
            rows,
        )
    finally:
        stop_broker(broker)


if __name__ == "__main__":
    main()
