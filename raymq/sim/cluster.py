"""SimCluster: the simulated cluster of the simulator's replicated mode, its
``ClusterOps`` (``raymq.core.cluster_ops``) for the real ``ReplicationController``.

Four nodes, each with its own ``SimDisk``. A leader is a real ``QueueCore`` with a
``ReplicationLeader``, started as ``QueueActor`` starts one (the controller's epoch,
``ReplicationLeader.begin``); a follower is a real ``ReplicationFollower`` over its
``ReplicaFiles``. A handle stands for an actor (what Ray names); each start of its
process is an *incarnation*: Ray restarts a crashed process in place, on the same
handle, until the controller kills the actor.

What each node can suffer, and what the others see of it:

* **crashed**: its disk's crash point was reached (``SimDisk.image``). Its timeline is
  erased from there: its processes reach no one (their frames and controller calls
  are refused) and answer no one, until the simulator restores the image and restarts
  them at the end of the step.
* **paused** (only the leader's node): its frames and calls wait at a gate until it
  resumes; the controller's pings and fences get no answer, and a kill sent to it is
  lost half the time (a stale leader then resumes, and must be fenced).
* **lost**: gone for good, with its processes.

Frames between a leader and its followers overtake each other (a random number of
loop turns each) and are lost, before or after the follower acts, at ``frame_loss``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import random
import shutil
from dataclasses import dataclass, field

from raymq.config import BrokerConfig, QueueConfig
from raymq.core.cluster_ops import FollowerRef, Unreachable
from raymq.core.queue import QueueCore
from raymq.core.registry import QueueEntry
from raymq.core.replication import ReplicationFollower, ReplicationLeader
from raymq.errors import StorageError
from raymq.sim.disk import SimDisk
from raymq.sim.environment import detach_loops
from raymq.sim.model import SimClock, Violation
from raymq.storage.checkpoint import read_checkpoint
from raymq.storage.mirror import ReplicaFiles

#: The simulated nodes: one more than the replicas, so a lost one can be replaced.
NODES = ("n0", "n1", "n2", "n3")
#: The replicated queue's name.
QUEUE = "rq"
#: Loop turns a ping waits for a starting leader (its timeout, in the simulation).
PING_TURNS = 50


def _copy_end(files: ReplicaFiles, records_end: int) -> int:
    """Where a follower's copy ends, as its recovery would find it when promoted: past
    its records (``records_end``) or its checkpoint's next offset, whichever is later
    (a segment whose messages were all acknowledged is deleted: the checkpoint keeps
    its offsets given)."""
    ckpt, _damage = read_checkpoint(files.directory)
    return max(records_end, int(ckpt["next_offset"]) if ckpt else 0)


class Gone(ConnectionError):
    """A call that cannot reach its actor (or leave its caller): as Ray's
    ``RayActorError``, or a frame of a replica channel that never arrived."""


@dataclass(eq=False)
class SimFollower:
    """A follower actor: its copy's directory, and the process now serving it."""

    rid: str
    node: str
    directory: str
    epoch: int
    follower: ReplicationFollower | None = None
    #: Ended by the controller (``ClusterOps.kill``): never restarted.
    killed: bool = False
    #: The end of the commits it acknowledged (less what a leader cut back since): its
    #: copy must hold them after any crash.
    acked_end: int = 0
    #: The newest epoch of a call it answered: its fence must hold it after any crash.
    answered_epoch: int = 0


@dataclass(eq=False)
class SimLeader:
    """A leader actor, and its current incarnation's core."""

    rid: str
    node: str
    directory: str
    epoch: int
    followers: tuple = ()
    core: QueueCore | None = None
    #: Its process's start: done once it leads (or failed, with the error).
    started: asyncio.Task | None = None
    incarnation: int = 0
    killed: bool = False
    #: Its process died (a crash) and waits for the simulator to restart it.
    down: bool = False
    #: Client calls under way in its process (a paused leader's send): they end with it.
    calls: set = field(default_factory=set)
    #: It began an epoch (``epoch`` is then the one the controller gave it).
    begun: bool = False


