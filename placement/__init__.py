"""Placement: which node runs which RayMQ actor.

Queue actors are pinned (hard node affinity) to the node whose disk holds their
segment files; the choice of that node is made here and recorded with the queue.
A consumer's TargetList actor goes near the consumer (soft node affinity).
"""

from raymq.placement.nodes import (
    alive_nodes,
    choose_queue_node,
    current_node_id,
    near,
    object_store_by_node,
    pinned_to,
)

__all__ = [
    "alive_nodes",
    "choose_queue_node",
    "current_node_id",
    "near",
    "object_store_by_node",
    "pinned_to",
]
