"""Failover soak (issue 28): a replicated queue's leader node is lost again and again
while producers send and churning consumers, created before and after each loss,
keep consuming; checked message by message at the end.

The cluster is a ``ray.cluster_utils.Cluster`` of its own: a head and three worker
raylets on this machine, as ``bench/replication.py`` and
``tests/replication_scenario.py`` build it, with Ray's default health checks. One queue
with ``--replicas`` copies (2 by default; 3 also works), its leader first on a worker.
Two unreplicated "ballast" queues live on the head node, so that the broker, placing a
follower on the free node with fewest queues, never puts one on the head: the head
cannot be removed, and a leader promoted there would end the failovers.

- Producers: 4 threads at ``--rate`` messages/s in all, two sending single messages
  (``send``, waiting), two ``send_batch`` of 10 to 200; unique bodies (producer,
  sequence, and bytes derived from them); each records what it was told is stored.
  They pause while the queue has more than ``--max-backlog`` messages ready.
- Consumers: 3 slots, each a thread that makes a consumer on the application's one
  queue handle (``q.consumer(prefetch=...)``, the handle the producers use), receives
  (``receive`` or ``receive_batch``) and acks, half its acks pipelined
  (``ack(..., wait=False)``), the others waited for, for 5-40 s, paced at
  ``--consume-share`` of ``--rate`` in all (so that a backlog stays and a consumer
  without deliveries shows as a stall); a quarter of them
  receive once more and close without acking that (it is delivered again); then a new
  one. A consumer alive at a failover lives on until it has received a message whose
  send started after the loss (for at most 120 s after it: then it fails the run).
- Every ``--fail-every`` seconds (uniform in LO,HI), in the main thread: a fresh worker
  node is added; once the replica set is whole and in sync (a loss before would be of
  every in-sync copy, which replication does not cover), the leader's node (the
  broker's replica set says which) is removed, not gracefully, and the processes its
  raylet started (the leader's among them) are SIGKILLed: a removed raylet leaves its
  workers running, a lost machine takes them at once. Adding first, the broker has a
  free node for the replacement follower the moment it fails over (the head aside), and
  four nodes remain.

At the end the producers stop, every consumer closes, the queue's ``in_flight`` is read,
and fresh consumers drain the queue until every acknowledged message is consumed, its
depth is 0 and nothing is in flight (``--drain-timeout``).

What must hold (exit status 1 otherwise; "FAILOVER SOAK OK" printed):

- lost = 0: every message a producer was told is stored was received and acked by the
  application by the end;
- unknown = 0: nothing received that no producer sent, or whose bytes differ;
- stuck = 0: nothing in flight once every consumer closed (after 10 s for the queue to
  take back what closes gave back), and nothing left in the queue after the drain;
- no consumer slot, no consumer, and not the queue without a delivery for more than
  ``STALL_SECONDS`` (60) while the queue had messages ready (depth - in flight, as the
  last answered ``stats()`` said: a ``stats()`` that hangs counts as a backlog);
- every consumer alive at a failover received a message sent after it;
- no client error that is not a ``RayMQError`` (Ray's own errors included), and never
  ``InvalidAck`` for the application's own ack;
- at least one failover done, each logged by the broker, and the replica set whole and
  in sync again within ``RESTORE_SECONDS`` after each.

Printed for information: typed errors by type and where (sends refused during a
failover, ``NotEnoughReplicas`` until the new follower caught up, are expected),
duplicates (at-least-once: messages held at a loss, sends retried, acks lost with the
leader), sends that raised but were delivered all the same (by error), failovers the
broker made without a node lost (a leader that missed its 1 s ping while this machine
was busy, starting a raylet say), and per failover: seconds
from the SIGKILL to the broker's log of it, the broker's own failover time, the first
acknowledged send that started after it, the first delivery of a message sent after it,
and the replica set in sync again.

Caveats: every "node" is on this one machine: they share its cores (2 here) and its
one disk, with the producers, the consumers and Ray itself; a replica's fdatasyncs, the
catch-up of each new follower and the leader compete for them. Rates therefore
understate a real cluster; the timings include the broker's detection (monitor pings
every 1 s, followers report a silent leader after 1.5 s). Thread timing makes two runs
with one seed alike, not identical. Ray prints each removed raylet's last log lines.

    python -m bench.failover_soak [--minutes 10] [--seed 1] [--fail-every 60,90]
        [--replicas 2] [--rate 600] [--consume-share 0.8] [--max-backlog 5000]
        [--drain-timeout 300] [--store-mib 100]

It always starts its own cluster (``$RAYMQ_BENCH_ADDRESS`` is not used: nodes are
removed), with its paging directory under ``$RAYMQ_BENCH_DIR`` (or /tmp) and Ray's
under /tmp, both deleted at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import psutil
import ray
from raymq.actors.names import queue_actor_name

from bench.common import console, print_table
from bench.replication import NAMESPACE, Bench
from raymq.errors import ConsumerClosed, InvalidAck, RayMQError

QUEUE = "failover-soak"
BALLAST = ("failover-soak.ballast-0", "failover-soak.ballast-1")
MIB = 2**20
PRODUCERS = 4
CONSUMER_SLOTS = 3
#: No delivery for this long while messages are ready is a stall (seconds).
STALL_SECONDS = 60.0
#: The replica set must be whole and in sync again this long after a failover (seconds).
RESTORE_SECONDS = 180.0
#: Bound on a failover being logged, a node joining (seconds): only a wedge takes this long.
DEADLINE_SECONDS = 120.0
PROGRESS_SECONDS = 10.0
FILL = bytes(range(256)) * 2
BATCH_SIZES, BATCH_WEIGHTS = (10, 50, 200), (50, 35, 15)
PREFETCHES = (100, 500, 2000)
LEAVE_SHARE = 0.25  # consumers that close holding a batch they did not ack
PIPELINED_SHARE = 0.5


def body_of(p: int, s: int) -> bytes:
    """Message ``s`` of producer ``p``: its id, then 32 to 287 bytes derived from it."""
    start = (s * 31 + p * 7) % 256
    return b"%d.%d|" % (p, s) + FILL[start : start + 32 + (s * 2654435761 + p) % 256]


def key_of(body: bytes) -> tuple[int, int] | None:
    """(producer, sequence) of a body as ``body_of`` made it, else None."""
    head, sep, _ = body.partition(b"|")
    try:
        p, s = (int(x) for x in head.split(b"."))
    except ValueError:
        return None
    if not sep or not 0 <= p < PRODUCERS or s < 0 or body != body_of(p, s):
        return None
    return p, s


class Ledger:
    """Every id (producer, sequence): when its send started, whether the queue said it
    is stored, how often it was delivered, whether the application acked it."""

    def __init__(self):
        self.lock = threading.Lock()
        self.next_seq = [0] * PRODUCERS
        self.started = [np.zeros(0, np.float64) for _ in range(PRODUCERS)]
        self.stored = [np.zeros(0, np.bool_) for _ in range(PRODUCERS)]
        self.acked = [np.zeros(0, np.bool_) for _ in range(PRODUCERS)]
        self.deliveries = [np.zeros(0, np.uint32) for _ in range(PRODUCERS)]
        #: The error a send raised (an index in ``kinds``, 0: none).
        self.failed = [np.zeros(0, np.uint8) for _ in range(PRODUCERS)]
        self.kinds = ["-"]
        self.delivered = 0  # receipts, all
        self.unknown = 0
        self.examples: list[str] = []

    def reserve(self, p: int, n: int) -> int:
        """Sequence numbers for ``n`` messages of producer ``p`` whose send starts now."""
        with self.lock:
            first = self.next_seq[p]
            self.next_seq[p] = end = first + n
            if end > len(self.stored[p]):
                size = max(end, 2 * len(self.stored[p]), 4096)
                for arrays in (
                    self.started,
                    self.stored,
                    self.acked,
                    self.deliveries,
                    self.failed,
                ):
                    grown = np.zeros(size, arrays[p].dtype)
                    grown[: len(arrays[p])] = arrays[p]
                    arrays[p] = grown
            self.started[p][first:end] = time.monotonic()
            return first

    def confirm(self, p: int, first: int, n: int) -> None:
        with self.lock:
            self.stored[p][first : first + n] = True

    def fail(self, p: int, first: int, n: int, kind: str) -> None:
        """The send of these ``n`` messages raised ``kind``."""
        with self.lock:
            if kind not in self.kinds:
                self.kinds.append(kind)
            self.failed[p][first : first + n] = self.kinds.index(kind)

    def raised_but_stored(self) -> tuple[Counter[str], list[tuple[int, int, str, float]]]:
        """Messages whose send raised and that were delivered all the same, by error;
        and the first few: (producer, sequence, error, monotonic time its send started)."""
        out: Counter[str] = Counter()
        examples = []
        with self.lock:
            for p in range(PRODUCERS):
                n = self.next_seq[p]
                failed, deliveries = self.failed[p][:n], self.deliveries[p][:n]
                both = (failed > 0) & (deliveries > 0)
                for code in np.unique(failed[both]):
                    out[self.kinds[code]] += int(((failed == code) & (deliveries > 0)).sum())
                for s in np.flatnonzero(both)[:3]:
                    examples.append((p, int(s), self.kinds[failed[s]], float(self.started[p][s])))
        return out, examples

    def receive(self, bodies: list[bytes]) -> tuple[list[tuple[int, int]], float]:
        """Count deliveries; returns the ids and the latest send start among them."""
        keys = []
        latest = 0.0
        with self.lock:
            self.delivered += len(bodies)
            for body in bodies:
                key = key_of(body)
                if key is None or key[1] >= self.next_seq[key[0]]:
                    self.unknown += 1
                    if len(self.examples) < 5:
                        self.examples.append(repr(body[:60]))
                    continue
                p, s = key
                self.deliveries[p][s] += 1
                latest = max(latest, self.started[p][s])
                keys.append(key)
        return keys, latest

    def ack(self, keys: list[tuple[int, int]]) -> None:
        with self.lock:
            for p, s in keys:
                self.acked[p][s] = True

    def totals(self) -> dict[str, int]:
        with self.lock:
            out = Counter()
            for p in range(PRODUCERS):
                n = self.next_seq[p]
                stored, acked = self.stored[p][:n], self.acked[p][:n]
                deliveries = self.deliveries[p][:n]
                out["sent"] += int(stored.sum())
                out["attempted"] += n
                out["consumed"] += int(acked.sum())
                out["lost"] += int((stored & ~acked).sum())
                out["lost_never_delivered"] += int((stored & (deliveries == 0)).sum())
                out["duplicates"] += int(np.maximum(deliveries.astype(np.int64) - 1, 0).sum())
            out["delivered"] = self.delivered
            out["unknown"] = self.unknown
            return dict(out)

    def missing(self) -> int:
        """Messages stored and not acked by the application yet."""
        with self.lock:
            return sum(
                int((self.stored[p][: self.next_seq[p]] & ~self.acked[p][: self.next_seq[p]]).sum())
                for p in range(PRODUCERS)
            )


@dataclass
class Failover:
    """One loss of the leader's node."""

    number: int
    leader_node: str
    leader_rid: str
    killed_at: float  # monotonic, right after the SIGKILL
    remove_seconds: float = 0.0
    killed_pids: int = 0
    logged_after: float | None = None  # SIGKILL -> the broker's failover log has it
    record: dict | None = None  # the broker's record
    first_ack_after: float | None = None  # SIGKILL -> first ack of a send started after it
    first_delivery_after: float | None = None  # -> first receipt of a message sent after it
    restored_after: float | None = None  # -> the replica set whole and in sync again
    spanning: int = 0  # consumers alive at the SIGKILL
    new_leader_node: str | None = None


