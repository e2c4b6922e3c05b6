"""The replication controller's sequences, without Ray: create, start a leader, fail
over, rejoin, trim excess, replace a follower, restore the count, stop the followers.

``ReplicaSet`` (``raymq.core.controller``) decides (where replicas go, whom a failover
promotes); this class applies its decisions to the cluster through ``ClusterOps``
(``raymq.core.cluster_ops``), the one interface of cluster operations. The broker actor
passes ``RayClusterOps`` (``raymq.actors.ray_cluster_ops``), which holds every Ray call,
as Ray Serve's controller reaches its replicas only through ``ActorReplicaWrapper``;
tests pass a fake cluster whose nodes die, pause and fail on cue
(``tests/test_replication_controller.py``).

A replicated queue's ``ReplicaSet`` is saved (``ClusterOps.save``) before any actor
hears of a change: an epoch, once given, is never given again, also across a broker
restart.

Interleaving: every sequence that changes a set runs under that queue's lock
(``lock_of``): a check and its failover, the end of a rejoin, a trim, a replacement, a
restore. ``begin_epoch`` and ``update_in_sync`` take no lock and never await (a leader
starting under a failover asks for its epoch while the failover holds the lock).

Retries: any step may fail (an actor that does not answer, a save that fails), and the
monitor's next round completes the sequence. A failover that failed after its promotion
is resumed, not begun again (``_handing_over``: begun again, it would find no follower
in sync and wait for ever); a changed set not yet saved or handed to its leader is
published again, and a replica it retired ended again (``_unpublished``: else the
leader would never learn of a new follower). The others start over from what the set says.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from raymq.config import QueueConfig
from raymq.core.cluster_ops import (
    REPLICA_PING_TIMEOUT_SECONDS,
    ClusterOps,
    FollowerRef,
    Handle,
    Unreachable,
)
from raymq.core.controller import NoNodes, ReplicaSet
from raymq.core.leader_starts import LeaderStarts
from raymq.core.leftovers import Leftover, Leftovers, verdict
from raymq.core.registry import QueueEntry
from raymq.errors import BrokerUnavailable, NotLeader

#: How often the controller checks the leaders and followers of replicated queues
#: (seconds); followers and clients report a silent leader sooner.
MONITOR_PERIOD_SECONDS = 1.0
#: How long a new replicated queue waits for its followers to be in sync (seconds).
IN_SYNC_TIMEOUT_SECONDS = 60.0
#: A node where a replica was lost gets no new replica for this long (seconds), unless
#: no other node is left.
LOST_NODE_SECONDS = 120.0
#: How long a replaced leader's node has to start its copy again as a follower
#: (seconds); a lost node never does. Generous: the replacement already serves, so
#: waiting costs nothing, while a node busy enough to have paused its leader may take
#: over 10 s to start a worker process (a paused-leader scenario timed out so at 10 s,
#: and on a loaded 2-core CI machine at 30 s).
REJOIN_SECONDS = 120.0
#: How long a follower on a node Ray counts alive may leave the monitor's pings
#: unanswered before it is replaced (seconds). One catching up or just started on a
#: loaded machine can miss a few: replaced after two rounds (2 s), a rejoined leader's
#: copy on a loaded 2-core machine was ended while it caught up, and its node, taken
#: for lost, could hold no replica for LOST_NODE_SECONDS. One whose actor or node is
#: gone is replaced at its second missed round.
FOLLOWER_SILENCE_SECONDS = 20.0

# The broker's logger: these sequences were the broker actor's, and operators grep it.
log = logging.getLogger("raymq.broker")


@dataclass
class _HandOver:
    """A failover past its promotion whose new leader has not started yet: if a step
    after the promotion fails, the next check resumes here (a check would otherwise
    find no follower in sync to promote and wait for ever)."""

    old_leader: str
    old_epoch: int
    #: The old leader's node.
    lost: str
    #: When the failover began (``clock`` seconds).
    began: float
    #: The lost replica's replacement was chosen (done once, also when resumed).
    replaced: bool = False
    #: The followers in sync before the promotion, but the promoted one: they hold
    #: every acknowledged send until the new leader begins its epoch.
    in_sync: tuple[str, ...] = ()
    #: The new leader began its epoch (``begin_epoch``; it may answer sends since).
    begun: bool = False


class ReplicationController:
    """The sequences of the replicated queues in ``queues`` (the broker's registry,
    shared: entries of unreplicated queues count toward placement)."""

    def __init__(
        self,
        queues: dict[str, QueueEntry],
        ops: ClusterOps,
        clock: Callable[[], float] = time.monotonic,
        monitor_period: float | None = MONITOR_PERIOD_SECONDS,
        leftovers: Leftovers | None = None,
    ):
        """``leftovers``: where the copies given up are recorded (default: in memory)."""
        self.queues = queues
        self.ops = ops
        self.clock = clock
        #: Seconds between two ``monitor_once`` rounds (None: no monitor task; tests
        #: call ``monitor_once`` themselves).
        self.monitor_period = monitor_period
        #: Set by ``stop``: nothing is started from then on (no leader, follower or
        #: epoch), so no actor outlives the broker's stop.
        self.stopping = False
        #: The failovers made: queue, epochs, replicas, seconds.
        self.failovers: list[dict] = []
        #: Replicas' copies given up on their nodes (``raymq.core.leftovers``).
        self.leftovers = leftovers if leftovers is not None else Leftovers(None)
        #: Replicated queues: one lock each around failovers and replacements.
        self._locks: dict[str, asyncio.Lock] = {}
        self._monitor: asyncio.Task | None = None
        #: (queue, follower) -> when it began missing the monitor's pings (clock's s):
        #: replaced at its second missed round if gone, after FOLLOWER_SILENCE_SECONDS
        #: if not.
        self._missed: dict[tuple[str, str], float] = {}
        self._rejoins: dict[tuple[str, str], asyncio.Task] = {}
        #: (queue, replica) -> until when (clock's s) a replaced leader's copy that
        #: rejoined may catch up before ``trim_excess`` retires it instead of the
        #: replacement.
        self._catching_up: dict[tuple[str, str], float] = {}
        #: Leaders starting (they answer no ping meanwhile).
        self._starts = LeaderStarts()
        #: Queue -> the leader replica id a failover under way replaces.
        self._replacing: dict[str, str] = {}
        #: Nodes where a replica was lost, and when (``clock`` seconds).
        self._lost_nodes: dict[str, float] = {}
        #: Failovers whose new leader has not started yet, by queue.
        self._handing_over: dict[str, _HandOver] = {}
        #: Queues whose changed set may not be saved or known to their leader yet (a
        #: step failed), with the replicas it retired whose actors may still run: the
        #: monitor's next round does it all again.
        self._unpublished: dict[str, set[str]] = {}

    # -- shared with the broker ---------------------------------------------------------

    def refuse_if_stopping(self, name: str) -> None:
        """``BrokerUnavailable`` once ``stop`` was called: a queue (re)started now
        would outlive the stop."""
        if self.stopping:
            raise BrokerUnavailable(f"queue {name!r}: the broker is stopping")

    def _tasks(self) -> list[asyncio.Task]:
        return [t for t in (self._monitor, *self._rejoins.values()) if t is not None]

    def stop(self) -> None:
        """Start nothing from now on; cancel the monitor and the rejoins under way
        (``wait_stopped`` waits for them to end)."""
        self.stopping = True
        for task in self._tasks():
            task.cancel()

    async def wait_stopped(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the tasks ``stop`` cancelled to end: a
        sequence cut short ends the actors it started outside the set as it unwinds,
        which must be done before the queues' actors are stopped. Logged if some do
        not end."""
        tasks = [t for t in self._tasks() if not t.done()]
        if not tasks:
            return
        _done, pending = await asyncio.wait(tasks, timeout=timeout)
        if pending:
            log.warning("stop: %d replication tasks still run after %.0f s", len(pending), timeout)

    def lock_of(self, name: str) -> asyncio.Lock:
        """The lock around ``name``'s failovers and replacements."""
        return self._locks.setdefault(name, asyncio.Lock())

    def _ensure_monitor(self) -> None:
        if self.stopping or self.monitor_period is None:
            return
        if self._monitor is None or self._monitor.done():
            self._monitor = asyncio.get_running_loop().create_task(self.monitor_loop())

    def _save(self, name: str) -> None:
        self.ops.save(self.queues[name])

    def _suspect(self) -> set[str]:
        """Nodes where a replica was lost lately: Ray may take most of a minute to
        declare a node dead, and until then lists it as alive."""
        now = self.clock()
        self._lost_nodes = {
            n: t for n, t in self._lost_nodes.items() if now - t < LOST_NODE_SECONDS
        }
        return set(self._lost_nodes)

    def _alive(self) -> list[str]:
        """Alive nodes, as the cluster knows them, less the ``_suspect`` ones."""
        suspect = self._suspect()
        return [n for n in self.ops.alive_nodes() if n not in suspect]

    def _queues_per_node(self) -> dict[str, int]:
        per_node: dict[str, int] = {}
        for entry in self.queues.values():
            nodes = entry.replicas.nodes.values() if entry.replicas else [entry.node_id]
            for node in nodes:
                per_node[node] = per_node.get(node, 0) + 1
        return per_node

    # -- create and start ---------------------------------------------------------------

    async def create(self, cfg: QueueConfig, node_id: str | None) -> Handle:
        """Place a new replicated queue (its leader on ``node_id`` if alive), save it,
        start it and wait up to ``IN_SYNC_TIMEOUT_SECONDS`` for ``insync_quorum``
        replicas in sync; returns its leader. ``BrokerUnavailable`` if too few nodes or
        replicas."""
        try:
            per_node = self._queues_per_node()
            alive, suspect = self.ops.alive_nodes(), self._suspect()
            replicas = ReplicaSet.place(cfg.replicas, alive, per_node, node_id, suspect)
        except NoNodes as exc:
            raise BrokerUnavailable(f"queue {cfg.name!r}: {exc}") from None
        self.queues[cfg.name] = QueueEntry(cfg, replicas.leader_node, replicas)
        self._save(cfg.name)
        handle = await self.leader(cfg.name)
        in_sync = await self.ops.wait_in_sync(handle, cfg.insync_quorum, IN_SYNC_TIMEOUT_SECONDS)
        if len(in_sync) < cfg.insync_quorum:
            raise BrokerUnavailable(
                f"queue {cfg.name!r}: {len(in_sync)} replicas in sync after"
                f" {IN_SYNC_TIMEOUT_SECONDS:.0f} s, min_insync_replicas={cfg.insync_quorum}"
            )
        return handle

    def _follower(self, name: str, rid: str, node: str, epoch: int) -> Handle:
        self.refuse_if_stopping(name)
        return self.ops.start_follower(name, rid, node, epoch)

    def _follower_refs(self, name: str, rs: ReplicaSet) -> tuple[FollowerRef, ...]:
        """The followers of ``rs``, their actors started (if need be), for its leader."""
        return tuple(
            (r, rs.nodes[r], self._follower(name, r, rs.nodes[r], rs.epoch)) for r in rs.followers
        )

    async def leader(self, name: str, fresh: bool = False) -> Handle:
        """The leader of a replicated queue, its followers started (if need be). A
        leader that runs already has ``REPLICA_PING_TIMEOUT_SECONDS * 5`` to answer
        (``BrokerUnavailable`` after: it is checked, and failed over, meanwhile); one
        started here is not checked until it is up (it answers nothing while it
        recovers)."""
        self.refuse_if_stopping(name)
        self._ensure_monitor()
        running = not fresh and self.ops.find_leader(name) is not None
        if running:
            leader = await self._leader_actor(name)
            try:
                await self.ops.leader_ready(leader, REPLICA_PING_TIMEOUT_SECONDS * 5)
            except Unreachable as exc:
                raise BrokerUnavailable(
                    f"queue {name!r}: its leader does not answer ({exc}); it is checked"
                    " and replaced if lost: try again"
                ) from None
            return leader
        with self._starts.making(name):  # not checked meanwhile: it may recover long
            leader = await self._leader_actor(name, fresh)
            await self.ops.leader_ready(leader, None)
            return leader

    async def _leader_actor(self, name: str, fresh: bool = False) -> Handle:
        """The leader actor (created with its role if it does not run; ``fresh``: a new
        one), its followers started."""
        entry = self.queues[name]
        rs = entry.replicas
        followers = []
        for rid in rs.followers:
            handle = self._follower(name, rid, rs.nodes[rid], rs.epoch)
            self.ops.wake_follower(handle)  # starts its watch; a lost node never answers
            followers.append((rid, rs.nodes[rid], handle))
        return await self.ops.start_leader(entry, tuple(followers), fresh)

    # -- what leaders, followers and clients ask ------------------------------------------

    def begin_epoch(self, name: str, replica_id: str) -> tuple[int, tuple[FollowerRef, ...]]:
        """A leader (re)starts: the next epoch (saved before it is given) and the
        current followers. ``NotLeader`` if ``replica_id`` no longer leads the queue."""
        entry = self.queues.get(name)
        rs = entry.replicas if entry is not None else None
        if rs is None or rs.leader != replica_id or self._replacing.get(name) == replica_id:
            # (a leader restarted in place while its failover fences the followers would
            # get the epoch they are fenced with)
            raise NotLeader(f"queue {name!r}: replica {replica_id} no longer leads it")
        self.refuse_if_stopping(name)
        rs.epoch += 1
        self._save(name)
        if name in self._handing_over:
            self._handing_over[name].begun = True
        return rs.epoch, self._follower_refs(name, rs)

    def in_sync_replicas(self, name: str) -> list[str]:
        """The replica ids last reported in sync for queue ``name`` (none if it is not
        replicated): a leader restarted in place asks which followers to trust."""
        entry = self.queues.get(name)
        if entry is None or entry.replicas is None:
            return []
        self._starts.began(name, entry.replicas.epoch, self.clock())  # (only a start asks)
        return list(entry.replicas.in_sync)

    def update_in_sync(self, name: str, epoch: int, in_sync: list[str]) -> bool:
        """A leader's in-sync replicas; False (fenced) if ``epoch`` is not current."""
        entry = self.queues.get(name)
        if entry is None or entry.replicas is None or entry.replicas.epoch != epoch:
            return False
        rs = entry.replicas
        rs.in_sync = [r for r in in_sync if r in rs.nodes]
        self._save(name)
        self._starts.reported(name)
        return True

    async def leader_silent(self, name: str, epoch: int) -> None:
        """A follower has not heard from the leader of ``epoch``: check it now."""
        entry = self.queues.get(name)
        current = entry is not None and entry.replicas is not None and entry.replicas.epoch == epoch
        if current and not self.lock_of(name).locked():  # one check at a time, no queue
            await self.check_leader(name)

    async def suspect_leader(self, name: str, actor_id: str) -> bool:
        """A client could not reach the leader actor ``actor_id``: check it now.
        Returns False if the queue is not replicated (its actor restarts in place)."""
        entry = self.queues.get(name)
        if entry is None or entry.replicas is None:
            return False
        current = self.ops.find_leader(name)
        lock = self.lock_of(name)
        if current is None or self.ops.actor_id(current) == actor_id:
            if lock.locked():  # a check (a failover) is under way: wait for it, not in line
                while lock.locked():
                    await asyncio.sleep(0.05)
            else:
                await self.check_leader(name)
        return True

    # -- failover ---------------------------------------------------------------------

    async def check_leader(self, name: str) -> None:
        """Fail over if the leader does not answer (under the queue's lock: one check
        at a time, and one that waited finds the new leader answering)."""
        async with self.lock_of(name):
            entry = self.queues.get(name)
            if entry is None or entry.replicas is None or self._starts.made_here(name):
                return
            leader = self.ops.find_leader(name)
            # A leader of another epoch was replaced (or fenced): it leads nothing.
            answer = await self.ops.ping(leader) if leader is not None else None
            if answer is None and leader is not None and self._still_starting(name):
                return  # checked again at the next round
            if answer == entry.replicas.epoch:
                if name in self._handing_over:  # it started after all
                    self._handed_over(name)
                return
            resumed = self._handing_over.get(name)
            if resumed is not None and entry.replicas.leader_node not in self.ops.alive_nodes():
                self._abandon_hand_over(name, resumed)
                resumed = None
            self._replacing[name] = resumed.old_leader if resumed else entry.replicas.leader
            try:
                if resumed is not None:
                    await self._hand_over(name, leader)
                else:
                    await self._fail_over(name, leader, answered=answer is not None)
            finally:
                self._replacing.pop(name, None)

    def _still_starting(self, name: str) -> bool:
        """The leader, which did not answer a ping, began its start's survey of the
        followers less than ``LEADER_START_SECONDS`` ago and its node is alive: not
        failed over yet (it answers no ping until its start ends)."""
        rs = self.queues[name].replicas
        if self._starts.since(name, rs.epoch, self.clock()) is None:
            return False
        if rs.leader_node not in self.ops.alive_nodes():
            return False
        log.info("queue %r: leader %s is starting: checked again later", name, rs.leader)
        return True

    def _abandon_hand_over(self, name: str, h: _HandOver) -> None:
        """The promoted replica's node was lost before the hand-over ended (found by the
        simulator: resumed again and again, the hand-over waited for ever); the next
        failover replaces it. If it never began its epoch it answered no send, so the
        followers in sync before still hold every acknowledged one: in sync again, for
        that failover to promote one of them."""
        self._handing_over.pop(name)
        rs = self.queues[name].replicas
        if not h.begun:
            rs.in_sync = [rs.leader] + [r for r in h.in_sync if r in rs.nodes and r != rs.leader]
            self._save(name)
        log.warning(
            "queue %r: replica %s, promoted in epoch %d, was lost before the hand-over"
            " ended; in sync: %s",
            name,
            rs.leader,
            rs.epoch,
            rs.in_sync,
        )

    async def _fail_over(self, name: str, old: Handle | None, answered: bool = False) -> None:
        """Fence the followers with the next epoch, promote the most complete in-sync
        one, replace the old leader's replica, start the new leader. If none can be
        promoted and the old leader answered, it starts again in place."""
        t0 = self.clock()
        entry = self.queues[name]
        rs = entry.replicas
        old_epoch, old_leader = rs.epoch, rs.leader
        if not [r for r in rs.in_sync if r != rs.leader]:
            if answered:
                await self._start_again_in_place(name, old)
                return
            # Nothing may be promoted: fencing would only stop a leader that may live.
            log.warning(
                "queue %r: leader %s does not answer and no follower is in sync: waiting"
                " for it (epoch %d)",
                name,
                old_leader,
                old_epoch,
            )
            return
        ends = await self._fence_followers(name, old_epoch + 1)
        lost = rs.leader_node
        if not answered:  # (one that answered runs: its node is alive)
            self._lost_nodes[lost] = self.clock()
        in_sync_before = tuple(r for r in rs.in_sync if r != old_leader)
        if rs.promote(ends) is not None:
            self.queues[name] = QueueEntry(entry.config, rs.leader_node, rs)
            others = tuple(r for r in in_sync_before if r != rs.leader)
            self._handing_over[name] = _HandOver(old_leader, old_epoch, lost, t0, in_sync=others)
            await self._hand_over(name, old)
        else:
            self._save(name)  # the epoch, before any actor acts on it
            if answered:
                await self._start_again_in_place(name, old)
                return
            log.warning(
                "queue %r: leader %s lost and no in-sync follower answered (epoch %d;"
                " answered: %s): unavailable until one does",
                name,
                old_leader,
                rs.epoch,
                sorted(ends),
            )

    async def _start_again_in_place(self, name: str, old: Handle) -> None:
        """No in-sync follower can be promoted and the leader answers, fenced (by an
        earlier failover that promoted no one) or of an older epoch: it holds every
        acknowledged send (it answered them all), so it starts again in place, in the
        next epoch. Found by the simulator: left fenced, it kept the queue unavailable
        for good once its in-sync followers were lost."""
        rs = self.queues[name].replicas
        log.warning("queue %r: leader %s answers, fenced: it starts again", name, rs.leader)
        self.ops.kill(old)
        self._replacing.pop(name, None)  # it is not replaced: it may begin an epoch
        await self.leader(name, fresh=True)

    async def _fence_followers(self, name: str, epoch: int) -> dict[str, int]:
        """Fence every running follower with ``epoch``, side by side; where the copies
        of those that answered end, by replica id."""
        handles = {}
        for rid in self.queues[name].replicas.followers:
            handle = self.ops.find_follower(name, rid)
            if handle is not None:  # (one never started answers nothing)
                handles[rid] = handle
        answers = await asyncio.gather(
            *(self.ops.fence(h, epoch) for h in handles.values()), return_exceptions=True
        )
        return {
            rid: end
            for rid, end in zip(handles, answers, strict=True)
            if not isinstance(end, BaseException)
        }

    async def _hand_over(self, name: str, old: Handle | None) -> None:
        """After a promotion (``_handing_over``): save it, end the old leader and the
        promoted follower's actor, replace the lost replica, and start the new leader
        on the promoted copy. Each step may run again (a resumed failover)."""
        h = self._handing_over[name]
        rs = self.queues[name].replicas
        self._save(name)  # the epoch, before any actor acts on it
        if old is not None:
            self.ops.kill(old)
        promoted = self.ops.find_follower(name, rs.leader)
        if promoted is not None:
            try:
                with contextlib.suppress(Unreachable):
                    # its files are opened all the same (a follower writes only when told)
                    await self.ops.release(promoted)
            finally:  # also if the stop cancels us: it leads nothing, and is in no set
                self.ops.kill(promoted)
        if not h.replaced:
            h.replaced = True  # once (a set still short is restored by the monitor)
            try:
                rs.add_replica(self._alive(), self._queues_per_node(), lost=(h.lost,))
                self._save(name)
            except NoNodes as exc:
                log.warning("queue %r: the lost replica is not replaced: %s", name, exc)
        await self.leader(name, fresh=True)
        self._handed_over(name)

    def _handed_over(self, name: str) -> None:
        """A failover's new leader runs: log the failover, and try to bring the old
        leader's copy back if its node lives."""
        h = self._handing_over.pop(name)
        rs = self.queues[name].replicas
        # Its copy's follower actor, if a client's lookup started the leader before the
        # hand-over ended it: it would run outside the set until the stop.
        stray = self.ops.find_follower(name, rs.leader)
        if stray is not None:
            self.ops.kill(stray)
        record = {
            "queue": name,
            "old_epoch": h.old_epoch,
            "epoch": rs.epoch,
            "old_leader": h.old_leader,
            "leader": rs.leader,
            "seconds": self.clock() - h.began,
        }
        self.failovers.append(record)
        log.warning("queue %r: failover %s", name, record)
        if h.lost in self.ops.alive_nodes():  # maybe only its process paused
            rejoin = self.rejoin(name, h.old_leader, h.lost)
            self._rejoins[(name, h.old_leader)] = asyncio.get_running_loop().create_task(rejoin)
        else:
            self._give_up(name, h.old_leader, h.lost, "replaced leader; its node was lost")

    # -- changes of the set ---------------------------------------------------------------

    async def rejoin(self, name: str, rid: str, node: str) -> None:
        """Try to bring a replaced leader's copy back as a follower, on its node, with
        its files: the new leader cuts off the tail it wrote that was never committed
        (the epoch history says where) and catches it up. If its node does not start it
        within ``REJOIN_SECONDS``, the node is taken for lost (the replacement stays)."""
        entry = self.queues.get(name)
        if entry is None or entry.replicas is None:
            return
        epoch = entry.replicas.epoch
        handle = self._follower(name, rid, node, epoch)
        recorded = False
        why: str | None = "replaced leader; did not rejoin"
        try:
            try:
                await self.ops.follower_ready(handle, REJOIN_SECONDS)
            except Unreachable as exc:
                log.info("queue %r: replica %s does not rejoin from its node: %s", name, rid, exc)
                why = f"replaced leader; did not start within {REJOIN_SECONDS:.0f} s"
                return
            self._lost_nodes.pop(node, None)  # it started there: the node is alive
            # (the stop may cancel us while a check holds the lock: the follower runs)
            async with self.lock_of(name):
                rs = self.queues[name].replicas
                if rs.epoch != epoch or rid in rs.nodes:
                    # another failover meanwhile (its copy is the set's again: not left)
                    why = None if rid in rs.nodes else "replaced leader; another failover first"
                    return
                rs.nodes[rid] = node
                recorded = True
                self._catching_up[(name, rid)] = self.clock() + REJOIN_SECONDS
                with contextlib.suppress(OSError):  # (a stale record, refused at removal)
                    self.leftovers.drop(name, rid, node)
                log.warning("queue %r: replica %s rejoins as a follower", name, rid)
                await self._publish(name)
        finally:
            if not recorded:  # failed, refused or cancelled: not left running outside the set
                self.ops.kill(handle)
                if why is not None and not self.stopping:  # (a stop: the next start's)
                    self._give_up(name, rid, node, why)

    async def trim_excess(self, name: str) -> None:
        """A set grown past the queue's replicas (a replaced leader rejoined): once the
        in-sync replicas alone are enough, drop a follower that is not in sync, else
        the newest one (the replacement). Not while the rejoined copy catches up
        (``REJOIN_SECONDS`` at most): it holds most of the queue already, and which
        copy stays should not hang on which one a loaded machine got in sync first."""
        async with self.lock_of(name):
            entry = self.queues.get(name)
            if entry is None or entry.replicas is None:
                return
            rs = entry.replicas
            if len(rs.nodes) <= entry.config.replicas or len(rs.in_sync) < entry.config.replicas:
                return
            lagging = [r for r in rs.followers if r not in rs.in_sync]
            now = self.clock()
            if any(self._catching_up.get((name, r), now) > now for r in lagging):
                return
            for r in rs.followers:
                self._catching_up.pop((name, r), None)
            drop = lagging[0] if lagging else max(rs.followers, key=lambda r: int(r[1:]))
            rs.remove_replica(drop)
            log.warning("queue %r: replica %s retired (%d replicas)", name, drop, len(rs.nodes))
            await self._publish(name, retired=drop)

    async def replace_follower(self, name: str, rid: str) -> None:
        """Replace a lost follower by a new one on another node (none free: the set
        stays short until ``restore_count`` finds one). Not one the set still counts
        in sync: it may be the only copy of acknowledged sends a failover can promote
        (its leader lost, say); a leader that serves takes it out of sync first."""
        async with self.lock_of(name):
            entry = self.queues.get(name)
            if entry is None or entry.replicas is None or rid not in entry.replicas.followers:
                return
            rs = entry.replicas
            if rid in rs.in_sync:
                log.info("queue %r: follower %s does not answer; kept while in sync", name, rid)
                return
            handle = self.ops.find_follower(name, rid)
            if handle is not None:
                self.ops.kill(handle)
            lost = rs.nodes[rid]
            self._lost_nodes[lost] = self.clock()
            alive = self._alive()  # (before the set changes: a failure leaves it whole)
            rs.remove_replica(rid)
            try:
                new = rs.add_replica(alive, self._queues_per_node(), lost=(lost,))
            except NoNodes as exc:
                new = None
                log.warning("queue %r: lost follower %s not replaced: %s", name, rid, exc)
            log.warning("queue %r: follower %s lost, replaced by %s", name, rid, new)
            self._give_up(name, rid, lost, "lost follower; replaced")
            await self._publish(name)

    def leftover_verdicts(self) -> list[tuple[Leftover, str]]:
        """Each copy left behind and what ``raymq remove-leftovers`` may do with it
        (``raymq.core.leftovers``: ``REMOVABLE``, ``IN_THE_SET``, ``RUNNING``,
        ``NODE_GONE``)."""
        alive = set(self.ops.alive_nodes())
        out = []
        for left in self.leftovers:
            entry = self.queues.get(left.queue)
            rs = entry.replicas if entry is not None else None
            in_set = rs is not None and rs.nodes.get(left.replica_id) == left.node_id
            # (Ray keeps the names of actors whose node died: only a live node's run.)
            rejoin = self._rejoins.get((left.queue, left.replica_id))
            running = (rejoin is not None and not rejoin.done()) or (
                left.node_id in alive
                and self.ops.find_follower(left.queue, left.replica_id) is not None
            )
            out.append((left, verdict(in_set, running, left.node_id in alive)))
        return out

    def _give_up(self, name: str, rid: str, node: str, why: str) -> None:
        """Replica ``rid``'s copy on ``node`` is left there: record it (a failure to
        save is logged; the copy is then as unreported as before)."""
        try:
            self.leftovers.add(name, rid, node, why)
        except OSError as exc:
            log.warning("queue %r: replica %s's copy on %s not recorded: %s", name, rid, node, exc)
            return
        log.warning("queue %r: replica %s's copy left on node %s (%s)", name, rid, node, why)

    async def _publish(self, name: str, retired: str | None = None) -> None:
        """Save a changed set, end the actor of a replica it ``retired`` (its copy
        deleted), then hand the followers to the leader; until all is done, the
        monitor's rounds do it again (``_unpublished``). Saved first: a saved set that
        still names the retired replica in sync must find its copy whole."""
        retiring = self._unpublished.setdefault(name, set())
        if retired is not None:
            retiring.add(retired)
        self._save(name)
        for rid in sorted(retiring):
            handle = self.ops.find_follower(name, rid)
            if handle is not None:
                try:
                    with contextlib.suppress(Unreachable):
                        await self.ops.shutdown_replica(handle, True)
                finally:  # also if it fails or the stop cancels us (its copy may stay)
                    self.ops.kill(handle)
        await self._tell_followers(name)
        del self._unpublished[name]

    async def _republish(self, name: str) -> None:
        """``_publish`` again a set whose save, retirement or hand-over failed."""
        async with self.lock_of(name):
            entry = self.queues.get(name)
            if entry is None or entry.replicas is None:
                self._unpublished.pop(name, None)
            elif name in self._unpublished:
                await self._publish(name)

    async def _tell_followers(self, name: str) -> None:
        """Start the followers of the replica set and hand them to the leader."""
        rs = self.queues[name].replicas
        leader = await self.leader(name)
        await self.ops.set_followers(leader, rs.epoch, self._follower_refs(name, rs))

    async def restore_count(self, name: str) -> None:
        """Add followers while the set is short of the queue's replicas (lost ones that
        found no free node then) and a node is free now."""
        async with self.lock_of(name):
            entry = self.queues.get(name)
            if entry is None or entry.replicas is None:
                return
            rs, added = entry.replicas, []
            while len(rs.nodes) < entry.config.replicas:
                try:
                    added.append(rs.add_replica(self._alive(), self._queues_per_node()))
                except NoNodes:
                    break
            if added:
                log.warning(
                    "queue %r: replicas %s added (%d of %d)",
                    name,
                    added,
                    len(rs.nodes),
                    entry.config.replicas,
                )
                await self._publish(name)

    # -- the monitor and the stop -------------------------------------------------------

    async def monitor_loop(self) -> None:
        """Every ``monitor_period`` seconds: ``monitor_once`` for each replicated queue."""
        while True:
            await asyncio.sleep(self.monitor_period)
            names = [n for n, e in self.queues.items() if e.replicas is not None]
            for name in names:
                try:
                    await self.monitor_once(name)
                except Exception:
                    log.exception("queue %r: replica monitor", name)

    async def monitor_once(self, name: str) -> None:
        """Ping the queue's leader (fail over if it does not answer), restore or trim
        the count, and ping the followers (replace one that missed two rounds, gone,
        or ``FOLLOWER_SILENCE_SECONDS`` of rounds, on an alive node)."""
        entry = self.queues.get(name)
        if entry is None or entry.replicas is None:
            return
        await self.check_leader(name)
        if name in self._unpublished:
            await self._republish(name)
        rs = entry.replicas
        if len(rs.nodes) < entry.config.replicas:
            await self.restore_count(name)
        elif len(rs.nodes) > entry.config.replicas:
            await self.trim_excess(name)
        alive: list[str] | None = None  # (asked of the cluster once, if a ping fails)
        for rid in rs.followers:
            handle = self.ops.find_follower(name, rid)
            if handle is not None and await self.ops.ping(handle) is not None:
                self._missed.pop((name, rid), None)
                continue
            first = self._missed.get((name, rid))
            if first is None:
                self._missed[(name, rid)] = self.clock()
                continue
            if alive is None:
                alive = self.ops.alive_nodes()
            gone = handle is None or rs.nodes.get(rid) not in alive
            if gone or self.clock() - first >= FOLLOWER_SILENCE_SECONDS:
                del self._missed[(name, rid)]
                await self.replace_follower(name, rid)

    async def stop_followers(self, name: str, delete_files: bool = False) -> None:
        """Stop a replicated queue's follower actors (and delete their copies), each
        within ``ClusterOps.shutdown_replica``'s bound; one that fails is ended all the
        same (logged). Then end, without waiting, the follower actors a sequence cut
        short may have left outside the set: replicas retired but not yet ended
        (``_unpublished``), and the promoted leader's copy of a hand-over."""
        entry = self.queues.get(name)
        if entry is None or entry.replicas is None:
            return
        rs = entry.replicas
        for rid in rs.followers:
            handle = self.ops.find_follower(name, rid)
            if handle is None:
                continue
            try:
                await self.ops.shutdown_replica(handle, delete_files)
            except Unreachable:
                pass
            except Exception as exc:  # (a RayError that is not a lost actor): the next one
                log.warning("queue %r: follower %s not shut down: %r; ended", name, rid, exc)
            finally:
                self.ops.kill(handle)
        for rid in sorted({*self._unpublished.get(name, ()), rs.leader}):
            handle = self.ops.find_follower(name, rid)
            if handle is not None:
                log.warning("queue %r: follower actor %s outside the set ended", name, rid)
                self.ops.kill(handle)
        # Its followers are ended: nothing is left to retire or watch. (A queue made
        # again under this name numbers its replicas from r0 again: a stale entry
        # would end one of them.)
        self._unpublished.pop(name, None)
        self._missed = {k: t for k, t in self._missed.items() if k[0] != name}
        self._catching_up = {k: t for k, t in self._catching_up.items() if k[0] != name}


__all__ = ["ReplicationController"]
