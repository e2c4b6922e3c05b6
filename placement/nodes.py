"""Node lookups and scheduling strategies for RayMQ actors."""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


def current_node_id() -> str:
    """Hex id of the node this process runs on."""
    return ray.get_runtime_context().get_node_id()


def alive_nodes() -> list[dict]:
    """Ray's records of the nodes that are alive."""
    return [n for n in ray.nodes() if n.get("Alive")]


def choose_queue_node(preferred_node_id: str | None = None) -> str:
    """The node a new queue's files (and so its actor) live on.

    The node named by the caller if it is alive, else the node of the calling process
    (the broker actor's node for queues it creates).
    """
    if preferred_node_id and any(n["NodeID"] == preferred_node_id for n in alive_nodes()):
        return preferred_node_id
    return current_node_id()


def pinned_to(node_id: str) -> NodeAffinitySchedulingStrategy:
    """Hard affinity: the actor runs on ``node_id`` or not at all (its files are there)."""
    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


def near(node_id: str | None = None) -> NodeAffinitySchedulingStrategy:
    """Soft affinity for a consumer's TargetList actor: on ``node_id`` (default: the
    calling process's node, so delivery batches are read from the local object store
    without a copy), elsewhere if that node cannot take it."""
    return NodeAffinitySchedulingStrategy(node_id=node_id or current_node_id(), soft=True)
