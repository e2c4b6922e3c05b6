"""RayQueueProcesses: the Hibernator's operations on queue processes as Ray calls.

Every Ray call of ``raymq.core.hibernator`` is here, so that its starts, sweeps and
trims run against fake processes in tests (``tests/test_hibernator.py``), as the
replication controller's run against a fake cluster (``ray_cluster_ops``). Each
waiting call has its own bound.
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray
from raymq.actors.names import queue_actor_name
from raymq.actors.queue_actor import QueueActor
from raymq.actors.ray_cluster_ops import GONE
from raymq.placement.nodes import choose_queue_node, pinned_to

from raymq.config import BrokerConfig, QueueConfig
from raymq.core.hibernator import Closed, Handle, Unreachable
from raymq.core.registry import QueueEntry, QueueRegistry
from raymq.errors import BrokerUnavailable, NotLeader, QueueNotFound

#: Longest a queue's ``hibernate`` call (flush and close) and the release of its actor
#: name may take (seconds); past it the hibernation is given up (logged, counted).
HIBERNATE_SECONDS = 10.0
#: Longest an idleness probe may take; a queue that does not answer counts as busy
#: (seconds).
IDLE_PROBE_SECONDS = 2.0

log = logging.getLogger("raymq.broker")


class RayQueueProcesses:
    """``QueueProcesses`` for one broker's unreplicated queues (its namespace). It
    reads (and, when a queue moves, writes) the broker's registry: ``queues`` is the
    broker's own dict."""

    def __init__(
        self,
        namespace: str,
        broker_config: BrokerConfig,
        registry: QueueRegistry,
        queues: dict[str, QueueEntry],
    ):
        self.namespace = namespace
        self.broker_config = broker_config
        self.registry = registry
        self.queues = queues

    def start(self, name: str) -> tuple[Handle, str]:
        """See ``QueueProcesses``: the named actor, made if none holds the name."""
        entry = self.queues.get(name)
        if entry is None:
            raise QueueNotFound(f"queue {name!r} does not exist (deleted)")
        cfg = entry.config
        if cfg.replicas > 1:
            raise AssertionError("replicated queues start through ReplicationController")
        home = choose_queue_node(entry.node_id)
        if home != entry.node_id:
            self._move_here(name, cfg, entry.node_id, home)
        handle = QueueActor.options(
            name=queue_actor_name(name),
            namespace=self.namespace,
            lifetime="detached",
            get_if_exists=True,
            scheduling_strategy=pinned_to(home),
        ).remote(cfg, self.broker_config, self.namespace)
        return handle, home

    def _move_here(self, name: str, cfg: QueueConfig, gone: str, here: str) -> None:
        """A queue's node is not alive: start it on this node only if its files are here
        (one machine whose Ray restarted with a new node id, or a paging directory every
        node mounts), and record the move; else refuse, rather than start it empty."""
        if not self.registry.has_files(name):
            raise BrokerUnavailable(
                f"queue {name!r} lives on node {gone[:12] or '?'}, which is not alive, and"
                f" its files are not in {self.registry.directory(name)} on this node: it is"
                " unavailable until that node is back"
            )
        self.queues[name] = QueueEntry(cfg, here)
        self.registry.save(self.queues[name])

    async def ready(self, handle: Handle) -> None:
        """See ``QueueProcesses`` (not bounded: a recovery takes what it takes)."""
        try:
            await handle.ready.remote()
        except (NotLeader, ray.exceptions.RayTaskError) as exc:
            if isinstance(getattr(exc, "cause", exc), NotLeader):
                raise Closed(str(exc)) from None
            raise

    def find(self, name: str) -> Handle | None:
        """See ``QueueProcesses`` (a short blocking GCS call)."""
        try:
            return ray.get_actor(queue_actor_name(name), namespace=self.namespace)
        except ValueError:
            return None

    def same(self, a: Handle, b: Handle) -> bool:
        """See ``QueueProcesses``."""
        return a._actor_id == b._actor_id

    async def idle_seconds(self, handle: Handle) -> float | None:
        """See ``QueueProcesses`` (at most ``IDLE_PROBE_SECONDS``)."""
        try:
            return await asyncio.wait_for(handle.idle_seconds.remote(), IDLE_PROBE_SECONDS)
        except (TimeoutError, *GONE):
            return None

    async def hibernate(self, handle: Handle) -> bool:
        """See ``QueueProcesses`` (at most ``HIBERNATE_SECONDS``)."""
        try:
            return await asyncio.wait_for(handle.hibernate.remote(), HIBERNATE_SECONDS)
        except (TimeoutError, *GONE) as exc:
            raise Unreachable(repr(exc)) from None

    async def delete_files(self, name: str, handle: Handle) -> None:
        """See ``QueueProcesses`` (at most ``HIBERNATE_SECONDS``)."""
        try:
            await asyncio.wait_for(handle.shutdown.remote(delete_files=True), HIBERNATE_SECONDS)
        except Exception as exc:  # gone, silent, or closed for a hibernation (NotLeader)
            log.warning("queue %r: its actor did not delete its files: %r; ended", name, exc)

    async def end(self, name: str, handle: Handle) -> None:
        """See ``QueueProcesses``: killed, then its name polled (up to
        ``HIBERNATE_SECONDS``; logged if it is still held)."""
        ray.kill(handle, no_restart=True)
        deadline = time.monotonic() + HIBERNATE_SECONDS
        while time.monotonic() < deadline:
            if await asyncio.to_thread(self.find, name) is None:
                return  # the name is free
            await asyncio.sleep(0.02)
        log.warning(
            "queue %r: its actor name is not released %.0f s after a kill", name, HIBERNATE_SECONDS
        )
