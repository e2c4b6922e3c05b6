"""Replicated queues on a real four-node Ray cluster on one machine (issue 14).

Run by ``tests/test_replication_on_ray.py`` in its own process (one Ray per process; the
rest of the suite shares another). Ray's default health-check settings: the broker must
notice a lost leader by itself, long before Ray declares its node dead. Prints one JSON
object of observations on stdout; the test makes the assertions.

Scenarios, each on the cluster as the previous one left it (nodes added back):

- ``leader``: the leader's node is removed (not gracefully) while four producer threads
  send, two single messages, two batches; every acknowledged message is then consumed.
- ``lifetimes``: a queue with expiring, scheduled and prioritized messages loses its
  leader's node: the new leader finds them again from its replicated files (issue 30).
- ``follower``: a follower's node is removed while a producer sends: sends go on.
- ``two``: two of three replica nodes are removed: sends fail with NotEnoughReplicas
  until a new follower has caught up, then resume.
- ``paused``: the leader's process is paused (SIGSTOP) until the broker failed over,
  then resumed: a send to it is not acknowledged.
- ``broker``: the broker's process is paused while a leader restarts in place: the
  leader's start ends in ``BrokerUnavailable`` (it waits on the controller a bounded
  time), and once the broker is resumed the queue has every message.

Then the broker stops its queues: from then on it starts nothing (an epoch asked for
by a restarting leader, a revival), and no queue or replica actor is left.

Usage: python tests/replication_scenario.py PAGING_DIR RAY_TEMP_DIR [SCENARIO ...]
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
import threading
import time

import ray
from ray.cluster_utils import Cluster

import raymq
from raymq.batch import MessageBatch
from raymq.core.replication_controller import REJOIN_SECONDS
from raymq.errors import BrokerUnavailable, NotEnoughReplicas, RayMQError

MIB = 2**20
STORE = 80 * MIB
#: Bound on anything that should take seconds: only a wedge takes this long.
DEADLINE_SECONDS = 60.0


class Producers:
    """Producer threads sending unique bodies, recording what was acknowledged."""

    def __init__(self, queue, threads: int = 4, batch_every: int = 2):
        self.queue = queue
        self.acked: list[bytes] = []
        self.acked_at: list[tuple[float, float]] = []  # (send started, acknowledged)
        self.errors: dict[str, int] = {}
        self.first_error: dict[str, str] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, args=(t, t % batch_every == 1), daemon=True)
            for t in range(threads)
        ]

    def start(self) -> Producers:
        for t in self._threads:
            t.start()
        return self

    def _run(self, t: int, batches: bool) -> None:
        i = 0
        while not self._stop.is_set():
            if batches:
                bodies = [f"p{t}-{i + k}".encode() + b"." * 200 for k in range(100)]
            else:
                bodies = [f"p{t}-{i}".encode() + b"." * 200]
            started = time.monotonic()
            try:
                if batches:
                    self.queue.send_batch(bodies, timeout=10)
                else:
                    self.queue.send(bodies[0], timeout=10)
            except (RayMQError, ray.exceptions.RayError) as exc:
                kind = type(exc).__name__
                with self._lock:
                    self.errors[kind] = self.errors.get(kind, 0) + 1
                    self.first_error.setdefault(kind, str(exc)[:300])
                time.sleep(0.05)
                continue  # not acknowledged: the same bodies are not counted
            now = time.monotonic()
            with self._lock:
                self.acked += bodies
                self.acked_at.append((started, now))
            i += len(bodies)

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


def _frozen(_actor) -> int:
    import gc

    return gc.get_freeze_count()


def wait_for(what: str, check, timeout: float = DEADLINE_SECONDS):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout} s")
        time.sleep(0.05)


def consume_all(queue, offsets: list[int] | None = None) -> list[bytes]:
    """Receive and ack until the queue has nothing more (their offsets appended to
    ``offsets``)."""
    got: list[bytes] = []
    deadline = time.monotonic() + DEADLINE_SECONDS
    with queue.consumer(prefetch=2000) as c:
        while True:
            batch = c.receive_batch(1000, timeout=1)
            if batch.num_rows:
                got += batch.column("body").to_pylist()
                if offsets is not None:
                    offsets += batch.column("offset").to_pylist()
                c.ack(batch)
            elif c.backlog() == 0 and queue.stats()["depth"] == 0:
                # (depth, not only the backlog: messages a closed consumer held come
                # back once the queue learns of its end, perhaps after this drain began)
                return got
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(got)} consumed after {DEADLINE_SECONDS} s")


def _receive_one(queue) -> int:
    """A new consumer on ``queue`` receives one message and acks it (its offset); the
    ack is redelivered-safe (at-least-once): the drain that follows still sees it."""
    with queue.consumer(prefetch=10) as c:
        got = c.receive(timeout=DEADLINE_SECONDS)
        assert got, "a consumer on the idle handle received nothing"
        c.nack(got)  # back to the queue: the drain counts every message
        return int(got[0].offset)


def check_bodies(acked: list[bytes], consumed: list[bytes]) -> dict:
    got = set(consumed)
    return {
        "acked": len(acked),
        "consumed": len(consumed),
        "lost": len(set(acked) - got),
        "never_sent": sum(1 for b in got if not b.startswith(b"p")),
        "duplicates": len(consumed) - len(got),
    }


class Scenario:
    def __init__(self, cluster: Cluster, broker, paging_dir: str = ""):
        self.cluster = cluster
        self.broker = broker
        self.paging_dir = paging_dir
        self.head = ray.get_runtime_context().get_node_id()

    def workers(self) -> dict:
        """Worker node id -> its cluster node handle (alive ones)."""
        return {n.node_id: n for n in self.cluster.worker_nodes}

    def top_up(self, n: int = 3) -> None:
        while len(self.cluster.worker_nodes) < n:
            self.cluster.add_node(num_cpus=1, object_store_memory=STORE)
        self.cluster.wait_for_nodes()

    def create(self, name: str, replicas: int = 3):
        leader_node = sorted(self.workers())[0]
        return self.broker.create_queue(name, replicas=replicas, node_id=leader_node)

    def remove(self, node_id: str, pids: list[int] = ()) -> float:
        """Remove a worker node, not gracefully, killing ``pids`` (its actors'
        processes) with it: a lost machine takes them at once, where a removed raylet
        leaves them running for a while."""
        node = self.workers()[node_id]
        t = time.monotonic()
        self.cluster.remove_node(node, allow_graceful=False)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return t

    def remove_leader(self, name: str) -> tuple[str, float]:
        """Remove the node of queue ``name``'s leader, with its process: the leader the
        broker names now, once it names one on a worker node (under load a failover may
        have moved it since the queue was made). Returns that node and when it went."""
        found: dict[str, str | None] = {}

        def on_a_worker() -> bool:
            found["node"] = self.broker.queue_nodes().get(name)
            return found["node"] in self.workers()

        wait_for(f"queue {name!r}'s leader on a worker node", on_a_worker)
        node = found["node"]
        assert node is not None
        pid = ray.get(self.broker.get_queue(name)._actor.pid.remote())
        return node, self.remove(node, [pid])

    def leader_pid(self, q) -> int:
        return ray.get(q._actor.pid.remote())

    def follower_pid(self, name: str, rid: str) -> int:
        from raymq.actors.names import replica_actor_name

        return ray.get(ray.get_actor(replica_actor_name(name, rid), "replication").pid.remote())

    def follower_frozen(self, name: str, rid: str) -> int:
        """Objects the follower's process froze out of full collections (raymq.heap)."""
        from raymq.actors.names import replica_actor_name

        actor = ray.get_actor(replica_actor_name(name, rid), "replication")
        return ray.get(actor.__ray_call__.remote(_frozen))

    def leader_loss(self) -> dict:
        q = self.create("leader")
        producers = Producers(q).start()
        wait_for("acks before the loss", lambda: producers.count() >= 2000)
        holder = q.consumer(prefetch=500)  # holds messages unacknowledged across the loss
        held = []
        while len(held) < 300:
            held += [m.body for m in holder.receive(max_messages=300, timeout=5)]
        idle = self.broker.get_queue("leader")  # a handle not used until after the loss
        leader, removed_at = self.remove_leader("leader")
        wait_for("a new leader", lambda: self.broker.queue_nodes()["leader"] != leader)
        wait_for("acks after the loss", lambda: producers.first_ack_after(removed_at + 0.001))
        after = producers.count()
        wait_for("more acks", lambda: producers.count() >= after + 2000)
        producers.stop()
        out = {"idle_handle": self.idle_handle_after_failover(idle)}
        out["same_handle"] = self.used_handle_after_failover(q, holder, held)
        out |= {
            "first_ack_seconds": producers.first_ack_after(removed_at),
            "leader_before": leader,
            "leader_after": self.broker.queue_nodes()["leader"],
            "errors": producers.errors,
            "first_error": producers.first_error,
        }
        holder.close()  # what it held goes to the next consumer
        t = time.monotonic()
        offsets: list[int] = []
        consumed = consume_all(q, offsets)
        out["consume_seconds"] = time.monotonic() - t
        out.update(check_bodies(producers.acked, consumed))
        out["held"] = len(set(held))  # (after the loss the new leader may deliver a held one again)
        out["held_delivered_again"] = len(set(held) & set(consumed))
        out["distinct_offsets"] = len(set(offsets))
        out["replicas"] = q.stats()["replicas"]
        return out

    @staticmethod
    def idle_handle_after_failover(idle) -> dict:
        """Every call of a handle made before the failover, used first after it,
        follows the new leader (issue 28, Observed 1: ``consumer()`` raised Ray's
        ``ActorUnschedulableError``): a consumer receives and acks, a send is stored,
        stats answer. Returns what happened (error type -> message)."""
        out: dict = {"errors": {}}
        for what, call in (
            ("consumer", lambda: _receive_one(idle)),
            ("send", lambda: idle.send(b"p-idle" + b"." * 200, timeout=10)),
            ("stats", lambda: idle.stats()["depth"]),
        ):
            try:
                out[what] = call()
            except Exception as exc:  # noqa: BLE001 - recorded: the test asserts none
                out["errors"][what] = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"[:400]
        return out

    @staticmethod
    def used_handle_after_failover(q, holder, held: list[bytes]) -> dict:
        """The application's own handle, used before the failover (sends, a consumer,
        so its queue's fetch endpoint is remembered), after it: the consumer created
        before the loss receives more, and a new consumer on that handle receives and
        acks (issue 28, Observed 1 as reported: ``q.send()`` followed the new leader,
        ``q.consumer()`` raised ``ActorUnschedulableError`` from ``_fetch_endpoint``).
        What the holder receives joins ``held`` (kept unacknowledged: delivered again
        once it closes). Returns what happened (error type -> message)."""
        out: dict = {"errors": {}}

        def holder_receives() -> int:
            got = holder.receive(max_messages=50, timeout=DEADLINE_SECONDS)
            assert got, "the consumer created before the loss received nothing after it"
            held.extend(m.body for m in got)
            return len(got)

        for what, call in (
            ("consumer_before", holder_receives),
            ("consumer_after", lambda: _receive_one(q)),
        ):
            try:
                out[what] = call()
            except Exception as exc:  # noqa: BLE001 - recorded: the test asserts none
                out["errors"][what] = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"[:400]
        return out

    def lifetimes(self) -> dict:
        """Expiry, delivery times and priorities over a failover: sent before the
        leader's node is lost, the new leader sets the far ones aside, drops the expired
        ones, delivers the due one not before its time and the urgent ones first."""
        self.top_up()
        q = self.broker.create_queue(
            "timed",
            replicas=2,
            node_id=sorted(self.workers())[0],
            max_priority=9,
            message_expiry_scan_period_s=0.5,
        )
        q.send_batch([b"plain-%d" % i for i in range(20)])
        q.send_batch([b"far-%d" % i for i in range(5)], delay=3600)
        due_at = time.time() + 8
        q.send(b"due", deliver_at=due_at)
        q.send_batch([b"short-%d" % i for i in range(5)], ttl=2.0)
        q.send_batch([b"urgent-%d" % i for i in range(5)], priority=9)
        leader, _ = self.remove_leader("timed")
        wait_for("a new leader", lambda: self.broker.queue_nodes()["timed"] != leader)
        # The new leader's pass finds them again (at once after its start).
        wait_for("priorities found", lambda: q.stats()["prioritized"] == 5)
        # The 5 short ones are gone: dropped by the new leader, or by the old one before
        # its node went (its count went with it), their acks replicated either way.
        wait_for("expired dropped", lambda: q.stats()["depth"] == 31)
        wait_for("far ones set aside", lambda: q.stats()["scheduled"] >= 5)
        received: list[tuple[bytes, float]] = []
        with q.consumer(prefetch=100) as c:
            deadline = time.monotonic() + DEADLINE_SECONDS
            while len(received) < 26 and time.monotonic() < deadline:
                got = c.receive(max_messages=100, timeout=1)
                received += [(m.body, time.time()) for m in got]
                c.ack(got)
        due = [t for body, t in received if body == b"due"]
        return {
            "leader_before": leader,
            "leader_after": self.broker.queue_nodes()["timed"],
            "order": [body.decode() for body, _ in received],
            "due_early_seconds": due_at - due[0] if due else None,
            "stats": {k: q.stats()[k] for k in ("depth", "scheduled", "messages_expired")},
        }

    def follower_loss(self) -> dict:
        self.top_up()
        q = self.create("follower")
        sets = self.broker._actor.replica_sets.remote()
        rs = ray.get(sets)["follower"]
        follower = next(
            node for rid, node in rs["nodes"].items() if rid != rs["leader"] and node != self.head
        )
        producers = Producers(q, threads=2).start()
        wait_for("acks before the loss", lambda: producers.count() >= 1000)
        rid = next(r for r, node in rs["nodes"].items() if node == follower)
        frozen = self.follower_frozen("follower", rid)
        removed_at = self.remove(follower, [self.follower_pid("follower", rid)])
        before = producers.count()
        wait_for("acks after the loss", lambda: producers.count() >= before + 2000)
        producers.stop()
        out = {
            "first_ack_seconds": producers.first_ack_after(removed_at),
            "errors": producers.errors,
            "first_error": producers.first_error,
            "follower_frozen": frozen,
        }
        consumed = consume_all(q)
        out.update(check_bodies(producers.acked, consumed))
        out["replicas"] = wait_for(  # the two left are in sync at once: wait for the third
            "a new follower in sync",
            lambda: (
                (r := q.stats()["replicas"]) and len(r) == 3 and all(x["in_sync"] for x in r) and r
            ),
        )
        return out

    def two_of_three(self) -> dict:
        """The leader on the head; both followers' nodes lost, and the one free node:
        no replica can be added, so sends are refused (typed) until a node joins and a
        new follower there has caught up."""
        self.top_up()
        q = self.broker.create_queue("two", replicas=3, node_id=self.head)
        q.send_batch([b"p-before"] * 100)
        rs = ray.get(self.broker._actor.replica_sets.remote())["two"]
        pids = {
            rs["nodes"][rid]: self.follower_pid("two", rid)
            for rid in rs["nodes"]
            if rid != rs["leader"]
        }
        for node in list(self.workers()):
            self.remove(node, [pids[node]] if node in pids else [])
        refused: dict[str, int] = {}
        t0 = time.monotonic()
        while not refused:  # no follower alive: the send cannot be acknowledged
            try:
                q.send(b"p-refused", timeout=5)
                raise AssertionError("a send was acknowledged with no follower alive")
            except (NotEnoughReplicas, BrokerUnavailable) as exc:
                refused[type(exc).__name__] = refused.get(type(exc).__name__, 0) + 1
            if time.monotonic() - t0 > DEADLINE_SECONDS:
                raise TimeoutError("sends neither refused nor acknowledged")
        refused_after = time.monotonic() - t0
        self.cluster.add_node(num_cpus=1, object_store_memory=STORE)
        t1 = time.monotonic()
        send_once_in_sync(q, b"p-after", refused)  # refused until a new follower caught up
        resumed = time.monotonic() - t1
        consumed = consume_all(q)
        return {
            "refused": refused,
            "refused_after_seconds": refused_after,
            "resumed_seconds": resumed,
            "consumed": sorted({b.decode() for b in consumed}),
            "count": len(consumed),
            "replicas": q.stats()["replicas"],
        }

    def paused_leader(self) -> dict:
        self.top_up()
        q = self.create("paused")
        q.send_batch([b"p-before"] * 10)
        old = q._actor
        pid = ray.get(old.pid.remote())
        failovers = len(ray.get(self.broker._actor.failover_log.remote()))
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_for(
                "a failover",
                lambda: len(ray.get(self.broker._actor.failover_log.remote())) > failovers,
            )
        finally:
            # The failover may have killed the paused process already (the controller
            # ends a leader it fenced): then there is nothing to resume.
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        batch = MessageBatch.from_bodies([b"p-stale"], None, max_message_size=MIB)
        try:
            ray.get(old.send_batch.remote(batch, 5.0), timeout=30)
            stale = "acknowledged"
        except ray.exceptions.RayTaskError as exc:
            stale = type(exc.cause).__name__
        except ray.exceptions.RayError as exc:
            stale = type(exc).__name__
        # The new leader's followers may still be catching up (refused meanwhile).
        send_once_in_sync(q, b"p-after", {})
        old_rid = ray.get(self.broker._actor.failover_log.remote())[-1]["old_leader"]

        def rejoined():
            rs = ray.get(self.broker._actor.replica_sets.remote())["paused"]
            replicas = q.stats()["replicas"]
            back = old_rid in rs["nodes"] and len(rs["nodes"]) == 3
            return back and all(r["in_sync"] for r in replicas) and (rs, replicas)

        # Its node restarts its copy as a follower within REJOIN_SECONDS (a new worker
        # process, if the failover ended the paused one: slow on a loaded machine).
        rs, replicas = wait_for(
            "the old leader back as an in-sync follower", rejoined, REJOIN_SECONDS + 60
        )
        consumed = consume_all(q)
        return {
            "old_leader": old_rid,
            "replica_set": rs,
            "replicas": replicas,
            "stale_send": stale,
            "consumed": sorted({b.decode() for b in consumed}),
            "count": len(consumed),
        }

    def healed_leader(self) -> dict:
        """Issue 31: a byte of the leader's copy rots, then its process dies and Ray
        restarts it in place; recovery finds the damage, an in-sync follower holds the
        records: the leader steps down, the follower takes over, nothing is lost."""
        self.top_up()
        q = self.create("healed", replicas=2)
        sent = [f"h-{i}-".encode() + b"." * 200 for i in range(500)]
        q.send_batch(sent)  # acknowledged: on both copies
        rs = ray.get(self.broker._actor.replica_sets.remote())["healed"]
        old_rid = rs["leader"]
        directory = os.path.join(self.paging_dir, "healed", old_rid)
        segment = sorted(f for f in os.listdir(directory) if f.endswith(".seg"))[0]
        with open(os.path.join(directory, segment), "r+b") as f:
            f.seek(300)  # inside the first record's bodies
            byte = f.read(1)
            f.seek(300)
            f.write(bytes([byte[0] ^ 0x10]))
        failovers = len(ray.get(self.broker._actor.failover_log.remote()))
        old_pid = self.leader_pid(q)
        # The broker paused while Ray restarts the leader in place, so that the restart
        # (not the controller's failover of an unanswering leader) meets the damage.
        broker_pid = ray.get(self.broker._actor.pid.remote())
        os.kill(broker_pid, signal.SIGSTOP)
        try:
            os.kill(old_pid, signal.SIGKILL)
            wait_for("the restart in place", lambda: _pid_now(q) not in (None, old_pid))
            started = q._actor.ready.remote()  # asks the paused broker for its epoch
        finally:
            os.kill(broker_pid, signal.SIGCONT)
        start = _answer(ray.get, started, timeout=DEADLINE_SECONDS)
        with contextlib.suppress(TimeoutError):  # (none: the leader cut the follower)
            wait_for(
                "a failover to the follower",
                lambda: len(ray.get(self.broker._actor.failover_log.remote())) > failovers,
                timeout=30,
            )
        consumed = consume_all(q)
        new_rid = ray.get(self.broker._actor.replica_sets.remote())["healed"]["leader"]
        return {
            "start": start,
            "old_leader": old_rid,
            "new_leader": new_rid,
            "sent": len(sent),
            "lost": len(set(sent) - set(consumed)),
            "never_sent": len(set(consumed) - set(sent)),
        }

    def paused_broker(self) -> dict:
        self.top_up()
        q = self.create("controller")
        q.send_batch([b"c-before"] * 10)
        broker_pid = ray.get(self.broker._actor.pid.remote())
        os.kill(broker_pid, signal.SIGSTOP)
        try:
            os.kill(self.leader_pid(q), signal.SIGKILL)  # Ray restarts it in place
            t0 = time.monotonic()
            while True:  # until the restarted process takes calls (as clients retry)
                start = _answer(ray.get, q._actor.ready.remote(), timeout=DEADLINE_SECONDS)
                if start != "ActorUnavailableError" or time.monotonic() - t0 > DEADLINE_SECONDS:
                    break
                time.sleep(0.1)  # the pace of tries, not a wait for anything
            start_seconds = time.monotonic() - t0
        finally:
            os.kill(broker_pid, signal.SIGCONT)
        refused: dict[str, int] = {}
        send_once_in_sync(q, b"c-after", refused)
        consumed = consume_all(q)
        return {
            "start": start,
            "start_seconds": start_seconds,
            "refused": refused,
            "consumed": sorted(b.decode() for b in consumed),
        }


