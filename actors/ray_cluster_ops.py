"""RayClusterOps: the replication controller's cluster operations as Ray calls.

Every Ray call of ``raymq.core.replication_controller`` is here, so that its sequences
run against a fake cluster in tests (Ray Serve keeps its replicas' Ray calls in
``ActorReplicaWrapper`` for the same reason). Each waiting call has its own bound and
turns a timeout or a gone actor into ``Unreachable``; other errors pass through.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
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
from raymq.placement.nodes import alive_nodes, pinned_to

from raymq.config import BrokerConfig
from raymq.core.cluster_ops import (
    REPLICA_PING_TIMEOUT_SECONDS,
    FollowerRef,
    Handle,
    Unreachable,
)
from raymq.core.leftovers import remove_replica_copy
from raymq.core.registry import QueueEntry, QueueRegistry

#: Errors of a call to an actor that is gone (or whose node is).
GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
#: How long a fresh leader's start waits for its old actor's name to be released
#: (seconds).
NAME_RELEASE_SECONDS = 10.0

#: How long removing a copy left behind may take on its node (seconds).
REMOVE_COPY_SECONDS = 60.0

log = logging.getLogger("raymq.broker")


@ray.remote(num_cpus=0, max_retries=0)
def _remove_replica_copy(paging_directory: str, queue: str, rid: str) -> str:
    """``raymq.core.leftovers.remove_replica_copy`` on the node this task runs on."""
    return remove_replica_copy(paging_directory, queue, rid)


async def _bounded(call, timeout: float | None):
    """``call``'s answer within ``timeout`` seconds, else ``Unreachable`` (also if
    its actor is gone)."""
    try:
        return await asyncio.wait_for(call, timeout)
    except (TimeoutError, *GONE) as exc:
        raise Unreachable(repr(exc)) from None


class RayClusterOps:
    """``ClusterOps`` for the queue and replica actors of one broker (its namespace)."""

    def __init__(self, namespace: str, broker_config: BrokerConfig, registry: QueueRegistry):
        self.namespace = namespace
        self.broker_config = broker_config
        self.registry = registry

    def alive_nodes(self) -> list[str]:
        """See ``ClusterOps`` (a blocking GCS call, short)."""
        return [n["NodeID"] for n in alive_nodes()]

    def save(self, entry: QueueEntry) -> None:
        """See ``ClusterOps``: the queue's ``queue.json``."""
        self.registry.save(entry)

    def find_leader(self, name: str) -> Handle | None:
        """See ``ClusterOps``."""
        try:
            return ray.get_actor(queue_actor_name(name), namespace=self.namespace)
        except ValueError:
            return None

    def actor_id(self, handle: Handle) -> str:
        """See ``ClusterOps``."""
        return handle._actor_id.hex()

    def find_follower(self, name: str, rid: str) -> Handle | None:
        """See ``ClusterOps``."""
        try:
            return ray.get_actor(replica_actor_name(name, rid), namespace=self.namespace)
        except ValueError:
            return None

    def start_follower(self, name: str, rid: str, node: str, epoch: int) -> Handle:
        """See ``ClusterOps``: a detached ReplicaActor pinned to ``node``."""
        return ReplicaActor.options(
            name=replica_actor_name(name, rid),
            namespace=self.namespace,
            lifetime="detached",
            get_if_exists=True,
            scheduling_strategy=pinned_to(node),
        ).remote(name, rid, self.registry.replica_directory(name, rid), epoch, self.namespace)

    def wake_follower(self, handle: Handle) -> None:
        """See ``ClusterOps``."""
        handle.ready.remote()

    async def follower_ready(self, handle: Handle, timeout: float) -> None:
        """See ``ClusterOps``."""
        await _bounded(handle.ready.remote(), timeout)

    async def start_leader(
        self, entry: QueueEntry, followers: tuple[FollowerRef, ...], fresh: bool
    ) -> Handle:
        """See ``ClusterOps``: a detached QueueActor with its ``LeaderRole``, pinned to
        the leader's node; a fresh one retries while the old one's name is released
        (``ValueError`` after ``NAME_RELEASE_SECONDS``)."""
        name, rs = entry.config.name, entry.replicas
        role = LeaderRole(
            rs.leader, self.registry.replica_directory(name, rs.leader), rs.epoch, followers
        )
        deadline = time.monotonic() + NAME_RELEASE_SECONDS
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

    async def leader_ready(self, handle: Handle, timeout: float | None) -> None:
        """See ``ClusterOps``."""
        if timeout is None:
            await handle.ready.remote()
        else:
            await _bounded(handle.ready.remote(), timeout)

    async def wait_in_sync(self, leader: Handle, replicas: int, timeout: float) -> list[str]:
        """See ``ClusterOps``."""
        return await leader.wait_in_sync.remote(replicas, timeout)

    async def set_followers(
        self, leader: Handle, epoch: int, followers: tuple[FollowerRef, ...]
    ) -> None:
        """See ``ClusterOps``."""
        await leader.set_followers.remote(epoch, followers)

    async def ping(self, handle: Handle) -> int | None:
        """See ``ClusterOps``."""
        try:
            return await _bounded(handle.ping.remote(), REPLICA_PING_TIMEOUT_SECONDS)
        except Unreachable:
            return None

    async def fence(self, handle: Handle, epoch: int) -> int:
        """See ``ClusterOps``."""
        state = await _bounded(handle.fence.remote(epoch), REPLICA_PING_TIMEOUT_SECONDS * 2)
        return state.end_offset

    async def release(self, handle: Handle) -> None:
        """See ``ClusterOps``."""
        await _bounded(handle.release.remote(), REPLICA_PING_TIMEOUT_SECONDS * 5)

    async def shutdown_replica(self, handle: Handle, delete_files: bool) -> None:
        """See ``ClusterOps``."""
        await _bounded(handle.shutdown.remote(delete_files), REPLICA_PING_TIMEOUT_SECONDS * 5)

    async def remove_copy(self, node: str, queue: str, rid: str) -> str:
        """Remove replica ``rid``'s copy of ``queue`` on ``node`` (by a task pinned
        there): "removed" or "absent"; ``StorageError`` if a queue process holds it or
        it cannot be removed, ``Unreachable`` if the node does not answer in time."""
        paging = self.broker_config.paging_directory
        ref = _remove_replica_copy.options(scheduling_strategy=pinned_to(node)).remote(
            paging, queue, rid
        )
        return await _bounded(ref, REMOVE_COPY_SECONDS)

    def kill(self, handle: Handle) -> None:
        """See ``ClusterOps``."""
        ray.kill(handle, no_restart=True)

    def end_strays(self) -> None:
        """End any queue or replica actor of this broker still running after the stop,
        which would outlive ``raymq stop`` holding its files. A safety net: a follower
        was left so in 1 of 4 runs of the replication scenario, by a controller
        sequence the stop cancelled between starting a follower and recording it (or
        retiring one and ending it); the controller now ends those itself
        (``ReplicationController.stop_followers``, ``wait_stopped``). What it ends is
        logged; blocking GCS calls: run off the event loop."""
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
