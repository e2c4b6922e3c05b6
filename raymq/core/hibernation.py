"""Which queue actors hibernate, without Ray.

A queue actor is a Ray worker process (about 96 MiB PSS and a second of CPU to start
on the development machine), so a node cannot keep a thousand of them alive. The
broker keeps at most ``max_active_queues`` running per node: a queue nobody has called
for ``hibernate_after_seconds`` hibernates (its actor closes its files and ends; the
files stay), and when a node is full the least recently used idle queue hibernates to
make room. The next call to a hibernated queue revives it (``BrokerActor.get_queue``).

A queue that is busy (``QueueCore.busy``: consumers registered, sends or acks not yet
durable, deliveries not acknowledged, blocked producers, dead letters waiting, delivery
counts only its process knows, a transient queue holding messages; or replicated) never
hibernates: the cap is then exceeded rather than a call refused (counted in
``HibernationStats.over_cap``). The queue actor reports its own idleness (it sees every
call; the broker sees only lookups); this module only decides.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from raymq.errors import InvalidSetting

#: Default cap of running queue actors per node: none. Hibernation is opt-in
#: (``Broker.set_hibernation``): it costs a queue's next caller a process start.
DEFAULT_MAX_ACTIVE_QUEUES: int | None = None
#: Default idle time after which a queue hibernates even below the cap (seconds; None:
#: never for idleness alone).
DEFAULT_HIBERNATE_AFTER_SECONDS: float | None = None
#: Longest a queue whose actor the broker handed out is kept from hibernating while
#: its client's first call has not arrived (seconds). That call comes within ms; a
#: client this late (a paused process) costs a revival, not a stall.
HANDOUT_GRACE_SECONDS = 10.0


@dataclass(frozen=True)
class HibernationSettings:
    """``max_active_queues``: running queue actors per node (None: no cap);
    ``hibernate_after_seconds``: idle time before a queue hibernates (None: never
    for idleness alone)."""

    max_active_queues: int | None = DEFAULT_MAX_ACTIVE_QUEUES
    hibernate_after_seconds: float | None = DEFAULT_HIBERNATE_AFTER_SECONDS

    def __post_init__(self) -> None:
        cap = self.max_active_queues
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise InvalidSetting(f"max_active_queues={cap!r} must be an int >= 1 or None")
        idle = self.hibernate_after_seconds
        if idle is not None and (
            isinstance(idle, bool) or not isinstance(idle, int | float) or idle <= 0
        ):
            raise InvalidSetting(
                f"hibernate_after_seconds={idle!r} must be a number of seconds > 0 or None"
            )


@dataclass(frozen=True)
class HibernationStats:
    """The broker's hibernation so far (counts since the broker actor started)."""

    max_active_queues: int | None
    hibernate_after_seconds: float | None
    #: Running unreplicated queue actors, by node id.
    active_per_node: dict[str, int]
    #: Names of registered queues whose actor is not running (hibernated, or not
    #: started since the broker started), sorted.
    hibernated: list[str]
    hibernations: int
    revivals: int
    #: Hibernations a queue refused (it became busy meanwhile) or that failed (logged).
    refused: int
    #: Times a queue started on a node already at its cap (no idle queue to hibernate).
    over_cap: int
    #: Total seconds spent reviving queues (start of the actor to ready).
    revival_seconds: float

    def to_dict(self) -> dict:
        """As a plain dict (for ``raymq status`` and JSON)."""
        return {
            "max_active_queues": self.max_active_queues,
            "hibernate_after_seconds": self.hibernate_after_seconds,
            "active_per_node": dict(self.active_per_node),
            "hibernated": list(self.hibernated),
            "hibernations": self.hibernations,
            "revivals": self.revivals,
            "refused": self.refused,
            "over_cap": self.over_cap,
            "revival_seconds": self.revival_seconds,
        }


