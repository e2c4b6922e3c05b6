"""Replicated queues (issue 14): what replicas cost a producer, how long a failover and a
follower's catch-up take, measured in one run on a four-node Ray cluster of its own.

1. Produce: N x 1 KiB sent with ``send_batch`` (batches of 1,000 from 4 threads), then
   up to M single messages from 8 threads each calling ``send`` and waiting, to a queue
   with ``replicas=1``, ``2`` and ``3`` (each its own queue, its leader on a worker
   node). Rates and their ratio to ``replicas=1`` (targets for ``replicas=2``: batched
   >= 0.6x, 8-producer single sends >= 0.5x); the bytes every copy writes to the one
   disk; messages per replicated group commit and its time (a follower's
   ``applied_commits``: the leader sends one commit at a time).
2. CPU per message of each produce phase: the leader's process, one follower's process,
   this (the producers') process (``/proc/<pid>/stat`` before and after) and the whole
   machine, in microseconds. Then, for ``replicas=2``, one replicated commit (its time,
   the leader's CPU beyond ``replicas=1``'s and the follower's) against a bare Ray call
   between two worker nodes carrying as many bytes to an actor that does nothing with
   them: the share of Ray's transport in what a replica costs.
3. Failover, ``replicas=3``: single-message producers (``--producers``) and a consumer
   running; the leader's node is removed (not gracefully) and the leader's process
   SIGKILLed. Seconds from the SIGKILL (and from the start of the removal) to the first
   acknowledged send that started after it, and to the first delivery of a message whose
   send started after it (target: writes resume within 5 s); when the broker started
   and ended its failover (from its failover log, polled); every acknowledged message
   is checked to have been consumed.
4. Catch-up, ``replicas=2`` (leader on the head node, so the follower is on a worker):
   the queue filled with ``--fill-mib`` of 1 KiB messages, the follower's node removed
   and its process SIGKILLed: seconds until the broker names a new follower (it replaces
   one that missed two monitor pings), then until the leader reports it in sync, and the
   copy's MB/s (the leader's segment bytes over that second interval).

Method and caveats: the cluster is ``ray.cluster_utils.Cluster`` (a head and three
worker raylets, ``--store-mib`` of object store each) on this one machine, with Ray's
default health-check settings: the broker's own pings notice a lost replica, long
before Ray declares a node dead. A removed raylet leaves its worker processes running
for a while, so the benchmark SIGKILLs the lost replica's process itself, right after
``remove_node`` (a lost machine takes both at once); Ray prints each removed raylet's
last log lines, as it would for a crash. All nodes share this machine's cores (2 here)
and its one disk: every copy's writes and fdatasyncs, the producers, the consumer, Ray's
object transfers between "nodes" and Ray itself compete for them, where on a real
cluster each replica has a machine and a disk of its own. The rates therefore
understate a real cluster, the more so the more replicas (``replicas=2`` writes twice
the bytes to the same disk: the disk's fdatasync bandwidth, measured first, bounds the
sum). What projects to a real cluster is the CPU per message of the leader's and a
follower's process (a process's ceiling is about 1 s / its CPU per message), plus the
network's round trip per commit for single sends, which are bound by commit latency
(8 producers, one commit at a time). Failover and catch-up times include the broker's
detection (a monitor round every 1 s, 1 s ping timeout; followers report a silent
leader after 1.5 s) and are bounded below by it. The machine's load before the run is
printed: other work on it skews every figure.

    python -m bench.replication [--quick] [--batched 200000] [--single 16000]
        [--single-seconds 20] [--fill-mib 1024] [--producers 3] [--parts 1234]

``--quick`` (about a minute): 100,000 batched and up to 4,000 single sends per queue
(5 s), 128 MiB for the catch-up. The default run takes about two minutes here. It
always starts its own cluster (``$RAYMQ_BENCH_ADDRESS`` is not used: nodes are removed),
with its paging directory under ``$RAYMQ_BENCH_DIR`` (or /tmp) and Ray's under /tmp,
both deleted at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time

import numpy as np
import ray
from ray.cluster_utils import Cluster
from raymq.actors.names import replica_actor_name
from raymq.placement import spares
from raymq.placement.nodes import pinned_to

import raymq
from bench.common import (
    console,
    fdatasync_bandwidth,
    machine_cpu_seconds,
    print_table,
    process_cpu_seconds,
    timed,
)
from raymq.errors import RayMQError

NAMESPACE = "raymq-bench-replication"
MIB = 2**20
BODY = b"x" * 1024
BATCH = 1000
#: Bound on anything that should take seconds: only a wedge takes this long.
DEADLINE_SECONDS = 120.0
#: The issue's targets.
BATCHED_TARGET = 0.6
SINGLE_TARGET = 0.5
RESUME_TARGET_SECONDS = 5.0


def wait_for(what: str, check, timeout: float = DEADLINE_SECONDS, poll: float = 0.02):
    """``check()`` until it is truthy (returned); ``TimeoutError`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout:.0f} s")
        time.sleep(poll)


class Bench:
    """The cluster, the broker and the helpers every part uses."""

    def __init__(self, store_bytes: int):
        self.store = store_bytes
        self.root = tempfile.mkdtemp(prefix="rmq-bench-repl-")  # short: Ray's socket paths
        self.paging = tempfile.mkdtemp(
            prefix="rmq-bench-repl-paging-", dir=os.environ.get("RAYMQ_BENCH_DIR")
        )
        temp = os.path.join(self.root, "ray")
        os.makedirs(os.path.join(temp, "ray"))
        os.environ["RAY_TMPDIR"] = temp
        self.cluster = self.broker = None
        try:
            self.cluster = Cluster(
                initialize_head=True,
                head_node_args={
                    "num_cpus": 2,
                    "object_store_memory": store_bytes,
                    "include_dashboard": False,
                    "temp_dir": temp,
                },
            )
            self.top_up()
            ray.init(address=self.cluster.address, log_to_driver=False, configure_logging=False)
            self.broker = raymq.connect(namespace=NAMESPACE, paging_directory=self.paging)
        except BaseException:
            self.close()
            raise
        self.head = ray.get_runtime_context().get_node_id()

    def close(self) -> None:
        """Stop the broker, Ray and the cluster; delete the temporary directories."""
        try:
            if self.broker is not None:
                with contextlib.suppress(Exception):
                    self.broker.shutdown()
        finally:
            ray.shutdown()
            if self.cluster is not None:
                self.cluster.shutdown()
            shutil.rmtree(self.root, ignore_errors=True)
            shutil.rmtree(self.paging, ignore_errors=True)

    def workers(self) -> dict:
        """Worker node id -> its cluster node handle (alive ones)."""
        return {n.node_id: n for n in self.cluster.worker_nodes}

    def top_up(self, n: int = 3) -> None:
        """Add worker nodes until there are ``n`` (after one was removed)."""
        while len(self.cluster.worker_nodes) < n:
            self.cluster.add_node(num_cpus=1, object_store_memory=self.store)
        self.cluster.wait_for_nodes()

    def remove(self, node_id: str, pids: list[int]) -> tuple[float, float]:
        """Remove a worker node, not gracefully, and SIGKILL ``pids`` (its replicas'
        processes: a removed raylet leaves them running for a while, a lost machine
        takes them at once). Returns (monotonic time before the removal, after the
        kill)."""
        node = self.workers()[node_id]
        t0 = time.monotonic()
        self.cluster.remove_node(node, allow_graceful=False)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return t0, time.monotonic()

    def replica_set(self, name: str) -> dict:
        return ray.get(self.broker._actor.replica_sets.remote())[name]

    def follower(self, name: str, rid: str):
        return ray.get_actor(replica_actor_name(name, rid), namespace=NAMESPACE)

    def leader_pid(self, q) -> int:
        return ray.get(q._actor.pid.remote())

    def follower_pids(self, name: str) -> dict[str, int]:
        """Follower replica id -> its process id."""
        rs = self.replica_set(name)
        return {
            rid: ray.get(self.follower(name, rid).pid.remote())
            for rid in sorted(rs["nodes"])
            if rid != rs["leader"]
        }

    def delete(self, name: str) -> None:
        """Delete a queue (its followers with it)."""
        self.broker.delete_queue(name)


def background_load(seconds: float = 2.0) -> float:
    """Fraction of the machine's cores busy over ``seconds`` before the cluster starts
    (other work on the machine, which every figure below competes with)."""
    busy0 = machine_cpu_seconds()
    time.sleep(seconds)
    return (machine_cpu_seconds() - busy0) / (seconds * (os.cpu_count() or 1))


# -- part 1 and 2: produce ------------------------------------------------------------


def in_threads(n_threads: int, total: int, work) -> int:
    """Split ``total`` over threads running ``work(count)``, each returning what it did;
    returns the sum."""
    per = total // n_threads
    done = [0] * n_threads
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            done[k] = work(per)
        except BaseException as exc:  # raised in the caller, not lost in a thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return sum(done)


def produce(
    b: Bench, replicas: int, batched: int, single: int, single_seconds: float, leader_node: str
) -> dict:
    """Batched then single sends to a queue of ``replicas``; rates and CPU per message."""
    name = f"produce-r{replicas}"
    q = b.broker.create_queue(name, replicas=replicas, node_id=leader_node)
    leader = b.leader_pid(q)
    followers = b.follower_pids(name) if replicas > 1 else {}
    rid, follower = next(iter(followers.items()), (None, None))
    bodies = [BODY] * BATCH
    for _ in range(5):  # warm: the send channel, the first segments
        q.send_batch(bodies)
        q.send(BODY)

    def batches(count: int) -> int:
        for _ in range(count // BATCH):
            q.send_batch(bodies)
        return count - count % BATCH

    def singles(count: int) -> int:
        deadline = time.monotonic() + single_seconds
        for k in range(count):
            q.send(BODY)
            if time.monotonic() > deadline:
                return k + 1
        return count

    def commits() -> int:
        return ray.get(b.follower(name, rid).stats.remote())["applied_commits"] if rid else 0

    pids = (leader, follower, os.getpid())
    out: dict = {"followers": len(followers)}
    phases = {
        "batched": lambda: in_threads(4, batched - batched % (4 * BATCH), batches),
        "single": lambda: in_threads(8, single, singles),
    }
    for phase, fn in phases.items():
        commits0, bytes0 = commits(), q.stats()["bytes_in"]
        cpu0 = [process_cpu_seconds(p) if p else 0.0 for p in pids] + [machine_cpu_seconds()]
        seconds, rate = timed(fn)
        cpu1 = [process_cpu_seconds(p) if p else 0.0 for p in pids] + [machine_cpu_seconds()]
        n = rate * seconds
        us = [(c1 - c0) / n * 1e6 for c0, c1 in zip(cpu0, cpu1, strict=True)]
        replicated = commits() - commits0
        stored = q.stats()["bytes_in"] - bytes0
        out[phase] = {
            "messages": n,
            "rate": rate,
            # What every replica writes, all on this machine's one disk.
            "disk_mb_s": stored / seconds * replicas / 1e6,
            "bytes_per_msg": stored / n,
            "leader_us": us[0],
            "follower_us": us[1] if follower else None,
            "producers_us": us[2],
            "machine_us": us[3],
            # One commit at a time: the follower answered each before the next left.
            "per_commit": n / replicated if replicated else None,
            "commit_ms": seconds / replicated * 1e3 if replicated else None,
        }
    b.delete(name)
    return out


def produce_rows(res: dict[int, dict]) -> tuple[list[list[str]], list[list[str]]]:
    """Rows of the rate table and of the CPU table."""
    base = res[1]
    rates = []
    for phase, label, target in (
        ("batched", "batched: 4 threads x send_batch(1000 x 1 KiB)", BATCHED_TARGET),
        ("single", "single: 8 threads x send(1 KiB), each waiting", SINGLE_TARGET),
    ):
        for r in sorted(res):
            p = res[r][phase]
            ratio = p["rate"] / base[phase]["rate"]
            rates.append(
                [
                    label if r == 1 else "",
                    str(r),
                    f"{p['messages']:,.0f}",
                    f"{p['rate']:,.0f}",
                    f"{ratio:.2f}x",
                    f"{p['disk_mb_s']:,.0f}",
                    "-" if p["per_commit"] is None else f"{p['per_commit']:,.1f}",
                    "-" if p["commit_ms"] is None else f"{p['commit_ms']:.2f}",
                    f">= {target}x" if r == 2 else "-",
                    "-" if r != 2 else ("yes" if ratio >= target else "NO"),
                ]
            )
    cpu = []
    for phase in ("batched", "single"):
        for r in sorted(res):
            c = res[r][phase]
            cpu.append(
                [
                    phase if r == 1 else "",
                    str(r),
                    f"{c['leader_us']:.1f}",
                    f"{c['leader_us'] / base[phase]['leader_us']:.2f}x",
                    "-" if c["follower_us"] is None else f"{c['follower_us']:.1f}",
                    f"{c['producers_us']:.1f}",
                    f"{c['machine_us']:.1f}",
                    f"{1e6 / c['leader_us']:,.0f}",
                    "-" if not c["follower_us"] else f"{1e6 / c['follower_us']:,.0f}",
                ]
            )
    return rates, cpu


@ray.remote(num_cpus=0, max_concurrency=1000)
class _Callee:
    """The far end of a bare Ray call (the baseline of a replicated commit)."""

    def apply(self, epoch: int, data: np.ndarray) -> None:
        return None

    def pid(self) -> int:
        return os.getpid()

    async def ready(self) -> bool:
        return True


@ray.remote(num_cpus=0, max_concurrency=1000)
class _Caller:
    """An async actor calling ``_Callee.apply`` and awaiting each answer, as a leader
    sends its followers a commit."""

    def __init__(self, callee):
        self.callee = callee

    def pid(self) -> int:
        return os.getpid()

    async def run(self, calls: int, nbytes: int) -> float:
        import asyncio

        data = np.zeros(nbytes, dtype=np.uint8)
        t0 = time.perf_counter()
        for _ in range(calls):
            await asyncio.wait({asyncio.ensure_future(self.callee.apply.remote(1, data))})
        return (time.perf_counter() - t0) / calls


def bare_calls(b: Bench, sizes: dict[str, int], seconds: float = 2.0) -> dict[str, dict]:
    """Per bare Ray call between two worker nodes, with ``sizes`` bytes of argument:
    latency and the CPU of caller and callee (microseconds)."""
    a_node, b_node = sorted(b.workers())[:2]
    callee = _Callee.options(scheduling_strategy=pinned_to(b_node)).remote()
    ray.get(callee.ready.remote())
    caller = _Caller.options(scheduling_strategy=pinned_to(a_node)).remote(callee)
    pids = ray.get([caller.pid.remote(), callee.pid.remote()])
    out = {}
    for label, nbytes in sizes.items():
        latency = ray.get(caller.run.remote(20, nbytes))  # warm, and a first estimate
        calls = max(20, int(seconds / latency))
        cpu0 = [process_cpu_seconds(p) for p in pids]
        latency = ray.get(caller.run.remote(calls, nbytes))
        cpu = [
            (process_cpu_seconds(p) - c0) / calls * 1e6 for p, c0 in zip(pids, cpu0, strict=True)
        ]
        out[label] = {
            "bytes": nbytes,
            "ms": latency * 1e3,
            "caller_us": cpu[0],
            "callee_us": cpu[1],
        }
    ray.kill(caller)
    ray.kill(callee)
    return out


def commit_rows(res: dict[int, dict], bare: dict[str, dict]) -> list[list[str]]:
    """Each phase's replicated commit (replicas=2) against a bare call of its size."""
    rows = []
    for phase, c in bare.items():
        r1, r2 = res[1][phase], res[2][phase]
        per = r2["per_commit"]
        rows.append(
            [
                f"{phase}: replicated commit ({per:,.0f} msgs)",
                f"{c['bytes'] / 1024:,.0f}",
                f"{r2['commit_ms']:.2f}",
                f"{(r2['leader_us'] - r1['leader_us']) * per:,.0f}",
                f"{r2['follower_us'] * per:,.0f}",
            ]
        )
        rows.append(
            [
                f"{phase}: bare Ray call, same bytes",
                f"{c['bytes'] / 1024:,.0f}",
                f"{c['ms']:.2f}",
                f"{c['caller_us']:,.0f}",
                f"{c['callee_us']:,.0f}",
            ]
        )
    return rows


# -- part 3: failover -----------------------------------------------------------------


def body_of(t: int, i: int, started: float) -> bytes:
    """A 1 KiB body naming its producer, number and the monotonic time its send started."""
    head = f"p{t}:{i}:{started:.6f}:".encode()
    return head + BODY[: max(0, len(BODY) - len(head))]


def started_of(body: bytes) -> float:
    return float(body.split(b":", 3)[2])


class Producers:
    """Threads sending single messages, recording each acknowledged send's start and end."""

    def __init__(self, queue, threads: int):
        self.queue = queue
        self.acked: list[bytes] = []
        self.acked_at: list[tuple[float, float]] = []
        self.errors: dict[str, int] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, args=(t,), daemon=True) for t in range(threads)
        ]

    def start(self) -> Producers:
        for t in self._threads:
            t.start()
        return self

    def _run(self, t: int) -> None:
        i = 0
        while not self._stop.is_set():
            started = time.monotonic()
            body = body_of(t, i, started)
            try:
                self.queue.send(body, timeout=10)
            except (RayMQError, ray.exceptions.RayError) as exc:
                with self._lock:
                    self.errors[type(exc).__name__] = self.errors.get(type(exc).__name__, 0) + 1
                time.sleep(0.01)
                continue  # not acknowledged: another body next
            with self._lock:
                self.acked.append(body)
                self.acked_at.append((started, time.monotonic()))
            i += 1

    def count(self) -> int:
        with self._lock:
            return len(self.acked)

    def first_ack_after(self, t: float) -> float | None:
        """Seconds from ``t`` to the first acknowledgement of a send started after it."""
        with self._lock:
            later = [end for start, end in self.acked_at if start > t]
        return min(later) - t if later else None

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(DEADLINE_SECONDS)


class Receiver:
    """A consumer receiving and acknowledging continuously in a thread, recording when
    each body arrived."""

    def __init__(self, queue):
        self.queue = queue
        self.got: list[tuple[float, bytes]] = []
        self.errors: dict[str, int] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        spares.wait_warm(timeout=30)
        self.consumer = queue.consumer(prefetch=2 * BATCH)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Receiver:
        self._thread.start()
        return self

    def _run(self) -> None:
        c = self.consumer
        while not self._stop.is_set():
            try:
                batch = c.receive_batch(BATCH, timeout=0.2)
            except RayMQError as exc:  # the leader moves: the TargetList follows it
                self._error(exc)
                time.sleep(0.05)
                continue
            if not batch.num_rows:
                continue
            now = time.monotonic()
            bodies = batch.column("body").to_pylist()
            with self._lock:
                self.got += [(now, body) for body in bodies]
            try:
                c.ack(batch)  # waits: follows the leader (a pipelined ack does not)
            except RayMQError as exc:  # offsets the new leader did not deliver to us
                self._error(exc)

    def _error(self, exc: Exception) -> None:
        with self._lock:
            self.errors[type(exc).__name__] = self.errors.get(type(exc).__name__, 0) + 1

    def first_after(self, t: float, sent_after: bool) -> float | None:
        """Seconds from ``t`` to the first delivery after it (of a message whose send
        started after it, if ``sent_after``)."""
        with self._lock:
            later = [
                at for at, body in self.got if at > t and (not sent_after or started_of(body) > t)
            ]
        return min(later) - t if later else None

    def stop(self) -> list[bytes]:
        """Stop, drain what is left, close; returns every body received."""
        self._stop.set()
        self._thread.join(DEADLINE_SECONDS)
        c = self.consumer
        deadline = time.monotonic() + DEADLINE_SECONDS
        while time.monotonic() < deadline:
            try:
                batch = c.receive_batch(BATCH, timeout=1)
                if batch.num_rows:
                    self.got += [(time.monotonic(), x) for x in batch.column("body").to_pylist()]
                    c.ack(batch)
                elif c.backlog() == 0:
                    break
            except RayMQError as exc:
                self._error(exc)
                time.sleep(0.1)
        with contextlib.suppress(RayMQError):
            c.close()
        return [body for _, body in self.got]


class Watch:
    """Polls the broker in a thread: when its failover log grows (a failover is logged
    once its new leader started)."""

    def __init__(self, b: Bench):
        self.b = b
        self.count = len(ray.get(b.broker._actor.failover_log.remote()))
        self.logged: tuple[float, dict] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            log = ray.get(self.b.broker._actor.failover_log.remote())
            if len(log) > self.count:
                self.logged = (time.monotonic(), log[self.count])
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def failover(b: Bench, threads: int, before: float, after: float) -> dict:
    """Part 3: the leader's node lost under single-message producers and a consumer."""
    name = "failover"
    leader_node = sorted(b.workers())[0]
    q = b.broker.create_queue(name, replicas=3, node_id=leader_node)
    q.send(BODY)  # the send channel is open before the producers start
    receiver = Receiver(q).start()
    producers = Producers(q, threads).start()
    wait_for("acks before the loss", lambda: producers.count() >= 200)
    time.sleep(before)
    watch = Watch(b)
    removed, killed = b.remove(leader_node, [b.leader_pid(q)])
    try:
        wait_for("a failover", lambda: watch.logged)
        wait_for("acks after the loss", lambda: producers.first_ack_after(killed))
        wait_for("deliveries after the loss", lambda: receiver.first_after(killed, True))
        time.sleep(after)
    finally:
        watch.stop()
        producers.stop()
        received = receiver.stop()
    logged_at, record = watch.logged
    consumed = set(received)
    st = q.stats()
    out = {
        "remove_node_seconds": killed - removed,
        "ack_after_kill": producers.first_ack_after(killed),
        "ack_after_removal": producers.first_ack_after(removed),
        "delivery_after_kill": receiver.first_after(killed, False),
        "sent_delivery_after_kill": receiver.first_after(killed, True),
        # The broker logs a failover once its new leader started: what came before
        # is the time to notice the loss (polled every 10 ms here).
        "detected_after_kill": logged_at - record["seconds"] - killed,
        "failover_seconds": record["seconds"],
        "logged_after_kill": logged_at - killed,
        "leader_moved": b.broker.queue_nodes()[name] != leader_node,
        "acked": producers.count(),
        "lost": len(set(producers.acked) - consumed),
        "duplicates": len(received) - len(consumed),
        "producer_errors": producers.errors,
        "consumer_errors": receiver.errors,
        "replicas": st["replicas"],
    }
    b.delete(name)
    return out


# -- part 4: catch-up -----------------------------------------------------------------


def catch_up(b: Bench, fill_bytes: int) -> dict:
    """Part 4: fill a replicas=2 queue, lose its follower's node, time the new follower.
    The leader is on the head node, so that the follower is on a worker (removable)."""
    name = "catchup"
    q = b.broker.create_queue(name, replicas=2, node_id=b.head)
    bodies = [BODY] * BATCH
    batches = max(4, fill_bytes // (len(BODY) * BATCH))
    fill_seconds, fill_rate = timed(lambda: in_threads(4, batches * BATCH, fill_batches(q, bodies)))
    st = q.stats()
    (old_rid, old_pid), *_ = b.follower_pids(name).items()
    rids = set(b.replica_set(name)["nodes"])
    old_node = b.replica_set(name)["nodes"][old_rid]
    wait_for("in sync before", lambda: all(r["in_sync"] for r in q.stats()["replicas"]))
    removed, killed = b.remove(old_node, [old_pid])
    stale = [0.0]  # the lost follower still reported in sync, this long after the kill

    def new_follower() -> str | None:
        new = next((r for r in b.replica_set(name)["nodes"] if r not in rids), None)
        if new is None:
            reps = {r["replica_id"]: r for r in q.stats()["replicas"]}
            if reps.get(old_rid, {}).get("in_sync"):
                stale[0] = time.monotonic() - killed
        return new

    new_rid = wait_for("a new follower", new_follower, poll=0.01)
    named = time.monotonic()
    lag = {"bytes": 0, "messages": 0}

    def in_sync() -> bool:
        reps = q.stats()["replicas"]
        mine = [r for r in reps if r["replica_id"] == new_rid]
        if mine and not mine[0]["in_sync"]:
            lag["bytes"] = max(lag["bytes"], mine[0]["lag_bytes"])
            lag["messages"] = max(lag["messages"], mine[0]["lag_messages"])
        return bool(mine) and len(reps) == 2 and all(r["in_sync"] for r in reps)

    wait_for("the new follower in sync", in_sync, timeout=600, poll=0.05)
    synced = time.monotonic()
    new_state = ray.get(b.follower(name, new_rid).stats.remote())
    out = {
        "fill_messages": batches * BATCH,
        "fill_seconds": fill_seconds,
        "fill_rate": fill_rate,
        "bytes_on_disk": st["bytes_on_disk"],
        "remove_node_seconds": killed - removed,
        "named_seconds": named - killed,
        "stale_in_sync_seconds": stale[0],
        "sync_seconds": synced - named,
        "total_seconds": synced - killed,
        "lag_bytes": lag["bytes"],
        "lag_messages": lag["messages"],
        "new_end_offset": new_state["end_offset"],
    }
    b.delete(name)
    return out


def fill_batches(q, bodies):
    def work(count: int) -> int:
        for _ in range(count // BATCH):
            q.send_batch(bodies)
        return count - count % BATCH

    return work


# -- main ---------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small run (about a minute)")
    parser.add_argument("--batched", type=int, help="part 1: batched messages per queue")
    parser.add_argument("--single", type=int, help="part 1: single sends per queue (at most)")
    parser.add_argument(
        "--single-seconds", type=float, help="part 1: single sends stop after this long"
    )
    parser.add_argument("--fill-mib", type=int, help="part 4: MiB of 1 KiB messages")
    parser.add_argument("--producers", type=int, default=3, help="part 3: producer threads")
    parser.add_argument("--store-mib", type=int, default=150, help="object store per node")
    parser.add_argument("--parts", default="1234", help="which parts to run (2 comes with 1)")
    args = parser.parse_args()
    quick = args.quick
    batched = args.batched or (100_000 if quick else 200_000)
    single = args.single or (4_000 if quick else 16_000)
    single_seconds = args.single_seconds or (5.0 if quick else 20.0)
    fill_mib = args.fill_mib or (128 if quick else 1024)
    steady = (1.0, 2.0) if quick else (3.0, 5.0)  # part 3: seconds before and after the loss
    if not console.is_terminal:
        console.width = max(console.width, 120)  # tables unwrapped in a log

    t_start = time.monotonic()
    load = background_load()
    disk = fdatasync_bandwidth()
    console.print(
        f"machine: {os.cpu_count()} cores, {load:.0%} busy before the run"
        + (" (other work: figures below compete with it)" if load > 0.1 else "")
        + f"; disk: {disk / 1e6:,.0f} MB/s sequential with fdatasync per MiB"
    )
    console.print(f"starting a 4-node cluster ({args.store_mib} MiB object store each) ...")
    b = Bench(args.store_mib * MIB)
    summary: list[list[str]] = []
    try:
        if "1" in args.parts or "2" in args.parts:
            leader_node = sorted(b.workers())[0]
            res = {}
            for r in (1, 2, 3):
                console.print(
                    f"part 1: replicas={r}: {batched:,} x 1 KiB in batches, up to"
                    f" {single:,} single sends ({single_seconds:.0f} s) from 8 threads ..."
                )
                res[r] = produce(b, r, batched, single, single_seconds, leader_node)
            rates, cpu = produce_rows(res)
            print_table(
                "1. produce by replicas (same run; each its own queue, leader on a worker)",
                [
                    "sends",
                    "replicas",
                    "messages",
                    "msg/s",
                    "vs replicas=1",
                    "disk MB/s, all copies",
                    "msgs/commit",
                    "ms/commit",
                    "target",
                    "met?",
                ],
                rates,
            )
            print_table(
                "2. CPU per message (us); ceiling = 1 s / CPU per message of that process",
                [
                    "sends",
                    "replicas",
                    "leader",
                    "leader vs r=1",
                    "a follower",
                    "producers",
                    "machine",
                    "leader ceiling msg/s",
                    "follower ceiling msg/s",
                ],
                cpu,
            )
            sizes = {
                phase: int(res[2][phase]["per_commit"] * res[2][phase]["bytes_per_msg"])
                for phase in ("batched", "single")
            }
            print_table(
                "2b. replicas=2: per replicated commit, against a bare Ray call between two"
                " nodes (same run)",
                [
                    "what",
                    "KiB",
                    "ms each",
                    "leader CPU us (beyond r=1) / caller",
                    "follower / callee CPU us",
                ],
                commit_rows(res, bare_calls(b, sizes)),
            )
            for phase, target in (("batched", BATCHED_TARGET), ("single", SINGLE_TARGET)):
                ratio = res[2][phase]["rate"] / res[1][phase]["rate"]
                summary.append(
                    [
                        f"replicas=2 {phase} produce vs replicas=1",
                        f"{ratio:.2f}x ({res[2][phase]['rate']:,.0f} vs"
                        f" {res[1][phase]['rate']:,.0f} msg/s)",
                        f">= {target}x",
                        "yes" if ratio >= target else "NO",
                    ]
                )
        if "3" in args.parts:
            b.top_up()
            console.print(
                f"part 3: failover, replicas=3, {args.producers} producers and a consumer ..."
            )
            f = failover(b, args.producers, *steady)
            b.top_up()
            na = "not seen"
            rows = [
                ["remove_node, then SIGKILL of the leader", f"{f['remove_node_seconds']:.2f} s"],
                [
                    "SIGKILL -> broker starts the failover (detection)",
                    fmt_s(f["detected_after_kill"]),
                ],
                ["broker's failover (fence, promote, start leader)", fmt_s(f["failover_seconds"])],
                ["SIGKILL -> failover logged", fmt_s(f["logged_after_kill"])],
                ["SIGKILL -> first ack of a send started after it", fmt_s(f["ack_after_kill"], na)],
                [
                    "remove_node began -> first ack of a send started after it"
                    " (the old leader runs until its SIGKILL)",
                    fmt_s(f["ack_after_removal"], na),
                ],
                [
                    "SIGKILL -> first delivery of anything",
                    fmt_s(f["delivery_after_kill"], na),
                ],
                [
                    "SIGKILL -> first delivery of a message sent after it",
                    fmt_s(f["sent_delivery_after_kill"], na),
                ],
                ["leader moved off the lost node", str(f["leader_moved"])],
                [
                    "acknowledged / lost (acked, never consumed) / delivered twice",
                    f"{f['acked']:,} / {f['lost']:,} / {f['duplicates']:,}",
                ],
                ["producer errors (retried)", str(f["producer_errors"] or "none")],
                ["consumer errors (retried)", str(f["consumer_errors"] or "none")],
                [
                    "replicas afterwards (in sync)",
                    f"{len(f['replicas'])} ({sum(r['in_sync'] for r in f['replicas'])})",
                ],
            ]
            print_table("3. failover: the leader's node lost", ["figure", "value"], rows)
            resumed = f["ack_after_kill"]
            summary += [
                [
                    "writes resume after the leader's loss (first ack)",
                    fmt_s(resumed, na),
                    f"< {RESUME_TARGET_SECONDS:.0f} s",
                    "yes" if resumed is not None and resumed < RESUME_TARGET_SECONDS else "NO",
                ],
                [
                    "a message sent after the loss is delivered",
                    fmt_s(f["sent_delivery_after_kill"], na),
                    "-",
                    "-",
                ],
                [
                    "acknowledged messages lost in the failover",
                    f"{f['lost']:,} of {f['acked']:,}",
                    "0",
                    "yes" if f["lost"] == 0 else "NO",
                ],
            ]
        if "4" in args.parts:
            b.top_up()
            console.print(f"part 4: catch-up, replicas=2 filled with {fill_mib:,} MiB ...")
            c = catch_up(b, fill_mib * MIB)
            mb_s = c["bytes_on_disk"] / 1e6 / c["sync_seconds"]
            rows = [
                [
                    "fill (replicas=2, 4 threads x send_batch)",
                    f"{c['fill_messages']:,} msgs, {c['bytes_on_disk'] / MIB:,.0f} MiB on disk"
                    f" in {c['fill_seconds']:.1f} s ({c['fill_rate']:,.0f} msg/s)",
                ],
                ["remove_node, then SIGKILL of the follower", f"{c['remove_node_seconds']:.2f} s"],
                [
                    "SIGKILL -> new follower named (detection: 2 missed pings)",
                    f"{c['named_seconds']:.2f} s",
                ],
                [
                    "lost follower still reported in sync (stats) after SIGKILL",
                    f"{c['stale_in_sync_seconds']:.2f} s (no sends meanwhile)",
                ],
                [
                    "new follower named -> in sync (copy)",
                    f"{c['sync_seconds']:.2f} s: {mb_s:,.0f} MB/s of the leader's segments",
                ],
                ["SIGKILL -> in sync again", f"{c['total_seconds']:.2f} s"],
                [
                    "largest lag reported (leader's view)",
                    f"{c['lag_bytes'] / MIB:,.0f} MiB, {c['lag_messages']:,} msgs",
                ],
            ]
            print_table("4. catch-up of a replacement follower", ["figure", "value"], rows)
            summary.append(
                [
                    f"catch-up of {c['bytes_on_disk'] / MIB:,.0f} MiB: detection + copy",
                    f"{c['named_seconds']:.1f} + {c['sync_seconds']:.1f} s ({mb_s:,.0f} MB/s)",
                    "-",
                    "-",
                ]
            )
    finally:
        b.close()
    print_table("summary", ["figure", "value", "target", "met?"], summary)
    console.print(f"total {time.monotonic() - t_start:.0f} s")


def fmt_s(seconds: float | None, none: str = "-") -> str:
    return none if seconds is None else f"{seconds:.2f} s"


if __name__ == "__main__":
    main()
