"""Redelivery after a consumer's process is killed, against the time Ray itself takes to
tell a caller that an actor owned by that process is gone (the baseline: RayMQ cannot
learn of the death sooner).

A worker process creates a consumer (its TargetList actor is owned by that process) and
a bare actor, and receives messages without acknowledging them; the bench keeps a call
to the bare actor pending, SIGKILLs the process and times (1) until that call fails and
(2) until another consumer receives the dead one's messages again.

    python -m bench.redelivery [--rounds 5] [--messages 100]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import threading
import time

import ray

from bench.common import console, print_table, start_broker, stop_broker


@ray.remote(num_cpus=0)
class Bare:
    """An actor owned by the consumer's process, with nothing of RayMQ in it."""

    async def wait_forever(self) -> None:
        await asyncio.Event().wait()


@ray.remote(num_cpus=0)
class ConsumerProcess:
    """A worker process holding ``n`` unacknowledged messages of one queue."""

    def __init__(self, namespace: str, queue: str):
        import raymq

        self.consumer = raymq.connect(namespace=namespace).get_queue(queue).consumer(prefetch=1000)
        self.bare = Bare.remote()

    def hold(self, n: int) -> list[int]:
        got: list[int] = []
        while len(got) < n:
            got += [m.offset for m in self.consumer.receive(n - len(got), timeout=10)]
        return got

    def bare_actor(self):
        ray.get(self.bare.__ray_ready__.remote())
        return self.bare

    def pid(self) -> int:
        return os.getpid()


def one_round(broker, queue, messages: int) -> tuple[float, float]:
    """Seconds until Ray reports the owned actor dead, and until redelivery."""
    queue.send_batch([b"r" * 100] * messages)
    worker = ConsumerProcess.remote(broker.namespace, queue.name)
    held = ray.get(worker.hold.remote(messages))
    bare = ray.get(worker.bare_actor.remote())
    pending = bare.wait_forever.remote()
    ray_notice: list[float] = []

    def notice() -> None:
        try:
            ray.get(pending)
        except ray.exceptions.RayActorError:
            ray_notice.append(time.perf_counter())

    watcher = threading.Thread(target=notice)
    watcher.start()
    pid = ray.get(worker.pid.remote())
    with queue.consumer(prefetch=messages) as survivor:
        t0 = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        got: set[int] = set()
        while not got.issuperset(held):
            batch = survivor.receive(messages, timeout=0.05)
            got.update(m.offset for m in batch)
            survivor.ack(batch)
        redelivered = time.perf_counter() - t0
    watcher.join()
    return ray_notice[0] - t0, redelivered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--messages", type=int, default=100)
    args = parser.parse_args()
    broker = start_broker("bench-redelivery")
    try:
        queue = broker.create_queue("redelivery")
        rounds = []
        for i in range(args.rounds):
            rounds.append(one_round(broker, queue, args.messages))
            console.print(
                f"round {i + 1}: Ray noticed after {rounds[-1][0] * 1000:.0f} ms,"
                f" redelivered after {rounds[-1][1] * 1000:.0f} ms"
            )
    finally:
        stop_broker(broker)
    notice = statistics.median(r[0] for r in rounds)
    redelivered = statistics.median(r[1] for r in rounds)
    print_table(
        f"Redelivery after SIGKILL of a consumer's process (median of {args.rounds})",
        ["measure", "ms", "ratio"],
        [
            [
                "Ray: a pending call to an actor of that process fails",
                f"{notice * 1000:.0f}",
                "1.00",
            ],
            [
                "RayMQ: another consumer receives its messages",
                f"{redelivered * 1000:.0f}",
                f"{redelivered / notice:.2f}",
            ],
        ],
    )


if __name__ == "__main__":
    main()