class Activity:
    """A queue actor's last call, for its idle time (``clock``: seconds, monotonic)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self.last_call = clock()

    def touch(self) -> None:
        """A call came in (every call but the broker's idleness probe)."""
        self.last_call = self._clock()

    def idle_seconds(self, busy: bool) -> float | None:
        """Seconds since the last call; None while ``busy``."""
        return None if busy else max(0.0, self._clock() - self.last_call)


class HibernationPolicy:
    """The running queue actors, by node, the ones handed out and not called yet, and
    the choice of which hibernate (``clock``: seconds, monotonic)."""

    def __init__(
        self,
        settings: HibernationSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        handout_grace_seconds: float = HANDOUT_GRACE_SECONDS,
    ):
        self.settings = settings
        self._clock = clock
        self._handout_grace = handout_grace_seconds
        #: Running queue -> its node id.
        self._active: dict[str, str] = {}
        #: Running queue -> when the broker last handed its actor out (``clock``).
        self._handed_out: dict[str, float] = {}

    def started(self, name: str, node: str) -> None:
        """``name``'s actor runs (or is starting, and counts already) on ``node``."""
        self._active[name] = node

    def stopped(self, name: str) -> None:
        """``name``'s actor no longer runs (hibernated, stopped or deleted)."""
        self._active.pop(name, None)
        self._handed_out.pop(name, None)

    def handed_out(self, name: str) -> None:
        """The broker just answered a client with ``name``'s actor (a lookup, a
        creation, a revival): its first call is on its way, and until it arrives (or
        ``handout_grace_seconds`` passed) the queue is not idle, whatever its actor
        says (its last call was the broker's own ``ready``)."""
        self._handed_out[name] = self._clock()

    def awaits_call(self, name: str, idle: float | None, probed_at: float) -> bool:
        """True if ``name`` was handed out less than ``handout_grace_seconds`` before
        ``probed_at`` and its actor has seen no call since: its idle time, measured at
        ``probed_at`` (by this clock), is at least the handout's age then. The broker
        takes the probe's sending for ``probed_at``, the earliest the actor can have
        measured: a queue not called since its handout is then always held back, and
        at worst one called just after it is held for one more sweep."""
        at = self._handed_out.get(name)
        if at is None or idle is None:
            return False
        age = probed_at - at
        return age < self._handout_grace and idle >= age

    def is_active(self, name: str) -> bool:
        """True if ``name``'s actor is known to run."""
        return name in self._active

    def active(self, node: str | None = None) -> list[str]:
        """Running queues (on ``node``, or all), sorted."""
        return sorted(n for n, at in self._active.items() if node is None or at == node)

    def active_per_node(self) -> dict[str, int]:
        """How many queue actors run on each node."""
        out: dict[str, int] = {}
        for node in self._active.values():
            out[node] = out.get(node, 0) + 1
        return out

    def needs_room(self, node: str) -> bool:
        """True if starting one more queue actor on ``node`` would pass the cap."""
        cap = self.settings.max_active_queues
        return cap is not None and self.active_per_node().get(node, 0) + 1 > cap

    def over_cap(self, node: str) -> bool:
        """True if more queue actors run on ``node`` than the cap allows (queues that
        started side by side found no idle one to make room)."""
        cap = self.settings.max_active_queues
        return cap is not None and self.active_per_node().get(node, 0) > cap

    def choose(self, idle: dict[str, float | None], room_on: str | None = None) -> list[str]:
        """The running queues to hibernate (``choose_and_held``, probed now)."""
        return self.choose_and_held(idle, room_on)[0]

    def choose_and_held(
        self,
        idle: dict[str, float | None],
        room_on: str | None = None,
        probed_at: dict[str, float] | None = None,
    ) -> tuple[list[str], list[str]]:
        """The running queues to hibernate, given each one's idle time (seconds since
        its last call; None: busy, or it did not answer), and those held back because
        they were handed out and have not been called yet (``awaits_call``; each
        one's idle time measured at ``probed_at[name]``, by ``clock``; default now).
        Chosen: those idle
        for ``hibernate_after_seconds``; then, on each node over the cap (counting one
        more on ``room_on``, which is about to start a queue), idle ones least
        recently used first until the node is within it. Busy queues never."""
        now = self._clock()
        at = probed_at or {}
        held = sorted(
            n for n, seconds in idle.items() if self.awaits_call(n, seconds, at.get(n, now))
        )
        idle = {n: None if n in held else seconds for n, seconds in idle.items()}
        return self._choose(idle, room_on), held

    def _choose(self, idle: dict[str, float | None], room_on: str | None) -> list[str]:
        after = self.settings.hibernate_after_seconds
        chosen = [
            n
            for n, seconds in idle.items()
            if n in self._active and seconds is not None and after is not None and seconds >= after
        ]
        cap = self.settings.max_active_queues
        if cap is None:
            return sorted(chosen)
        for node, count in self.active_per_node().items():
            excess = count + (node == room_on) - cap - sum(self._active[n] == node for n in chosen)
            if excess <= 0:
                continue
            candidates = sorted(
                (
                    (seconds, n)
                    for n, seconds in idle.items()
                    if self._active.get(n) == node and seconds is not None and n not in chosen
                ),
                reverse=True,  # the longest idle (least recently used) first
            )
            chosen += [n for _, n in candidates[:excess]]
        return sorted(chosen)


__all__ = [
    "Activity",
    "DEFAULT_HIBERNATE_AFTER_SECONDS",
    "DEFAULT_MAX_ACTIVE_QUEUES",
    "HANDOUT_GRACE_SECONDS",
    "HibernationPolicy",
    "HibernationSettings",
    "HibernationStats",
]
