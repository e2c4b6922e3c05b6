"""BrokerActor: the named registry of a broker's queues and its settings.

One detached actor ``raymq.broker`` per namespace. It creates queue actors, finds them
again after a restart of the cluster (each queue directory holds a ``queue.json``), and
serializes create and delete so that ``create_queue`` is idempotent. It holds no
message: a crash of it loses nothing and it rebuilds its registry from the files.

It also hibernates idle unreplicated queues (``raymq.core.hibernation``): at most
``max_active_queues`` queue actors run per node, and one idle for
``hibernate_after_seconds`` ends (its files stay). ``get_queue`` starts a hibernated
queue's actor again; clients reach it through ``Queue._refresh``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time

import ray
from raymq.actors.names import (
    QUEUE_ACTOR_PREFIX,
    REPLICA_ACTOR_PREFIX,
    queue_actor_name,
    replica_actor_name,
)
from raymq.actors.queue_actor import QueueActor
from raymq.actors.replica_actor import LeaderRole, ReplicaActor
from raymq.placement.nodes import alive_nodes, choose_queue_node, pinned_to

from raymq import metrics
from raymq.config import STOP_SECONDS, BrokerConfig, QueueConfig, validate_queue_name
from raymq.core.controller import NoNodes, ReplicaSet
from raymq.core.hibernation import (
    HibernationPolicy,
    HibernationSettings,
    HibernationStats,
)
from raymq.core.registry import QueueEntry, QueueRegistry
from raymq.errors import BrokerUnavailable, NotLeader, QueueExists, QueueNotFound

#: How often the controller checks the leaders and followers of replicated queues
#: (seconds); followers and clients report a silent leader sooner.
MONITOR_PERIOD_SECONDS = 1.0
#: A leader (or follower) that does not answer a ping in this long is taken for lost
#: (seconds); a false alarm costs a failover, never data (epochs fence the old one).
PING_TIMEOUT_SECONDS = 1.0
#: How long a new replicated queue waits for its followers to be in sync (seconds).
IN_SYNC_TIMEOUT_SECONDS = 60.0
#: A node where a replica was lost gets no new replica for this long (seconds), unless
#: no other node is left.
LOST_NODE_SECONDS = 120.0
#: How long a replaced leader's node has to start its copy again as a follower
#: (seconds); a lost node never does. Generous: the replacement already serves, so
#: waiting costs nothing, while a node busy enough to have paused its leader may take
#: over 10 s to start a worker process (a paused-leader scenario timed out so).
REJOIN_SECONDS = 30.0
#: Longest a queue's ``hibernate`` call (flush and close) and the release of its actor
#: name may take (seconds); past it the hibernation is given up (logged, counted).
HIBERNATE_SECONDS = 10.0
#: Longest an idleness probe may take; a queue that does not answer counts as busy
#: (seconds).
IDLE_PROBE_SECONDS = 2.0
#: Longest period of the hibernation sweep (seconds); shorter for a short
#: ``hibernate_after_seconds``.
SWEEP_PERIOD_SECONDS = 5.0
_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


def _hibernation_settings(config: BrokerConfig) -> HibernationSettings:
    """The broker's hibernation settings, from its ``BrokerConfig``."""
    return HibernationSettings(config.max_active_queues, config.hibernate_after_seconds)


log = logging.getLogger("raymq.broker")


