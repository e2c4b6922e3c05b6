"""Hibernator: starting and hibernating unreplicated queues' processes, without Ray.

The broker actor starts a queue's process when it is created, or revived after a
hibernation (``raymq.core.hibernation`` says which queues hibernate). Queues created or
revived at the same time start side by side: each holds only its own queue's lock for
the second of CPU its process takes to start, and a per-node lock while it makes room
there and is counted toward the node's cap (at once: a start beside it makes room for
both). Starts that overlap can pass the cap, when the queues filling it are themselves
starting; the trimmer then hibernates idle ones in the background.

Two races made the first version of this (bba7ed7) flaky, and this module closes both
(``tests/test_hibernator.py`` replays each against fake processes):

- **A handed-out queue looks idle.** The broker answers ``get_queue`` with a queue's
  actor; until the client's first call reaches it, its last call is the broker's own
  ``ready``. To a sweep it is idle, and among queues started together it is often the
  least recently used, so the trimmer hibernated it before its client called. The
  client's call failed, followed the queue, revived it over the cap again (the others
  busy) and the trimmer hibernated it again: a client that followed its queue onto a
  dead actor for its whole retry grace, a consumer whose TargetList registered with an
  ended actor. A queue handed out less than ``HANDOUT_GRACE_SECONDS`` ago that has seen
  no call since is now never chosen (``HibernationPolicy.choose``).
- **A sweep's choice outlives the process it probed.** A sweep probes the running
  queues, then hibernates its choices one at a time; meanwhile another start may have
  hibernated and revived one of them. The new process, never probed, was hibernated on
  the old one's idle time. ``hibernate`` now ends only the process that was probed.

Its Ray calls are ``QueueProcesses`` (``raymq.actors.ray_queue_processes``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from raymq.core.hibernation import HibernationPolicy, HibernationSettings, HibernationStats
from raymq.errors import BrokerUnavailable

#: An actor handle, opaque here: only ``QueueProcesses`` looks inside.
Handle = Any
#: Longest period of the hibernation sweep (seconds); shorter for a short
#: ``hibernate_after_seconds``.
SWEEP_PERIOD_SECONDS = 5.0
#: Pause of the trimmer between sweeps that hibernated nothing because the queues over
#: a cap were handed out and not called yet (seconds): their calls come within ms.
TRIM_RETRY_SECONDS = 0.25

log = logging.getLogger("raymq.broker")


class Closed(Exception):
    """A queue's actor answered ``ready`` as closed for a hibernation that its broker
    did not finish (the broker died, or gave up waiting)."""


class Unreachable(Exception):
    """A queue's actor did not answer in time, or is gone."""


class QueueProcesses(Protocol):
    """The cluster operations on unreplicated queues' processes. ``start`` and
    ``find`` return at once; the others wait, each at most its own bounded time."""

    def start(self, name: str) -> tuple[Handle, str]:
        """The queue's running actor, or a new one starting (not waited for), and the
        node it is on (a queue whose node is gone may move: its entry is saved).
        ``QueueNotFound`` if it was deleted; ``BrokerUnavailable`` if it cannot start."""

    async def ready(self, handle: Handle) -> None:
        """Wait for the actor's recovery; ``Closed`` if it was closed for a hibernation.
        Other errors (its process died while starting) pass through."""

    def find(self, name: str) -> Handle | None:
        """The queue's actor if one holds its name, else None."""

    def same(self, a: Handle, b: Handle) -> bool:
        """True if both handles are of one actor."""

    async def idle_seconds(self, handle: Handle) -> float | None:
        """Seconds since the actor's last call; None if busy or not answering in time."""

    async def hibernate(self, handle: Handle) -> bool:
        """Ask the actor to close for a hibernation; False if it is busy (nothing
        changed). ``Unreachable`` if it does not answer in time or is gone."""

    async def end(self, name: str, handle: Handle) -> None:
        """End a closed actor and wait (bounded) until its name is free, so that the
        next ``start`` makes a new one."""

    async def delete_files(self, name: str, handle: Handle) -> None:
        """Ask the actor to close its queue and delete its files, waiting a bounded
        time; one that fails (gone, silent, or closed by a hibernation its broker did
        not finish) is logged, not raised: it is ended next, and its files deleted by
        the broker."""


