"""Consumer liveness on the queue's side, without Ray: which consumers the queue takes
for dead, and when.

A consumer's TargetList actor holds messages the queue delivered to it; when that actor
dies, the queue closes the consumer, and what it held is delivered again. Three signals
tell of a death, one for each way the queue knows a consumer:

- the death watch: a consumer registered through Ray gave the queue its TargetList's
  handle, and the queue keeps a call to that actor's ``until_closed`` pending; Ray fails
  the call as soon as it knows the actor died (the fastest notice Ray gives);
- the ping, the death watch's back-up: every ``WATCH_PERIOD_SECONDS``, each watched
  consumer not heard from for ``CONSUMER_SILENCE_SECONDS`` is pinged. A ping that finds
  its actor gone closes the consumer; one unanswered within ``CONSUMER_PING_TIMEOUT_SECONDS`` is
  sent again next round (busy, not dead);
- the FetchChannel: a consumer registered over a connection and not watched yet (its
  TargetList puts off its Ray registration until its first delivery) whose connection
  ended is closed if it is still unwatched ``UNWATCHED_GRACE_SECONDS`` later (its
  TargetList died before its Ray registration). Not at once: a TargetList closing, or
  fetching through Ray after its channel broke, is alive and registers or closes
  meanwhile.

``ConsumerLiveness`` decides and the queue actor (``raymq.actors.queue_actor``) acts, as
Ray Serve's controller decides and its replica wrappers make the calls: the actor feeds
it events (registered, closed, heard from, watch ended, ping ended, channel lost, tick)
and carries out the actions they return (``Watch``, ``Unwatch``, ``Ping``, ``Close``).
The clock is injected: tests drive every path with a fake one
(``tests/test_consumer_liveness.py``).

A consumer is named by (consumer id, subscription), the subscription None for a queue's
own. Events about a consumer the liveness does not know (closed meanwhile, or never
registered) change nothing, and so does any event told twice: the actor need not check
before it reports.
"""

from __future__ import annotations

import enum
import itertools
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

#: How often the back-up to the death watches looks for silent consumers (seconds).
#: Rare: the pending ``until_closed`` call tells of a death at once (bench.redelivery).
WATCH_PERIOD_SECONDS = 10.0
#: A consumer not heard from for this long is pinged (seconds).
CONSUMER_SILENCE_SECONDS = 10.0
#: A ping unanswered for this long is retried next round, not taken as death (seconds).
CONSUMER_PING_TIMEOUT_SECONDS = 5.0
#: A consumer whose FetchChannel connection closed while the queue did not watch it
#: yet (its TargetList puts off its Ray registration until its first delivery, at most
#: 0.1 s) is taken for dead only if it is still unwatched and registered this long
#: after (seconds): a live TargetList registers, or closes, well within it.
UNWATCHED_GRACE_SECONDS = 2.0

#: (consumer id, subscription): the subscription None for a queue's own.
ConsumerKey = tuple[str, str | None]


class ConsumerState(enum.Enum):
    """Where a registered consumer's liveness stands. A consumer closed (as dead or
    by itself) is forgotten: ``ConsumerLiveness.state`` is then None."""

    #: Registered over a FetchChannel connection: no handle to watch it by yet.
    UNWATCHED = "unwatched"
    #: Unwatched, and its connection ended: closed at the end of the grace unless it
    #: is watched (or closes) first.
    CHANNEL_LOST = "channel lost"
    #: Its TargetList's death watch runs.
    WATCHED = "watched"
    #: Watched, and silent for so long that a ping is out.
    PINGED = "pinged"


class Death(enum.Enum):
    """Why a consumer was taken for dead (the value is the queue's log wording)."""

    WATCH = "its actor is gone"
    PING = "no answer to a ping"
    CHANNEL = "its fetch channel closed, unwatched"


class PingOutcome(enum.Enum):
    """How a ping ended, as the actor saw it."""

    ANSWERED = "answered"
    #: Ray says its actor is dead.
    GONE = "gone"
    #: No answer within ``CONSUMER_PING_TIMEOUT_SECONDS``, or an error that is no death: the
    #: consumer is pinged again next round if it is still silent.
    UNANSWERED = "unanswered"


@dataclass(frozen=True)
class Watch:
    """Start the death watch of a consumer on ``watch`` (its TargetList's handle),
    replacing the one it had; report how it ends with ``watch_ended(..., generation,
    died)``."""

    consumer_id: str
    subscription: str | None
    watch: object
    generation: int


@dataclass(frozen=True)
class Unwatch:
    """Stop the consumer's death watch (nothing left to watch for)."""

    consumer_id: str
    subscription: str | None