# Many concurrent calls: clients reporting a lost leader wait while it is replaced, and
# the new leader's begin_epoch must still find a free slot.
@ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=1000)
class BrokerActor:
    """Registry of queues: name -> (settings, node, actor handle)."""

    def __init__(self, config: BrokerConfig, namespace: str):
        self.broker_config = config
        self.namespace = namespace
        self._lock = asyncio.Lock()
        self._registry = QueueRegistry(config.paging_directory)
        self._queues: dict[str, QueueEntry] = self._registry.load()
        #: Replicated queues: one lock each around failovers and replacements.
        self._replica_locks: dict[str, asyncio.Lock] = {}
        self._monitor: asyncio.Task | None = None
        #: Follower replica ids that missed a ping last round (replaced at the second).
        self._missed: set[tuple[str, str]] = set()
        self.failovers: list[dict] = []
        self._rejoins: dict[tuple[str, str], asyncio.Task] = {}
        #: Replicated queues whose leader is being started (not checked meanwhile: it
        #: answers no ping while it recovers), with how many starts are under way.
        self._starting: dict[str, int] = {}
        #: Queue -> the leader replica id a failover under way replaces.
        self._replacing: dict[str, str] = {}
        #: Nodes where a replica was lost, and when (monotonic seconds).
        self._lost_nodes: dict[str, float] = {}
        # Hibernation of idle unreplicated queues (raymq.core.hibernation).
        self._hibernation = HibernationPolicy(_hibernation_settings(config))
        #: Unreplicated queue -> lock around its revival and hibernation.
        self._queue_locks: dict[str, asyncio.Lock] = {}
        self._sweeper: asyncio.Task | None = None
        self._exporter: asyncio.Task | None = None
        self._counts = {"hibernations": 0, "revivals": 0, "refused": 0, "over_cap": 0}
        self._revival_seconds = 0.0
        #: Set by ``stop_queues``: nothing is started from then on (no revival, leader,
        #: follower or epoch), so no actor outlives the stop.
        self._stopping = False
        self._find_running()

    def config(self) -> BrokerConfig:
        """The broker settings."""
        return self.broker_config

    def pid(self) -> int:
        """The actor's process id (for fault tests and diagnostics)."""
        return os.getpid()

    def _actor(self, name: str, cfg: QueueConfig, node_id: str):
        if cfg.replicas > 1:
            raise AssertionError("replicated queues start through _replicated")
        home = choose_queue_node(node_id)
        if home != node_id:
            self._move_here(name, cfg, node_id, home)
        return QueueActor.options(
            name=queue_actor_name(name),
            namespace=self.namespace,
            lifetime="detached",
            get_if_exists=True,
            scheduling_strategy=pinned_to(home),
        ).remote(cfg, self.broker_config, self.namespace)

    def _move_here(self, name: str, cfg: QueueConfig, gone: str, here: str) -> None:
        """A queue's node is not alive: start it on this node only if its files are here
        (one machine whose Ray restarted with a new node id, or a paging directory every
        node mounts), and record the move; else refuse, rather than start it empty."""
        if not self._registry.has_files(name):
            raise BrokerUnavailable(
                f"queue {name!r} lives on node {gone[:12] or '?'}, which is not alive, and"
                f" its files are not in {self._registry.directory(name)} on this node: it is"
                " unavailable until that node is back"
            )
        self._queues[name] = QueueEntry(cfg, here)
        self._registry.save(self._queues[name])

    async def create_queue(self, cfg: QueueConfig, node_id: str | None = None):
        """Create (or return, for equal settings) a queue; returns its actor handle."""
        async with self._lock:
            existing = self._queues.get(cfg.name)
            if existing is not None:
                if existing.config != cfg:
                    kind = "an address" if existing.config.address else "a queue"
                    raise QueueExists(
                        f"{cfg.name!r} exists, as {kind} with settings"
                        f" {existing.config.to_dict()}, not {cfg.to_dict()}"
                    )
                handle = await self._handle(cfg.name)
            elif cfg.replicas > 1:
                handle = await self._create_replicated(cfg, node_id)
            else:
                per_node: dict[str, int] = {}
                for entry in self._queues.values():
                    per_node[entry.node_id] = per_node.get(entry.node_id, 0) + 1
                node = choose_queue_node(node_id, per_node)
                self._queues[cfg.name] = QueueEntry(cfg, node)
                self._registry.save(self._queues[cfg.name])
                handle = await self._handle(cfg.name, new=True)
            await handle.ready.remote()
            return handle

    async def get_queue(self, name: str):
        """The actor handle of an existing queue (started if its actor is not running)."""
        validate_queue_name(name)
        entry = self._queues.get(name)
        if entry is None:
            raise QueueNotFound(
                f"queue {name!r} does not exist in {self.broker_config.paging_directory}"
            )
        return await self._handle(name)

    async def _handle(self, name: str, new: bool = False):
        """The running actor of a queue (its leader's, if replicated), started if need be
        (``new``: a queue being created, not a revival). Starting one on a node at its
        ``max_active_queues`` hibernates an idle queue there meanwhile."""
        self._refuse_if_stopping(name)
        entry = self._queues[name]
        if entry.config.replicas > 1:
            return await self._replicated(name)
        self._ensure_sweeper()
        async with self._queue_lock(name):  # not while it hibernates
            entry = self._queues[name]  # (it may have moved)
            reviving = not self._hibernation.is_active(name)
            t0 = time.monotonic()
            handle = self._actor(name, entry.config, entry.node_id)
            if reviving:  # while its process starts (a second of CPU): its ready comes later
                await self._make_room(self._queues[name].node_id, name)
            try:
                await handle.ready.remote()
            except (NotLeader, ray.exceptions.RayTaskError) as exc:
                if not isinstance(getattr(exc, "cause", exc), NotLeader):
                    raise
                # Closed for a hibernation that its broker did not finish (it died, or
                # gave up waiting): end it and start the queue anew.
                log.warning("queue %r: ending an actor left hibernating", name)
                await self._end_actor(name, handle)
                handle = self._actor(name, entry.config, self._queues[name].node_id)
                await handle.ready.remote()
            self._hibernation.started(name, self._queues[name].node_id)
            if reviving and not new:
                self._counts["revivals"] += 1
                self._revival_seconds += time.monotonic() - t0
            return handle

    async def dead_letter_queue(self, name: str, durable: bool):
        """The handle of dead-letter queue ``name``, created with default settings and
        ``durable`` if it does not exist (a queue's first dead letter)."""
        if name not in self._queues:
            try:
                return await self.create_queue(QueueConfig(name, durable=durable))
            except QueueExists:  # created meanwhile with other settings: use it as it is
                pass
        return await self.get_queue(name)

    def list_queues(self) -> list[str]:
        """Names of all queues (not addresses), sorted."""
        return sorted(n for n, e in self._queues.items() if not e.config.address)

    def list_addresses(self) -> list[str]:
        """Names of all addresses, sorted."""
        return sorted(n for n, e in self._queues.items() if e.config.address)

    def list_running(self) -> list[str]:
        """Names of the queues and addresses whose actor runs (replicated ones: always
        asked), sorted: the MemoryGovernor looks up only these, not hibernated ones."""
        return sorted(
            name
            for name, entry in self._queues.items()
            if entry.replicas is not None or self._hibernation.is_active(name)
        )

    def queue_nodes(self) -> dict[str, str]:
        """The node each queue was placed on (a replicated queue's leader's), by name."""
        return {name: entry.node_id for name, entry in sorted(self._queues.items())}

    def replica_sets(self) -> dict[str, dict]:
        """Each replicated queue's ``ReplicaSet`` (as in its ``queue.json``), by name."""
        return {
            name: entry.replicas.to_dict()
            for name, entry in sorted(self._queues.items())
            if entry.replicas is not None
        }

    def failover_log(self) -> list[dict]:
        """The failovers this broker actor made: queue, epochs, replicas, seconds."""
        return list(self.failovers)

    # -- replicated queues: the controller ----------------------------------------------

    def _refuse_if_stopping(self, name: str) -> None:
        """``BrokerUnavailable`` once ``stop_queues`` began: a queue (re)started now
        would outlive the stop."""
        if self._stopping:
            raise BrokerUnavailable(f"queue {name!r}: the broker is stopping")

    def _ensure_monitor(self) -> None:
        if self._stopping:
            return
        if self._monitor is None or self._monitor.done():
            self._monitor = asyncio.get_running_loop().create_task(self._monitor_loop())

    def _save(self, name: str) -> None:
        self._registry.save(self._queues[name])

    def _lock_of(self, name: str) -> asyncio.Lock:
        return self._replica_locks.setdefault(name, asyncio.Lock())

    def _alive(self) -> list[str]:
        """Alive nodes, as Ray knows them, less those where a replica was lost lately
        (Ray may take most of a minute to declare a node dead)."""
        now = time.monotonic()
        self._lost_nodes = {
            n: t for n, t in self._lost_nodes.items() if now - t < LOST_NODE_SECONDS
        }
        return [n["NodeID"] for n in alive_nodes() if n["NodeID"] not in self._lost_nodes]

    def _queues_per_node(self) -> dict[str, int]:
        per_node: dict[str, int] = {}
        for entry in self._queues.values():
            nodes = entry.replicas.nodes.values() if entry.replicas else [entry.node_id]
            for node in nodes:
                per_node[node] = per_node.get(node, 0) + 1
        return per_node

    async def _create_replicated(self, cfg: QueueConfig, node_id: str | None):
        try:
            per_node = self._queues_per_node()
            replicas = ReplicaSet.place(cfg.replicas, self._alive(), per_node, node_id)
        except NoNodes as exc:
            raise BrokerUnavailable(f"queue {cfg.name!r}: {exc}") from None
        self._queues[cfg.name] = QueueEntry(cfg, replicas.leader_node, replicas)
        self._save(cfg.name)
        handle = await self._replicated(cfg.name)
        in_sync = await handle.wait_in_sync.remote(cfg.insync_quorum, IN_SYNC_TIMEOUT_SECONDS)
        if len(in_sync) < cfg.insync_quorum:
            raise BrokerUnavailable(
                f"queue {cfg.name!r}: {len(in_sync)} replicas in sync after"
                f" {IN_SYNC_TIMEOUT_SECONDS:.0f} s, min_insync_replicas={cfg.insync_quorum}"
            )
        return handle

    def _follower(self, name: str, rid: str, node: str, epoch: int):
        self._refuse_if_stopping(name)
        return ReplicaActor.options(
            name=replica_actor_name(name, rid),
            namespace=self.namespace,
            lifetime="detached",
            get_if_exists=True,
            scheduling_strategy=pinned_to(node),
        ).remote(name, rid, self._registry.replica_directory(name, rid), epoch, self.namespace)

    def _replica_handle(self, name: str, rid: str):
        """A follower's actor by name (``ValueError`` if there is none)."""
        return ray.get_actor(replica_actor_name(name, rid), namespace=self.namespace)

    async def _replicated(self, name: str, fresh: bool = False):
        """The leader of a replicated queue, its followers started (if need be). A
        leader that runs already has ``PING_TIMEOUT_SECONDS * 5`` to answer
        (``BrokerUnavailable`` after: it is checked, and failed over, meanwhile); one
        started here is not checked until it is up (it answers nothing while it
        recovers)."""
        self._refuse_if_stopping(name)
        self._ensure_monitor()
        running = False
        if not fresh:
            with contextlib.suppress(ValueError):
                running = bool(ray.get_actor(queue_actor_name(name), namespace=self.namespace))
        if running:
            leader = await self._leader_actor(name)
            try:
                await asyncio.wait_for(leader.ready.remote(), PING_TIMEOUT_SECONDS * 5)
            except (TimeoutError, *_GONE) as exc:
                raise BrokerUnavailable(
                    f"queue {name!r}: its leader does not answer ({exc!r}); it is checked"
                    " and replaced if lost: try again"
                ) from None
            return leader
        self._starting[name] = self._starting.get(name, 0) + 1
        try:
            leader = await self._leader_actor(name, fresh)
            await leader.ready.remote()
            return leader
        finally:
            self._starting[name] -= 1
            if not self._starting[name]:
                del self._starting[name]

    async def _leader_actor(self, name: str, fresh: bool = False):
        """The leader actor (created with its role if it does not run; ``fresh``: a new
        one, once the old one's name is free), its followers started."""
        entry = self._queues[name]
        rs = entry.replicas
        followers = []
        for rid in rs.followers:
            handle = self._follower(name, rid, rs.nodes[rid], rs.epoch)
            handle.ready.remote()  # starts its watch; a lost node never answers
            followers.append((rid, rs.nodes[rid], handle))
        role = LeaderRole(
            rs.leader, self._registry.replica_directory(name, rs.leader), rs.epoch, tuple(followers)
        )
        deadline = time.monotonic() + 10.0
        while True:
            try:
                return QueueActor.options(
                    name=queue_actor_name(name),
                    namespace=self.namespace,
                    lifetime="detached",
                    get_if_exists=not fresh,
                    scheduling_strategy=pinned_to(rs.leader_node),
                ).remote(entry.config, self.broker_config, self.namespace, role)
            except ValueError:  # the old leader's name is being released
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)

    async def begin_epoch(self, name: str, replica_id: str) -> tuple[int, tuple]:
        """A leader (re)starts: the next epoch (saved before it is given) and the
        current followers as (replica id, node id, actor handle). ``NotLeader`` if
        ``replica_id`` no longer leads the queue."""
        entry = self._queues.get(name)
        rs = entry.replicas if entry is not None else None
        if rs is None or rs.leader != replica_id or self._replacing.get(name) == replica_id:
            # (a leader restarted in place while its failover fences the followers would
            # get the epoch they are fenced with)
            raise NotLeader(f"queue {name!r}: replica {replica_id} no longer leads it")
        self._refuse_if_stopping(name)
        rs.epoch += 1
        self._save(name)
        followers = tuple(
            (r, rs.nodes[r], self._follower(name, r, rs.nodes[r], rs.epoch)) for r in rs.followers
        )
        return rs.epoch, followers

    async def update_in_sync(self, name: str, epoch: int, in_sync: list[str]) -> bool:
        """A leader's in-sync replicas; False (fenced) if ``epoch`` is not current."""
        entry = self._queues.get(name)
        if entry is None or entry.replicas is None or entry.replicas.epoch != epoch:
            return False
        rs = entry.replicas
        rs.in_sync = [r for r in in_sync if r in rs.nodes]
        self._save(name)
        return True

    async def leader_silent(self, name: str, epoch: int) -> None:
        """A follower has not heard from the leader of ``epoch``: check it now."""
        entry = self._queues.get(name)
        current = entry is not None and entry.replicas is not None and entry.replicas.epoch == epoch
        if current and not self._lock_of(name).locked():  # one check at a time, no queue
            await self._check_leader(name)

    async def suspect_leader(self, name: str, actor_id: str) -> bool:
        """A client could not reach the leader actor ``actor_id``: check it now.
        Returns False if the queue is not replicated (its actor restarts in place)."""
        entry = self._queues.get(name)
        if entry is None or entry.replicas is None:
            return False
        try:
            current = ray.get_actor(queue_actor_name(name), namespace=self.namespace)
        except ValueError:
            current = None
        lock = self._lock_of(name)
        if current is None or current._actor_id.hex() == actor_id:
            if lock.locked():  # a check (a failover) is under way: wait for it, not in line
                while lock.locked():
                    await asyncio.sleep(0.05)
            else:
                await self._check_leader(name)
        return True

    async def _ping(self, handle) -> int | None:
        """A replica's answer to a ping (a leader's epoch), None if none in time."""
        try:
            return await asyncio.wait_for(handle.ping.remote(), PING_TIMEOUT_SECONDS)
        except (TimeoutError, *_GONE):
            return None

    async def _check_leader(self, name: str) -> None:
        """Fail over if the leader does not answer (under the queue's lock: one check
        at a time, and one that waited finds the new leader answering)."""
        async with self._lock_of(name):
            entry = self._queues.get(name)
            if entry is None or entry.replicas is None or name in self._starting:
                return
            try:
                leader = ray.get_actor(queue_actor_name(name), namespace=self.namespace)
            except ValueError:
                leader = None
            # A leader of another epoch was replaced (or fenced): it leads nothing.
            if leader is not None and await self._ping(leader) == entry.replicas.epoch:
                return
            await self._failover(name, leader)

    async def _failover(self, name: str, old) -> None:
        """Fence the followers with the next epoch, promote the most complete in-sync
        one, replace the old leader's replica, start the new leader."""
        self._replacing[name] = self._queues[name].replicas.leader
        try:
            await self._fail_over(name, old)
        finally:
            self._replacing.pop(name, None)

    async def _fail_over(self, name: str, old) -> None:
        t0 = time.monotonic()
        entry = self._queues[name]
        rs = entry.replicas
        old_epoch, old_leader = rs.epoch, rs.leader
        if not [r for r in rs.in_sync if r != rs.leader]:
            # Nothing may be promoted: fencing would only stop a leader that may live.
            log.warning(
                "queue %r: leader %s does not answer and no follower is in sync: waiting"
                " for it (epoch %d)",
                name,
                old_leader,
                old_epoch,
            )
            return
        handles = {}
        for rid in rs.followers:
            with contextlib.suppress(ValueError):  # never started: it answers nothing
                handles[rid] = self._replica_handle(name, rid)
        answers = await asyncio.gather(
            *(
                asyncio.wait_for(h.fence.remote(old_epoch + 1), PING_TIMEOUT_SECONDS * 2)
                for h in handles.values()
            ),
            return_exceptions=True,
        )
        ends = {
            rid: state.end_offset
            for rid, state in zip(handles, answers, strict=True)
            if not isinstance(state, BaseException)
        }
        lost = rs.leader_node
        self._lost_nodes[lost] = time.monotonic()
        new = rs.promote(ends)
        if new is not None:
            self._queues[name] = QueueEntry(entry.config, rs.leader_node, rs)
        self._save(name)  # the epoch, before any actor acts on it
        if new is None:
            log.warning(
                "queue %r: leader %s lost and no in-sync follower answered (epoch %d;"
                " answered: %s): unavailable until one does",
                name,
                old_leader,
                rs.epoch,
                sorted(ends),
            )
            return
        if old is not None:
            ray.kill(old, no_restart=True)
        promoted = handles[new]
        try:
            await asyncio.wait_for(promoted.release.remote(), PING_TIMEOUT_SECONDS * 5)
        except (TimeoutError, *_GONE):
            pass  # its files are opened all the same (a follower writes only when told)
        ray.kill(promoted, no_restart=True)
        try:
            rs.add_replica(self._alive(), self._queues_per_node(), lost=(lost,))
            self._save(name)
        except NoNodes as exc:
            log.warning("queue %r: the lost replica is not replaced: %s", name, exc)
        await self._replicated(name, fresh=True)
        record = {
            "queue": name,
            "old_epoch": old_epoch,
            "epoch": rs.epoch,
            "old_leader": old_leader,
            "leader": new,
            "seconds": time.monotonic() - t0,
        }
        self.failovers.append(record)
        log.warning("queue %r: failover %s", name, record)
        if lost in {n["NodeID"] for n in alive_nodes()}:  # maybe only its process paused
            task = asyncio.get_running_loop().create_task(self._rejoin(name, old_leader, lost))
            self._rejoins[(name, old_leader)] = task

    async def _rejoin(self, name: str, rid: str, node: str) -> None:
        """Try to bring a replaced leader's copy back as a follower, on its node, with
        its files: the new leader cuts off the tail it wrote that was never committed
        (the epoch history says where) and catches it up. If its node does not start it
        within ``REJOIN_SECONDS``, the node is taken for lost (the replacement stays)."""
        entry = self._queues.get(name)
        if entry is None or entry.replicas is None:
            return
        epoch = entry.replicas.epoch
        handle = self._follower(name, rid, node, epoch)
        try:
            await asyncio.wait_for(handle.ready.remote(), REJOIN_SECONDS)
        except (TimeoutError, *_GONE) as exc:
            log.info("queue %r: replica %s does not rejoin from its node: %r", name, rid, exc)
            ray.kill(handle, no_restart=True)
            return
        async with self._lock_of(name):
            rs = self._queues[name].replicas
            if rs.epoch != epoch or rid in rs.nodes:
                ray.kill(handle, no_restart=True)  # another failover meanwhile
                return
            rs.nodes[rid] = node
            self._lost_nodes.pop(node, None)
            self._save(name)
            log.warning("queue %r: replica %s rejoins as a follower", name, rid)
            await self._tell_followers(name)

    async def _trim_excess(self, name: str) -> None:
        """A set grown past the queue's replicas (a replaced leader rejoined): once the
        in-sync replicas alone are enough, drop a follower that is not in sync, else
        the newest one."""
        async with self._lock_of(name):
            entry = self._queues.get(name)
            if entry is None or entry.replicas is None:
                return
            rs = entry.replicas
            if len(rs.nodes) <= entry.config.replicas or len(rs.in_sync) < entry.config.replicas:
                return
            lagging = [r for r in rs.followers if r not in rs.in_sync]
            drop = lagging[0] if lagging else max(rs.followers, key=lambda r: int(r[1:]))
            with contextlib.suppress(ValueError):
                handle = self._replica_handle(name, drop)
                with contextlib.suppress(asyncio.TimeoutError, *_GONE):
                    await asyncio.wait_for(handle.shutdown.remote(True), PING_TIMEOUT_SECONDS * 5)
                ray.kill(handle, no_restart=True)
            rs.remove_replica(drop)
            self._save(name)
            log.warning("queue %r: replica %s retired (%d replicas)", name, drop, len(rs.nodes))
            await self._tell_followers(name)

    async def _replace_follower(self, name: str, rid: str) -> None:
        async with self._lock_of(name):
            entry = self._queues.get(name)
            if entry is None or entry.replicas is None or rid not in entry.replicas.followers:
                return
            rs = entry.replicas
            with contextlib.suppress(ValueError):
                ray.kill(self._replica_handle(name, rid), no_restart=True)
            lost = rs.nodes[rid]
            self._lost_nodes[lost] = time.monotonic()
            rs.remove_replica(rid)
            try:
                new = rs.add_replica(self._alive(), self._queues_per_node(), lost=(lost,))
            except NoNodes as exc:
                new = None
                log.warning("queue %r: lost follower %s not replaced: %s", name, rid, exc)
            self._save(name)
            log.warning("queue %r: follower %s lost, replaced by %s", name, rid, new)
            await self._tell_followers(name)

    async def _tell_followers(self, name: str) -> None:
        """Start the followers of the replica set and hand them to the leader."""
        rs = self._queues[name].replicas
        leader = await self._replicated(name)
        followers = tuple(
            (r, rs.nodes[r], self._follower(name, r, rs.nodes[r], rs.epoch)) for r in rs.followers
        )
        await leader.set_followers.remote(rs.epoch, followers)

    async def _restore_count(self, name: str) -> None:
        """Add followers while the set is short of the queue's replicas (lost ones that
        found no free node then) and a node is free now."""
        async with self._lock_of(name):
            entry = self._queues.get(name)
            if entry is None or entry.replicas is None:
                return
            rs, added = entry.replicas, []
            while len(rs.nodes) < entry.config.replicas:
                try:
                    added.append(rs.add_replica(self._alive(), self._queues_per_node()))
                except NoNodes:
                    break
            if added:
                self._save(name)
                log.warning(
                    "queue %r: replicas %s added (%d of %d)",
                    name,
                    added,
                    len(rs.nodes),
                    entry.config.replicas,
                )
                await self._tell_followers(name)

    async def _monitor_loop(self) -> None:
        """Every ``MONITOR_PERIOD_SECONDS``: ping each replicated queue's leader (fail
        over if it does not answer) and followers (replace one that missed two rounds)."""
        while True:
            await asyncio.sleep(MONITOR_PERIOD_SECONDS)
            names = [n for n, e in self._queues.items() if e.replicas is not None]
            for name in names:
                try:
                    await self._monitor_once(name)
                except Exception:
                    log.exception("queue %r: replica monitor", name)

    async def _monitor_once(self, name: str) -> None:
        entry = self._queues.get(name)
        if entry is None or entry.replicas is None:
            return
        await self._check_leader(name)
        rs = entry.replicas
        if len(rs.nodes) < entry.config.replicas:
            await self._restore_count(name)
        elif len(rs.nodes) > entry.config.replicas:
            await self._trim_excess(name)
        for rid in rs.followers:
            try:
                ok = await self._ping(self._replica_handle(name, rid)) is not None
            except ValueError:
                ok = False
            if ok:
                self._missed.discard((name, rid))
            elif (name, rid) in self._missed:
                self._missed.discard((name, rid))
                await self._replace_follower(name, rid)
            else:
                self._missed.add((name, rid))

    async def delete_queue(self, name: str) -> None:
        """Stop a queue's actor and delete its files and messages."""
        validate_queue_name(name)
        async with self._lock:
            if name not in self._queues:
                raise QueueNotFound(f"queue {name!r} does not exist")
            handle = await self.get_queue(name)
            async with self._lock_of(name):  # no failover of what is being deleted
                await self._stop_followers(name, delete_files=True)
                await handle.shutdown.remote(delete_files=True)
                ray.kill(handle, no_restart=True)
                del self._queues[name]
                self._hibernation.stopped(name)
            shutil.rmtree(self._registry.directory(name), ignore_errors=True)

    async def stop_queues(self, timeout: float = STOP_SECONDS) -> None:
        """Stop every queue actor, keeping the files (``raymq stop``, test teardown).
        From the first moment nothing starts any more (``_refuse_if_stopping``): no
        revival, failover, rejoin, follower or epoch. Each queue waits up to ``timeout``
        seconds for a revival or failover under way, then has ``timeout`` seconds to
        flush and close (``shutdown``); one that takes longer (a paused process, a leader
        waiting for replicas) is ended all the same, logged: one stuck queue must not
        hang the stop, nor one that fails stop the others. What it had not flushed is
        acknowledged sends' acks at most: those messages are delivered again."""
        self._stopping = True
        background = [self._monitor, self._sweeper, *self._rejoins.values()]
        for task in background:  # stopped queues are not failed over nor hibernated
            if task is not None:
                task.cancel()
        async with self._lock:
            for name in list(self._queues):
                entry = self._queues[name]
                lock = self._lock_of(name) if entry.replicas else self._queue_lock(name)
                try:
                    async with asyncio.timeout(timeout):
                        await lock.acquire()
                except TimeoutError:  # stopped all the same: the broker ends next
                    log.warning("queue %r: its lock still held after %.0f s", name, timeout)
                    lock = None
                try:
                    await self._stop_queue(name, timeout)
                finally:
                    if lock is not None:
                        lock.release()
            await asyncio.to_thread(self._end_strays)

    def _end_strays(self) -> None:
        """End any queue or replica actor of this broker still running after the stop:
        one its bookkeeping lost track of in a race, which would outlive ``raymq stop``
        holding its files (a follower was left so in 1 of 4 runs of the replication
        scenario; its cause is not found yet). Logged; blocking GCS calls: run off the
        event loop."""
        try:
            named = ray.util.list_named_actors(all_namespaces=True)
        except Exception as exc:  # the stop itself is done: logged
            log.warning("stop: running actors not listed: %r", exc)
            return
        prefixes = (QUEUE_ACTOR_PREFIX, REPLICA_ACTOR_PREFIX)
        ended = []
        for actor in named:
            if actor["namespace"] != self.namespace or not actor["name"].startswith(prefixes):
                continue
            with contextlib.suppress(ValueError):  # gone meanwhile
                ray.kill(ray.get_actor(actor["name"], namespace=self.namespace), no_restart=True)
                ended.append(actor["name"])
        if ended:  # (one killed a moment ago may still be listed while it ends)
            log.info("stop: ended the actors still listed after the queues stopped: %s", ended)

    async def _stop_queue(self, name: str, timeout: float) -> None:
        """Stop one queue's actors (``stop_queues``): its followers, then its actor if
        it runs (not if hibernated, or never started since the broker started)."""
        try:
            handle = ray.get_actor(queue_actor_name(name), namespace=self.namespace)
        except ValueError:
            handle = None
        try:
            await self._stop_followers(name)
            if handle is not None:
                await asyncio.wait_for(handle.shutdown.remote(), timeout)
        except TimeoutError:
            log.warning("queue %r: no shutdown within %.0f s; ended", name, timeout)
        except Exception as exc:  # (a dead actor, a moved leader): the next queue
            log.warning("queue %r: shutdown failed: %r; ended", name, exc)
        finally:
            if handle is not None:
                ray.kill(handle, no_restart=True)
            self._hibernation.stopped(name)

    async def _stop_followers(self, name: str, delete_files: bool = False) -> None:
        """Stop a replicated queue's follower actors (and delete their copies)."""
        entry = self._queues.get(name)
        if entry is None or entry.replicas is None:
            return
        for rid in entry.replicas.followers:
            try:
                handle = self._replica_handle(name, rid)
            except ValueError:
                continue
            with contextlib.suppress(asyncio.TimeoutError, *_GONE):
                await asyncio.wait_for(
                    handle.shutdown.remote(delete_files), PING_TIMEOUT_SECONDS * 5
                )
            ray.kill(handle, no_restart=True)

    # -- hibernation of idle unreplicated queues ------------------------------------------

    def _find_running(self) -> None:
        """Take the queue actors already running (this broker actor restarted) as
        active: they count toward the cap and may hibernate."""
        try:
            running = ray.util.list_named_actors(all_namespaces=True)
        except Exception as exc:  # only the cap's accounting is lost: logged
            log.warning("running queue actors not listed: %r", exc)
            return
        prefix = queue_actor_name("")
        for actor in running:
            name = actor["name"][len(prefix) :]
            entry = self._queues.get(name)
            if (
                actor["namespace"] == self.namespace
                and actor["name"].startswith(prefix)
                and entry is not None
                and entry.replicas is None
            ):
                self._hibernation.started(name, entry.node_id)

    def _queue_lock(self, name: str) -> asyncio.Lock:
        return self._queue_locks.setdefault(name, asyncio.Lock())

    def _ensure_sweeper(self) -> None:
        """Start the metrics export and (with ``hibernate_after_seconds``) the sweep."""
        if self._exporter is None or self._exporter.done():
            self._exporter = asyncio.get_running_loop().create_task(self._export_metrics())
        if self._hibernation.settings.hibernate_after_seconds is None or self._stopping:
            return
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_loop())

    async def _export_metrics(self) -> None:
        """Every ``metrics.EXPORT_PERIOD_SECONDS``, the ``raymq_broker_*`` gauges."""
        while True:
            with metrics.guard("broker hibernation"):
                metrics.export_hibernation(self.hibernation_stats(), self.namespace)
            await asyncio.sleep(metrics.EXPORT_PERIOD_SECONDS)

    def _sweep_period(self) -> float:
        after = self._hibernation.settings.hibernate_after_seconds
        return SWEEP_PERIOD_SECONDS if after is None else min(SWEEP_PERIOD_SECONDS, after / 2)

    async def _sweep_loop(self) -> None:
        """Every ``_sweep_period()`` seconds, hibernate the queues idle for
        ``hibernate_after_seconds`` (and any over the cap)."""
        while True:
            await asyncio.sleep(self._sweep_period())
            try:
                await self._sweep()
            except Exception:
                log.exception("hibernation sweep")

    async def _idle_times(self, names: list[str]) -> dict[str, float | None]:
        """Each running queue's idle seconds (None: busy, or no answer in time); one
        whose actor is gone (killed, or stopped by hand) is no longer active."""

        async def probe(name: str) -> float | None:
            try:
                handle = ray.get_actor(queue_actor_name(name), namespace=self.namespace)
            except ValueError:
                self._hibernation.stopped(name)
                return None
            try:
                return await asyncio.wait_for(handle.idle_seconds.remote(), IDLE_PROBE_SECONDS)
            except (TimeoutError, *_GONE):
                return None

        answers = await asyncio.gather(*(probe(n) for n in names))
        return dict(zip(names, answers, strict=True))

    async def _sweep(self, room_on: str | None = None, skip: str | None = None) -> None:
        """Hibernate what the policy chooses (``room_on``: a node about to start one
        more queue; ``skip``: that queue)."""
        names = [
            n
            for n in self._hibernation.active()
            if n != skip and not self._queue_lock(n).locked()  # being revived or hibernated
        ]
        if not names:
            return
        idle = await self._idle_times(names)
        for name in self._hibernation.choose(idle, room_on):
            await self._hibernate(name)

    async def _make_room(self, node: str, name: str) -> None:
        """Before ``name`` starts on ``node``: hibernate idle queues there if the node
        is at its cap. None idle: it starts all the same (counted in ``over_cap``)."""
        if not self._hibernation.needs_room(node):
            return
        await self._sweep(room_on=node, skip=name)
        if self._hibernation.needs_room(node):
            self._counts["over_cap"] += 1
            log.warning(
                "queue %r starts on node %s over max_active_queues=%s: no idle queue there",
                name,
                node[:12],
                self._hibernation.settings.max_active_queues,
            )

    async def _hibernate(self, name: str) -> bool:
        """Hibernate one queue if it is still idle: its actor closes its files, is
        ended, and its name released (so that the next ``get_queue`` starts it anew).
        Returns True if it hibernated."""
        lock = self._queue_lock(name)
        if lock.locked():
            return False
        async with lock:
            try:
                handle = ray.get_actor(queue_actor_name(name), namespace=self.namespace)
            except ValueError:
                self._hibernation.stopped(name)
                return False
            try:
                done = await asyncio.wait_for(handle.hibernate.remote(), HIBERNATE_SECONDS)
            except (TimeoutError, *_GONE) as exc:
                log.warning("queue %r: hibernation failed: %r", name, exc)
                self._counts["refused"] += 1
                return False
            if not done:  # busy meanwhile
                self._counts["refused"] += 1
                return False
            # Closed: it answers every call with NotLeader until it is gone.
            await self._end_actor(name, handle)
            self._hibernation.stopped(name)
            self._counts["hibernations"] += 1
            log.info("queue %r hibernated", name)
            return True

    async def _end_actor(self, name: str, handle) -> None:
        """Kill a closed queue actor and wait until its name is free (up to
        ``HIBERNATE_SECONDS``), so that the next start makes a new actor."""
        ray.kill(handle, no_restart=True)
        deadline = time.monotonic() + HIBERNATE_SECONDS
        while time.monotonic() < deadline:
            try:
                await asyncio.to_thread(ray.get_actor, queue_actor_name(name), self.namespace)
            except ValueError:
                return  # the name is free
            await asyncio.sleep(0.02)
        log.warning(
            "queue %r: its actor name is not released %.0f s after a kill", name, HIBERNATE_SECONDS
        )

    async def hibernate(self, name: str) -> bool:
        """Hibernate queue ``name`` now if it is idle (tests, ``raymq``); returns True if
        it hibernated, False if it is busy, replicated or not running."""
        validate_queue_name(name)
        entry = self._queues.get(name)
        if entry is None:
            raise QueueNotFound(f"queue {name!r} does not exist")
        if entry.replicas is not None or not self._hibernation.is_active(name):
            return False
        return await self._hibernate(name)

    async def set_hibernation(
        self, max_active_queues: int | None, hibernate_after_seconds: float | None
    ) -> None:
        """Change the hibernation settings of this broker actor (until it restarts;
        ``BrokerConfig`` holds the lasting ones). Applied from the next sweep or start."""
        self._hibernation.settings = HibernationSettings(max_active_queues, hibernate_after_seconds)
        if self._sweeper is not None:
            self._sweeper.cancel()  # its period may change
            self._sweeper = None
        self._ensure_sweeper()

    def queue_states(self) -> dict[str, str]:
        """Each queue's (and address's) state by name: "active" (its actor runs),
        "hibernated" (it does not; the next call starts it), or "replicated"."""
        out = {}
        for name, entry in sorted(self._queues.items()):
            if entry.replicas is not None:
                out[name] = "replicated"
            else:
                out[name] = "active" if self._hibernation.is_active(name) else "hibernated"
        return out

    def hibernation_stats(self) -> HibernationStats:
        """Settings, running queues per node, hibernated queues and counts."""
        settings = self._hibernation.settings
        return HibernationStats(
            max_active_queues=settings.max_active_queues,
            hibernate_after_seconds=settings.hibernate_after_seconds,
            active_per_node=self._hibernation.active_per_node(),
            hibernated=[n for n, s in self.queue_states().items() if s == "hibernated"],
            hibernations=self._counts["hibernations"],
            revivals=self._counts["revivals"],
            refused=self._counts["refused"],
            over_cap=self._counts["over_cap"],
            revival_seconds=self._revival_seconds,
        )
