"""The wire's results protocol: a task's start and finish, from a task consumer's replica
to the broker's task-result store (``TaskResultsActor``).

Every task a Serve replica runs records its start (STARTED, its runs counted, unless it
was cancelled or ended already) before its handler runs, and its outcome after. Through
Ray each was an actor call: ~1.1 ms of CPU between caller and actor here (measured:
``sync ray call``), where this protocol's request costs ~0.1 ms. Requests are pipelined;
the store gathers those that arrive while it commits into its next commit, as it does
Ray calls, and answers each once its commit is on disk.

Ops (docs/WIRE.md, "results"):

- ``start [task_id, name, ttl_seconds]`` answers the record as
  ``[id, status, name, created_at, updated_at, runs]``: what a replica decides on (the
  result of a task that ended is not carried: a replica only skips it).
- ``finish [task_id, name, ttl_seconds, status, result, error_type, error, traceback]``
  answers nil; ``result`` is the handler's value packed by msgpack (bytes), so that any
  msgpack value (maps with int keys too) arrives as it was sent.

Every other call of the store (``cancel``, ``get``, ``counts``) stays a Ray call. A
client whose connection breaks goes through Ray instead (``WireBroken``): a start whose
answer was lost may then be counted twice, as a Ray call retried after the actor
restarted is.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack

from raymq.core.tasks import TaskRecord, pack_result
from raymq.wire.server import Op, Protocol, ProtocolServer, Request, WireServer

#: The protocol's name in the hello.
PROTOCOL = "results"
#: Connections served at once: one a replica (and its producers').
MAX_CONNECTIONS = 4096
#: Longest request (bytes): a finish carries a result and a traceback.
REQUEST_LIMIT = 16 * 1024 * 1024
#: The fields of a start's answer, in order.
START_FIELDS = ("id", "status", "name", "created_at", "updated_at", "runs")

#: ``call(name, args)``: the store's own call (gathered into its next commit).
StoreCall = Callable[[str, tuple], Awaitable[Any]]


class ResultsServer(ProtocolServer):
    """Serves the results protocol for a store whose calls ``call`` makes."""

    def __init__(self, call: StoreCall, what: str = "task results"):
        self._call = call
        self.requests = 0  # starts and finishes served
        ops = {"start": Op(self._start, _check_start), "finish": Op(self._finish, _check_finish)}
        protocol = Protocol(
            PROTOCOL, ops, request_limit=REQUEST_LIMIT, max_connections=MAX_CONNECTIONS
        )
        self.server = WireServer(protocol, what)

    def _start(self, request: Request) -> Awaitable[list]:
        self.requests += 1

        async def start() -> list:
            record: TaskRecord = await self._call("start", tuple(request.args))
            return [getattr(record, name) for name in START_FIELDS]

        return start()

    def _finish(self, request: Request) -> Awaitable[None]:
        self.requests += 1
        task_id, name, ttl, status, blob, *texts = request.args
        try:
            result = msgpack.unpackb(blob, raw=False, strict_map_key=False)
        except ValueError as exc:  # msgpack's own (FormatError...): named as the wire names
            what = f"finish of task {task_id!r}: the result is not msgpack"
            raise ValueError(f"{what}: {exc}") from None
        return self._call("finish", (task_id, name, ttl, status, result, *texts))


def start_record(value: list) -> TaskRecord:
    """A start's answer as the ``TaskRecord`` it was (no result, error or traceback)."""
    if not isinstance(value, list) or len(value) != len(START_FIELDS):
        raise ValueError(f"a start's answer has {len(START_FIELDS)} fields, not {value!r}")
    return TaskRecord(**dict(zip(START_FIELDS, value, strict=True)))


def finish_args(
    task_id: str,
    name: str,
    ttl_seconds: float,
    status: str,
    result: Any = None,
    error_type: str | None = None,
    error: str | None = None,
    traceback: str | None = None,
) -> list:
    """A finish's arguments as the wire carries them; ``TypeError`` if ``result`` is
    not a msgpack value (as the store's ``finish`` says)."""
    blob = pack_result(task_id, result)
    return [task_id, name, ttl_seconds, status, blob, error_type, error, traceback]


def _check_ttl(ttl: Any) -> None:
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not math.isfinite(ttl):
        raise TypeError(f"ttl_seconds must be a finite number of seconds, not {ttl!r}")
    if ttl <= 0:
        raise ValueError(f"ttl_seconds must be > 0, not {ttl}")


def _check_start(args: list, buffers: list) -> None:
    if len(args) != 3:
        raise TypeError(f"start takes [task_id, name, ttl_seconds], not {len(args)} values")
    task_id, name, ttl = args
    if not isinstance(task_id, str) or not isinstance(name, str):
        raise TypeError("start: task_id and name must be str")
    _check_ttl(ttl)


def _check_finish(args: list, buffers: list) -> None:
    if len(args) != 8:
        raise TypeError(f"finish takes 8 values, not {len(args)}")
    task_id, name, ttl, status, blob, *texts = args
    if not all(isinstance(v, str) for v in (task_id, name, status)):
        raise TypeError("finish: task_id, name and status must be str")
    _check_ttl(ttl)
    if not isinstance(blob, bytes):
        raise TypeError(f"finish: the result must be msgpack bytes, not {type(blob).__name__}")
    if not all(v is None or isinstance(v, str) for v in texts):
        raise TypeError("finish: error_type, error and traceback must be str or nil")


__all__ = ["PROTOCOL", "ResultsServer", "finish_args", "start_record"]
