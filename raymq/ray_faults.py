"""Ray's failures of a call on an actor, as the fault kinds of RayMQ's links
(``raymq.core.link.Fault``): written once for the client's link to a queue
(``raymq.client``) and a TargetList's (``raymq.actors.target_list_link``). The links
themselves are Ray-free; this is the one place that reads Ray's exceptions for them."""

from __future__ import annotations

import ray

from raymq.core.link import Fault

#: Ray's errors of an actor that cannot be reached (restarting, dead, its node gone).
ACTOR_FAULTS = (
    ray.exceptions.RayActorError,
    ray.exceptions.ActorUnavailableError,
    ray.exceptions.ActorUnschedulableError,
)


def fault_of(exc: BaseException) -> Fault:
    """The ``LinkFault`` kind of one of ``ACTOR_FAULTS``: restarting in place (the
    same actor comes back), moved (its node is gone), gone (dead)."""
    if isinstance(exc, ray.exceptions.ActorUnavailableError):
        return Fault.RESTARTING
    if isinstance(exc, ray.exceptions.ActorUnschedulableError):
        return Fault.MOVED
    return Fault.GONE


__all__ = ["ACTOR_FAULTS", "fault_of"]
