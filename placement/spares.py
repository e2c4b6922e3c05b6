"""Warm spare TargetList actors, one per node, kept by each client process.

Creating an actor starts a Ray worker process and imports RayMQ in it: most of a
second on these machines, which a consumer would otherwise pay before its first
message. Each process keeps one blank TargetList actor started ahead per node it uses;
a new consumer takes it (and a new spare starts in the background). The spare is owned
by this process, like the consumers it becomes, so it dies with it.
"""

from __future__ import annotations

import threading

import ray

_lock = threading.Lock()
_spares: dict[tuple[str, str], object] = {}
_ready: dict[tuple[str, str], object] = {}  # each spare's first call (an ObjectRef)


def _key(node_id: str) -> tuple[str, str]:
    # The job id changes when this process joins Ray again: old spares are gone then.
    return ray.get_runtime_context().get_job_id(), node_id


def _new(node_id: str) -> tuple[object, object]:
    from raymq.actors.target_list_actor import TargetListActor
    from raymq.placement.nodes import near

    actor = TargetListActor.options(scheduling_strategy=near(node_id)).remote()
    # A first call to a new actor pays for finding it and connecting (~0.1-0.5 s here,
    # measured): make it now, unawaited, so the consumer's first call is a warm one.
    return actor, actor.ready.remote()


def warm(node_id: str) -> None:
    """Start a spare on ``node_id`` unless one is there already (returns at once)."""
    with _lock:
        if _key(node_id) not in _spares:
            _spares[_key(node_id)], _ready[_key(node_id)] = _new(node_id)


def wait_warm(timeout: float | None = None) -> bool:
    """Wait up to ``timeout`` seconds (None: for ever) until every spare of this
    process is up; True if they all are.

    Starting one costs about a second of CPU: a benchmark waits for it before its
    clock starts, so that it measures consuming rather than a process starting.
    """
    job = ray.get_runtime_context().get_job_id()
    with _lock:
        refs = [ref for (job_id, _node), ref in _ready.items() if job_id == job]
    if not refs:
        return True
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    return len(done) == len(refs)


def take(node_id: str):
    """A TargetList actor on ``node_id``: the warm spare if there is one, else a new
    one. The caller starts the next spare with ``warm`` once its consumer is up:
    submitting an actor's creation costs the caller milliseconds, which a new
    consumer's first message need not wait for."""
    with _lock:
        actor = _spares.pop(_key(node_id), None)
        _ready.pop(_key(node_id), None)
    return actor if actor is not None else _new(node_id)[0]