def _pid_now(q) -> int | None:
    """The pid of ``q``'s leader actor, None while Ray restarts it."""
    try:
        return ray.get(q._actor.pid.remote(), timeout=5)
    except ray.exceptions.RayError:
        return None


def _answer(call, *args, **kwargs) -> str:
    """What ``call(*args, **kwargs)`` ended in: "given", or the name of its error."""
    try:
        call(*args, **kwargs)
        return "given"
    except BrokerUnavailable:  # (Ray's error for it is one too)
        return "BrokerUnavailable"
    except Exception as exc:
        return type(exc).__name__


def stop(broker) -> dict:
    """Stop the queues with the broker kept running, then ask it to start things: a
    restarting leader's epoch, a queue's revival."""
    from raymq.actors.names import QUEUE_ACTOR_PREFIX, REPLICA_ACTOR_PREFIX

    sets = ray.get(broker._actor.replica_sets.remote())
    ray.get(broker._actor.stop_queues.remote())
    asked: dict[str, set[str]] = {"begin_epoch": set(), "get_queue": set()}
    for name, rs in sorted(sets.items()):
        epoch = broker._actor.begin_epoch.remote(name, rs["leader"])
        asked["begin_epoch"].add(_answer(ray.get, epoch))
        asked["get_queue"].add(_answer(broker.get_queue, name))

    def left() -> list[str]:
        return sorted(
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == "replication"
            and a["name"].startswith((QUEUE_ACTOR_PREFIX, REPLICA_ACTOR_PREFIX))
        )

    t0 = time.monotonic()
    while left() and time.monotonic() - t0 < DEADLINE_SECONDS:  # killed: names freed soon
        time.sleep(0.1)  # polling a condition, with a deadline
    return {"asked": {k: sorted(v) for k, v in asked.items()}, "left": left()}


