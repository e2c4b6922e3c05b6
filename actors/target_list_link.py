"""RayQueueEndpoint: a TargetList's queue as seen through Ray, for its link.

The link's decisions (register, fetch, follow, give back) are Ray-free, in
``raymq.core.target_list_link.TargetListLink``; this is what it calls: the queue
actor's methods by Ray, the FetchChannel opened, and the queue's actor looked up by
name (the broker starts a hibernated or ended queue again). Ray's failures become
``LinkFault``s (restarting, gone, moved, failed); the queue's typed errors pass as
they are.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

import numpy as np
import ray
from raymq.actors.names import BROKER_ACTOR_NAME, queue_actor_name

from raymq import metrics
from raymq.core.link import Fault, LinkFault
from raymq.core.target_list import FetchAnswer, FetchFailed
from raymq.core.target_list_link import ConsumerSpec, Endpoint
from raymq.errors import BrokerUnavailable, RayMQError, ray_reason
from raymq.ray_faults import ACTOR_FAULTS, fault_of, submit
from raymq.wire.fetch import FetchChannel, Registration

#: Longest a TargetList waits for its broker to start its queue's actor again (seconds):
#: a revival is a process start, a second or two here.
REVIVE_SECONDS = 60.0

T = TypeVar("T")


def _link_fault(exc: ray.exceptions.RayError) -> Exception:
    """What a Ray failure of a call on the queue's actor means to the link: the
    queue's typed error, or a ``LinkFault`` (``raymq.ray_faults``)."""
    if isinstance(exc, ray.exceptions.RayTaskError):  # (first: an instance of its cause)
        if isinstance(exc.cause, RayMQError):
            return exc.cause
        return LinkFault(Fault.FAILED, repr(exc.cause))
    if isinstance(exc, ACTOR_FAULTS):
        final = bool(getattr(exc, "actor_init_failed", False))  # it could not start again
        return LinkFault(fault_of(exc), ray_reason(exc), final=final)
    return LinkFault(Fault.FAILED, ray_reason(exc))


def _submit(method: Any, *args: Any) -> Any:
    """``method.remote(*args)``; Ray's refusal to submit it as the link's fault."""
    try:
        return submit(method, *args)
    except ray.exceptions.RayError as exc:
        raise _link_fault(exc) from None


async def _ray(call: Awaitable[T]) -> T:
    try:
        return await call
    except ray.exceptions.RayError as exc:
        raise _link_fault(exc) from None


async def _ray_call(method: Any, *args: Any) -> Any:
    """``method(*args)`` by Ray, awaited; Ray's failures as the link's faults."""
    return await _ray(_submit(method, *args))


class RayQueueEndpoint:
    """The queue's actor for one TargetList (``raymq.core.target_list_link.QueueEndpoint``).

    ``queue_actor``: its handle, or None to look it up by name in ``namespace`` when
    first needed (a TargetList started over its DeliveryChannel: an actor handle among
    a call's arguments costs the call milliseconds here). ``me``: the TargetList's own
    handle, which the registration hands the queue for its death watch."""

    def __init__(self, spec: ConsumerSpec, queue_actor: Any, namespace: str | None, me: Any):
        self.spec = spec
        self.queue_actor = queue_actor
        self._namespace = namespace
        self._me = me
        self._finding: asyncio.Future | None = None
        self._death = ""

    async def actor(self):
        """The queue's actor handle, looked up by name the first time if not given (one
        lookup for every caller waiting on it). Raises ``BrokerUnavailable`` if the
        queue's actor is not running."""
        if self.queue_actor is None:
            if self._finding is None:
                self._finding = asyncio.ensure_future(self._find())
            finding = self._finding
            try:
                found = await asyncio.shield(finding)
            except FetchFailed as exc:
                if self._finding is finding:
                    self._finding = None  # the next caller looks again
                raise exc.error from None
            if self.queue_actor is None:  # (not replaced meanwhile by a newer lookup)
                self.queue_actor = found
        return self.queue_actor

    async def broker_namespace(self) -> str:
        """The broker's Ray namespace, found once (blocking GCS calls, off the loop)
        while the queue actor is alive (``metrics.broker_of``)."""
        if self._namespace is None:
            queue_id = (await self.actor())._actor_id.hex()
            name = queue_actor_name(self.spec.queue)
            self._namespace = await asyncio.to_thread(metrics.broker_of, name, queue_id)
        return self._namespace

    async def register(self) -> Endpoint | None:
        spec = self.spec
        queue = await self.actor()
        return await _ray_call(
            queue.register_consumer,
            spec.consumer_id,
            spec.prefetch,
            spec.selector,
            self._me,
            spec.subscription,
        )

    async def find(self) -> None:
        self.queue_actor = await self._find()

    async def _find(self):
        """The queue's actor, looked up by name: started again (a restart, a revival)
        it is a new actor. If none runs, the broker starts it again (``get_queue``, at
        most ``REVIVE_SECONDS``): a consumer that lives is never left on a queue nobody
        revives. Raises ``FetchFailed`` with the broker's typed error, or
        ``BrokerUnavailable``."""
        name = queue_actor_name(self.spec.queue)
        namespace = await self.broker_namespace()
        try:
            return await asyncio.to_thread(ray.get_actor, name, namespace)
        except ValueError:
            pass
        try:
            broker = await asyncio.to_thread(ray.get_actor, BROKER_ACTOR_NAME, namespace)
            return await asyncio.wait_for(submit(broker.get_queue, self.spec.queue), REVIVE_SECONDS)
        except RayMQError as exc:  # (Ray's error for a typed one is one too)
            raise FetchFailed(getattr(exc, "cause", exc)) from None
        except (ValueError, TimeoutError, ray.exceptions.RayError) as exc:
            error = BrokerUnavailable(
                f"queue {self.spec.queue!r} is not running (no actor {name!r})"
                f" and its broker did not start it: {exc!r}"
            )
            raise FetchFailed(error) from None

    async def connect(
        self,
        endpoint: Endpoint,
        timeout: float,
        register: Registration | None = None,
        fetch: tuple | None = None,
    ) -> FetchChannel:
        return await FetchChannel.connect(
            *endpoint, self.spec.queue, timeout=timeout, register=register, fetch=fetch
        )

    async def fetch(self, args: tuple) -> tuple[Any, Any]:
        queue = await self.actor()
        return tuple(_submit(queue.fetch_batch.options(num_returns=2), *args))

    async def fetch_parked(self, token: int) -> tuple[Any, Any]:
        queue = await self.actor()
        return tuple(_submit(queue.fetch_parked.options(num_returns=2), token))

    async def answer(self, handle: Any) -> FetchAnswer:
        return await _ray(handle)

    async def give_back(self, offsets: np.ndarray) -> None:
        spec = self.spec
        queue = await self.actor()
        await _ray_call(queue.give_back, spec.consumer_id, offsets, spec.subscription)

    async def close_consumer(self, offsets: np.ndarray) -> int:
        spec = self.spec
        queue = await self.actor()
        return await _ray_call(queue.close_consumer, spec.consumer_id, offsets, spec.subscription)

    async def consumer_stats(self) -> dict:
        spec = self.spec
        queue = await self.actor()
        return await _ray_call(queue.consumer_stats, spec.consumer_id, spec.subscription)
