"""Calls to RayMQ's actors: Ray's failures become the typed errors of
``raymq.errors`` (``_call``), and the restart grace every retry respects."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray

from raymq.errors import (
    BrokerUnavailable,
    NotEnoughReplicas,
    NotLeader,
    RayMQError,
    ray_reason,
)
from raymq.ray_faults import ACTOR_FAULTS, ActorNotFound, submit

#: How long a call keeps retrying while an actor restarts (seconds).
RESTART_GRACE_SECONDS = 60.0
_RETRYABLE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
#: Ray's errors of an actor that cannot be reached: ``LinkFault``s of a queue's link.
_FAULTS = ACTOR_FAULTS


def resent_refusal(error: Exception, lost: BaseException | None, queue: str) -> Exception:
    """The error of a send tried again after its connection was ``lost`` mid-send
    (None: it was not). A refusal of the second try (``NotEnoughReplicas``: a new
    leader whose followers catch up) says nothing of the first, which the old leader
    may have stored and replicated: its outcome is unknown, so the caller is told
    ``BrokerUnavailable`` (it may be delivered), never "not stored"."""
    if lost is None or not isinstance(error, NotEnoughReplicas):
        return error
    return BrokerUnavailable(
        f"queue {queue!r}: a send whose connection was lost ({lost}) was refused when"
        f" sent again ({error}); the first try may have been stored, and then is delivered"
    )


def _reason(exc: BaseException) -> str:
    """A Ray error in one line: its class and ``raymq.errors.ray_reason``."""
    return f"{type(exc).__name__}: {ray_reason(exc)}"


def _unwrap(exc: BaseException) -> BaseException:
    """The typed error inside a RayTaskError; ``BrokerUnavailable`` where the actor
    called (or one it called) was unavailable."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, RayMQError | TypeError | ValueError):
        return cause
    if isinstance(cause, _FAULTS):
        return BrokerUnavailable(f"actor unavailable: {_reason(cause)}")
    return exc


def _call(
    method,
    *args,
    retry: bool = True,
    refresh: Callable[[], Any] | None = None,
    about: str | None = None,
    **kwargs,
) -> Any:
    """Call an actor method and wait; typed errors unwrapped, restarts waited out.

    ``refresh`` gives the method again on a new actor when this one is unavailable or
    answers ``NotLeader`` (a replicated queue's leader moved): the call goes there.
    ``about`` names what the actor serves in the ``BrokerUnavailable`` raised when it
    cannot be reached ("queue 'orders'", say).
    """
    deadline = time.monotonic() + RESTART_GRACE_SECONDS
    delay = 0.05
    while True:
        try:
            try:
                return ray.get(submit(method, *args, **kwargs))
            except ray.exceptions.RayTaskError as exc:
                if isinstance(exc.cause, NotLeader) and refresh is not None:
                    raise exc.cause from None
                if not isinstance(exc.cause, _FAULTS):
                    raise _unwrap(exc) from None
                raise exc.cause from None  # an actor it called restarts: wait as for ours
        except (*_FAULTS, NotLeader) as exc:
            # An actor Ray cannot find (of a Ray session since shut down) never returns.
            if not retry or time.monotonic() > deadline or isinstance(exc, ActorNotFound):
                if isinstance(exc, NotLeader):
                    raise
                what = "actor unavailable" if about is None else f"{about}: actor unavailable"
                raise BrokerUnavailable(f"{what}: {exc}") from exc
            if refresh is not None:
                method = refresh()
                delay = min(delay, 0.2)
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