@dataclass
class ConsumerRecord:
    serial: int
    slot: int
    created_at: float  # monotonic, before q.consumer()
    ready_at: float = 0.0  # q.consumer() returned
    last_delivery: float = 0.0
    first_delivery_after: float | None = None
    closed_at: float | None = None
    #: Failover number -> seconds from its SIGKILL to this consumer's first receipt of
    #: a message sent after it (None: not yet), for failovers while it was alive.
    followed: dict[int, float | None] = field(default_factory=dict)
    #: Alive at a failover, it got no message sent after it within DEADLINE_SECONDS.
    gave_up: bool = False


class FailoverSoak:
    """The cluster, the broker, the queue, and the threads and figures of one run."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rng = random.Random(args.seed)
        self.store = args.store_mib * MIB
        self.ledger = Ledger()
        self.stop_producing = threading.Event()
        self.stop_consuming = threading.Event()
        self.stop_watching = threading.Event()
        self.lock = threading.Lock()
        self.errors: Counter[tuple[str, str]] = Counter()  # (where, type) -> count
        self.untyped: list[str] = []  # the first few non-RayMQError errors, with traceback
        self.untyped_count = 0
        self._shown: set[tuple[str, str]] = set()  # (where, type) printed once
        self.invalid_acks: list[str] = []
        self.failovers: list[Failover] = []
        self.fail_problems: list[str] = []
        self.consumers: dict[int, ConsumerRecord] = {}
        self.live: dict[int, ConsumerRecord] = {}
        self.serials = 0
        self.slot_progress = [0.0] * (CONSUMER_SLOTS + 1)  # last delivery (the last: drain)
        self.slot_stall_max = [0.0] * (CONSUMER_SLOTS + 1)
        self.consumer_stall_max = 0.0
        self.queue_stall_max = 0.0
        self.stalls: list[str] = []
        self.stats: dict | None = None  # the last stats() answered
        self.stats_at = 0.0
        self.stats_failures = 0
        self.broker_failovers = 0
        self.ready = 1  # messages ready, as the last stats said (1 until it answers)
        self.acks_lost = 0
        self.acks_resent = 0
        self.close_failures = 0
        self.skipped: Counter[str] = Counter()
        #: The 4-node cluster and the broker, as ``bench.replication`` makes them.
        self.bench: Bench | None = None
        self.cluster = self.broker = None

    # -- the cluster -------------------------------------------------------------------

    def start(self) -> None:
        bench = self.bench = Bench(self.store)
        self.cluster, self.broker, self.head = bench.cluster, bench.broker, bench.head
        self.session = ray._private.worker._global_node.get_session_dir_path()
        self.before_queue()
        for name in BALLAST:  # the head holds queues: followers go to workers
            self.broker.create_queue(name, node_id=self.head)
        leader = sorted(n.node_id for n in self.cluster.worker_nodes)[0]
        self.q = self.broker.create_queue(QUEUE, replicas=self.args.replicas, node_id=leader)
        self.watch_q = self.broker.get_queue(QUEUE)  # the monitor's own handle

    def before_queue(self) -> None:
        """Called once the broker runs, before the queue is made (a hook)."""

    def close(self) -> None:
        if self.bench is not None:
            self.bench.close()

    def top_up(self, n: int = 3) -> None:
        self.bench.top_up(n)

    def replica_set(self) -> dict:
        return ray.get(self.broker._actor.replica_sets.remote(), timeout=30)[QUEUE]

    def failover_log(self) -> list[dict]:
        return ray.get(self.broker._actor.failover_log.remote(), timeout=30)

    def in_sync(self) -> bool:
        """The replica set is whole and every replica in sync (the leader's view)."""
        try:
            reps = self.watch_q.stats()["replicas"]
        except RayMQError as exc:
            self.error("stats", exc)
            return False
        return len(reps) == self.args.replicas and all(r["in_sync"] for r in reps)

    # -- errors ------------------------------------------------------------------------

    def error(self, where: str, exc: BaseException) -> None:
        kind = type(exc).__name__
        with self.lock:
            self.errors[(where, kind)] += 1
            if isinstance(exc, InvalidAck):
                self.invalid_acks.append(f"{where}: {exc}"[:500])
            elif not isinstance(exc, RayMQError):
                self.untyped_count += 1
                if len(self.untyped) < 5:
                    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
                    self.untyped.append(f"{where}: " + "".join(tb))
            first = (where, kind) not in self._shown
            self._shown.add((where, kind))
        if first:  # each kind once, as it first happens
            console.print(f"[yellow]{where}: {kind}[/yellow]: {str(exc)[:300]}", soft_wrap=True)

    # -- producers ---------------------------------------------------------------------

    def produce(self, p: int) -> None:
        rng = random.Random(self.args.seed * 1000 + p)
        batches = p % 2 == 1
        rate = self.args.rate / PRODUCERS
        next_at = time.monotonic()
        while not self.stop_producing.is_set():
            if self.ready > self.args.max_backlog:
                self.stop_producing.wait(0.2)
                next_at = time.monotonic()
                continue
            n = rng.choices(BATCH_SIZES, BATCH_WEIGHTS)[0] if batches else 1
            first = self.ledger.reserve(p, n)
            started = time.monotonic()
            bodies = [body_of(p, s) for s in range(first, first + n)]
            try:
                if batches:
                    self.q.send_batch(bodies, timeout=10)
                else:
                    self.q.send(bodies[0], timeout=10)
            except Exception as exc:  # noqa: BLE001 - counted by type; untyped ones fail
                self.error("send_batch" if batches else "send", exc)
                self.ledger.fail(p, first, n, type(exc).__name__)
                self.stop_producing.wait(0.05)
                continue
            now = time.monotonic()
            self.ledger.confirm(p, first, n)
            self.note_ack(started, now)
            next_at = max(next_at + n / rate, now - 1.0)
            if next_at > now:
                self.stop_producing.wait(next_at - now)

    def note_ack(self, started: float, now: float) -> None:
        for f in self.failovers:
            if f.first_ack_after is None and started > f.killed_at:
                f.first_ack_after = now - f.killed_at

    # -- consumers ---------------------------------------------------------------------

    def consume(self, slot: int) -> None:
        rng = random.Random(self.args.seed * 7919 + slot)
        self.slot_progress[slot] = time.monotonic()
        while not self.stop_consuming.is_set():
            try:
                self.one_consumer(rng, slot)
            except Exception as exc:  # noqa: BLE001 - counted; a new consumer next
                self.error("consumer", exc)
                self.stop_consuming.wait(0.5)
        self.slot_progress[slot] = 0.0  # ended: not watched any more

    def one_consumer(self, rng: random.Random, slot: int) -> None:
        prefetch = rng.choice(PREFETCHES)
        life = rng.uniform(5, 40)
        leave = rng.random() < LEAVE_SHARE
        arrow = rng.random() < 0.5
        with self.lock:
            self.serials += 1
            rec = ConsumerRecord(self.serials, slot, time.monotonic())
        c = self.q.consumer(prefetch=prefetch)  # raises: counted, a new one next
        rec.ready_at = time.monotonic()
        with self.lock:
            self.consumers[rec.serial] = self.live[rec.serial] = rec
        end = rec.created_at + life
        rate = self.args.rate * self.args.consume_share / CONSUMER_SLOTS
        next_at = time.monotonic()
        try:
            while not self.stop_consuming.is_set():
                now = time.monotonic()
                if now >= end and not self.waits_to_follow(rec, now):
                    break
                if next_at > now:  # paced: slower than the producers, so a backlog stays
                    self.stop_consuming.wait(min(next_at - now, 1.0))
                    continue
                try:
                    got = self.receive(c, rng.choice((1, 10, 100, 500)), arrow, rec, slot)
                except ConsumerClosed:
                    raise
                except Exception as exc:  # noqa: BLE001 - counted; the consumer goes on
                    self.error("receive", exc)
                    self.stop_consuming.wait(0.2)
                    continue
                if not got:
                    continue
                offsets, keys = got
                next_at = max(next_at + len(offsets) / rate, time.monotonic() - 1.0)
                wait = rng.random() >= PIPELINED_SHARE
                self.ledger.ack(keys)  # (sent, so counted whatever the call answers)
                try:
                    c.ack(offsets, wait=wait)
                except Exception as exc:  # noqa: BLE001 - counted (InvalidAck fails the run)
                    self.error("ack" if wait else "ack(pipelined)", exc)
            if leave and not self.stop_consuming.is_set():
                with contextlib.suppress(Exception):  # left unacked: delivered again
                    self.receive(c, 100, arrow, rec, slot, unacked=True)
        finally:
            with self.lock:
                self.live.pop(rec.serial, None)
            try:
                c.close()  # flushes pipelined acks; raises the first refused one
            except Exception as exc:  # noqa: BLE001 - counted
                self.error("close", exc)
            rec.closed_at = time.monotonic()
            with self.lock:
                self.acks_lost += c.acks_lost
                self.acks_resent += c.acks_resent
                self.close_failures += c.close_failures

    def waits_to_follow(self, rec: ConsumerRecord, now: float) -> bool:
        """A consumer alive at a failover lives on until it received a message sent after
        it, at most ``DEADLINE_SECONDS`` after the loss (then it is flagged)."""
        pending = [n for n, s in rec.followed.items() if s is None]
        if not pending:
            return False
        if now - self.failovers[min(pending) - 1].killed_at < DEADLINE_SECONDS:
            return True
        rec.gave_up = True
        return False

    def receive(
        self,
        c,
        n: int,
        arrow: bool,
        rec: ConsumerRecord,
        slot: int,
        unacked: bool = False,
    ) -> tuple[list[int], list[tuple[int, int]]] | None:
        if arrow:
            batch = c.receive_batch(n, timeout=1.0)
            if not batch.num_rows:
                return None
            offsets = batch.column("offset").to_pylist()
            bodies = batch.column("body").to_pylist()
        else:
            msgs = c.receive(n, timeout=1.0)
            if not msgs:
                return None
            offsets = [m.offset for m in msgs]
            bodies = [m.body for m in msgs]
        now = time.monotonic()
        keys, latest = self.ledger.receive(bodies)
        rec.last_delivery = now
        if rec.first_delivery_after is None:
            rec.first_delivery_after = now - rec.created_at
        self.slot_progress[slot] = now
        for number, seconds in list(rec.followed.items()):
            f = self.failovers[number - 1]
            if seconds is None and latest > f.killed_at:
                rec.followed[number] = now - f.killed_at
        for f in self.failovers:
            if f.first_delivery_after is None and latest > f.killed_at:
                f.first_delivery_after = now - f.killed_at
        return None if unacked else (offsets, keys)

    # -- the monitor and the watchdog ------------------------------------------------

    def monitor(self) -> None:
        """``stats()`` every second on its own handle (it may hang in a failover)."""
        while not self.stop_watching.is_set():
            try:
                s = self.watch_q.stats()
            except Exception as exc:  # noqa: BLE001 - counted
                self.error("stats", exc)
                self.stats_failures += 1
            else:
                self.stats, self.stats_at = s, time.monotonic()
                self.ready = max(0, s["depth"] - s["in_flight"])
            with contextlib.suppress(Exception):  # (the broker's failovers: progress lines)
                self.broker_failovers = len(self.failover_log())
            self.stop_watching.wait(1.0)

    def watchdog(self, t0: float) -> None:
        """Every second: how long each slot, each live consumer and the queue went
        without a delivery while messages were ready; a progress line every 10 s."""
        seen = self.ledger.delivered
        queue_since = time.monotonic()
        slot_since = [time.monotonic()] * len(self.slot_progress)
        flagged: set = set()
        last_line = 0.0
        while not self.stop_watching.wait(1.0):
            now = time.monotonic()
            backlog = self.ready > 0
            if self.ledger.delivered != seen or not backlog:
                seen, queue_since = self.ledger.delivered, now
            self.queue_stall_max = max(self.queue_stall_max, now - queue_since)
            for i, progress in enumerate(self.slot_progress):
                if not progress:  # (the drain's, before it starts)
                    continue
                if not backlog:
                    slot_since[i] = now
                elif progress > slot_since[i]:
                    slot_since[i] = progress
                waited = now - slot_since[i]
                self.slot_stall_max[i] = max(self.slot_stall_max[i], waited)
                if waited > STALL_SECONDS and ("slot", i) not in flagged:
                    flagged.add(("slot", i))
                    self.stalls.append(f"consumer slot {i}: {waited:.0f} s without a delivery")
                    console.print(f"[red]{self.stalls[-1]}[/red]")
            with self.lock:
                live = list(self.live.values())
            for rec in live:
                waited = now - max(rec.last_delivery, rec.created_at)
                if backlog:
                    self.consumer_stall_max = max(self.consumer_stall_max, waited)
                    if waited > STALL_SECONDS and ("c", rec.serial) not in flagged:
                        flagged.add(("c", rec.serial))
                        self.stalls.append(
                            f"consumer {rec.serial}: {waited:.0f} s without a delivery"
                        )
                        console.print(f"[red]{self.stalls[-1]}[/red]")
                else:  # nothing ready: its wait starts again
                    rec.last_delivery = max(rec.last_delivery, now)
            if now - queue_since > STALL_SECONDS and ("q", int(queue_since)) not in flagged:
                flagged.add(("q", int(queue_since)))
                self.stalls.append(f"queue: {now - queue_since:.0f} s without a delivery")
                console.print(f"[red]{self.stalls[-1]}[/red]")
            if now - last_line >= PROGRESS_SECONDS:
                last_line = now
                self.progress(now - t0, len(live))

    def progress(self, elapsed: float, live: int) -> None:
        t = self.ledger.totals()
        s = self.stats
        with self.lock:
            by_type = Counter()
            for (_, kind), n in self.errors.items():
                by_type[kind] += n
        errors = ", ".join(f"{k} {n}" for k, n in sorted(by_type.items())) or "none"
        queue = (
            f"depth {s['depth']:,} in flight {s['in_flight']:,}"
            f" ({time.monotonic() - self.stats_at:.0f} s ago)"
            if s
            else "no stats yet"
        )
        console.print(
            f"{elapsed:6.0f} s  sent {t['sent']:,}  consumed {t['consumed']:,}"
            f"  delivered {t['delivered']:,}  {queue}  failovers {len(self.failovers)}"
            f" (broker: {self.broker_failovers})"
            f"  consumers alive {live} ({self.serials} made)  errors: {errors}",
            soft_wrap=True,
        )

    # -- the failovers -----------------------------------------------------------------

    def failer(self, end: float) -> None:
        """Failovers every ``--fail-every`` seconds until ``end`` (monotonic). In the main
        thread: ``Cluster.add_node`` sets a signal handler."""
        lo, hi = (float(x) for x in self.args.fail_every.split(","))
        while True:
            wait = self.rng.uniform(lo, hi)
            if time.monotonic() + wait >= end:
                break
            time.sleep(wait)
            try:
                self.fail_over()
            except Exception as exc:  # noqa: BLE001 - a failed step: reported, fails the run
                self.fail_problems.append(f"after failover {len(self.failovers)}: {exc!r}")
                console.print(f"[red]failover step failed[/red]: {exc!r}", soft_wrap=True)
                traceback.print_exc()
        time.sleep(max(0.0, end - time.monotonic()))

    def wait_in_sync(self, what: str) -> None:
        t = time.monotonic()
        while not self.in_sync():  # a loss now would be of every in-sync copy
            if time.monotonic() - t > RESTORE_SECONDS:
                raise TimeoutError(f"{what}: not in sync after {RESTORE_SECONDS:.0f} s")
            time.sleep(0.25)

    def fail_over(self) -> None:
        """Add a node; once the replica set is whole and in sync, remove the leader's
        node and SIGKILL what its raylet started; wait for the broker's failover and the
        set in sync again."""
        self.cluster.add_node(num_cpus=1, object_store_memory=self.store)  # 5, then 4
        self.cluster.wait_for_nodes()
        for _ in range(10):  # (the leader may move meanwhile: a failover of its own)
            self.wait_in_sync("before a failover")
            rs = self.replica_set()
            leader_rid = rs["leader"]
            leader_node = rs["nodes"][leader_rid]
            if leader_node == self.head:
                self.skipped["leader on the head node"] += 1
                console.print("[yellow]leader on the head node: not removed[/yellow]")
                return
            node = next(n for n in self.cluster.worker_nodes if n.node_id == leader_node)
            leader = ray.get_actor(queue_actor_name(QUEUE), namespace=NAMESPACE)
            leader_pid = ray.get(leader.pid.remote(), timeout=30)
            pids = node_pids(node)
            if leader_pid in pids:
                break
            time.sleep(1.0)
        else:
            raise RuntimeError(f"the leader's pid {leader_pid} is not on its node's raylet")
        log_before = len(self.failover_log())
        number = len(self.failovers) + 1
        with self.lock:
            live = list(self.live.values())
        t0 = time.monotonic()
        self.cluster.remove_node(node, allow_graceful=False)
        killed = 0
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
        f = Failover(number, leader_node, leader_rid, time.monotonic())
        f.remove_seconds, f.killed_pids, f.spanning = f.killed_at - t0, killed, len(live)
        for rec in live:
            rec.followed[number] = None
        self.failovers.append(f)
        console.print(
            f"[magenta]failover {number}[/magenta]: removed node {leader_node[:8]} (leader"
            f" {leader_rid}, pid {leader_pid}, {killed} processes SIGKILLed) with"
            f" {len(live)} consumers alive",
            soft_wrap=True,
        )
        deadline = f.killed_at + DEADLINE_SECONDS
        while True:
            log = self.failover_log()[log_before:]
            ours = [r for r in log if r["queue"] == QUEUE and r["old_leader"] == leader_rid]
            if ours:
                f.logged_after = time.monotonic() - f.killed_at
                f.record = ours[0]
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"failover {number} not logged after {DEADLINE_SECONDS:.0f} s")
            time.sleep(0.05)
        f.new_leader_node = self.replica_set()["nodes"][f.record["leader"]]
        self.wait_in_sync(f"failover {number}")
        f.restored_after = time.monotonic() - f.killed_at
        console.print(
            f"failover {number}: logged {f.logged_after:.2f} s after the SIGKILL (broker:"
            f" {f.record['seconds']:.2f} s), epoch {f.record['epoch']}, leader"
            f" {f.record['leader']} on {f.new_leader_node[:8]}; in sync again after"
            f" {f.restored_after:.1f} s",
            soft_wrap=True,
        )

    # -- the run -----------------------------------------------------------------------

    def run(self) -> dict:
        t0 = time.monotonic()
        producers = [threading.Thread(target=self.produce, args=(p,)) for p in range(PRODUCERS)]
        slots = [threading.Thread(target=self.consume, args=(i,)) for i in range(CONSUMER_SLOTS)]
        helpers = [
            threading.Thread(target=self.monitor, daemon=True),
            threading.Thread(target=self.watchdog, args=(t0,), daemon=True),
        ]
        for t in [*helpers, *producers, *slots]:
            t.start()
        self.failer(t0 + self.args.minutes * 60)
        self.stop_producing.set()
        console.print("producers stopping ...")
        for t in producers:
            t.join(DEADLINE_SECONDS)
        produce_seconds = time.monotonic() - t0
        console.print("producers stopped; closing consumers ...")
        self.stop_consuming.set()
        for t in slots:
            t.join(DEADLINE_SECONDS * 2)
        stuck_at_close = self.stats_now()["in_flight"]
        t1 = time.monotonic()
        stuck = stuck_at_close
        while stuck and time.monotonic() - t1 < 10:
            time.sleep(0.5)
            stuck = self.stats_now()["in_flight"]
        console.print(
            f"consumers closed: in flight {stuck_at_close:,} at once, {stuck:,} after"
            f" {time.monotonic() - t1:.1f} s; draining ..."
        )
        d0 = time.monotonic()
        drained = self.drain(self.args.drain_timeout)
        drain_seconds = time.monotonic() - d0
        self.stop_watching.set()
        final = self.stats_now()
        return {
            "produce_seconds": produce_seconds,
            "drain_seconds": drain_seconds,
            "all_seconds": time.monotonic() - t0,
            "stuck_at_close": stuck_at_close,
            "stuck_after_close": stuck,
            "drained": drained,
            "final": final,
            "log": self.failover_log(),
            "replicas_end": final["replicas"],
        }

    def stats_now(self) -> dict:
        """The queue's stats, tried again for up to ``DEADLINE_SECONDS`` (typed errors
        counted)."""
        deadline = time.monotonic() + DEADLINE_SECONDS
        while True:
            try:
                return self.watch_q.stats()
            except RayMQError as exc:
                self.error("stats", exc)
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)

    def drain(self, timeout: float) -> bool:
        """Fresh consumers receive and ack until every stored message is acked by the
        application and the queue is empty, or ``timeout``; True if so."""
        slot = CONSUMER_SLOTS
        deadline = time.monotonic() + timeout
        self.slot_progress[slot] = time.monotonic()
        rec = ConsumerRecord(0, slot, time.monotonic())
        while time.monotonic() < deadline:
            try:
                with self.q.consumer(prefetch=5000) as c:
                    idle_since = time.monotonic()
                    while time.monotonic() < deadline:
                        got = self.receive(c, 1000, True, rec, slot)
                        if got:
                            idle_since = time.monotonic()
                            self.ledger.ack(got[1])
                            c.ack(got[0], wait=True)
                            continue
                        if self.ledger.missing() == 0 and c.backlog() == 0:
                            s = self.stats_now()
                            if s["depth"] == 0 and s["in_flight"] == 0:
                                return True
                        if time.monotonic() - idle_since > 15:  # a fresh consumer
                            break
            except Exception as exc:  # noqa: BLE001 - counted; a fresh consumer next
                self.error("drain", exc)
                time.sleep(0.5)
        console.print(f"[red]drain timed out after {timeout:.0f} s[/red]")
        return False


