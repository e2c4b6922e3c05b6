"""Ray Serve task consumers: RayMQ beside Celery on Redis (Ray's own adapter), same run.

The same ``@task_consumer`` deployment runs on each broker in turn, on one Ray: a handler
that reports the time it started. For 1, 4 and 16 replicas (``--replicas``) the driver
enqueues ``--tasks`` tasks through the adapter from ``--producers`` threads (a Serve
ingress enqueues for concurrent requests) and waits for each result: tasks/s from
the first enqueue to the last result, and enqueue -> start p50/p99 (ms). Celery runs on
a ``redis-server`` this bench starts and stops (by PID; Debian's package, Redis's
default settings: snapshots, no append-only file) and ``celery[redis]`` (``pip install
-e '.[bench]'``). Celery's workers hold 4 tasks a thread (its default
``worker_prefetch_multiplier``); RayMQ runs as "raymq" with the same
(``prefetch_multiplier=4``) and as "raymq-x1" with its default (1: a replica holds only
the tasks it runs).

Beside each run, the CPU each kind of process used, in ms a task (``/proc``; the
driver is this process, enqueuing and polling statuses): where a broker's tasks/s goes
on a machine both brokers keep busy.

Then a broker loss: a run in which the broker's process is SIGKILLed at mid-run and
started again (``redis-server`` on the same port and directory; RayMQ's queue actor,
which Ray restarts in place), counting the tasks that never ended SUCCESS within
``--grace`` seconds ("lost") and those whose handler ran twice.

``--kill-replica-every S`` instead runs ``--tasks`` RayMQ tasks while a replica is
SIGKILLed every S seconds, and counts that every task ended SUCCESS and how many ran
twice (issue 29: 10,000 tasks, a kill every 30 s; ``--task-seconds`` makes each task
run that long, so that the run outlasts several kills).

    python -m bench.serve_tasks [--tasks 2000] [--replicas 1,4,16] [--concurrency 4]
    python -m bench.serve_tasks --kill-replica-every 30 --tasks 10000 --replicas 2 \
        --task-seconds 0.1 --grace 600
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable

import numpy as np
import ray
from ray import serve
from ray.serve.schema import CeleryAdapterConfig, TaskProcessorConfig
from ray.serve.task_consumer import instantiate_adapter_from_config, task_consumer, task_handler
from raymq.actors.names import queue_actor_name

from bench.common import console, print_table, process_cpu_seconds, start_broker, stop_broker
from raymq.serve import RayMQAdapterConfig

APP = "bench-tasks"
#: The named actor the handlers report their start times to.
STARTS = "bench-task-starts"


@ray.remote(num_cpus=0)
class Starts:
    """Each task's (sent, started) epoch seconds and its replica's pid, by send time."""

    def __init__(self) -> None:
        self.seen: dict[float, tuple[float, int]] = {}

    def add(self, sent_at: float, started_at: float, pid: int) -> None:
        self.seen.setdefault(sent_at, (started_at, pid))

    def take(self) -> dict[float, tuple[float, int]]:
        seen, self.seen = self.seen, {}
        return seen


REDIS_PORT = 6391


class Redis:
    """A ``redis-server`` of this bench's own (port ``REDIS_PORT``, a temp directory)."""

    def __init__(self) -> None:
        if shutil.which("redis-server") is None:
            raise SystemExit("redis-server is not installed (Debian: apt-get install redis-server)")
        self.dir = tempfile.mkdtemp(prefix="raymq-bench-redis-")
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(REDIS_PORT), "--dir", self.dir, "--daemonize", "no"],
            stdout=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        import redis

        while time.monotonic() < deadline:
            try:
                redis.Redis(port=REDIS_PORT).ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not answer in 10 s")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


#: Tasks a Celery worker holds per thread by default (``worker_prefetch_multiplier``).
CELERY_PREFETCH_MULTIPLIER = 4


