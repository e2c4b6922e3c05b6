"""Ray's failures of a call on an actor, as the fault kinds of RayMQ's links
(``raymq.core.link.Fault``): written once for the client's link to a queue
(``raymq.client``) and a TargetList's (``raymq.actors.target_list_link``). The links
themselves are Ray-free; this is the one place that reads Ray's exceptions for them."""

from __future__ import annotations

from typing import Any

import ray

from raymq.core.link import Fault
from raymq.errors import ray_reason

#: Ray's errors of an actor that cannot be reached (restarting, dead, its node gone).
ACTOR_FAULTS = (
    ray.exceptions.RayActorError,
    ray.exceptions.ActorUnavailableError,
    ray.exceptions.ActorUnschedulableError,
)

#: How Ray's message begins when it will not submit a call to an actor it does not know.
_SUBMIT_REFUSED = "Failed to submit task to actor"


class ActorNotFound(ray.exceptions.RayActorError):
    """Ray would not submit a call: it knows no such actor (dead and forgotten, or an
    actor of a Ray session since shut down). Ray raises a bare ``Exception`` for it
    from ``.remote()`` itself, not from the call's result; as a ``RayActorError`` it
    is one of ``ACTOR_FAULTS`` (gone), which every link already follows or reports."""


def submit(method: Any, *args: Any, **kwargs: Any) -> Any:
    """``method.remote(*args, **kwargs)``: the call's ``ObjectRef``; raises
    ``ActorNotFound`` where Ray refuses to submit it to an actor it cannot find."""
    try:
        return method.remote(*args, **kwargs)
    except Exception as exc:
        # Matched narrowly: Ray raises a plain Exception here, with this message.
        if type(exc) is Exception and str(exc).startswith(_SUBMIT_REFUSED):
            raise ActorNotFound(error_msg=ray_reason(exc)) from None
        raise


def fault_of(exc: BaseException) -> Fault:
    """The ``LinkFault`` kind of one of ``ACTOR_FAULTS``: restarting in place (the
    same actor comes back), moved (its node is gone), gone (dead)."""
    if isinstance(exc, ray.exceptions.ActorUnavailableError):
        return Fault.RESTARTING
    if isinstance(exc, ray.exceptions.ActorUnschedulableError):
        return Fault.MOVED
    return Fault.GONE


__all__ = ["ACTOR_FAULTS", "ActorNotFound", "fault_of", "submit"]
