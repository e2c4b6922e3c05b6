"""The replication controller's decisions, without Ray: where a replicated queue's
replicas go, which follower a failover promotes, where a lost replica is replaced.

``ReplicationController`` (``raymq.core.replication_controller``) applies them for the
broker actor, and keeps a ``ReplicaSet`` per replicated queue in the queue's
``queue.json``, written before any actor hears of a change: an epoch, once given, is
never given again, also across a broker restart.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field


class NoNodes(Exception):
    """Too few alive nodes to hold the replicas apart."""


@dataclass
class ReplicaSet:
    """A replicated queue's replicas, each on its own node."""

    #: The current epoch: the leader that holds it is the only one whose commits the
    #: followers accept.
    epoch: int
    #: The leader's replica id.
    leader: str
    #: Replica id -> node id.
    nodes: dict[str, str]
    #: Replicas known to hold every acknowledged send (the leader tells, before it
    #: answers a send without one of them). Only these may be promoted.
    in_sync: list[str] = field(default_factory=list)
    #: The number of the next replica id (``r<n>``): ids are never reused.
    next_id: int = 0

    def to_dict(self) -> dict:
        """As stored in ``queue.json``."""
        return {
            "epoch": self.epoch,
            "leader": self.leader,
            "nodes": dict(self.nodes),
            "in_sync": list(self.in_sync),
            "next_id": self.next_id,
        }

    @classmethod
    def from_dict(cls, saved: dict) -> ReplicaSet:
        """From ``queue.json``."""
        return cls(
            saved["epoch"],
            saved["leader"],
            dict(saved["nodes"]),
            list(saved.get("in_sync", [])),
            saved.get("next_id", len(saved["nodes"])),
        )

    @property
    def followers(self) -> list[str]:
        """Follower replica ids, in order."""
        return sorted(r for r in self.nodes if r != self.leader)

    @property
    def leader_node(self) -> str:
        """The leader's node id."""
        return self.nodes[self.leader]

    @classmethod
    def place(
        cls,
        replicas: int,
        alive: list[str],
        queues_per_node: dict[str, int],
        preferred: str | None = None,
        suspect: Collection[str] = (),
    ) -> ReplicaSet:
        """``replicas`` replicas on distinct alive nodes, the fewest queues first (the
        leader on ``preferred`` if it is alive). Nodes in ``suspect`` (where a replica
        was lost lately: Ray may not know yet that they are gone) come last, and never
        take the leader, which must start for the queue to serve; a follower that does
        not start is replaced. Raises ``NoNodes``."""
        nodes = set(alive)
        if len(nodes) < replicas or not nodes - set(suspect):
            lately = len(nodes & set(suspect))
            raise NoNodes(
                f"{replicas} replicas need {replicas} alive nodes; {len(nodes)} are"
                + (f" ({lately} where a replica was lost lately)" if lately else "")
            )
        order = sorted(
            nodes,
            key=lambda n: (n in suspect, n != preferred, queues_per_node.get(n, 0), n),
        )
        nodes = {f"r{i}": node for i, node in enumerate(order[:replicas])}
        return cls(1, "r0", nodes, ["r0"], replicas)

    def add_replica(
        self, alive: list[str], queues_per_node: dict[str, int], lost: tuple[str, ...] = ()
    ) -> str:
        """A new follower on an alive node holding no replica of this queue, and not
        one of the ``lost`` nodes (Ray may not know yet that they are gone); returns its
        id. Raises ``NoNodes``."""
        used = set(self.nodes.values()) | set(lost)
        free = sorted(
            (n for n in set(alive) if n not in used), key=lambda n: (queues_per_node.get(n, 0), n)
        )
        if not free:
            raise NoNodes(
                f"no alive node without a replica ({len(set(alive))} alive, {len(used)} used)"
            )
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.nodes[rid] = free[0]
        return rid

    def remove_replica(self, rid: str) -> None:
        """Forget a (lost) follower."""
        self.nodes.pop(rid, None)
        if rid in self.in_sync:
            self.in_sync.remove(rid)

    def promote(self, ends: dict[str, int]) -> str | None:
        """Start the next epoch with a new leader: of the in-sync followers that
        answered (``ends``: replica id -> where its copy ends), the most complete. The
        old leader leaves the set (its node is presumed lost; a new follower replaces
        it). Returns the new leader, or None (the epoch still moves on: the old leader
        is fenced all the same) if no in-sync follower answered."""
        self.epoch += 1
        candidates = [r for r in ends if r in self.in_sync and r != self.leader and r in self.nodes]
        if not candidates:
            return None
        new = max(candidates, key=lambda r: (ends[r], r))
        self.remove_replica(self.leader)
        self.leader = new
        self.in_sync = [new]  # the others are caught up to it first
        return new