class SimLink:
    """A leader incarnation's way to one follower (``FollowerLink``): frames that
    overtake each other, get lost, and never leave a crashed or stale process."""

    def __init__(self, cluster: SimCluster, leader: SimLeader, rid: str, node: str, handle):
        self.cluster, self.leader, self.handle = cluster, leader, handle
        self.replica_id, self.node_id = rid, node
        self.incarnation = leader.incarnation

    async def _call(self, method: str, *args):
        c = self.cluster
        await c.gate(self.leader.node)
        for _ in range(c.rng.randrange(3)):
            await asyncio.sleep(0)  # frames overtake each other
        if not c.runs(self.leader, self.incarnation):
            raise Gone(f"leader {self.leader.rid}'s process is gone")
        f: SimFollower = self.handle
        if not c.answers(f):
            raise Gone(f"replica {f.rid} does not answer")
        if c.rng.random() < c.frame_loss:
            raise Gone(f"a frame to {f.rid} was lost")
        if method == "truncate_to":  # (it may take effect even if the answer is lost)
            f.acked_end = min(f.acked_end, args[1])
        result = getattr(f.follower, method)(*args)
        if c.disks[f.node].image is not None:  # its crash point came during the call
            raise Gone(f"replica {f.rid} crashed")
        c.answered(f, method, args)
        if c.rng.random() < c.frame_loss:
            raise Gone(f"the answer of {f.rid} was lost")
        return result

    def apply(self, epoch, write):
        return self._call("apply", epoch, write)

    def heartbeat(self, epoch):
        return self._call("heartbeat", epoch)

    def state(self, epoch):
        return self._call("state", epoch)

    def truncate_to(self, epoch, offset):
        return self._call("truncate_to", epoch, offset)

    def write_chunk(self, epoch, name, pos, data, sync):
        return self._call("write_chunk", epoch, name, pos, data, sync)

    def install(self, epoch, segments, small, epochs, end, seq):
        return self._call("install", epoch, segments, small, epochs, end, seq)