@dataclass(frozen=True)
class Ping:
    """Ping the consumer's TargetList (``watch``), waiting at most
    ``CONSUMER_PING_TIMEOUT_SECONDS``; report with ``ping_ended(..., generation, outcome)``."""

    consumer_id: str
    subscription: str | None
    watch: object
    generation: int


@dataclass(frozen=True)
class Close:
    """Close the consumer, taken for dead: what it held is delivered again."""

    consumer_id: str
    subscription: str | None
    reason: Death


Action = Watch | Unwatch | Ping | Close


@dataclass
class _Consumer:
    state: ConsumerState
    #: Clock seconds of the last sign of life (registration, a call, a ping answered).
    heard: float
    #: Its TargetList's handle (opaque here), None while unwatched.
    watch: object = None
    #: Which handle's watch and pings count: a result of an earlier one (the consumer
    #: registered again meanwhile, maybe from a new TargetList) is ignored.
    generation: int = 0
    #: Clock seconds its ping went out (PINGED).
    pinged_at: float = 0.0


class ConsumerLiveness:
    """The liveness of one queue's consumers (all its subscriptions'): events in,
    actions out. Not thread-safe: the queue actor calls it from its event loop."""

    def __init__(
        self,
        clock: Callable[[], float],
        *,
        watch_period: float = WATCH_PERIOD_SECONDS,
        silence: float = CONSUMER_SILENCE_SECONDS,
        ping_timeout: float = CONSUMER_PING_TIMEOUT_SECONDS,
        unwatched_grace: float = UNWATCHED_GRACE_SECONDS,
    ):
        """``clock`` returns monotonic seconds; the others are seconds, as the
        module's constants of the same names."""
        self._clock = clock
        self.watch_period = watch_period
        self.silence = silence
        self.ping_timeout = ping_timeout
        self.unwatched_grace = unwatched_grace
        self._consumers: dict[ConsumerKey, _Consumer] = {}
        #: CHANNEL_LOST consumers -> clock seconds when they are closed.
        self._grace: dict[ConsumerKey, float] = {}
        # One count for all consumers: a consumer registered again after it was
        # forgotten never reuses the generation of a watch still running.
        self._generations = itertools.count(1)
        self._next_round = clock() + watch_period
        #: Consumers taken for dead so far, by why.
        self.deaths: Counter[Death] = Counter()
        #: Pings sent so far.
        self.pings = 0

    # -- events ----------------------------------------------------------------------

    def registered(
        self, consumer_id: str, subscription: str | None, watch: object = None
    ) -> list[Action]:
        """The queue registered the consumer: over a FetchChannel (``watch`` None), or
        through Ray with its TargetList's handle, which starts a death watch (``Watch``)
        and ends any grace. A registration over a channel changes nothing for a
        watched consumer; one over a new connection ends the grace of a lost one
        (that TargetList is alive)."""
        key = (consumer_id, subscription or None)
        now = self._clock()
        c = self._consumers.get(key)
        if c is None:
            c = self._consumers[key] = _Consumer(ConsumerState.UNWATCHED, now)
        c.heard = now
        if watch is None:
            if c.state is ConsumerState.CHANNEL_LOST:
                self._set(key, c, ConsumerState.UNWATCHED)
            elif c.state is ConsumerState.PINGED:  # alive: its ping's answer is not needed
                c.state = ConsumerState.WATCHED
            return []
        c.watch, c.generation = watch, next(self._generations)
        self._set(key, c, ConsumerState.WATCHED)
        return [Watch(consumer_id, key[1], watch, c.generation)]

    def closed(self, consumer_id: str, subscription: str | None) -> list[Action]:
        """The consumer closed (or the queue closed it): forget it, stop its watch."""
        return self._forget((consumer_id, subscription or None))

    def subscription_deleted(self, subscription: str) -> list[Action]:
        """An address's subscription was deleted, its consumers with it."""
        gone = [key for key in self._consumers if key[1] == subscription]
        return [action for key in gone for action in self._forget(key)]

    def heard_from(self, consumer_id: str, subscription: str | None) -> None:
        """The consumer called the queue (a fetch, an ack): it is alive now. On every
        consumer call: a dictionary look-up and a clock read."""
        c = self._consumers.get((consumer_id, subscription or None))
        if c is None:
            return
        c.heard = self._clock()
        if c.state is ConsumerState.PINGED:  # its ping's answer is not needed now
            c.state = ConsumerState.WATCHED

    def watch_ended(
        self, consumer_id: str, subscription: str | None, generation: int, died: bool
    ) -> list[Action]:
        """The death watch of ``generation`` ended: ``died`` if Ray said its actor is
        gone (the consumer is closed), else it ended otherwise (the TargetList closed,
        or cannot be watched: the pings remain)."""
        key = (consumer_id, subscription or None)
        c = self._consumers.get(key)
        if not died or c is None or c.generation != generation:
            return []
        self._forget(key)  # (its watch is over: no Unwatch)
        return [self._dead(key, Death.WATCH)]

    def ping_ended(
        self,
        consumer_id: str,
        subscription: str | None,
        generation: int,
        outcome: PingOutcome,
    ) -> list[Action]:
        """The ping of ``generation`` ended with ``outcome``: a gone actor closes the
        consumer; an unanswered ping is no death (a busy process), and the consumer is
        pinged again next round if it is still silent."""
        key = (consumer_id, subscription or None)
        c = self._consumers.get(key)
        if c is None or c.generation != generation:
            return []
        if outcome is PingOutcome.GONE:
            return [*self._forget(key), self._dead(key, Death.PING)]
        if c.state is ConsumerState.PINGED:
            c.state = ConsumerState.WATCHED
        if outcome is PingOutcome.ANSWERED:
            c.heard = self._clock()
        return []

    def channel_lost(self, registered: Iterable[ConsumerKey]) -> None:
        """A FetchChannel connection ended; ``registered`` are the (consumer id,
        subscription) it registered. Those still unwatched are closed
        ``unwatched_grace`` seconds from now by ``tick`` unless they are watched, or
        close, first: ``next_tick`` may be sooner now."""
        deadline = self._clock() + self.unwatched_grace
        for consumer_id, subscription in registered:
            key = (consumer_id, subscription or None)
            c = self._consumers.get(key)
            if c is not None and c.state is ConsumerState.UNWATCHED:
                self._set(key, c, ConsumerState.CHANNEL_LOST, deadline)

    def tick(self) -> list[Action]:
        """What is due now: the unwatched whose grace ended are closed; on a round
        (every ``watch_period`` seconds) each watched consumer silent for more than
        ``silence`` seconds is pinged (or pinged again, if its last ping was never
        reported within ``ping_timeout``). Call it at ``next_tick``, or any time."""
        now = self._clock()
        actions: list[Action] = []
        for key, deadline in list(self._grace.items()):
            if deadline <= now:
                self._forget(key)
                actions.append(self._dead(key, Death.CHANNEL))
        if now >= self._next_round:
            self._next_round = now + self.watch_period
            for (consumer_id, subscription), c in self._consumers.items():
                if self._ping_due(c, now):
                    c.state, c.pinged_at = ConsumerState.PINGED, now
                    self.pings += 1
                    actions.append(Ping(consumer_id, subscription, c.watch, c.generation))
        return actions

    # -- queries ---------------------------------------------------------------------

    def next_tick(self) -> float:
        """Clock seconds when ``tick`` next has something to do, at the latest."""
        return min([self._next_round, *self._grace.values()])

    def state(self, consumer_id: str, subscription: str | None) -> ConsumerState | None:
        """The consumer's state; None if not registered (or closed, as dead or not)."""
        c = self._consumers.get((consumer_id, subscription or None))
        return None if c is None else c.state

    # -- inside ----------------------------------------------------------------------

    def _ping_due(self, c: _Consumer, now: float) -> bool:
        if c.state is ConsumerState.WATCHED:
            return now - c.heard > self.silence
        # A ping whose end was never reported (the actor lost its task) is sent again.
        return c.state is ConsumerState.PINGED and now - c.pinged_at >= self.ping_timeout

    def _set(
        self, key: ConsumerKey, c: _Consumer, state: ConsumerState, deadline: float = 0.0
    ) -> None:
        """Change state, keeping ``_grace`` to the CHANNEL_LOST consumers."""
        c.state = state
        if state is ConsumerState.CHANNEL_LOST:
            self._grace[key] = deadline
        else:
            self._grace.pop(key, None)

    def _forget(self, key: ConsumerKey) -> list[Action]:
        c = self._consumers.pop(key, None)
        self._grace.pop(key, None)
        if c is None or c.watch is None:
            return []
        return [Unwatch(*key)]

    def _dead(self, key: ConsumerKey, why: Death) -> Close:
        self.deaths[why] += 1
        return Close(key[0], key[1], why)


__all__ = [
    "CONSUMER_SILENCE_SECONDS",
    "CONSUMER_PING_TIMEOUT_SECONDS",
    "UNWATCHED_GRACE_SECONDS",
    "WATCH_PERIOD_SECONDS",
    "Action",
    "Close",
    "ConsumerKey",
    "ConsumerLiveness",
    "ConsumerState",
    "Death",
    "Ping",
    "PingOutcome",
    "Unwatch",
    "Watch",
]