def config_for(kind: str, queue: str, namespace: str) -> TaskProcessorConfig:
    """``kind`` "celery", "raymq" (holding as many tasks a thread as Celery's workers
    do by default, ``prefetch_multiplier=4``) or "raymq-x1" (RayMQ's default: a replica
    holds only the tasks it runs)."""
    if kind == "celery":
        url = f"redis://127.0.0.1:{REDIS_PORT}"
        adapter_config = CeleryAdapterConfig(broker_url=f"{url}/0", backend_url=f"{url}/1")
        adapter = "ray.serve.task_processor.CeleryTaskProcessorAdapter"
    else:
        multiplier = 1 if kind == "raymq-x1" else CELERY_PREFETCH_MULTIPLIER
        adapter_config = RayMQAdapterConfig(namespace=namespace, prefetch_multiplier=multiplier)
        adapter = "raymq.serve.RayMQTaskProcessorAdapter"
    return TaskProcessorConfig(
        queue_name=queue, adapter=adapter, adapter_config=adapter_config, max_retries=3
    )


def deploy(
    config: TaskProcessorConfig, replicas: int, concurrency: int, task_seconds: float = 0.0
) -> None:
    """The bench's deployment: a handler that reports when it started, then runs
    ``task_seconds`` (a sleep)."""

    @serve.deployment(
        num_replicas=replicas,
        max_ongoing_requests=concurrency,
        ray_actor_options={"num_cpus": 0},
    )
    @task_consumer(task_processor_config=config)
    class Work:
        def __init__(self) -> None:
            self.starts = ray.get_actor(STARTS)

        @task_handler(name="work")
        def work(self, sent_at: float) -> None:
            # (Celery's adapter answered SUCCESS with result None here: the start time
            # goes to an actor instead, alike for both brokers.)
            self.starts.add.remote(sent_at, time.time(), os.getpid())
            if task_seconds:
                time.sleep(task_seconds)

    serve.run(Work.bind(), name=APP, route_prefix=None)


#: Processes whose CPU a run reports, by their command line's start (the driver apart).
#: (the replicas, Redis, RayMQ's queue actors, TargetLists and result store, and
#: this bench's actor that records start times)
CPU_GROUPS = {
    "replica": f"ray::ServeReplica:{APP}:",
    "redis": "redis-server",
    "queue": "ray::QueueActor",
    "TL": "ray::TargetListActor",
    "store": "ray::TaskResultsActor",
    "Starts": "ray::Starts",
}


def _group_pids() -> dict[str, list[int]]:
    """PIDs of each of ``CPU_GROUPS``' processes now."""
    found: dict[str, list[int]] = {group: [] for group in CPU_GROUPS}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        for group, prefix in CPU_GROUPS.items():
            if cmdline.startswith(prefix):
                found[group].append(int(entry))
    return found


def cpu_by_group() -> dict[str, dict[int, float]]:
    """CPU seconds used so far by each process of each group, and by the driver."""
    groups = {g: {p: process_cpu_seconds(p) for p in pids} for g, pids in _group_pids().items()}
    groups["driver"] = {os.getpid(): process_cpu_seconds(os.getpid())}
    return groups


def cpu_ms_a_task(before: dict[str, dict[int, float]], tasks: int) -> dict[str, float]:
    """ms of CPU a task each group used since ``before`` (processes of a group that
    started meanwhile count from 0)."""
    after = cpu_by_group()
    return {
        group: sum(s - before.get(group, {}).get(p, 0.0) for p, s in now.items()) / tasks * 1e3
        for group, now in after.items()
    }


