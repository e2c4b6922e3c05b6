"""BacklogAutoscalingPolicy: a task-consumer deployment scaled on its RayMQ queue.

Task handlers are not Serve requests, so Serve's default policy never sees a task
consumer's load. This class-based policy reads the queue's depth plus the messages in
flight (tasks waiting and tasks running) and asks for
``ceil(backlog / target_backlog_per_replica)`` replicas; Serve bounds that by
``min_replicas`` and ``max_replicas`` (0 allowed: scaled to zero when the queue is
empty, back to 1 at the first task) and applies its up- and downscale delays.

    autoscaling_config={
        "min_replicas": 0,
        "max_replicas": 8,
        "policy": {
            "policy_function": "raymq.serve:BacklogAutoscalingPolicy",
            "policy_kwargs": {"queue": "jobs", "target_backlog_per_replica": 10},
        },
    }

It runs in Serve's controller, on its event loop: the queue is asked by one-shot
asynchronous Ray calls at most every ``poll_interval_s``, never by a blocking call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray

from raymq.actors.names import BROKER_ACTOR_NAME
from raymq.core.tasks import replicas_for_backlog
from raymq.errors import InvalidSetting

log = logging.getLogger("raymq.serve")


class BacklogAutoscalingPolicy:
    """Serve autoscaling policy: replicas for the backlog of RayMQ queue ``queue``."""

    def __init__(
        self,
        queue: str,
        target_backlog_per_replica: float = 10.0,
        namespace: str = "raymq",
        poll_interval_s: float = 1.0,
    ):
        replicas_for_backlog(0, target_backlog_per_replica)  # (validates it)
        if not poll_interval_s > 0:
            raise InvalidSetting(f"poll_interval_s must be > 0, not {poll_interval_s}")
        self.queue = queue
        self.target = target_backlog_per_replica
        self.namespace = namespace
        self.poll_interval_s = poll_interval_s
        self.backlog = 0  # the last one read (messages)
        self.poll_failures = 0
        self._task: asyncio.Task | None = None
        self._broker: Any = None  # the broker actor's handle, once found
        self._polled_at = -float("inf")

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        """Serve's call (``AutoscalingContext``): the replicas wanted, and the state
        shown in Serve's status (the backlog it was computed from)."""
        now = time.monotonic()
        if (self._task is None or self._task.done()) and now - self._polled_at >= (
            self.poll_interval_s
        ):
            self._polled_at = now
            self._task = asyncio.get_running_loop().create_task(self._poll())
        return replicas_for_backlog(self.backlog, self.target), {"raymq_backlog": self.backlog}

    async def _poll(self) -> None:
        """Read the queue's depth plus in flight (a failure keeps the last figure)."""
        try:
            if self._broker is None:
                self._broker = ray.get_actor(BROKER_ACTOR_NAME, namespace=self.namespace)
            queue = await self._broker.get_queue.remote(self.queue)
            stats = await queue.stats.remote()
            self.backlog = stats.depth + stats.in_flight
        except Exception as exc:  # noqa: BLE001 - the broker may be restarting: try again
            self._broker = None  # found again next time
            self.poll_failures += 1
            log.warning("queue %r: backlog not read: %r", self.queue, exc)