def node_pids(node) -> list[int]:
    """The processes a cluster node's raylet started (its workers: actors' processes),
    and its own: those a lost machine takes with it."""
    pids: set[int] = set()
    for infos in node.all_processes.values():
        for info in infos:
            if info.process is None:
                continue
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(info.process.pid)
                pids.add(proc.pid)
                pids.update(c.pid for c in proc.children(recursive=True))
    return sorted(pids)


def report(soak: FailoverSoak, out: dict) -> bool:
    t = soak.ledger.totals()
    final = out["final"]
    stuck = out["stuck_after_close"] + final["depth"] + final["in_flight"]
    by_type: Counter[str] = Counter()
    for (_, kind), n in soak.errors.items():
        by_type[kind] += n
    untyped = soak.untyped_count
    raised, raised_examples = soak.ledger.raised_but_stored()
    invalid = by_type.get("InvalidAck", 0)
    spanning = [
        (rec.serial, n, s) for rec in soak.consumers.values() for n, s in rec.followed.items()
    ]
    not_followed = [r.serial for r in soak.consumers.values() if r.gave_up]
    follow_max = max((s for _, _, s in spanning if s is not None), default=0.0)
    first_max = max(
        (
            r.first_delivery_after
            for r in soak.consumers.values()
            if r.first_delivery_after is not None
        ),
        default=0.0,
    )
    never = [
        r.serial
        for r in soak.consumers.values()
        if r.first_delivery_after is None and r.closed_at and r.closed_at - r.created_at > 30
    ]
    stall = max(soak.queue_stall_max, soak.consumer_stall_max, *soak.slot_stall_max)
    done = len(soak.failovers)
    logged = sum(1 for f in soak.failovers if f.record is not None)
    created_after = sum(
        1
        for r in soak.consumers.values()
        if soak.failovers and r.created_at > soak.failovers[0].killed_at
    )

    rows = []
    for f in soak.failovers:
        rows.append(
            [
                str(f.number),
                f"{f.leader_node[:8]} ({f.leader_rid})",
                f"{f.new_leader_node[:8]} ({f.record['leader']})" if f.record else "-",
                fmt(f.logged_after),
                fmt(f.record["seconds"] if f.record else None),
                fmt(f.first_ack_after),
                fmt(f.first_delivery_after),
                fmt(f.restored_after),
                str(f.spanning),
                str(f.killed_pids),
            ]
        )
    print_table(
        "failovers (seconds from the SIGKILL of the leader's node)",
        [
            "#",
            "lost leader",
            "new leader",
            "logged",
            "broker's failover",
            "first ack of a later send",
            "first delivery of a later send",
            "in sync again",
            "consumers alive",
            "pids killed",
        ],
        rows,
    )
    must = [
        ("lost (stored, never acked by the application)", t["lost"], 0),
        ("  of which never delivered at all", t["lost_never_delivered"], 0),
        ("unknown (received, never sent / bytes differ)", t["unknown"], 0),
        ("stuck (in flight after close + depth and in flight after the drain)", stuck, 0),
        ("max seconds without a delivery while messages were ready", round(stall, 1), 60),
        ("consumers alive at a failover that never got a later message", len(not_followed), 0),
        ("client errors that are not RayMQError", untyped, 0),
        ("InvalidAck", invalid, 0),
        ("failover steps that failed (not logged, not back in sync)", len(soak.fail_problems), 0),
    ]
    ok = all(v <= limit for _, v, limit in must) and done >= 1 and logged == done
    ok = ok and out["drained"] and not soak.stalls
    print_table(
        f"failover soak: {soak.args.minutes:g} min, seed {soak.args.seed},"
        f" replicas={soak.args.replicas}, {done} failovers",
        ["figure", "value", "must be <="],
        [[k, f"{v:,}", f"{limit:,}"] for k, v, limit in must]
        + [
            ["sent (stored, as told to the producer)", f"{t['sent']:,}", "-"],
            ["sends attempted (messages)", f"{t['attempted']:,}", "-"],
            ["consumed (acked by the application, distinct)", f"{t['consumed']:,}", "-"],
            ["delivered (receipts)", f"{t['delivered']:,}", "-"],
            ["duplicates (deliveries after the first)", f"{t['duplicates']:,}", "-"],
            [
                "sends that raised but were delivered, by error",
                ", ".join(f"{k} {n:,}" for k, n in sorted(raised.items())) or "0",
                "-",
            ],
            ["failovers done / logged by the broker", f"{done} / {logged}", ">= 1"],
            [
                "consumers made / made after the first failover",
                f"{soak.serials} / {created_after}",
                "-",
            ],
            [
                "consumer-failovers spanned / max s to a later message",
                f"{len(spanning)} / {follow_max:.1f}",
                "-",
            ],
            ["max s from q.consumer() to a first message", f"{first_max:.1f}", "-"],
            [
                "max s without delivery: queue / consumer / slots",
                f"{soak.queue_stall_max:.0f} / {soak.consumer_stall_max:.0f} / "
                + ",".join(f"{s:.0f}" for s in soak.slot_stall_max),
                "60",
            ],
            [
                "in flight once consumers closed (at once / after <= 10 s)",
                f"{out['stuck_at_close']:,} / {out['stuck_after_close']:,}",
                "-",
            ],
            [
                "after the drain: depth / in flight",
                f"{final['depth']:,} / {final['in_flight']:,}",
                "-",
            ],
            [
                "pipelined acks resent / lost (clients' counters)",
                f"{soak.acks_resent:,} / {soak.acks_lost:,}",
                "-",
            ],
            [
                "queue (its last leader's process): redelivered / stale acks dropped",
                f"{final['messages_redelivered']:,} / {final.get('stale_acks', 0):,}",
                "-",
            ],
            ["TargetList close failures", f"{soak.close_failures:,}", "-"],
            ["consumers > 30 s that never got a message", f"{len(never)}", "-"],
        ],
    )
    errors = ", ".join(f"{k} x{n}" for k, n in sorted(by_type.items())) or "none"
    console.print(f"client errors by type: {errors}", soft_wrap=True)
    where = ", ".join(f"{w}/{k} x{n}" for (w, k), n in sorted(soak.errors.items())) or "none"
    console.print(f"client errors by call: {where}", soft_wrap=True)
    seconds = [r["seconds"] for r in out["log"] if r.get("queue") == QUEUE]
    ours = {(f.record["old_epoch"], f.record["old_leader"]) for f in soak.failovers if f.record}
    own = [
        r
        for r in out["log"]
        if r["queue"] == QUEUE and (r["old_epoch"], r["old_leader"]) not in ours
    ]
    if own:
        console.print(
            f"[yellow]failovers the broker made without a node lost[/yellow] (a leader"
            f" that missed a ping: this machine's load): {len(own)}: "
            + "; ".join(
                f"epoch {r['old_epoch']}->{r['epoch']} {r['old_leader']}->{r['leader']}"
                f" {r['seconds']:.2f} s"
                for r in own
            ),
            soft_wrap=True,
        )
    if seconds:
        console.print(
            f"broker's failover log: {len(seconds)} failovers, seconds min {min(seconds):.2f}"
            f" / median {float(np.median(seconds)):.2f} / max {max(seconds):.2f}",
            soft_wrap=True,
        )
    console.print(
        "replicas at the end: "
        + ", ".join(
            f"{r['replica_id']} {r['role']} in_sync={r['in_sync']}" for r in out["replicas_end"]
        ),
        soft_wrap=True,
    )
    produce = out["produce_seconds"]
    console.print(
        f"rates: {t['sent'] / produce:,.0f} msg/s stored while producing ({produce:.0f} s);"
        f" drain {out['drain_seconds']:.1f} s; whole run {out['all_seconds']:.0f} s",
        soft_wrap=True,
    )
    if soak.skipped:
        console.print(f"failovers skipped: {dict(soak.skipped)}")
    for line in soak.fail_problems:
        console.print(f"[red]{line}[/red]", soft_wrap=True)
    for line in soak.stalls:
        console.print(f"[red]stall: {line}[/red]", soft_wrap=True)
    if not_followed:
        console.print(f"[red]consumers that did not follow: {not_followed[:10]}[/red]")
    for p, seq, kind, started in raised_examples[:6]:
        near = min(soak.failovers, key=lambda f: abs(started - f.killed_at), default=None)
        when = "" if near is None else f", its send began {started - near.killed_at:+.2f} s"
        when += "" if near is None else f" from failover {near.number}'s SIGKILL"
        console.print(f"send raised {kind}, delivered all the same: id {p}.{seq}{when}")
    for example in soak.ledger.examples:
        console.print(f"unknown body: {example}", markup=False)
    for text in soak.untyped:
        console.print("[red]untyped client error[/red]:")
        console.print(text, markup=False, soft_wrap=True)
    for text in soak.invalid_acks[:5]:
        console.print(f"[red]InvalidAck[/red]: {text}", soft_wrap=True)
    if not out["drained"]:
        console.print("[red]the drain did not finish[/red]")
    if done == 0:
        console.print("[red]no failover was done[/red]")
    console.print("[green]FAILOVER SOAK OK[/green]" if ok else "[red]FAILOVER SOAK FAILED[/red]")
    return ok