class SimCluster:
    """The nodes, actors and saved state of one replicated run (``ClusterOps``)."""

    def __init__(
        self,
        root: str,
        rng: random.Random,
        clock: SimClock,
        config: QueueConfig,
        controller_of,
    ):
        """``controller_of()``: the ``ReplicationController`` (made after this)."""
        self.root = root
        self.rng = rng
        self.clock = clock
        self.config = config
        self._controller_of = controller_of
        self.disks = {n: SimDisk(os.path.join(root, n), rng) for n in NODES}
        for node in NODES:
            os.makedirs(os.path.join(root, node), exist_ok=True)
        self.alive: set[str] = set(NODES)
        self.paused: set[str] = set()
        self._gates: dict[str, asyncio.Event] = {}
        self.frame_loss = 0.0
        self.leader: SimLeader | None = None
        #: Leaders replaced whose kill was lost: they run on, fenced or to be.
        self.stale: list[SimLeader] = []
        self.followers: dict[str, SimFollower] = {}
        self.saved_epoch = 0
        self.saved: QueueEntry | None = None
        self.notes: list[str] = []
        self._stopping: set[asyncio.Task] = set()  # kills under way (kept from the GC)

    # -- nodes and processes ---------------------------------------------------------

    def directory(self, node: str, rid: str) -> str:
        """Replica ``rid``'s copy on ``node``."""
        return os.path.join(self.root, node, f"{QUEUE}-{rid}")

    def crashed(self, node: str) -> bool:
        """Its crash point came: its processes are dead from there."""
        return self.disks[node].image is not None

    def reachable(self, node: str) -> bool:
        """Calls to ``node`` are answered now."""
        return node in self.alive and node not in self.paused and not self.crashed(node)

    async def gate(self, node: str) -> None:
        """Wait while ``node`` is paused (its process is stopped)."""
        while node in self.paused:
            await self._gates.setdefault(node, asyncio.Event()).wait()

    def pause(self, node: str) -> None:
        """Stop ``node``'s processes (SIGSTOP; the controller sees silence)."""
        self.paused.add(node)
        self._gates[node] = asyncio.Event()

    def resume(self, node: str) -> None:
        """Let ``node``'s processes run on."""
        self.paused.discard(node)
        gate = self._gates.pop(node, None)
        if gate is not None:
            gate.set()

    def runs(self, leader: SimLeader, incarnation: int) -> bool:
        """Incarnation ``incarnation`` of ``leader`` still runs and may reach others."""
        return (
            not leader.killed
            and not leader.down
            and leader.incarnation == incarnation
            and leader.node in self.alive
            and not self.crashed(leader.node)
        )

    def answers(self, f: SimFollower) -> bool:
        """Follower ``f``'s process runs, with its files open, and can be reached."""
        return not f.killed and f.follower is not None and self.reachable(f.node)

    def answered(self, f: SimFollower, method: str, args: tuple) -> None:
        """Bookkeeping of what a follower's answer promises (checked after a crash)."""
        epoch = args[0]
        f.answered_epoch = max(f.answered_epoch, epoch)
        if method == "apply" and args[1].records:
            f.acked_end = max(f.acked_end, args[1].end_offset)
        elif method == "install":
            # Its copy's end (the leader's next offset may lie past burned offsets).
            f.acked_end = _copy_end(f.follower.files, f.follower.files._scan_end())

    def try_open(self, f: SimFollower) -> None:
        """``open_follower``, if its node answers; a failing disk leaves it closed (the
        actor's start failed: Ray tries again later)."""
        if f.killed or not self.reachable(f.node):
            return
        try:
            self.open_follower(f)
        except Violation:
            raise
        except Exception:
            pass

    def open_follower(self, f: SimFollower) -> None:
        """Start follower ``f``'s process (its files); checks that its copy kept what
        it promised. ``OSError`` or ``StorageError`` if its disk fails."""
        if f.follower is not None:
            return
        files = ReplicaFiles(f.directory, QUEUE)
        end = _copy_end(files, files.end_offset)
        if end < f.acked_end:
            raise Violation(
                f"replica {f.rid} acknowledged commits up to offset {f.acked_end}; after"
                f" a crash its copy ends at {end} (it holds {sorted(os.listdir(f.directory))})"
            )
        # (Ray restarts it with the epoch it was created with: that one counts too.)
        follower = ReplicationFollower(files, f.epoch, self.clock.monotonic)
        if follower.epoch < f.answered_epoch:
            raise Violation(
                f"replica {f.rid} answered in epoch {f.answered_epoch}; after a crash it"
                f" knows only epoch {follower.epoch}"
            )
        f.follower = follower

    async def stop_leader_process(self, leader: SimLeader) -> None:
        """End ``leader``'s current incarnation (its core's tasks; its files are left
        as they are: a crash, or a kill)."""
        core, leader.core = leader.core, None
        # Everything that ran in its process ends with it (a send still cutting back a
        # commit would write into a copy another process now holds).
        running = [t for t in (leader.started, *leader.calls) if t is not None and not t.done()]
        leader.calls.clear()
        for task in running:
            task.cancel()
        for task in running:
            with contextlib.suppress(BaseException):
                await task
        if core is not None:
            await core._tasks.cancel_all()
            if core.replication is not None:
                core.replication.close()

    async def crash_node(self, node: str) -> None:
        """The node's crash point came: end its processes, put its disk back as the
        crash left it; Ray restarts its actors (``restart``)."""
        leaders = [h for h in (self.leader, *self.stale) if h is not None and h.node == node]
        for h in leaders:
            if not h.down and not h.killed:
                await self.stop_leader_process(h)
                h.down = True
        for f in self.followers.values():
            if f.node == node and f.follower is not None:
                f.follower = None
        disk = self.disks[node]
        disk.fail_rate, disk.full = 0.0, False
        disk.restore(disk.image)

    async def lose_node(self, node: str) -> None:
        """``node`` is gone for good (its processes with it)."""
        self.alive.discard(node)
        self.resume(node)
        for h in (self.leader, *self.stale):
            if h is not None and h.node == node:
                await self.stop_leader_process(h)
        for f in self.followers.values():
            if f.node == node and f.follower is not None:
                f.follower.files.close()
                f.follower = None

    async def restart(self) -> None:
        """Ray restarts the crashed processes of actors not killed, on alive nodes."""
        h = self.leader  # (a stale leader is dead to Ray: its kill reached the GCS)
        if h is not None and h.down and not h.killed and self.reachable(h.node):
            h.down = False
            self._start_incarnation(h)
        for f in self.followers.values():
            self.try_open(f)

    # -- a leader's process (QueueActor's start) ----------------------------------------

    def _start_incarnation(self, h: SimLeader) -> None:
        h.incarnation += 1
        h.core = None
        h.started = asyncio.get_running_loop().create_task(self._run_start(h, h.incarnation))

    def _retry_start(self, h: SimLeader) -> None:
        """A call to a leader whose start failed after its core opened starts it again,
        as ``QueueActor._ensure_started`` does at every call."""
        t = h.started
        failed = t is not None and t.done() and not t.cancelled() and t.exception() is not None
        if failed and h.core is not None and self.runs(h, h.incarnation):
            h.started = asyncio.get_running_loop().create_task(self._run_start(h, h.incarnation))

    async def _run_start(self, h: SimLeader, incarnation: int) -> None:
        if h.core is None:
            try:
                h.core = self._open_core(h, incarnation)
            except Exception:  # the actor's constructor failed: Ray starts it again
                h.down = True
                raise
        core, controller = h.core, self._controller_of()
        await self._leave(h, incarnation)
        epoch, followers = controller.begin_epoch(QUEUE, h.rid)
        h.epoch, h.followers, h.begun = epoch, followers, True
        in_sync = controller.in_sync_replicas(QUEUE)
        links = self.links(h, followers)
        leading = await core.replication.begin(epoch, links, in_sync, core.recovery.damaged > 0)
        core.start()
        if leading:
            core.replication.set_followers(links)

    def _open_core(self, h: SimLeader, incarnation: int) -> QueueCore:
        """``QueueActor``'s constructor: the leader's core over its copy. Its directory
        lock (``raymq.storage.lock``, a per-process lock: one process here) is held by
        a stale leader's process still running on that copy: ``StorageError``, as the
        real lock gives after its wait."""
        for other in (self.leader, *self.stale):
            holds = other is not None and other is not h and other.core is not None
            if holds and other.directory == h.directory and other.node in self.alive:
                raise StorageError(
                    errno.EAGAIN, f"queue {QUEUE!r}: LOCK held by another process", h.directory
                )
        controller = self._controller_of()

        async def report(epoch: int, in_sync: list[str]) -> bool:
            await self._leave(h, incarnation)
            return controller.update_in_sync(QUEUE, epoch, in_sync)

        async def next_epoch() -> int:
            await self._leave(h, incarnation)
            return controller.begin_epoch(QUEUE, h.rid)[0]

        rep = ReplicationLeader(
            QUEUE,
            h.directory,
            replica_id=h.rid,
            node_id=h.node,
            epoch=h.epoch,
            quorum=self.config.insync_quorum,
            epochs=[],
            report_in_sync=report,
            new_epoch=next_epoch,
            clock=self.clock.monotonic,
        )
        broker = BrokerConfig(paging_directory=self.root, checkpoint_interval=0.05)
        core = QueueCore(self.config, broker, directory=h.directory, replication=rep)
        detach_loops(core)
        return core

    async def _leave(self, h: SimLeader, incarnation: int) -> None:
        """A call leaving a leader's process for the controller: held while its node is
        paused, refused once the process is gone."""
        await self.gate(h.node)
        if not self.runs(h, incarnation):
            raise Gone(f"leader {h.rid}'s process is gone")

    def replaced(self, h: SimLeader) -> bool:
        """The controller chose another replica to lead, or another actor of this one
        began a newer epoch: ``h`` may acknowledge nothing from now on. (A fresh actor
        that has not begun replaces nothing yet: ``h``'s copy still leads.)"""
        if self.saved.replicas.leader != h.rid:
            return True
        others = (o for o in (self.leader, *self.stale) if o is not None and o is not h)
        return any(o.begun and o.epoch > h.epoch for o in others)

    def links(self, h: SimLeader, followers: tuple[FollowerRef, ...]) -> list[SimLink]:
        """Links from ``h``'s current incarnation to ``followers``."""
        return [SimLink(self, h, rid, node, handle) for rid, node, handle in followers]

    def serving(self) -> SimLeader | None:
        """The leader that may take calls now: started, running and reachable."""
        h = self.leader
        if h is None or h.core is None or h.started is None or not h.started.done():
            return None
        if h.started.cancelled() or h.started.exception() is not None:
            return None
        if not self.runs(h, h.incarnation) or not self.reachable(h.node):
            return None
        return h

    # -- ClusterOps ------------------------------------------------------------------

    def alive_nodes(self) -> list[str]:
        """See ``ClusterOps``."""
        return sorted(self.alive)

    def save(self, entry: QueueEntry) -> None:
        """See ``ClusterOps``; epochs only grow."""
        epoch = entry.replicas.epoch
        if epoch < self.saved_epoch:
            raise Violation(f"the saved epoch went back from {self.saved_epoch} to {epoch}")
        self.saved_epoch = epoch
        self.saved = entry

    def find_leader(self, name: str) -> SimLeader | None:
        """See ``ClusterOps``."""
        h = self.leader
        return h if h is not None and not h.killed and h.node in self.alive else None

    def actor_id(self, handle) -> str:
        """See ``ClusterOps``."""
        return f"{handle.rid}@{id(handle):x}"

    def find_follower(self, name: str, rid: str) -> SimFollower | None:
        """See ``ClusterOps``."""
        f = self.followers.get(rid)
        return f if f is not None and not f.killed and f.node in self.alive else None

    def start_follower(self, name: str, rid: str, node: str, epoch: int) -> SimFollower:
        """See ``ClusterOps``."""
        f = self.find_follower(name, rid)
        if f is None:
            f = self.followers[rid] = SimFollower(rid, node, self.directory(node, rid), epoch)
            self.try_open(f)
        return f

    def wake_follower(self, handle: SimFollower) -> None:
        """See ``ClusterOps``."""
        self.try_open(handle)

    async def follower_ready(self, handle: SimFollower, timeout: float) -> None:
        """See ``ClusterOps``."""
        if handle.killed or not self.reachable(handle.node):
            raise Unreachable(f"replica {handle.rid} does not start")
        try:
            self.open_follower(handle)
        except Violation:
            raise
        except Exception as exc:
            raise Unreachable(f"replica {handle.rid} does not start: {exc!r}") from None

    async def start_leader(self, entry: QueueEntry, followers: tuple, fresh: bool) -> SimLeader:
        """See ``ClusterOps``."""
        h = self.leader
        if h is not None and not fresh and not h.killed:
            return h
        rs = entry.replicas
        node = rs.leader_node
        h = SimLeader(rs.leader, node, self.directory(node, rs.leader), rs.epoch, followers)
        self.leader = h
        if self.reachable(h.node):
            self._start_incarnation(h)
        else:
            h.down = True
        return h

    async def _answer_within(self, h: SimLeader) -> None:
        """A ping waits a while for a leader that is starting (its first call runs
        the start): some loop turns stand for ``REPLICA_PING_TIMEOUT_SECONDS``."""
        for _ in range(PING_TURNS):
            if h.started is None or h.started.done():
                return
            await asyncio.sleep(0)

    async def leader_ready(self, handle: SimLeader, timeout: float | None) -> None:
        """See ``ClusterOps``: without a timeout, the start's own error passes through."""
        if handle.started is None or not self.reachable(handle.node):
            raise Unreachable(f"leader {handle.rid} does not answer")
        self._retry_start(handle)
        if timeout is None:
            await handle.started
        elif not handle.started.done() or handle.started.exception() is not None:
            raise Unreachable(f"leader {handle.rid} does not answer")

    async def wait_in_sync(self, leader: SimLeader, replicas: int, timeout: float) -> list[str]:
        """See ``ClusterOps`` (the simulator's loop turns stand for the timeout)."""
        for _ in range(200):
            core = leader.core
            if core is None:
                return []
            if len(core.replication.in_sync) >= replicas:
                break
            await asyncio.sleep(0)
        return list(leader.core.replication.in_sync) if leader.core else []

    async def set_followers(self, leader: SimLeader, epoch: int, followers: tuple) -> None:
        """See ``ClusterOps``."""
        if not self.runs(leader, leader.incarnation) or not self.reachable(leader.node):
            raise Unreachable(f"leader {leader.rid} does not answer")
        await leader.started
        rep = leader.core.replication
        if epoch == rep.epoch:
            leader.followers = followers
            rep.set_followers(self.links(leader, followers))

    async def ping(self, handle) -> int | None:
        """See ``ClusterOps``."""
        if isinstance(handle, SimFollower):
            return handle.follower.epoch if self.answers(handle) else None
        self._retry_start(handle)
        await self._answer_within(handle)
        if self.serving() is not handle:
            return None
        rep = handle.core.replication
        return -1 if rep.fenced is not None else rep.epoch

    async def fence(self, handle: SimFollower, epoch: int) -> int:
        """See ``ClusterOps``."""
        if not self.answers(handle):
            raise Unreachable(f"replica {handle.rid} does not answer")
        state = handle.follower.fence(epoch)
        if self.crashed(handle.node):
            raise Unreachable(f"replica {handle.rid} crashed")
        self.answered(handle, "fence", (epoch,))
        return state.end_offset

    async def release(self, handle: SimFollower) -> None:
        """See ``ClusterOps``."""
        if not self.answers(handle):
            raise Unreachable(f"replica {handle.rid} does not answer")
        handle.follower.retire()
        handle.follower.files.close()
        handle.follower = None

    async def shutdown_replica(self, handle: SimFollower, delete_files: bool) -> None:
        """See ``ClusterOps``."""
        await self.release(handle)
        if delete_files:
            shutil.rmtree(handle.directory, ignore_errors=True)
            handle.acked_end = handle.answered_epoch = 0

    def kill(self, handle) -> None:
        """See ``ClusterOps``: a kill sent to a paused node is lost half the time (its
        process resumes later, stale)."""
        if isinstance(handle, SimFollower):
            handle.killed = True
            if handle.follower is not None:
                handle.follower.files.close()
                handle.follower = None
            return
        if handle.node in self.paused and self.rng.random() < 0.5:
            self.notes.append(f"the kill of leader {handle.rid} was lost")
            if handle not in self.stale:
                self.stale.append(handle)
            return
        handle.killed = True
        if handle.core is not None:
            task = asyncio.get_running_loop().create_task(self.stop_leader_process(handle))
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)


__all__ = ["NODES", "QUEUE", "Gone", "SimCluster", "SimFollower", "SimLeader", "SimLink"]
