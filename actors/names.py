"""The Ray actor names of the broker's actors, in one place: every module that finds an
actor by name imports them from here (not from the actor's module, which would tie the
actors' modules to each other: they imported each other for these constants).

All are looked up in the broker's namespace, except replicas (``"replication"``)."""

from __future__ import annotations

#: The broker (one per namespace, detached).
BROKER_ACTOR_NAME = "raymq.broker"
#: The MemoryGovernor (one per namespace, detached).
GOVERNOR_ACTOR_NAME = "raymq.governor"
#: The store of task statuses and results (one per namespace, detached; ``raymq.serve``).
TASK_RESULTS_ACTOR_NAME = "raymq.task_results"
#: A queue's (or an address's) actor: this prefix and the queue's name.
QUEUE_ACTOR_PREFIX = "raymq.queue."
#: A follower of a replicated queue: this prefix, the queue's name and the replica id.
REPLICA_ACTOR_PREFIX = "raymq.replica."


def queue_actor_name(queue: str) -> str:
    """Ray actor name of a queue's actor."""
    return QUEUE_ACTOR_PREFIX + queue


def replica_actor_name(queue: str, replica_id: str) -> str:
    """Ray actor name of one follower of a replicated queue."""
    return f"{REPLICA_ACTOR_PREFIX}{queue}.{replica_id}"