def fmt(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="producing time")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--fail-every", default="60,90", help="seconds between losses: LO,HI")
    parser.add_argument("--replicas", type=int, default=2, choices=(2, 3))
    parser.add_argument("--rate", type=float, default=600, help="messages/s, all producers")
    parser.add_argument(
        "--max-backlog", type=int, default=5000, help="ready messages above which producers pause"
    )
    parser.add_argument(
        "--consume-share",
        type=float,
        default=0.8,
        help="consumers' pace as a share of --rate (below 1: a backlog builds up to"
        " --max-backlog, so that a stall shows)",
    )
    parser.add_argument("--drain-timeout", type=float, default=300.0, help="seconds")
    parser.add_argument("--store-mib", type=int, default=100, help="object store per node")
    args = parser.parse_args()
    if not console.is_terminal:
        console.width = max(console.width, 140)  # tables unwrapped in a log
    console.print(
        f"failover soak: {args.minutes:g} min, seed {args.seed}, replicas={args.replicas},"
        f" a loss every {args.fail_every} s; machine: {os.cpu_count()} cores,"
        f" load {os.getloadavg()[0]:.1f}; starting a 4-node cluster ..."
    )
    soak = FailoverSoak(args)
    ok = False
    try:
        soak.start()
        console.print(f"Ray session {soak.session}")
        out = soak.run()
        ok = report(soak, out)
    finally:
        soak.close()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
