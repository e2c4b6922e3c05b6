"""Latency: ``send()`` until durable, send -> receive at fixed rates, first message.

1 KiB durable messages. For each rate, producers send single messages on a fixed
schedule (a thread that falls behind sends at once), each body carrying its send time;
one consumer thread receives them. Up to ``THREADED_MAX_RATE`` msg/s, producer threads
each wait on ``send()`` (several where one cannot reach the rate); above it, one thread
sends with ``send(wait=False)`` (pipelined: many threads waiting in one process fight
for its GIL, which the consumer thread needs too), and its "send()" figure is the time
until the future is done, seen at that thread's next send (at most one interval late).
Printed: p50/p99/p99.9/max of ``send()`` (until durable: it returns after the fsync)
and of send -> receive, for the default consumer (``queue.consumer()``, ``receive()``)
and the tuned one (``prefetch=10_000``, ``receive_batch(1000)``). Baselines measured in
the same run: ``send()`` (a message cannot be received before it is durable, so the
delivery path's own cost is about the difference), a plain Ray actor call's round trip,
the default consumer with its TargetList fetching through Ray calls ("Ray fetch": the
queue's ``fetch_batch``, as before the FetchChannel), and receiving through Ray calls
too ("Ray path": also the TargetList's ``take`` then ``ray.get``, as before the
DeliveryChannel), whose send -> receive p99 the others are printed against.

``--repeats N`` runs every path N times per rate, interleaved, and pools the figures.

Then the first message for a new consumer on a deep backlog: from ``queue.consumer()``
to its first ``receive()`` returning, for several new consumers in turn (each closed
before the next; the spare TargetList process waited for, as a process starting is not
what is measured). A full ``ray.get`` round trip to an actor is printed beside it.

    python -m bench.latency [--rates 100,1000,10000] [--seconds 4] [--backlog 1000000]
        [--tries 5] [--repeats 1]
"""

from __future__ import annotations

import argparse
import struct
import threading
import time
from collections import deque

import numpy as np
import ray
from raymq.placement import spares

from bench.common import console, print_table, start_broker, stop_broker
from raymq.wire import delivery as delivery_channel

BODY = b"x" * 1024
#: ``send()`` calls one thread keeps up with at a steady rate (it waits ~1 ms each).
PER_THREAD_RATE = 400
MAX_THREADS = 32
#: Highest rate sent by threads each waiting on ``send()``; above it, pipelined (msg/s).
THREADED_MAX_RATE = 2000
#: Longest a running fetch of the TargetList's loader waits (it polls this long): after
#: switching its FetchChannel off, the next fetch goes through Ray (seconds).
LOADER_POLL_SECONDS = 1.0
_STAMP = struct.Struct("<d")


def percentiles(ms: list[float]) -> list[str]:
    """p50, p99, p99.9, max of ``ms`` (milliseconds), formatted."""
    if not ms:
        return ["-"] * 4
    a = np.asarray(ms)
    return [f"{v:.2f}" for v in (*np.percentile(a, [50, 99, 99.9]), a.max())]


def run_rate(
    q, rate: int, seconds: float, tuned: bool, channel: bool = True, fetch_channel: bool = True
) -> tuple[list, list, float]:
    """Send ``rate`` msg/s for ``seconds`` and receive them; returns (send ms,
    send -> receive ms, achieved send rate). ``channel=False``: the consumer receives
    through Ray calls only (the path before the DeliveryChannel, as a baseline);
    ``fetch_channel=False``: its TargetList fetches through Ray calls (before the
    FetchChannel)."""
    total = int(rate * seconds)
    pipelined = rate > THREADED_MAX_RATE
    threads = 1 if pipelined else min(MAX_THREADS, max(1, -(-rate // PER_THREAD_RATE)))
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
    if not fetch_channel:
        ray.get(consumer.target_list.use_fetch_channel.remote(False))
        time.sleep(LOADER_POLL_SECONDS + 0.2)  # the fetch under way ends; Ray from then on

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
        unanswered: deque = deque()  # pipelined: (send time, future), answered in order
        try:
            for i in range(count):
                due = start + (index / rate) + i * interval
                wait = due - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                t0 = time.perf_counter()
                body = _STAMP.pack(t0) + BODY[_STAMP.size :]
                if pipelined:
                    unanswered.append((t0, q.send(body, wait=False)))
                    now = time.perf_counter()
                    while unanswered and unanswered[0][1].done():
                        mine.append((now - unanswered.popleft()[0]) * 1e3)
                else:
                    q.send(body)
                    mine.append((time.perf_counter() - t0) * 1e3)
            for t0, future in unanswered:
                future.result(timeout=30)  # raises the queue's error, if any
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
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of each path per rate, interleaved (A B C D A B C D ...) and pooled:"
        " a machine busy with other work then weighs on every path alike",
    )
    args = parser.parse_args()
    broker = start_broker("raymq-bench-latency")
    try:
        hop = actor_round_trip()
        rows = [["Ray call round trip", "-", "-", *percentiles(hop), "-"]]
        q = broker.create_queue("bench-latency", durable=True)
        for rate in (int(r) for r in args.rates.split(",") if r):
            base_p99 = None
            runs = (
                ("Ray path", False, False, False),
                ("Ray fetch", False, True, False),
                ("default", False, True, True),
                ("tuned", True, True, True),
            )
            pooled: dict[str, tuple[list, list, list]] = {r[0]: ([], [], []) for r in runs}
            for _ in range(args.repeats):
                for label, tuned, channel, fetch in runs:
                    got = run_rate(q, rate, args.seconds, tuned, channel, fetch)
                    for into, part in zip(pooled[label], (*got[:2], [got[2]]), strict=True):
                        into.extend(part)
            for label, *_ in runs:
                send_ms, e2e_ms, rates = pooled[label]
                achieved = sum(rates) / len(rates)
                p99 = float(np.percentile(e2e_ms, 99))
                base_p99 = base_p99 or p99  # the Ray path, measured first at this rate
                got = f"{achieved:,.0f}"
                how = "send(wait=False)" if rate > THREADED_MAX_RATE else "send()"
                rows.append([f"{how}, {label} run", str(rate), got, *percentiles(send_ms), "-"])
                rows.append(
                    [
                        f"send->receive, {label}",
                        str(rate),
                        got,
                        *percentiles(e2e_ms),
                        f"{p99 / base_p99:.2f}x",
                    ]
                )
                e2e = rows[-1]
                console.print(f"{label} at {rate}/s: send->receive p50 {e2e[3]}, p99 {e2e[4]} ms")
        broker.delete_queue("bench-latency")
        if args.backlog:
            made, first = first_message(broker, args.backlog, args.tries)
            depth = f"{args.backlog / 1e6:g}M backlog"
            rows.append([f"consumer(), {depth}", "-", "-", *percentiles(made), "-"])
            rows.append([f"first message, {depth}", "-", "-", *percentiles(first), "-"])
        console.width = max(console.width, 120)  # one line per row
        print_table(
            "latency (ms), 1 KiB durable messages; Ray fetch: the TargetList fetches by Ray"
            " calls; Ray path: the consumer receives by them too",
            ["measure", "rate/s", "achieved/s", "p50", "p99", "p99.9", "max", "p99 vs Ray path"],
            rows,
        )
    finally:
        stop_broker(broker)


if __name__ == "__main__":
    main()