def run_tasks(
    producer,
    n: int,
    kill: Callable[[], None] | None = None,
    grace: float = 120.0,
    producers: int = 8,
) -> dict:
    """Enqueue ``n`` tasks from ``producers`` threads (as a Serve ingress enqueues for
    concurrent requests), then wait for each; ``kill`` is called once, when half were
    sent."""
    t0 = time.perf_counter()
    ids, sent = [], []
    enqueue_failures = 0
    lock = threading.Lock()
    killed = threading.Event()

    def produce(count: int) -> None:
        nonlocal enqueue_failures
        for _ in range(count):
            if kill is not None and len(ids) >= n // 2 and not killed.is_set():
                with lock:
                    if not killed.is_set():
                        killed.set()
                        kill()
            at = time.time()
            try:
                task_id = producer.enqueue_task_sync("work", args=[at]).id
            except Exception:  # noqa: BLE001 - a broker that is down refuses: counted
                with lock:
                    enqueue_failures += 1
                continue
            with lock:
                ids.append(task_id)
                sent.append(at)

    threads = [
        threading.Thread(target=produce, args=(n // producers + (i < n % producers),))
        for i in range(producers)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    enqueue_seconds = time.perf_counter() - t0
    lost = 0
    deadline = time.monotonic() + grace
    for task_id in ids:
        while True:
            try:
                result = producer.get_task_status_sync(task_id)
            except Exception:  # noqa: BLE001 - the result store may be down a moment
                result = None
            if result is not None and result.status == "SUCCESS":
                break
            if time.monotonic() > deadline:
                lost += 1
                break
            time.sleep(0.002)
    seconds = time.perf_counter() - t0
    seen = ray.get(ray.get_actor(STARTS).take.remote())
    starts = [(seen[at][0] - at) * 1e3 for at in sent if at in seen]
    ms = np.asarray(starts) if starts else np.asarray([np.nan])
    return {
        "tasks/s": (len(ids) - lost) / seconds,
        "p50": float(np.percentile(ms, 50)),
        "p99": float(np.percentile(ms, 99)),
        "lost": lost,
        "refused": enqueue_failures,
        "enqueued/s": len(ids) / enqueue_seconds,
        "ids": ids,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--replicas", default="1,4,16")
    parser.add_argument("--concurrency", type=int, default=4, help="handler threads a replica")
    parser.add_argument(
        "--task-seconds", type=float, default=0.0, help="how long each task runs (a sleep)"
    )
    parser.add_argument("--grace", type=float, default=120.0, help="seconds for the last results")
    parser.add_argument("--kill-replica-every", type=float, default=None)
    parser.add_argument(
        "--brokers",
        default="celery,raymq,raymq-x1",
        help="celery; raymq (4 tasks held a thread, as Celery); raymq-x1 (RayMQ's default)",
    )
    parser.add_argument("--producers", type=int, default=8, help="threads enqueuing")
    args = parser.parse_args()
    broker = start_broker("raymq-bench-serve")
    collector = Starts.options(name=STARTS).remote()  # noqa: F841 - (kept alive by name)
    serve.start(proxy_location="Disabled")
    redis_server = Redis()
    try:
        if args.kill_replica_every:
            replica_chaos(broker, args)
            return
        rows = []
        cpu_columns = [*CPU_GROUPS, "driver"]
        cpu_rows: list[list[str]] = []
        results: dict[tuple[str, int], dict] = {}
        kinds = args.brokers.split(",")
        for replicas in (int(r) for r in args.replicas.split(",")):
            for kind in kinds:
                if kind == "celery":
                    redis_server.start()
                queue = f"bench-{kind}-{replicas}"
                config = config_for(kind, queue, broker.namespace)
                deploy(config, replicas, args.concurrency, args.task_seconds)
                producer = instantiate_adapter_from_config(config)
                warm = producer.enqueue_task_sync("work", args=[time.time()])
                while producer.get_task_status_sync(warm.id).status != "SUCCESS":
                    time.sleep(0.01)  # a first task through: the replicas are up
                ray.get(ray.get_actor(STARTS).take.remote())
                console.print(f"{kind}, {replicas} replicas: {args.tasks:,} tasks ...")
                cpu_before = cpu_by_group()
                results[kind, replicas] = got = run_tasks(
                    producer, args.tasks, grace=args.grace, producers=args.producers
                )
                cpu = cpu_ms_a_task(cpu_before, args.tasks)
                cpu_rows.append(
                    [kind, str(replicas), *(f"{cpu[g]:.2f}" for g in cpu_columns)]
                    + [f"{sum(cpu.values()):.2f}"]
                )
                console.print(f"  enqueued {got['enqueued/s']:,.0f} tasks/s")
                serve.delete(APP)
                if kind == "celery":
                    redis_server.kill()
                rows.append(
                    [
                        kind,
                        str(replicas),
                        f"{got['tasks/s']:,.0f}",
                        f"{got['p50']:.1f}",
                        f"{got['p99']:.1f}",
                    ]
                )
            for kind in kinds:
                if kind == "celery" or "celery" not in kinds:
                    continue
                r, c = results[kind, replicas], results["celery", replicas]
                rows.append(
                    [
                        f"{kind} / celery",
                        str(replicas),
                        f"{r['tasks/s'] / c['tasks/s']:.2f}x",
                        f"{r['p50'] / c['p50']:.2f}x",
                        f"{r['p99'] / c['p99']:.2f}x",
                    ]
                )
        print_table(
            f"Serve task consumers, {args.tasks:,} tasks, {args.concurrency} threads a replica",
            ["broker", "replicas", "tasks/s", "enqueue->start p50 ms", "p99 ms"],
            rows,
        )
        print_table(
            "CPU of each kind of process, ms a task",
            ["broker", "repl.", *cpu_columns, "all"],
            cpu_rows,
        )
        loss_rows = []
        for kind in kinds:
            if kind == "celery":
                redis_server.start()
            queue = f"bench-{kind}-loss"
            config = config_for(kind, queue, broker.namespace)
            deploy(config, 1, args.concurrency, args.task_seconds)
            producer = instantiate_adapter_from_config(config)

            def kill(kind: str = kind, queue: str = queue) -> None:
                if kind == "celery":
                    redis_server.kill()
                    redis_server.start()
                else:
                    actor = ray.get_actor(queue_actor_name(queue), namespace=broker.namespace)
                    pid = ray.get(actor.pid.remote())
                    os.kill(pid, signal.SIGKILL)

            console.print(f"{kind}: {args.tasks:,} tasks, its broker killed at mid-run ...")
            got = run_tasks(
                producer, args.tasks, kill=kill, grace=args.grace, producers=args.producers
            )
            serve.delete(APP)
            if kind == "celery":
                redis_server.kill()
            loss_rows.append([kind, f"{args.tasks:,}", str(got["refused"]), str(got["lost"])])
        print_table(
            "broker killed (SIGKILL) at mid-run and started again",
            ["broker", "tasks", "enqueue refused", f"lost (no SUCCESS in {args.grace:.0f} s)"],
            loss_rows,
        )
    finally:
        redis_server.stop()
        serve.shutdown()
        stop_broker(broker)


def replica_pids() -> list[int]:
    """PIDs of this bench's Serve replicas (Ray titles them ``ray::ServeReplica:APP:...``)."""
    return sorted(_group_pids()["replica"])


def replica_chaos(broker, args) -> None:
    """``--tasks`` RayMQ tasks while a replica is SIGKILLed every few seconds: every task
    must end SUCCESS; the result store tells how many ran more than once."""
    queue = "bench-replica-chaos"
    config = config_for("raymq", queue, broker.namespace)
    deploy(config, int(args.replicas.split(",")[0]), args.concurrency, args.task_seconds)
    producer = instantiate_adapter_from_config(config)
    stop = threading.Event()
    kills: list[int] = []

    def killer() -> None:
        while not stop.wait(args.kill_replica_every):
            pids = replica_pids()
            if pids:
                victim = pids[len(kills) % len(pids)]
                os.kill(victim, signal.SIGKILL)
                kills.append(victim)
                console.print(f"SIGKILL replica pid {victim}")

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    got = run_tasks(producer, args.tasks, grace=args.grace, producers=args.producers)
    stop.set()
    results = broker.task_results()
    runs = [ray.get(results.get.remote(i)).runs for i in got["ids"]]
    twice = sum(r > 1 for r in runs)
    console.print(
        f"{args.tasks:,} tasks, {len(kills)} replica kills:"
        f" SUCCESS {len(got['ids']) - got['lost']:,},"
        f" lost {got['lost']}, ran more than once {twice}; {got['tasks/s']:,.0f} tasks/s"
    )
    console.print("REPLICA CHAOS OK" if got["lost"] == 0 and not got["refused"] else "FAILED")


if __name__ == "__main__":
    main()