@dataclass(frozen=True)
class Sweep:
    """What one sweep did: queues ``hibernated``, and queues it would have chosen but
    left because they were handed out and not called yet (``held``)."""

    hibernated: int
    held: int


class Hibernator:
    """Starts, hibernates and trims one broker's unreplicated queues' processes."""

    def __init__(
        self,
        settings: HibernationSettings,
        processes: QueueProcesses,
        *,
        stopping: Callable[[], bool] = lambda: False,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        self.policy = HibernationPolicy(settings, clock=clock)
        self._processes = processes
        #: True once the broker stops its queues: nothing starts or hibernates after.
        self._stopping = stopping
        self._clock = clock
        self._sleep = sleep
        #: Queue -> lock around its start, revival and hibernation.
        self._queue_locks: dict[str, asyncio.Lock] = {}
        #: Node -> lock around making room there and being counted (``room_lock``).
        self._room_locks: dict[str, asyncio.Lock] = {}
        self._sweeper: asyncio.Task | None = None
        self._trimmer: asyncio.Task | None = None  # (``trim_soon``)
        self._trim_again = False  # a start over the cap asked the trimmer for a sweep
        self.counts = {"hibernations": 0, "revivals": 0, "refused": 0, "over_cap": 0}
        #: Total seconds spent reviving queues (start of the actor to ready).
        self.revival_seconds = 0.0

    def lock_of(self, name: str) -> asyncio.Lock:
        """The lock around ``name``'s start, revival and hibernation."""
        return self._queue_locks.setdefault(name, asyncio.Lock())

    def room_lock(self, node: str) -> asyncio.Lock:
        """Around one queue's making room on ``node`` and being counted there: queues
        starting side by side would otherwise hibernate the same idle queue, and pass
        the cap together."""
        return self._room_locks.setdefault(node, asyncio.Lock())

    # -- starts -----------------------------------------------------------------------

    async def handle(self, name: str, new: bool = False) -> Handle:
        """The running actor of queue ``name``, started if need be (``new``: a queue
        being created, not a revival), and recorded as handed out: until the caller's
        first call reaches it, no sweep hibernates it. Starting one on a node at its
        ``max_active_queues`` hibernates an idle queue there meanwhile."""
        async with self.lock_of(name):  # not while it hibernates; starts of others go on
            self._refuse_if_stopping(name)  # (stopped while this waited for the lock)
            reviving = not self.policy.is_active(name)
            t0 = self._clock()
            handle, node = self._processes.start(name)
            if reviving:  # while its process starts (a second of CPU): its ready later
                async with self.room_lock(node):
                    await self._make_room(node, name)
                    # Counted from now: a start beside it makes room for both.
                    self.policy.started(name, node)
            try:
                try:
                    await self._processes.ready(handle)
                except Closed:
                    # Closed for a hibernation that its broker did not finish: end it
                    # and start the queue anew.
                    log.warning("queue %r: ending an actor left hibernating", name)
                    await self._processes.end(name, handle)
                    handle, node = self._processes.start(name)
                    await self._processes.ready(handle)
            except BaseException:
                if reviving:
                    self.policy.stopped(name)
                raise
            self.policy.started(name, node)
            self.policy.handed_out(name)
            if self.policy.over_cap(node):
                self.trim_soon()
            if reviving and not new:
                self.counts["revivals"] += 1
                self.revival_seconds += self._clock() - t0
            return handle

    def _refuse_if_stopping(self, name: str) -> None:
        if self._stopping():
            raise BrokerUnavailable(f"queue {name!r}: the broker is stopping its queues")

    async def _make_room(self, node: str, name: str) -> None:
        """Before ``name`` starts on ``node``: hibernate idle queues there if the node
        is at its cap. None idle: it starts all the same (counted in ``over_cap``)."""
        if not self.policy.needs_room(node):
            return
        await self.sweep(room_on=node, skip=name)
        if self.policy.needs_room(node):
            self.counts["over_cap"] += 1
            log.warning(
                "queue %r starts on node %s over max_active_queues=%s: no idle queue there",
                name,
                node[:12],
                self.policy.settings.max_active_queues,
            )

    # -- sweeps -----------------------------------------------------------------------

    async def sweep(self, room_on: str | None = None, skip: str | None = None) -> Sweep:
        """Hibernate what the policy chooses (``room_on``: a node about to start one
        more queue; ``skip``: that queue). Each chosen queue hibernates only if the
        process probed still serves it."""
        names = [
            n
            for n in self.policy.active()
            if n != skip and not self.lock_of(n).locked()  # being started or hibernated
        ]
        if not names:
            return Sweep(0, 0)
        found = {n: self._processes.find(n) for n in names}
        for name, handle in found.items():
            if handle is None and not self.lock_of(name).locked():
                self.policy.stopped(name)  # killed, or stopped by hand: no longer active
        probed = {n: h for n, h in found.items() if h is not None}
        answers = await asyncio.gather(*(self._probe(h) for h in probed.values()))
        idle = {n: seconds for n, (seconds, _) in zip(probed, answers, strict=True)}
        probed_at = {n: at for n, (_, at) in zip(probed, answers, strict=True)}
        chosen, held = self.policy.choose_and_held(idle, room_on, probed_at)
        done = 0
        for name in chosen:
            done += await self.hibernate(name, probed[name])
        return Sweep(done, len(held))

    async def _probe(self, handle: Handle) -> tuple[float | None, float]:
        """A process's idle seconds, and the earliest it can have measured them by this
        broker's clock: when the probe was sent (each probe its own). Not the middle of
        the round trip: an answer slow to come back (a loaded machine) put that middle
        after the measuring by more than separates a handout from the call before it,
        and a queue handed out and not called yet was hibernated (a fake replays it,
        ``tests/test_hibernator.py``, probes answered 1 ms late)."""
        sent = self._clock()
        seconds = await self._processes.idle_seconds(handle)
        return seconds, sent

    async def hibernate(self, name: str, probed: Handle | None = None) -> bool:
        """Hibernate one queue if it is still idle: its actor closes its files, is
        ended, and its name released (so that the next ``handle`` starts it anew).
        ``probed``: the actor a sweep found idle; another one serving the queue now
        (hibernated and revived meanwhile) is left alone. Returns True if it
        hibernated."""
        lock = self.lock_of(name)
        if lock.locked():
            return False
        async with lock:
            handle = self._processes.find(name)
            if handle is None:
                self.policy.stopped(name)
                return False
            if probed is not None and not self._processes.same(handle, probed):
                return False  # a new process since the probe: its idle time is unknown
            try:
                done = await self._processes.hibernate(handle)
            except Unreachable as exc:
                log.warning("queue %r: hibernation failed: %s", name, exc)
                self.counts["refused"] += 1
                return False
            if not done:  # busy meanwhile
                self.counts["refused"] += 1
                return False
            # Closed: it answers every call with NotLeader until it is gone.
            await self._processes.end(name, handle)
            self.policy.stopped(name)
            self.counts["hibernations"] += 1
            log.info("queue %r hibernated", name)
            return True

    async def delete(self, name: str, forget: Callable[[], None]) -> bool:
        """Delete queue ``name``'s process, if one runs: it deletes its files and is
        ended. A hibernated queue is not started for it (its files are the caller's to
        delete). ``forget`` drops the queue from the registry while its lock is held,
        so that a start waiting for the lock finds it deleted (``QueueNotFound``).
        Returns True if a process was running."""
        async with self.lock_of(name):  # no start, revival or hibernation meanwhile
            handle = self._processes.find(name)
            if handle is not None:
                await self._processes.delete_files(name, handle)
                await self._processes.end(name, handle)
            forget()
            self.policy.stopped(name)
        return handle is not None

    def trim_soon(self) -> None:
        """Queues started side by side passed a node's cap (the others were starting
        too, so none was idle to make room): hibernate the least recently used idle
        ones in the background, one trimmer at a time (``_trim``)."""
        self._trim_again = True
        if self._stopping() or (self._trimmer is not None and not self._trimmer.done()):
            return
        self._trimmer = asyncio.get_running_loop().create_task(self._trim())

    async def _trim(self) -> None:
        """Sweep until no node is over its cap, or a sweep hibernates nothing, holds
        back no queue handed out and not called yet, and no start asked for another
        meanwhile (the queues over it are busy or starting: the start of the last of
        them asks again)."""
        while self._trim_again and not self._stopping():
            self._trim_again = False
            try:
                swept = await self.sweep()
            except Exception:  # logged: the next start over the cap trims again
                log.exception("trimming the queues over max_active_queues failed")
                return
            if not self.over_any_cap():
                return
            if swept.hibernated:
                self._trim_again = True
            elif swept.held:  # their first calls come soon: then they may go
                self._trim_again = True
                await self._sleep(TRIM_RETRY_SECONDS)

    def over_any_cap(self) -> bool:
        """True if a node runs more queue actors than its cap."""
        return any(self.policy.over_cap(n) for n in self.policy.active_per_node())

    def sweep_period(self) -> float:
        """Seconds between periodic sweeps (``hibernate_after_seconds``)."""
        after = self.policy.settings.hibernate_after_seconds
        return SWEEP_PERIOD_SECONDS if after is None else min(SWEEP_PERIOD_SECONDS, after / 2)

    def ensure_sweeper(self) -> None:
        """Start the periodic sweep if ``hibernate_after_seconds`` asks for one."""
        if self.policy.settings.hibernate_after_seconds is None or self._stopping():
            return
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_loop())

    async def _sweep_loop(self) -> None:
        """Every ``sweep_period()`` seconds, hibernate the queues idle for
        ``hibernate_after_seconds`` (and any over the cap)."""
        while True:
            await self._sleep(self.sweep_period())
            try:
                await self.sweep()
            except Exception:
                log.exception("hibernation sweep")

    def set_settings(self, settings: HibernationSettings) -> None:
        """New settings, from the next sweep or start; the periodic sweep restarts
        (its period may change)."""
        self.policy.settings = settings
        self.stop_background()
        self.ensure_sweeper()

    def stop_background(self) -> None:
        """Cancel the periodic sweep and the trimmer (the broker stops its queues)."""
        for task in (self._sweeper, self._trimmer):
            if task is not None:
                task.cancel()
        self._sweeper = self._trimmer = None

    def stats(self, hibernated: list[str]) -> HibernationStats:
        """Settings, running queues per node, counts (``hibernated``: the registered
        queues whose actor is not running, as the broker knows them)."""
        settings = self.policy.settings
        return HibernationStats(
            max_active_queues=settings.max_active_queues,
            hibernate_after_seconds=settings.hibernate_after_seconds,
            active_per_node=self.policy.active_per_node(),
            hibernated=hibernated,
            hibernations=self.counts["hibernations"],
            revivals=self.counts["revivals"],
            refused=self.counts["refused"],
            over_cap=self.counts["over_cap"],
            revival_seconds=self.revival_seconds,
        )


__all__ = [
    "Closed",
    "Handle",
    "Hibernator",
    "QueueProcesses",
    "SWEEP_PERIOD_SECONDS",
    "Sweep",
    "TRIM_RETRY_SECONDS",
    "Unreachable",
]
