"""The simulator's replicated mode (``python -m raymq.sim --mode replicated``): one
replicated queue (3 replicas, ``min_insync_replicas`` 2 or 3) on the four nodes of a
``SimCluster``, run by the real ``ReplicationController``, under a producer, a
consumer, crashes at any system call of any node, a paused leader that resumes after a
failover (its kill lost half the time), lost and reordered frames, a follower's disk
full or failing, a lost node, and the controller's monitor rounds.

The invariants (a broken one raises ``Violation`` with the step and what was seen):

* Nothing acknowledged lost: at every quiet point (faults healed, paused nodes resumed,
  crashed processes restarted, the controller's rounds run until a leader serves with
  a quorum in sync) a fresh consumer receives every message acknowledged to its
  producer and not acknowledged by a consumer.
* No offset served with two bodies, no body at two offsets, nothing served that was
  not sent; an offset acknowledged to a producer names that message for ever.
* Epochs only grow: the one the controller saves, and each copy's across its crashes
  (a follower that answered in an epoch still knows it after a crash).
* A fenced leader acknowledges nothing: a send that began once the controller had
  replaced its leader (chosen another replica, or another actor of it began a newer
  epoch) is refused.
* A follower that acknowledged a commit has it on disk: after a crash of its node its
  copy ends no earlier than the commits it answered (less what a leader cut back).
* Every call returns or raises within ``CALL_BOUND`` seconds, and the queue core
  raises only typed errors from ``raymq.errors``.

What a process observes after its node's crash point happened in an erased timeline:
a send it acknowledged then is "in doubt", never an invariant.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import tempfile
import traceback
from dataclasses import dataclass

import numpy as np

from raymq.batch import MessageBatch
from raymq.config import QueueConfig
from raymq.core.replication_controller import ReplicationController
from raymq.errors import RayMQError
from raymq.sim.cluster import NODES, QUEUE, SimCluster, SimLeader
from raymq.sim.disk import SimDisk
from raymq.sim.environment import simulated
from raymq.sim.model import CALL_BOUND, SimClock, Traced, Violation, offset_runs

#: Mixed into the seed: a replicated seed draws apart from the queue seed of that number.
REPLICATED_SALT = 0x5EED_2E91
#: Rounds of healing a quiet point may take before the queue must serve again.
HEALING_ROUNDS = 40
#: Loop turns after each step: catch-ups, kills and rejoins run on meanwhile.
SETTLE_TURNS = 20


@dataclass
class Sent:
    """A message the producer sent."""

    body: bytes
    #: "sending", "stored" (acknowledged to the producer), "doubt" (refused, or
    #: answered after its leader's crash point: it may or may not be stored).
    state: str = "sending"
    offset: int | None = None
    #: A consumer's ack of it: "yes" returned, "doubt" raised or answered after a
    #: crash point (it may hold), "" none.
    acked: str = ""


class ReplicatedSimulation(Traced):
    """One replicated run: ``ReplicatedSimulation(seed).run()`` returns a summary or
    raises ``Violation``."""

    def __init__(self, seed: int, steps: int = 300, root: str | None = None, verbose: bool = False):
        self.seed = seed
        self.steps = steps
        self.verbose = verbose
        self.rng = random.Random(seed ^ REPLICATED_SALT)
        self.quorum = self.rng.choice([2, 3])
        self.config = QueueConfig(
            QUEUE,
            page_size_bytes=self.rng.choice([16 * 1024, 64 * 1024]),
            page_max_cache_size=2,
            replicas=3,
            min_insync_replicas=self.quorum,
        )
        self._own_root = root is None
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        self.root = root or tempfile.mkdtemp(prefix=f"raymq-rsim-{seed}-", dir=shm)
        self.clock = SimClock()
        self.cluster = SimCluster(self.root, self.rng, self.clock, self.config, lambda: self.ctl)
        self.ctl = ReplicationController(
            {}, self.cluster, self.clock.monotonic, monitor_period=None
        )
        self.sent: list[Sent] = []
        self.by_body: dict[bytes, int] = {}
        #: Offset -> the index of the message acknowledged (or served) there, for ever.
        self.owner: dict[int, int] = {}
        #: Offsets the current consumer holds, and the incarnation it belongs to.
        self.held: set[int] = set()
        self.consumer: tuple[SimLeader, int, str] | None = None
        #: Sends of paused leaders, with the leader and its incarnation then.
        self.background: list[tuple[SimLeader, int, asyncio.Task]] = []
        self.step = 0
        self.cids = 0
        self.lost_node = False
        self.trace: list[str] = []
        self.counts = {
            "acknowledged": 0,
            "refused": 0,
            "in_doubt": 0,
            "served": 0,
            "consumer_acks": 0,
            "crashes": 0,
            "pauses": 0,
            "stale_sends_refused": 0,
            "quiet_points": 0,
            "monitor_errors": 0,
            "lost_nodes": 0,
        }

    # -- running ------------------------------------------------------------------------

    def run(self) -> dict:
        """Run every step and the final checks; the summary of what happened."""
        disks = list(self.cluster.disks.values())
        try:
            with (
                simulated(self.clock, self.verbose, replicated=True),
                SimDisk.installed_together(disks),
            ):
                asyncio.run(self._run())
        except Violation as exc:
            raise Violation(f"replicated seed {self.seed}, step {self.step}: {exc}") from None
        finally:
            if self._own_root:
                shutil.rmtree(self.root, ignore_errors=True)
        return {
            **self.counts,
            "messages": len(self.sent),
            "failovers": len(self.ctl.failovers),
            "epoch": self.cluster.saved_epoch,
            "injected_errors": sum(len(d.injected) for d in disks),
            "kills_lost": sum("kill" in n for n in self.cluster.notes),
        }

    async def _run(self) -> None:
        # Calls of a process that ended fail unheard (a frame to a follower of a crashed
        # leader): the loop's "never retrieved" report is noise here.
        asyncio.get_running_loop().set_exception_handler(lambda _loop, _context: None)
        await self._bounded(self._create(), "create")
        ops = [
            (self._op_send, 30),
            (self._op_fetch, 15),
            (self._op_ack, 10),
            (self._op_housekeeping, 4),
            (self._op_monitor, 8),
            (self._op_restart, 4),
            (self._op_crash, 3),
            (self._op_kill_process, 2),
            (self._op_pause, 2),
            (self._op_resume, 2),
            (self._op_stale_send, 2),
            (self._op_faults, 3),
            (self._op_heal, 2),
            (self._op_frames, 2),
            (self._op_lose_node, 1),
        ]
        funcs, weights = zip(*ops, strict=True)
        for step in range(self.steps):
            self.step = step
            self.clock.now += 0.01
            op = self.rng.choices(funcs, weights)[0]
            self._note(op.__name__[4:])
            await self._bounded(op(), op.__name__)
            await self._settle()
            await self._crashes()
            if step % 100 == 99:
                await self._quiet_point()
        await self._quiet_point()
        await self._close()

    async def _settle(self, turns: int = SETTLE_TURNS) -> None:
        for _ in range(turns):
            await asyncio.sleep(0)

    async def _create(self) -> None:
        for _attempt in range(5):
            try:
                await self.ctl.create(self.config, NODES[0])
                return
            except RayMQError as exc:
                self._note(f"create: {exc}")
                await self._monitor()
        raise Violation("the replicated queue is not created on healthy nodes")

    async def _crashes(self) -> None:
        """Nodes whose crash point came during the step: their processes end and their
        disks are put back as the crash left them."""
        for node in NODES:
            if self.cluster.crashed(node):
                self._note(f"  {node} crashed")
                for note in self.cluster.disks[node].image.notes:
                    self._note(f"    crash image: {note}")
                self.counts["crashes"] += 1
                if self.consumer is not None and self.consumer[0].node == node:
                    self.consumer, self.held = None, set()
                await self.cluster.crash_node(node)

    async def _monitor(self) -> None:
        """The leader's heartbeats, then one round of the controller's monitor (as a
        second of wall clock would bring them; its loop logs what a round raises)."""
        h = self.cluster.serving()
        if h is not None and h.core.replication.fenced is None:
            await h.core.replication.heartbeat_once()
        try:
            await self.ctl.monitor_once(QUEUE)
        except Violation:
            raise
        except Exception as exc:
            self._note(f"  monitor: {exc!r}")
            self.counts["monitor_errors"] += 1

    # -- producing and consuming --------------------------------------------------------

    def _new_messages(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            i = len(self.sent)
            body = f"{i}|".encode() + bytes([i % 251]) * self.rng.choice([10, 300, 3000])
            self.sent.append(Sent(body))
            self.by_body[body] = i
            out.append(i)
        return out

    async def _send_to(self, h: SimLeader, n: int) -> None:
        """Send ``n`` messages to leader ``h`` and judge the outcome."""
        core, incarnation = h.core, h.incarnation
        indices = self._new_messages(n)
        batch = MessageBatch.from_bodies(
            [self.sent[i].body for i in indices], None, max_message_size=1 << 20
        )
        # Replaced already: this actor must acknowledge nothing from now on. (An epoch
        # that moved on without a new leader fences nothing by itself: the followers
        # that missed the fence may still take this leader's commits, none lacks them.)
        replaced_then = self.cluster.replaced(h)
        try:
            first, count = await core.send_batch(batch)
        except RayMQError as exc:
            self._note(f"  send refused: {type(exc).__name__}")
            self._doubt(indices, "refused")
            return
        except Exception as exc:
            where = "".join(traceback.format_exception(exc)[-16:-6])
            raise Violation(f"a send raised {exc!r}, not a typed error:\n{where}") from None
        if not self.cluster.runs(h, incarnation):  # answered in an erased timeline
            self._doubt(indices, "in_doubt")
            return
        epoch = core.replication.epoch
        if replaced_then:
            raise Violation(
                f"leader {h.rid} of epoch {epoch} acknowledged a send that began after the"
                f" controller had replaced it (epoch {self.cluster.saved_epoch}): a fenced"
                " leader acknowledged"
            )
        if count != n:
            raise Violation(f"a send of {n} stored {count}")
        self._note(f"  stored {first}..{first + n - 1} by {h.rid}, epoch {epoch}, {rep_in_sync(h)}")
        for k, i in enumerate(indices):
            self._own(first + k, i, "acknowledged")
            self.sent[i].state, self.sent[i].offset = "stored", first + k
        self.counts["acknowledged"] += n

    def _doubt(self, indices: list[int], count: str) -> None:
        for i in indices:
            self.sent[i].state = "doubt"
        self.counts[count] += len(indices)

    def _own(self, offset: int, i: int, how: str) -> None:
        """Offset ``offset`` names message ``i`` (acknowledged or served there)."""
        other = self.owner.setdefault(offset, i)
        if other != i:
            raise Violation(
                f"offset {offset} {how} for message {i}, and before for message {other}"
            )
        known = self.sent[i].offset
        if known is not None and known != offset:
            raise Violation(f"message {i} {how} at offset {offset}, and before at {known}")
        self.sent[i].offset = offset

    def _check_served(self, rows) -> list[int]:
        offsets = rows.column("offset").to_pylist()
        for offset, body in zip(offsets, rows.column("body").to_pylist(), strict=True):
            i = self.by_body.get(body)
            if i is None:
                raise Violation(f"offset {offset} served a body never sent: {body[:40]!r}")
            self._own(offset, i, "served")
        self.counts["served"] += len(offsets)
        return offsets

    def _consumer_on(self, h: SimLeader) -> str:
        """The consumer of ``h``'s current incarnation (a new one after a change)."""
        if self.consumer is not None:
            held_by, incarnation, cid = self.consumer
            if held_by is h and incarnation == h.incarnation:
                return cid
        self.cids += 1
        cid = f"c{self.cids}"
        h.core.register_consumer(cid, 50, None)
        self.consumer, self.held = (h, h.incarnation, cid), set()
        return cid

    async def _op_send(self) -> None:
        h = self.cluster.serving()
        if h is not None:
            await self._send_to(h, self.rng.randint(1, 5))

    async def _op_fetch(self) -> None:
        h = self.cluster.serving()
        if h is None:
            return
        cid = self._consumer_on(h)
        try:
            rows = await h.core.fetch(cid, self.rng.randint(1, 20), 0.0, 50)
        except RayMQError as exc:
            self._note(f"  fetch: {type(exc).__name__}")
            return
        self.held.update(self._check_served(rows))

    async def _op_ack(self) -> None:
        h = self.cluster.serving()
        if h is None or not self.held or self.consumer is None or self.consumer[0] is not h:
            return
        picked = sorted(o for o in self.held if self.rng.random() < 0.7)
        if not picked:
            return
        incarnation = h.incarnation
        self.held.difference_update(picked)
        try:
            await h.core.ack(self.consumer[2], np.array(picked, dtype=np.int64))
        except RayMQError as exc:
            # Written by the leader, and maybe by followers: the ack may hold.
            self._note(f"  ack of {offset_runs(picked)} failed: {type(exc).__name__}")
            self._ack_in_doubt(picked)
            return
        if not self.cluster.runs(h, incarnation):  # answered in an erased timeline
            self._ack_in_doubt(picked)
            return
        for o in picked:
            self.sent[self.owner[o]].acked = "yes"
        self.counts["consumer_acks"] += len(picked)

    def _ack_in_doubt(self, offsets: list[int]) -> None:
        for o in offsets:
            m = self.sent[self.owner[o]]
            if m.acked != "yes":
                m.acked = "doubt"

    async def _op_housekeeping(self) -> None:
        h = self.cluster.serving()
        if h is not None:
            with contextlib.suppress(RayMQError):
                h.core.housekeeping()

    # -- the controller and the faults --------------------------------------------------

    async def _op_monitor(self) -> None:
        self.clock.now += 1.0  # the monitor's period
        await self._monitor()

    async def _op_restart(self) -> None:
        await self.cluster.restart()

    def _nodes_with_replicas(self) -> list[str]:
        c = self.cluster
        nodes = {f.node for f in c.followers.values() if not f.killed}
        if c.leader is not None:
            nodes.add(c.leader.node)
        return sorted(n for n in nodes if n in c.alive and not c.crashed(n))

    async def _op_crash(self) -> None:
        nodes = self._nodes_with_replicas()
        if nodes:
            node = self.rng.choice(nodes)
            self.cluster.disks[node].crash_after = self.rng.randint(0, 60)
            self._note(f"  {node} crashes after {self.cluster.disks[node].crash_after} calls")

    async def _op_kill_process(self) -> None:
        nodes = self._nodes_with_replicas()
        if nodes:
            node = self.rng.choice(nodes)
            disk = self.cluster.disks[node]
            disk.image = disk.crash_image()

    async def _op_pause(self) -> None:
        """Pause the leader's node, a send of its under way."""
        c = self.cluster
        h = c.serving()
        if h is None or c.paused:
            return
        task = asyncio.get_running_loop().create_task(self._send_to(h, 3))
        self.background.append((h, h.incarnation, task))
        h.calls.add(task)
        task.add_done_callback(h.calls.discard)
        await asyncio.sleep(0)
        c.pause(h.node)
        self.counts["pauses"] += 1
        self._note(f"  {h.node} paused (leader {h.rid}, epoch {h.epoch})")

    async def _op_resume(self) -> None:
        for node in sorted(self.cluster.paused):
            self.cluster.resume(node)
            self._note(f"  {node} resumed")

    async def _op_stale_send(self) -> None:
        """A client still holding a replaced leader's handle sends to it."""
        c = self.cluster
        for h in c.stale:
            if h.core is not None and c.runs(h, h.incarnation) and h.node not in c.paused:
                refused = self.counts["refused"]
                await self._send_to(h, 1)
                self.counts["stale_sends_refused"] += self.counts["refused"] - refused
                return

    async def _op_faults(self) -> None:
        c = self.cluster
        leader_node = c.leader.node if c.leader is not None else None
        nodes = [n for n in self._nodes_with_replicas() if n != leader_node]
        if nodes:
            disk = c.disks[self.rng.choice(nodes)]
            if self.rng.random() < 0.5:
                disk.full = True
            else:
                disk.fail_rate = self.rng.choice([0.02, 0.1, 0.3])

    async def _op_heal(self) -> None:
        for disk in self.cluster.disks.values():
            disk.fail_rate, disk.full = 0.0, False

    async def _op_frames(self) -> None:
        self.cluster.frame_loss = self.rng.choice([0.0, 0.0, 0.05, 0.2])

    async def _op_lose_node(self) -> None:
        c = self.cluster
        if self.lost_node or len(c.alive) <= self.config.replicas:
            return
        # Not the last node holding an in-sync copy: without one, the queue stays
        # unavailable by design (no unclean election), and the run would end there.
        rs = c.saved.replicas
        keeps = [
            n for n in sorted(c.alive) if any(rs.nodes.get(r) not in (n, None) for r in rs.in_sync)
        ]
        if not keeps:
            return
        node = self.rng.choice(keeps)
        self.lost_node = True
        self.counts["lost_nodes"] += 1
        self._note(f"  {node} lost")
        await c.lose_node(node)

    # -- quiet points -------------------------------------------------------------------

    async def _quiet_point(self) -> None:
        """Heal everything, let the controller bring the queue back, and drain it."""
        self.counts["quiet_points"] += 1
        c = self.cluster
        self._note("quiet point")
        for node in sorted(c.paused):
            c.resume(node)
        c.frame_loss = 0.0
        for disk in c.disks.values():
            disk.fail_rate, disk.full, disk.crash_after = 0.0, False, None
        await self._crashes()
        for h, incarnation, task in self.background:
            if not c.runs(h, incarnation):  # its process is gone: so is the call
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._bounded(task, "a send of a paused leader")
        self.background.clear()
        for h in c.stale:  # their nodes hear the kill at last
            h.killed = True
            await c.stop_leader_process(h)
        c.stale.clear()
        h = await self._healed()
        await self._drain(h)

    async def _healed(self) -> SimLeader:
        c = self.cluster
        for _round in range(HEALING_ROUNDS):
            self.clock.now += 10.0  # lost-node windows and rejoin waits pass
            await c.restart()
            await self._monitor()
            await self._settle(100)
            await self._crashes()
            h = c.serving()
            if h is None:
                continue
            rep = h.core.replication
            leads = rep.fenced is None and rep.epoch == c.saved_epoch
            if leads and len(rep.in_sync) >= self.quorum:
                return h
        raise Violation(
            f"no leader serves with {self.quorum} replicas in sync after {HEALING_ROUNDS}"
            f" rounds of healing (saved epoch {c.saved_epoch}, leader"
            f" {c.leader.rid if c.leader else None}): {c.saved}"
        )

    async def _drain(self, h: SimLeader) -> None:
        """A fresh consumer gets every acknowledged message not acknowledged by one."""
        core = h.core
        if self.consumer is not None and self.consumer[0] is h:
            core.close_consumer(self.consumer[2])
        self.consumer, self.held = None, set()
        self.cids += 1
        cid = f"drain{self.cids}"
        core.register_consumer(cid, 1000, None)
        got: set[int] = set()
        for _round in range(len(self.sent) + 2):
            rows = await self._bounded(core.fetch(cid, 1000, 0.0, 1000), "drain fetch")
            if not rows.num_rows:
                break
            offsets = self._check_served(rows)
            got.update(offsets)
            try:
                await self._bounded(core.ack(cid, np.array(offsets, dtype=np.int64)), "ack")
            except RayMQError as exc:
                raise Violation(f"an ack failed after healing: {exc!r}") from None
            for o in offsets:
                self.sent[self.owner[o]].acked = "yes"
        else:
            raise Violation("a drain does not end: the same messages come back")
        core.close_consumer(cid)
        missing = [
            m.offset
            for m in self.sent
            if m.state == "stored" and not m.acked and m.offset not in got
        ]
        if missing:
            raise Violation(
                f"{len(missing)} acknowledged messages lost after healing (epoch"
                f" {self.cluster.saved_epoch}, leader {h.rid}): {offset_runs(sorted(missing))}"
            )

    async def _close(self) -> None:
        c = self.cluster
        self.ctl.stop()
        await self.ctl.wait_stopped(CALL_BOUND)
        for h in [c.leader, *c.stale]:
            if h is not None:
                await c.stop_leader_process(h)
        for f in c.followers.values():
            if f.follower is not None:
                f.follower.files.close()


def rep_in_sync(h: SimLeader) -> str:
    """The replicas ``h`` holds in sync, for the trace."""
    return "in sync: " + ",".join(h.core.replication.in_sync) if h.core else "down"


def run_replicated_seed(seed: int, steps: int = 300, verbose: bool = False) -> dict:
    """Run one replicated seed in a temporary directory; raises ``Violation``."""
    return ReplicatedSimulation(seed, steps, verbose=verbose).run()


__all__ = ["REPLICATED_SALT", "ReplicatedSimulation", "Sent", "run_replicated_seed"]
