"""Warm spare TargetList actors, one per node, kept by each client process.

Creating an actor starts a Ray worker process and imports RayMQ in it: most of a
second on these machines, which a consumer would otherwise pay before its first
message. Each process keeps one blank TargetList actor started ahead per node it uses;
a new consumer takes it (and a new spare starts in the background). The spare is owned
by this process, like the consumers it becomes, so it dies with it.

Submitting an actor's creation itself costs the caller 2-4 ms here (measured): ``warm``
does it in a background thread, so that a new consumer's first message does not wait
for the next consumer's spare; ``take`` waits for a creation under way rather than
start a second one. A spare that is up comes with its DeliveryChannel connected: the
consumer starts it over that socket, without a Ray call, and without paying for the
connection and its hello (1.8 ms of a new consumer's first message, measured) itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterator
from typing import NamedTuple

import ray

from raymq.wire import delivery
from raymq.wire.delivery import DeliveryChannel
from raymq.wire.errors import WireBroken

log = logging.getLogger("raymq.placement")

_lock = threading.Lock()
_spares: dict[tuple[str, str], object] = {}
_ready: dict[tuple[str, str], object] = {}  # each spare's first call (an ObjectRef)
#: Each spare's DeliveryChannel, connected once the spare was up (``_connect``).
_channels: dict[tuple[str, str], DeliveryChannel] = {}
#: Connections under way (``_connect``), each set when it is over: ``wait_warm`` waits.
_connecting: dict[tuple[str, str], threading.Event] = {}
#: Creations under way in a background thread, each set when it is over.
_making: dict[tuple[str, str], threading.Event] = {}
#: Creations put off (``warm``'s ``after``): ``take`` and ``wait_warm`` end the wait.
_deferred: dict[tuple[str, str], threading.Event] = {}
#: Longest ``take`` waits for a spare's creation under way (seconds); a creation is a
#: submission, not the process start, so only a wedged Ray takes this long.
CREATION_WAIT_SECONDS = 10.0
#: Longest the next spare's creation waits for the consumer that took the last one to
#: have its first answer (``warm``'s ``after``), seconds: a process starting takes a
#: core for most of a second, which that consumer's first message would share on a
#: small machine (measured here on 2 cores: 6-7 ms alone, 7-15 ms beside it).
DEFER_SECONDS = 1.0
#: Longest the background thread waits for a spare to be up before it connects to its
#: DeliveryChannel (seconds): a worker process starting, on a loaded machine.
UP_SECONDS = 120.0
#: False within ``none_started``: ``warm`` starts nothing.
_keeping = True
_makers_here: _Makers | None = None


class Spare(NamedTuple):
    """A TargetList actor for a new consumer (``take``)."""

    actor: object
    #: Its DeliveryChannel's (host, port, secret) if it is up and listening (None:
    #: start it by a Ray call, which waits for it).
    endpoint: tuple[str, int, str] | None = None
    #: That channel, connected already (None: connect to ``endpoint``). Its owner is
    #: the caller now, who closes it.
    channel: DeliveryChannel | None = None

    def without_channel(self) -> Spare:
        """This spare as one still starting: its connection closed, no endpoint."""
        if self.channel is not None:
            self.channel.close()
        return Spare(self.actor)


def _key(node_id: str) -> tuple[str, str]:
    # The job id changes when this process joins Ray again: old spares are gone then.
    return ray.get_runtime_context().get_job_id(), node_id


def _new(node_id: str) -> tuple[object, object]:
    from raymq.actors.target_list_actor import TargetListActor
    from raymq.placement.nodes import near

    actor = TargetListActor.options(scheduling_strategy=near(node_id)).remote()
    # A first call to a new actor pays for finding it and connecting (~0.1-0.5 s here,
    # measured), and its DeliveryChannel opens (``TargetListActor.ready``): make it
    # now, unawaited, so the consumer's first call is a warm one.
    return actor, actor.ready.remote()


@contextlib.contextmanager
def none_started() -> Iterator[None]:
    """Within this block ``warm`` starts no spare: for the consumer of a process that
    makes one and ends (the ``raymq`` command), whose next spare would be a Ray worker
    started for nothing. Such a consumer still takes a spare that is there."""
    global _keeping
    before, _keeping = _keeping, False
    try:
        yield
    finally:
        _keeping = before


def warm(node_id: str, after: threading.Event | None = None) -> None:
    """Start a spare on ``node_id`` unless one is there or on its way (returns at once;
    the creation is submitted from a background thread, once ``after`` is set or
    ``DEFER_SECONDS`` have passed, or as soon as ``take`` or ``wait_warm`` wants it)."""
    if not _keeping:
        return
    key = _key(node_id)
    with _lock:
        if key in _spares or key in _making:
            return
        done = _making[key] = threading.Event()
        if after is not None:
            _deferred[key] = after

    def make() -> None:
        connecting: threading.Event | None = None
        try:
            if after is not None:
                after.wait(DEFER_SECONDS)
            if not ray.is_initialized():  # ended meanwhile: .remote() would start a Ray
                return
            actor, ready = _new(node_id)
            with _lock:
                _spares[key], _ready[key] = actor, ready
                if delivery.USE_CHANNEL:
                    connecting = _connecting[key] = threading.Event()
        except Exception as exc:  # Ray shutting down, say: take() then makes one itself
            log.warning("no spare TargetList on node %s: %r", node_id, exc)
            return
        finally:
            with _lock:
                _making.pop(key, None)
                _deferred.pop(key, None)
            done.set()
        if connecting is not None:
            try:
                _connect(key, actor, ready)
            finally:
                with _lock:
                    if _connecting.get(key) is connecting:
                        del _connecting[key]
                connecting.set()

    _makers().submit(make)


class _Makers:
    """Daemon threads that run ``warm``'s creations, reused: a thread started for each
    spare held its caller, a new consumer, until the thread ran (``Thread.start``
    waits for it; 0.3-0.5 ms here). A thread is started only when none is idle; daemon,
    as before, so that a process ending is never held by a spare still being made."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self.pid = os.getpid()

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` in an idle thread, or a new one."""
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1  # that thread's next job is this one
        self._jobs.put(job)
        if start:
            threading.Thread(target=self._run, name="raymq-spare", daemon=True).start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job()
            except Exception:  # (make() logs its own; never lose the thread)
                log.exception("a spare TargetList's creation failed")
            except SystemExit:  # Ray ended in this process (ray.shutdown): so do we
                return
            with self._lock:
                self._idle += 1


def _makers() -> _Makers:
    """This process's ``_Makers`` (made again in a forked child: threads do not fork)."""
    global _makers_here
    with _lock:
        if _makers_here is None or _makers_here.pid != os.getpid():
            _makers_here = _Makers()
        return _makers_here


def _connect(key: tuple[str, str], actor: object, ready: object) -> None:
    """Once the spare ``actor`` is up, connect to its DeliveryChannel and keep the
    connection beside it, unless the spare was taken meanwhile (whoever took it
    connects). A failure is logged: the consumer then connects, or starts it by Ray."""
    try:
        # Waited on as a Python future, not in ray.get: this daemon thread may still be
        # waiting when the process ends Ray (ray.shutdown), and Ray's own wait then
        # ends it with SystemExit from inside the core worker being torn down.
        endpoint = ready.future().result(timeout=UP_SECONDS)
        if endpoint is None:  # it could not listen: started by a Ray call
            return
        channel = DeliveryChannel(*endpoint, "(none yet)")
    except (ray.exceptions.RayError, WireBroken, TimeoutError) as exc:  # take() sees it
        log.info("spare TargetList %s: no DeliveryChannel connected: %r", key[1], exc)
        return
    with _lock:
        if _spares.get(key) is actor:
            _channels[key] = channel
            return
    channel.close()


def kept() -> list[str]:
    """Ids of the nodes this process keeps a warm spare on, or is making one for."""
    job = ray.get_runtime_context().get_job_id()
    with _lock:
        return sorted({node for job_id, node in [*_spares, *_making] if job_id == job})


def wait_warm(timeout: float | None = None) -> bool:
    """Wait up to ``timeout`` seconds (None: for ever) until every spare of this
    process is up; True if they all are.

    Starting one costs about a second of CPU: a benchmark waits for it before its
    clock starts, so that it measures consuming rather than a process starting.
    """
    job = ray.get_runtime_context().get_job_id()
    with _lock:
        making = [done for (job_id, _node), done in _making.items() if job_id == job]
        for (job_id, _node), after in _deferred.items():
            if job_id == job:
                after.set()  # wanted now
    for done in making:  # submitted in a moment: a submission is milliseconds
        done.wait(timeout)
    with _lock:
        refs = [ref for (job_id, _node), ref in _ready.items() if job_id == job]
    if refs:
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        if len(done) < len(refs):
            return False
    with _lock:  # connected a moment after they are up
        connecting = [event for (job_id, _node), event in _connecting.items() if job_id == job]
    return all(event.wait(timeout) for event in connecting)


def take(node_id: str) -> Spare:
    """A TargetList actor on ``node_id``: the warm spare if there is one, or is being
    submitted (with its DeliveryChannel's endpoint, and the channel connected, as far
    as they are up); else a new one. The caller starts the next spare with ``warm``
    once its consumer is up."""
    key = _key(node_id)
    with _lock:
        making = _making.get(key)
        after = _deferred.get(key)
    if after is not None:
        after.set()  # wanted now: not after the last consumer's first answer
    if making is not None:
        making.wait(CREATION_WAIT_SECONDS)
    with _lock:
        actor = _spares.pop(key, None)
        ready = _ready.pop(key, None)
        channel = _channels.pop(key, None)
    if actor is None:
        return Spare(_new(node_id)[0])
    if channel is not None and channel.broken is None:
        return Spare(actor, None, channel)
    if channel is not None:  # its process ended, say: Ray tells below
        channel.close()
    done, _ = ray.wait([ready], timeout=0)
    if not done:
        return Spare(actor)
    try:
        return Spare(actor, ray.get(ready))
    except ray.exceptions.RayError as exc:  # it died, say: a new one, started by Ray
        log.warning("spare TargetList on node %s failed, starting another: %r", node_id, exc)
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
        return Spare(_new(node_id)[0])
