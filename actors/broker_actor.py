"""BrokerActor: the named registry of a broker's queues and its settings.

One detached actor ``raymq.broker`` per namespace. It creates queue actors, finds them
again after a restart of the cluster (each queue directory holds a ``queue.json``), and
serializes create and delete so that ``create_queue`` is idempotent. It holds no
message: a crash of it loses nothing and it rebuilds its registry from the files.
"""

from __future__ import annotations

import asyncio
import os
import shutil

import ray
from raymq.actors.queue_actor import QueueActor, queue_actor_name
from raymq.placement.nodes import choose_queue_node, pinned_to

from raymq.config import BrokerConfig, QueueConfig, validate_queue_name
from raymq.core.registry import QueueEntry, QueueRegistry
from raymq.errors import BrokerUnavailable, QueueExists, QueueNotFound

BROKER_ACTOR_NAME = "raymq.broker"


@ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=100)
class BrokerActor:
    """Registry of queues: name -> (settings, node, actor handle)."""

    def __init__(self, config: BrokerConfig, namespace: str):
        self.broker_config = config
        self.namespace = namespace
        self._lock = asyncio.Lock()
        self._registry = QueueRegistry(config.paging_directory)
        self._queues: dict[str, QueueEntry] = self._registry.load()

    def config(self) -> BrokerConfig:
        """The broker settings."""
        return self.broker_config

    def pid(self) -> int:
        """The actor's process id (for fault tests and diagnostics)."""
        return os.getpid()

    def _actor(self, name: str, cfg: QueueConfig, node_id: str):
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
                handle = self._actor(cfg.name, existing.config, existing.node_id)
            else:
                per_node: dict[str, int] = {}
                for entry in self._queues.values():
                    per_node[entry.node_id] = per_node.get(entry.node_id, 0) + 1
                node = choose_queue_node(node_id, per_node)
                self._queues[cfg.name] = QueueEntry(cfg, node)
                self._registry.save(self._queues[cfg.name])
                handle = self._actor(cfg.name, cfg, node)
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
        handle = self._actor(name, entry.config, entry.node_id)
        await handle.ready.remote()
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

    def list_all(self) -> list[str]:
        """Names of all queues and addresses, sorted."""
        return sorted(self._queues)

    def queue_nodes(self) -> dict[str, str]:
        """The node each queue was placed on, by queue name."""
        return {name: entry.node_id for name, entry in sorted(self._queues.items())}

    async def delete_queue(self, name: str) -> None:
        """Stop a queue's actor and delete its files and messages."""
        validate_queue_name(name)
        async with self._lock:
            if name not in self._queues:
                raise QueueNotFound(f"queue {name!r} does not exist")
            handle = await self.get_queue(name)
            await handle.shutdown.remote(delete_files=True)
            ray.kill(handle, no_restart=True)
            del self._queues[name]
            shutil.rmtree(self._registry.directory(name), ignore_errors=True)

    async def stop_queues(self) -> None:
        """Stop every queue actor, keeping the files (``raymq stop``, test teardown)."""
        async with self._lock:
            for name in list(self._queues):
                try:
                    handle = ray.get_actor(queue_actor_name(name), namespace=self.namespace)
                except ValueError:
                    continue
                try:
                    await handle.shutdown.remote()
                finally:
                    ray.kill(handle, no_restart=True)
