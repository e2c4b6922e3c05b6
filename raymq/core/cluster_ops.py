"""ClusterOps: the cluster operations the replication controller's sequences need.

``raymq.core.replication_controller`` reaches actors and nodes only through this
interface: the broker actor passes ``RayClusterOps`` (``raymq.actors.ray_cluster_ops``,
every Ray call), tests a fake cluster (``tests/test_replication_controller.py``). An
actor handle is opaque to the controller: it only passes it back.
"""

from __future__ import annotations

from typing import Any, Protocol

from raymq.core.registry import QueueEntry

#: A leader (or follower) that does not answer a ping in this long is taken for lost
#: (seconds); a false alarm costs a failover, never data (epochs fence the old one).
REPLICA_PING_TIMEOUT_SECONDS = 1.0

#: An actor handle, opaque here: only ``ClusterOps`` looks inside.
Handle = Any
#: What a leader is told of each follower: (replica id, node id, follower handle).
FollowerRef = tuple[str, str, Handle]


class Unreachable(Exception):
    """A replica or leader did not answer in time, or its actor is gone."""


class ClusterOps(Protocol):
    """The cluster operations the controller's sequences need. The synchronous ones
    return at once (a lookup, a start that does not wait, a kill); the others wait for
    an actor, each at most its own bounded time, and raise ``Unreachable`` when it does
    not answer."""

    def alive_nodes(self) -> list[str]:
        """Ids of the nodes the cluster takes for alive."""

    def save(self, entry: QueueEntry) -> None:
        """Write a queue's entry (its ``ReplicaSet`` included) durably."""

    def find_leader(self, name: str) -> Handle | None:
        """The queue's leader actor if one holds its name, else None."""

    def actor_id(self, handle: Handle) -> str:
        """An actor's id, as clients report it (``suspect_leader``)."""

    def find_follower(self, name: str, rid: str) -> Handle | None:
        """Follower ``rid``'s actor if it runs, else None."""

    def start_follower(self, name: str, rid: str, node: str, epoch: int) -> Handle:
        """Follower ``rid``'s actor on ``node`` (the running one if any); its start
        is not waited for."""

    def wake_follower(self, handle: Handle) -> None:
        """Ask a follower to open its files and watch its leader; no wait (a lost node
        never answers)."""

    async def follower_ready(self, handle: Handle, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for a follower's files to be open."""

    async def start_leader(
        self, entry: QueueEntry, followers: tuple[FollowerRef, ...], fresh: bool
    ) -> Handle:
        """The leader actor of ``entry.replicas.leader`` on its node, in the set's
        epoch, with ``followers``; the running one unless ``fresh`` (then a new one,
        once the old one's name is free)."""

    async def leader_ready(self, handle: Handle, timeout: float | None) -> None:
        """Wait until a leader has started; with a ``timeout`` (seconds),
        ``Unreachable`` after it. Without, its own errors pass through."""

    async def wait_in_sync(self, leader: Handle, replicas: int, timeout: float) -> list[str]:
        """Up to ``timeout`` seconds for ``replicas`` replicas in sync; the in-sync ids."""

    async def set_followers(
        self, leader: Handle, epoch: int, followers: tuple[FollowerRef, ...]
    ) -> None:
        """Hand a leader its followers (ignored by one not in ``epoch``)."""

    async def ping(self, handle: Handle) -> int | None:
        """A replica's epoch (a leader's: -1 once fenced), None if no answer within
        ``REPLICA_PING_TIMEOUT_SECONDS``."""

    async def fence(self, handle: Handle, epoch: int) -> int:
        """Make a follower refuse epochs before ``epoch``; where its copy ends (next
        offset)."""

    async def release(self, handle: Handle) -> None:
        """Make a follower close its files (its copy is about to lead)."""

    async def shutdown_replica(self, handle: Handle, delete_files: bool) -> None:
        """Close a follower's files (and delete its copy)."""

    def kill(self, handle: Handle) -> None:
        """End an actor for good (no restart)."""


__all__ = ["REPLICA_PING_TIMEOUT_SECONDS", "ClusterOps", "FollowerRef", "Handle", "Unreachable"]
