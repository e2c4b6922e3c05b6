"""BrokerActor: the named registry of a broker's queues and its settings.

One detached actor ``raymq.broker`` per namespace. It creates queue actors, finds them
again after a restart of the cluster (each queue directory holds a ``queue.json``), and
serializes create and delete so that ``create_queue`` is idempotent. It holds no
message: a crash of it loses nothing and it rebuilds its registry from the files.

It also hibernates idle unreplicated queues (``raymq.core.hibernation``): at most
``max_active_queues`` queue actors run per node, and one idle for
``hibernate_after_seconds`` ends (its files stay). ``get_queue`` starts a hibernated
queue's actor again; clients reach it through their ``QueueLink``. Queues created or
revived together start side by side: the starts, sweeps and trims are
``raymq.core.hibernator``'s, without Ray; their Ray calls are ``RayQueueProcesses``.

For replicated queues it is the controller: the sequences (create, failover, rejoin,
trim, replace, restore) are ``raymq.core.replication_controller``'s, without Ray; their
Ray calls are ``RayClusterOps`` (``raymq.actors.ray_cluster_ops``). This actor only
delegates to them, and answers its leaders, followers and clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from dataclasses import asdict

import ray
from raymq.actors.names import TASK_RESULTS_ACTOR_NAME, queue_actor_name
from raymq.actors.ray_cluster_ops import RayClusterOps
from raymq.actors.ray_queue_processes import RayQueueProcesses
from raymq.actors.task_results_actor import TaskResultsActor
from raymq.placement.nodes import choose_queue_node, current_node_id, pinned_to

from raymq import metrics
from raymq.config import STOP_SECONDS, BrokerConfig, QueueConfig, validate_queue_name
from raymq.core.hibernation import HibernationSettings, HibernationStats
from raymq.core.hibernator import Hibernator
from raymq.core.leftovers import IN_THE_SET, REMOVABLE, Leftover, Leftovers
from raymq.core.registry import QueueEntry, QueueRegistry
from raymq.core.replication_controller import ReplicationController
from raymq.errors import BrokerUnavailable, QueueExists, QueueNotFound


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
        self._replication = ReplicationController(
            self._queues, self._ops, leftovers=Leftovers(config.paging_directory)
        )
        # Unreplicated queues' processes: started side by side, hibernated when idle
        # (raymq.core.hibernator; its Ray calls are RayQueueProcesses).
        self._hibernator = Hibernator(
            _hibernation_settings(config),
            RayQueueProcesses(namespace, config, self._registry, self._queues),
            stopping=lambda: self._replication.stopping,
        )
        self._hibernation = self._hibernator.policy
        self._exporter: asyncio.Task | None = None
        self._find_running()

    def config(self) -> BrokerConfig:
        """The broker settings."""
        return self.broker_config

    def task_results(self):
        """The handle of the store of task statuses and results (``raymq.serve``),
        started on this node, over a file in the paging directory, when first asked."""
        if self._replication.stopping:  # it would outlive the stop
            raise BrokerUnavailable("the broker is stopping: its task results are closed")
        return TaskResultsActor.options(
            name=TASK_RESULTS_ACTOR_NAME,
            namespace=self.namespace,
            lifetime="detached",
            get_if_exists=True,
            scheduling_strategy=pinned_to(current_node_id()),
        ).remote(self.broker_config.paging_directory)

    def pid(self) -> int:
        """The actor's process id (for fault tests and diagnostics)."""
        return os.getpid()

    async def create_queue(self, cfg: QueueConfig, node_id: str | None = None):
        """Create (or return, for equal settings) a queue; returns its actor handle.
        The broker's lock is held only while the queue is recorded (a replicated one:
        while its replicas start): unreplicated queues created together start their
        processes side by side (``Hibernator.handle``)."""
        async with self._lock:
            existing = self._queues.get(cfg.name)
            if existing is not None:
                if existing.config != cfg:
                    kind = "an address" if existing.config.address else "a queue"
                    raise QueueExists(
                        f"{cfg.name!r} exists, as {kind} with settings"
                        f" {existing.config.to_dict()}, not {cfg.to_dict()}"
                    )
            elif cfg.replicas > 1:
                handle = await self._replication.create(cfg, node_id)
                await handle.ready.remote()
                return handle
            else:
                per_node: dict[str, int] = {}
                for entry in self._queues.values():
                    per_node[entry.node_id] = per_node.get(entry.node_id, 0) + 1
                node = choose_queue_node(node_id, per_node)
                self._queues[cfg.name] = QueueEntry(cfg, node)
                self._registry.save(self._queues[cfg.name])
        # Its ready was awaited by _handle (a replicated leader's by the controller).
        return await self._handle(cfg.name, new=existing is None)

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
        entry = self._queues.get(name)
        if entry is None:  # deleted meanwhile (create_queue starts it after its lock)
            raise QueueNotFound(f"queue {name!r} does not exist (deleted)")
        if entry.config.replicas > 1:
            return await self._replication.leader(name)
        self._ensure_sweeper()
        return await self._hibernator.handle(name, new=new)

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

    async def leftovers(self) -> list[dict]:
        """Replicas' copies left on their nodes: queue, replica_id, node_id, why,
        since (seconds since the epoch) and what ``remove_leftovers`` would do
        (``verdict``)."""
        return [
            {**asdict(left), "verdict": verdict}
            for left, verdict in self._replication.leftover_verdicts()
        ]

    async def remove_leftovers(self, dry_run: bool = False) -> list[dict]:
        """Remove the copies left behind that no replica uses, each on its node (see
        ``leftovers``); a record of a copy in the replica set again is dropped. Returns
        each copy with its ``outcome``: "removed", "absent", "kept: <why>",
        "record dropped: in the replica set again" or "failed: <error>"."""
        out = []
        for left, verdict in self._replication.leftover_verdicts():
            outcome = f"kept: {verdict}"
            if not dry_run and verdict == IN_THE_SET:
                self._replication.leftovers.drop(*left.key)
                outcome = f"record dropped: {verdict}"
            elif not dry_run and verdict == REMOVABLE:
                outcome = await self._remove_leftover(left)
            elif dry_run and verdict == REMOVABLE:
                outcome = "would be removed"
            out.append({**asdict(left), "outcome": outcome})
        return out

    async def _remove_leftover(self, left: Leftover) -> str:
        # Under the queue's lock: no failover or replacement starts a replica there
        # meanwhile (it is checked again inside).
        async with self._replication.lock_of(left.queue):
            verdict = dict((x.key, v) for x, v in self._replication.leftover_verdicts()).get(
                left.key
            )
            if verdict != REMOVABLE:
                return f"kept: {verdict or 'gone'}"
            try:
                outcome = await self._ops.remove_copy(left.node_id, left.queue, left.replica_id)
            except Exception as exc:  # held, unremovable, its node not answering
                log.warning(
                    "removing %s/%s on %s failed: %s",
                    left.queue,
                    left.replica_id,
                    left.node_id,
                    exc,
                )
                return f"failed: {exc}"
            self._replication.leftovers.drop(*left.key)
            log.info(
                "replica %s's copy of %r on node %s: %s",
                left.replica_id,
                left.queue,
                left.node_id,
                outcome,
            )
            return outcome

    async def in_sync_replicas(self, name: str) -> list[str]:
        """The replica ids the controller holds in sync for queue ``name``."""
        return self._replication.in_sync_replicas(name)

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
        """Stop a queue's actor and delete its files and messages. A hibernated queue
        is not started for it: its files are deleted as they are."""
        validate_queue_name(name)
        async with self._lock:
            entry = self._queues.get(name)
            if entry is None:
                raise QueueNotFound(f"queue {name!r} does not exist")
            if entry.config.replicas > 1:
                handle = await self.get_queue(name)
                async with self._replication.lock_of(name):  # no failover of what is deleted
                    await self._replication.stop_followers(name, delete_files=True)
                    await handle.shutdown.remote(delete_files=True)
                    ray.kill(handle, no_restart=True)
                    del self._queues[name]
                    self._hibernation.stopped(name)
            else:
                await self._hibernator.delete(name, lambda: self._queues.pop(name, None))
            # In a thread: a deep queue's segment files take a while to unlink.
            await asyncio.to_thread(
                shutil.rmtree, self._registry.directory(name), ignore_errors=True
            )

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
        self._hibernator.stop_background()
        # A sequence cut short ends, as it unwinds, a follower it started outside the
        # set (stop_followers ends only what the set and its bookkeeping name).
        await self._replication.wait_stopped(timeout)
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
        # Task results: every write is on disk already, so ended, not asked to stop.
        with contextlib.suppress(ValueError):  # (never started)
            ray.kill(ray.get_actor(TASK_RESULTS_ACTOR_NAME, namespace=self.namespace))

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
        """The lock around an unreplicated queue's start, revival and hibernation."""
        return self._hibernator.lock_of(name)

    def _ensure_sweeper(self) -> None:
        """Start the metrics export and (with ``hibernate_after_seconds``) the sweep."""
        if self._exporter is None or self._exporter.done():
            self._exporter = asyncio.get_running_loop().create_task(self._export_metrics())
        self._hibernator.ensure_sweeper()

    async def _export_metrics(self) -> None:
        """Every ``metrics.EXPORT_PERIOD_SECONDS``, the ``raymq_broker_*`` gauges."""
        while True:
            with metrics.guard("broker hibernation"):
                metrics.export_hibernation(self.hibernation_stats(), self.namespace)
            await asyncio.sleep(metrics.EXPORT_PERIOD_SECONDS)

    async def hibernate(self, name: str) -> bool:
        """Hibernate queue ``name`` now if it is idle (tests, ``raymq``); returns True if
        it hibernated, False if it is busy, replicated or not running."""
        validate_queue_name(name)
        entry = self._queues.get(name)
        if entry is None:
            raise QueueNotFound(f"queue {name!r} does not exist")
        if entry.replicas is not None or not self._hibernation.is_active(name):
            return False
        return await self._hibernator.hibernate(name)

    async def set_hibernation(
        self, max_active_queues: int | None, hibernate_after_seconds: float | None
    ) -> None:
        """Change the hibernation settings of this broker actor (until it restarts;
        ``BrokerConfig`` holds the lasting ones). Applied from the next sweep or start."""
        self._hibernator.set_settings(
            HibernationSettings(max_active_queues, hibernate_after_seconds)
        )
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
        return self._hibernator.stats(
            [n for n, state in self.queue_states().items() if state == "hibernated"]
        )
