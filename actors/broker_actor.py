"""BrokerActor: the named registry of a broker's queues and its settings.

One detached actor ``raymq.broker`` per namespace. It creates queue actors, finds them
again after a restart of the cluster (each queue directory holds a ``queue.json``), and
serializes create and delete so that ``create_queue`` is idempotent. It holds no
message: a crash of it loses nothing and it rebuilds its registry from the files.

It also hibernates idle unreplicated queues (``raymq.core.hibernation``): at most
``max_active_queues`` queue actors run per node, and one idle for
``hibernate_after_seconds`` ends (its files stay). ``get_queue`` starts a hibernated
queue's actor again; clients reach it through ``Queue._refresh``.

For replicated queues it is the controller: the sequences (create, failover, rejoin,
trim, replace, restore) are ``raymq.core.replication_controller``'s, without Ray; their
Ray calls are ``RayClusterOps`` (``raymq.actors.ray_cluster_ops``). This actor only
delegates to them, and answers its leaders, followers and clients.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time

import ray
from raymq.actors.names import queue_actor_name
from raymq.actors.queue_actor import QueueActor
from raymq.actors.ray_cluster_ops import GONE as _GONE
from raymq.actors.ray_cluster_ops import RayClusterOps
from raymq.placement.nodes import choose_queue_node, pinned_to

from raymq import metrics
from raymq.config import STOP_SECONDS, BrokerConfig, QueueConfig, validate_queue_name
from raymq.core.hibernation import (
    HibernationPolicy,
    HibernationSettings,
    HibernationStats,
)
from raymq.core.registry import QueueEntry, QueueRegistry
from raymq.core.replication_controller import ReplicationController
from raymq.errors import BrokerUnavailable, NotLeader, QueueExists, QueueNotFound

#: Longest a queue's ``hibernate`` call (flush and close) and the release of its actor
#: name may take (seconds); past it the hibernation is given up (logged, counted).
HIBERNATE_SECONDS = 10.0
#: Longest an idleness probe may take; a queue that does not answer counts as busy
#: (seconds).
IDLE_PROBE_SECONDS = 2.0
#: Longest period of the hibernation sweep (seconds); shorter for a short
#: ``hibernate_after_seconds``.
SWEEP_PERIOD_SECONDS = 5.0


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
        # Replicated queues' sequences, over every Ray call they make (one wrapper).
        self._ops = RayClusterOps(namespace, config, self._registry)
        self._replication = ReplicationController(self._queues, self._ops)
        # Hibernation of idle unreplicated queues (raymq.core.hibernation).
        self._hibernation = HibernationPolicy(_hibernation_settings(config))
        #: Unreplicated queue -> lock around its revival and hibernation.
        self._queue_locks: dict[str, asyncio.Lock] = {}
        self._sweeper: asyncio.Task | None = None
        self._exporter: asyncio.Task | None = None
        self._counts = {"hibernations": 0, "revivals": 0, "refused": 0, "over_cap": 0}
        self._revival_seconds = 0.0
        self._find_running()

    def config(self) -> BrokerConfig:
        """The broker settings."""
        return self.broker_config

    def pid(self) -> int:
        """The actor's process id (for fault tests and diagnostics)."""
        return os.getpid()

    def _actor(self, name: str, cfg: QueueConfig, node_id: str):
        if cfg.replicas > 1:
            raise AssertionError("replicated queues start through ReplicationController")
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
                handle = await self._replication.create(cfg, node_id)
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
        self._replication.refuse_if_stopping(name)
        entry = self._queues[name]
        if entry.config.replicas > 1:
            return await self._replication.leader(name)
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
        return list(self._replication.failovers)

    # -- replicated queues: the controller (raymq.core.replication_controller) ----------

    async def begin_epoch(self, name: str, replica_id: str) -> tuple[int, tuple]:
        """A leader (re)starts: the next epoch (saved before it is given) and the
        current followers as (replica id, node id, actor handle). ``NotLeader`` if
        ``replica_id`` no longer leads the queue."""
        return self._replication.begin_epoch(name, replica_id)

    async def update_in_sync(self, name: str, epoch: int, in_sync: list[str]) -> bool:
        """A leader's in-sync replicas; False (fenced) if ``epoch`` is not current."""
        return self._replication.update_in_sync(name, epoch, in_sync)

    async def leader_silent(self, name: str, epoch: int) -> None:
        """A follower has not heard from the leader of ``epoch``: check it now."""
        await self._replication.leader_silent(name, epoch)

    async def suspect_leader(self, name: str, actor_id: str) -> bool:
        """A client could not reach the leader actor ``actor_id``: check it now.
        Returns False if the queue is not replicated (its actor restarts in place)."""
        return await self._replication.suspect_leader(name, actor_id)

    async def delete_queue(self, name: str) -> None:
        """Stop a queue's actor and delete its files and messages."""
        validate_queue_name(name)
        async with self._lock:
            if name not in self._queues:
                raise QueueNotFound(f"queue {name!r} does not exist")
            handle = await self.get_queue(name)
            async with self._replication.lock_of(name):  # no failover of what is deleted
                await self._replication.stop_followers(name, delete_files=True)
                await handle.shutdown.remote(delete_files=True)
                ray.kill(handle, no_restart=True)
                del self._queues[name]
                self._hibernation.stopped(name)
            shutil.rmtree(self._registry.directory(name), ignore_errors=True)

    async def stop_queues(self, timeout: float = STOP_SECONDS) -> None:
        """Stop every queue actor, keeping the files (``raymq stop``, test teardown).
        From the first moment nothing starts any more (``refuse_if_stopping``): no
        revival, failover, rejoin, follower or epoch. Each queue waits up to ``timeout``
        seconds for a revival or failover under way, then has ``timeout`` seconds to
        flush and close (``shutdown``); one that takes longer (a paused process, a leader
        waiting for replicas) is ended all the same, logged: one stuck queue must not
        hang the stop, nor one that fails stop the others. What it had not flushed is
        acknowledged sends' acks at most: those messages are delivered again."""
        # Stopped queues are not failed over nor hibernated.
        self._replication.stop()
        if self._sweeper is not None:
            self._sweeper.cancel()
        async with self._lock:
            for name in list(self._queues):
                entry = self._queues[name]
                lock = self._replication.lock_of(name) if entry.replicas else self._queue_lock(name)
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
            await asyncio.to_thread(self._ops.end_strays)

    async def _stop_queue(self, name: str, timeout: float) -> None:
        """Stop one queue's actors (``stop_queues``): its followers, then its actor if
        it runs (not if hibernated, or never started since the broker started)."""
        try:
            handle = ray.get_actor(queue_actor_name(name), namespace=self.namespace)
        except ValueError:
            handle = None
        try:
            await self._replication.stop_followers(name)
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
        stopping = self._replication.stopping
        if self._hibernation.settings.hibernate_after_seconds is None or stopping:
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