def send_once_in_sync(q, body: bytes, refused: dict[str, int]) -> None:
    """Send ``body`` once enough replicas are in sync: a refusal (the typed error, counted
    in ``refused`` by name) is tried again, up to ``DEADLINE_SECONDS``."""
    t0 = time.monotonic()
    while True:
        try:
            q.send(body, timeout=5)
            return
        except (NotEnoughReplicas, BrokerUnavailable) as exc:
            refused[type(exc).__name__] = refused.get(type(exc).__name__, 0) + 1
            time.sleep(0.1)  # the pace of tries, not a wait for anything
        if time.monotonic() - t0 > DEADLINE_SECONDS:
            raise TimeoutError(f"sends to {q.name!r} did not resume")


def readme(s: Scenario) -> dict:
    """README.md's ``python replicas`` block, run as written (``raymq.connect`` gives
    this cluster's broker)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "README.md")) as f:
        text = f.read()
    start = text.index("```python replicas\n") + len("```python replicas\n")
    block = text[start : text.index("```\n", start)]
    connect = raymq.connect
    raymq.connect = lambda *a, **k: s.broker
    try:
        scope: dict = {}
        exec(compile(block, "README.md (python replicas)", "exec"), scope)
    finally:
        raymq.connect = connect
    orders = scope["orders"]
    from raymq.cli import main as raymq_command

    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):  # `raymq status` as a pipe gets it
        code = raymq_command(["--namespace", "replication", "status"])
    # The send was answered once 2 of the 3 copies had it: the third may still be
    # catching up when the block ends (CI saw it), so wait for it as the follower
    # scenario does.
    replicas = wait_for(
        "the third replica in sync",
        lambda: (
            (r := orders.stats()["replicas"]) and len(r) == 3 and all(x["in_sync"] for x in r) and r
        ),
    )
    return {
        "replicas": replicas,
        "leader_node": s.broker.queue_nodes()["orders"],
        "consumed": [b.decode() for b in consume_all(orders)],
        "status_code": code,
        "status": shown.getvalue(),
    }


SCENARIOS = {
    "readme": readme,
    "leader": Scenario.leader_loss,
    "lifetimes": Scenario.lifetimes,
    "follower": Scenario.follower_loss,
    "two": Scenario.two_of_three,
    "paused": Scenario.paused_leader,
    "healed": Scenario.healed_leader,
    "broker": Scenario.paused_broker,
}


def print_controller_log(temp_dir: str, lines: int = 40) -> None:
    """The replication controller's last ``lines`` log lines (the broker actor's
    warnings name the queue first), to stderr: what CI shows of a failed scenario."""
    logs = os.path.join(temp_dir, "session_latest", "logs")
    found: list[str] = []
    with contextlib.suppress(OSError):
        for f in sorted(os.listdir(logs)):
            if f.startswith("worker-") and f.endswith(".err"):
                with open(os.path.join(logs, f), errors="replace") as fh:
                    found += [x.rstrip()[:300] for x in fh if x.startswith("queue '")]
    print("the controller's log, last lines:", *found[-lines:], sep="\n  ", file=sys.stderr)


def main(paging_dir: str, temp_dir: str, names: list[str]) -> dict:
    os.environ["RAY_TMPDIR"] = temp_dir
    os.makedirs(os.path.join(temp_dir, "ray"), exist_ok=True)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "object_store_memory": STORE,
            "include_dashboard": False,
            "temp_dir": temp_dir,
        },
    )
    for _ in range(3):
        cluster.add_node(num_cpus=1, object_store_memory=STORE)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    out: dict = {}
    try:
        # No checkpoint but the one each open takes: recovery scans only past the
        # checkpointed size, and healed_leader's rot must be found by the restart's
        # recovery (a periodic checkpoint taken between its send and its kill, on a
        # slow run, would cover the rotted record: the scrub's to find, not recovery's).
        broker = raymq.connect(
            namespace="replication", paging_directory=paging_dir, checkpoint_interval=3600.0
        )
        s = Scenario(cluster, broker, paging_dir)
        for name in names:
            t = time.monotonic()
            try:
                out[name] = SCENARIOS[name](s)
            except BaseException:
                print_controller_log(temp_dir)
                raise
            out[name]["scenario_seconds"] = time.monotonic() - t
        out["failovers"] = ray.get(broker._actor.failover_log.remote())
        if "leader" in out:  # its old leader's rejoin gives up within REJOIN_SECONDS
            lost = out["leader"]["leader_before"]
            wait_for(
                "the lost leader's copy recorded",
                lambda: any(
                    (x["queue"], x["node_id"], x["verdict"]) == ("leader", lost, "node not alive")
                    for x in broker.leftovers()
                ),
                REJOIN_SECONDS + 60,
            )
        out["leftovers"] = broker.leftovers()
        out["stop"] = stop(broker)
        broker.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3:] or list(SCENARIOS))))
