"""Tasks on a queue, without Ray: the message a task travels in, its statuses and its
retry schedule.

Ray Serve's task consumers (``raymq.serve``) take tasks from a RayMQ queue. A task is
one message: its body is the task (``TaskEnvelope``, msgpack), and its id and name are
also properties (``RayMQTaskId``, ``RayMQTaskName``), so that selectors, ``browse`` and
dead letters show them without decoding the body. Statuses are Celery's, which
``ray.serve.schema.TaskResult`` reports: PENDING, STARTED, SUCCESS, FAILURE, CANCELLED.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgpack

from raymq.errors import InvalidSetting

#: Property naming the task a message carries (and each of its dead letters).
TASK_ID_PROPERTY = "RayMQTaskId"
#: Property naming the task's handler (``@task_handler(name=...)``).
TASK_NAME_PROPERTY = "RayMQTaskName"

PENDING = "PENDING"
STARTED = "STARTED"
SUCCESS = "SUCCESS"
FAILURE = "FAILURE"
CANCELLED = "CANCELLED"
#: Statuses after which a task never runs again.
FINAL = frozenset({SUCCESS, FAILURE, CANCELLED})
STATUSES = frozenset({PENDING, STARTED, *FINAL})

#: The result store's calls that may share one actor call (``TaskResultsActor.batch``):
#: a task's start and finish, and reads. Not ``cancel``: it is never sent twice.
BATCHED = frozenset({"start", "finish", "get"})


class UndecodableTask(ValueError):
    """A message whose body is not a task (``TaskEnvelope.decode``)."""


@dataclass(frozen=True)
class TaskEnvelope:
    """One task: what ``enqueue_task_sync`` sends and a task consumer runs."""

    name: str
    args: list = field(default_factory=list)
    kwargs: dict = field(default_factory=dict)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created_at: float = 0.0  # epoch seconds

    def encode(self) -> bytes:
        """The message body (msgpack). ``TypeError`` naming the task if an argument is
        not msgpack's (str, bytes, numbers, bool, None, lists and dicts of them)."""
        try:
            return msgpack.packb(
                [1, self.id, self.name, list(self.args), dict(self.kwargs), self.created_at],
                use_bin_type=True,
            )
        except (TypeError, ValueError, OverflowError) as exc:
            raise TypeError(
                f"task {self.name!r}: its arguments must be msgpack values"
                f" (str, bytes, numbers, bool, None, lists, dicts): {exc}"
            ) from None

    @classmethod
    def decode(cls, body: bytes) -> TaskEnvelope:
        """The task in a message ``body``; ``UndecodableTask`` if it holds none."""
        try:
            fields = msgpack.unpackb(body, raw=False, strict_map_key=False)
        except Exception as exc:  # noqa: BLE001 - msgpack raises several kinds
            raise UndecodableTask(f"not a task: {exc!r:.200}") from None
        if not (
            isinstance(fields, list)
            and len(fields) == 6
            and fields[0] == 1
            and isinstance(fields[1], str)
            and isinstance(fields[2], str)
            and isinstance(fields[3], list)
            and isinstance(fields[4], dict)
            and isinstance(fields[5], int | float)
        ):
            raise UndecodableTask(f"not a task (version 1): {fields!r:.200}")
        _, task_id, name, args, kwargs, created_at = fields
        return cls(name, args, kwargs, task_id, float(created_at))

    def properties(self) -> dict[str, str]:
        """The message properties that name this task."""
        return {TASK_ID_PROPERTY: self.id, TASK_NAME_PROPERTY: self.name}


@dataclass(frozen=True)
class RetryPolicy:
    """When a failed task runs again: after ``retry_delay_s * retry_backoff**n``
    seconds (n = 0 for the first retry), at most ``max_retry_delay_s``, for up to
    ``max_retries`` retries (so ``1 + max_retries`` runs in all)."""

    max_retries: int = 3
    retry_delay_s: float = 1.0
    retry_backoff: float = 2.0
    max_retry_delay_s: float = 60.0

    def __post_init__(self) -> None:
        if isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int):
            raise InvalidSetting(f"max_retries must be an int >= 0, not {self.max_retries!r}")
        if self.max_retries < 0:
            raise InvalidSetting(f"max_retries must be >= 0, not {self.max_retries}")
        for name in ("retry_delay_s", "retry_backoff", "max_retry_delay_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidSetting(f"{name} must be a number, not {value!r}")
            if not math.isfinite(value) or value < 0:
                raise InvalidSetting(f"{name} must be finite and >= 0, not {value}")
        if self.retry_backoff < 1:
            raise InvalidSetting(f"retry_backoff must be >= 1, not {self.retry_backoff}")

    def retries_left(self, runs: int) -> bool:
        """Whether a task that failed on its ``runs``-th run (1 = the first) runs again."""
        return runs <= self.max_retries

    def delay(self, runs: int) -> float:
        """Seconds to wait before the run after the ``runs``-th (1 = after the first)."""
        exponent = max(runs - 1, 0)
        try:
            wait = self.retry_delay_s * self.retry_backoff**exponent
        except OverflowError:
            wait = math.inf
        return min(wait, self.max_retry_delay_s)


@dataclass(frozen=True)
class TaskRecord:
    """What the result store holds of one task (``raymq.storage.task_results``)."""

    id: str
    status: str
    name: str = ""
    created_at: float = 0.0  # epoch seconds
    updated_at: float = 0.0  # epoch seconds
    runs: int = 0  # times a handler started it (retries and redeliveries counted)
    result: Any = None  # the handler's return value (SUCCESS)
    error_type: str | None = None  # the exception's type (FAILURE)
    error: str | None = None  # its text
    traceback: str | None = None


def pack_result(task_id: str, result: Any) -> bytes:
    """A task's result as the store keeps it (msgpack); ``TypeError`` naming the task
    if it is not a msgpack value."""
    try:
        return msgpack.packb(result, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(
            f"task {task_id}: its result must be a msgpack value, not"
            f" {type(result).__name__}: {exc}"
        ) from None


def replicas_for_backlog(backlog: int, target_backlog_per_replica: float) -> int:
    """Replicas a task-consumer deployment wants for ``backlog`` tasks (waiting plus
    running): enough that each has at most ``target_backlog_per_replica``, and none
    for none (Serve bounds it by ``min_replicas`` and ``max_replicas`` and smooths it
    with its up- and downscale delays)."""
    if not target_backlog_per_replica > 0:
        raise InvalidSetting(
            f"target_backlog_per_replica must be > 0, not {target_backlog_per_replica}"
        )
    return math.ceil(max(backlog, 0) / target_backlog_per_replica)


@dataclass(frozen=True)
class StoreLocation:
    """Where a broker's task-result store is (``TaskResultsActor.locate``): its node,
    its file's absolute path there, and the id written in that file."""

    node_id: str
    path: str
    store_id: str
