"""TargetListLink: a TargetList's link to its queue's actor, free of Ray.

A consumer's TargetList loads messages from its queue's actor, and that actor can
restart in place (forgetting what it delivered), die and be revived by the broker (a
new process), move (a replicated queue's new leader), pause, hibernate or be ended.
This class decides what the TargetList does about each, written once: the TargetList
actor (``raymq.actors.target_list_link``) gives it a ``QueueEndpoint``, the queue's
actor as seen through Ray, with Ray's failures translated into ``LinkFault``s; tests
give it a fake that can do all of the above (``tests/test_target_list_link.py``).

The states and their rules:

- **Registering.** A consumer registers over the queue's FetchChannel when the client
  knows its endpoint (``begin``); the Ray registration, which hands the queue our
  actor handle for its death watch, is then put off until the first delivery (at most
  ``watch_delay`` seconds), because it costs a new consumer's first message
  milliseconds. Without an endpoint, a Ray registration goes first and the first fetch
  does not wait for it (a fetch registers an unknown consumer too).
- **Fetching.** Over the FetchChannel: small deliveries come inline; a large one is
  parked there and taken by a Ray call (by reference), and while deliveries are large,
  fetches go by Ray alone (``_large_fetches``). Before the channel is known and after
  it broke, fetches go by Ray.
- **Following.** Any failure of a fetch marks the link for a new registration (the
  queue's actor may be a new one that does not know us); a dead or moved actor is
  found again first (``QueueEndpoint.find``: the broker revives a hibernated or
  ended queue). A fetch that was not answered in ``answer_seconds`` is a silent
  actor: the link waits for that same fetch again rather than ask twice.
- **Stale copies.** A registration that answers another process's endpoint (each
  queue process makes its own secret) means the process we loaded from was replaced,
  and its record of what it delivered to us with it: the new one delivers those
  messages again, so what we hold is given back, never handed out (``stale_dropped``).
- **Closing.** Everything not acknowledged goes back: what the TargetList holds, the
  fetch under way (the queue counts it as ours) and what the client never received.

Each failure becomes ``FetchFailed`` carrying a typed error naming the queue; the eager
loader (``raymq.core.target_list.EagerLoader``) retries with backoff and raises it from
``take`` once it persists. Interleaving: the loader's fetch, give-backs, ``queue_side``
and ``close`` meet at their awaits; each state change between two awaits is one step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from raymq.batch import offsets_of
from raymq.core.link import Fault, LinkFault
from raymq.core.target_list import (
    FIRST_FETCH_MESSAGES,
    DirectEntry,
    EagerLoader,
    FetchAnswer,
    FetchFailed,
    TargetList,
)
from raymq.errors import BrokerUnavailable, NotLeader, RayMQError
from raymq.wire.errors import WireBroken
from raymq.wire.fetch import (
    CONNECT_TIMEOUT_SECONDS,
    INLINE_BYTES,
    REMEMBERED_CONNECT_SECONDS,
    InlineDelivery,
    Registration,
)

log = logging.getLogger("raymq.consumer")

#: Longest one fetch waits in the queue actor (seconds); the loader simply asks again.
LOADER_POLL_SECONDS = 1.0
#: A fetch not answered in this long counts as a failure of a restarting queue actor;
#: the loader waits for the same fetch again rather than ask twice (seconds).
FETCH_ANSWER_SECONDS = LOADER_POLL_SECONDS + 10.0
#: Longest a TargetList registered over the FetchChannel puts off its Ray registration
#: (the queue's death watch), unless its first delivery comes sooner (seconds).
WATCH_DELAY_SECONDS = 0.1
#: How long ``close`` keeps asking a restarting queue actor (seconds), and how long it
#: pauses between two attempts.
CLOSE_RETRY_SECONDS = 30.0
CLOSE_RETRY_PAUSE_SECONDS = 0.2
#: How long ``close`` waits for the fetch under way to end (seconds): the channel's
#: ends at once when we finish our side, a Ray one within the queue's poll.
CLOSE_FETCH_SECONDS = LOADER_POLL_SECONDS + 5.0

#: A queue process's FetchChannel: (host, port, secret). The secret is new in each
#: process, which is how a replaced process is told.
Endpoint = tuple[str, int, str]


@dataclass(frozen=True)
class ConsumerSpec:
    """Who the link fetches for: a consumer of ``queue`` (or of its ``subscription``,
    when ``queue`` is an address) with its ``prefetch`` (messages) and ``selector``."""

    queue: str
    consumer_id: str
    prefetch: int
    selector: str | None = None
    subscription: str | None = None


@dataclass
class InFlight:
    """A fetch sent through Ray and not yet taken in: ``answer`` (the queue's
    ``FetchAnswer``, awaited through ``QueueEndpoint.answer``) and ``batch`` (the
    reference to the batch made for this delivery); ``kind`` is "ray" (a fetch) or
    "parked" (a parked delivery taken)."""

    answer: Any
    batch: Any
    kind: str = "ray"


class FetchChannelLike(Protocol):
    """The FetchChannel as the link uses it (``raymq.wire.fetch.FetchChannel``)."""

    @property
    def closed(self) -> bool: ...

    #: The first fetch ``QueueEndpoint.connect`` wrote behind the registration.
    pending_fetch: asyncio.Task | None

    async def fetch(self, *args: Any, streams: bool = False) -> object: ...

    def finish(self) -> None: ...

    def close(self) -> None: ...


class QueueEndpoint(Protocol):
    """The queue's actor, as a TargetList reaches it. Every method raises the queue's
    typed ``RayMQError`` as it is (``NotLeader`` included), or a ``LinkFault`` when the
    call did not reach the actor: RESTARTING (restarts in place), GONE (died; ``final``
    if it could not start again), MOVED, FAILED (a transport error)."""

    async def register(self) -> Endpoint | None:
        """Register the consumer, handing the queue our handle for its death watch;
        the queue's FetchChannel endpoint (None: it has none)."""
        ...

    async def find(self) -> None:
        """Look the queue's actor up again (the broker starts it if none runs). Raises
        ``FetchFailed`` with a typed error if it cannot be found."""
        ...

    async def connect(
        self,
        endpoint: Endpoint,
        timeout: float,
        register: Registration | None = None,
        fetch: tuple | None = None,
    ) -> FetchChannelLike:
        """Open the FetchChannel at ``endpoint`` within ``timeout`` seconds; raises
        ``WireBroken``. ``register``: the consumer registered over it too, in the same
        round trip (raises as ``raymq.wire.fetch.FetchChannel.register``); ``fetch``: its first
        fetch's arguments, written behind the registration (its answer's task:
        ``pending_fetch``)."""
        ...

    async def fetch(self, args: tuple) -> tuple[Any, Any]:
        """Send a fetch (``args`` as the queue actor's ``fetch_batch``) without waiting
        for it: (its answer's handle, its batch's reference)."""
        ...

    async def fetch_parked(self, token: int) -> tuple[Any, Any]:
        """Take the delivery parked under ``token`` (as ``fetch``)."""
        ...

    async def answer(self, handle: Any) -> FetchAnswer:
        """Wait for a fetch's answer; may be awaited again after a timeout."""
        ...

    async def give_back(self, offsets: np.ndarray) -> None:
        """Return ``offsets`` (never received) to the queue."""
        ...

    async def close_consumer(self, offsets: np.ndarray) -> int:
        """Unregister, giving back ``offsets``; returns how many went back."""
        ...

    async def consumer_stats(self) -> dict:
        """The queue's view of this consumer."""
        ...


@dataclass(frozen=True)
class TargetListLinkStats:
    """A link's state and history, as the TargetList's stats report it."""

    watched_by_queue: bool  # the queue has our handle (its death watch)
    fetch_channel: bool  # fetching over the FetchChannel now
    fetch_channel_failures: int  # channels that broke or did not open
    fetches_inline: int  # fetches that brought messages inline over the channel
    fetches_parked: int  # ... parked on the channel, then taken by Ray
    fetches_by_ray: int  # ... by a Ray fetch
    stale_dropped: int  # messages loaded from a queue process since replaced


class StaleEndpoint(Exception):
    """A remembered FetchChannel endpoint that failed: its queue actor was replaced."""

    def __init__(self, endpoint: Endpoint, cause: BaseException):
        host, port, _secret = endpoint
        super().__init__(f"the remembered fetch channel {host}:{port} failed: {cause}")


@dataclass
class _Counts:
    fetched: dict[str, int] = field(default_factory=lambda: {"inline": 0, "parked": 0, "ray": 0})
    channel_failures: int = 0
    stale_dropped: int = 0


class TargetListLink:
    """The queue side of one consumer's TargetList: registration, fetches, following.

    ``targets``: the TargetList the loader (``self.loader``) fills. ``answer_seconds``:
    how long a Ray fetch's answer is waited for before the actor counts as silent;
    ``watch_delay``: how long the Ray registration is put off (both seconds).
    ``clock`` and ``sleep`` (seconds) drive the loader's backoff and ``close``'s retries.
    """

    def __init__(
        self,
        spec: ConsumerSpec,
        endpoint: QueueEndpoint,
        targets: TargetList,
        *,
        answer_seconds: float = FETCH_ANSWER_SECONDS,
        watch_delay: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        self.spec = spec
        self.targets = targets
        self.loader = EagerLoader(
            targets,
            self.fetch,
            queue=spec.queue,
            give_back=self.give_back,
            clock=clock,
            sleep=sleep,
        )
        self._endpoint = endpoint
        self._answer_seconds = answer_seconds
        self._watch_delay = watch_delay
        self._clock = clock
        self._sleep = sleep
        self._counts = _Counts()
        #: The queue has our handle (a Ray registration): it watches for our death.
        self.watched = False
        self.closed = False
        #: Fetch over the FetchChannel when there is one (``use_fetch_channel``).
        self.channel_enabled = True
        self._channel: FetchChannelLike | None = None
        self._channel_endpoint: Endpoint | None = None
        #: The secret of the queue process we registered with last (stale copies).
        self._queue_process: str | None = None
        #: Register again before the next fetch (the queue's actor may be a new one).
        self._register_again = False
        #: The queue's actor died or moved: find it before the next fetch.
        self._queue_dead = False
        self._death = ""  # why, for the errors that follow
        #: The fetch under way: on the channel (a task: a cancelled loader leaves it to
        #: ``close``), or through Ray.
        self._channel_fetch: asyncio.Task | None = None
        self._in_flight: InFlight | None = None
        #: The last delivery was larger than the channel sends inline: fetch by Ray.
        self._large_fetches = False
        #: The first Ray registration, until the loader's second fetch takes its answer.
        self._registering: asyncio.Future | None = None
        self._first_fetch = True  # made without waiting for that registration
        #: The Ray registration put off after one over the channel (``_watch``).
        self._watching: asyncio.Future | None = None
        self._delivered = asyncio.Event()  # set at the first delivery, or at close
        self._stale_give_back: asyncio.Future | None = None

    # -- registration --------------------------------------------------------------------

    async def begin(self, endpoint: Endpoint | None, cached: bool) -> asyncio.Future | None:
        """Register with the queue: over its FetchChannel at ``endpoint`` if given (the
        Ray registration is then put off, ``_watch``), else by a Ray registration
        not waited for here. Returns that registration's future for the caller to
        ``finish_registration`` with (None if registered already). Raises
        ``StaleEndpoint`` if a ``cached`` endpoint does not answer or answers
        ``NotLeader``, and the queue's typed error (a malformed selector...)."""
        if endpoint is not None and await self._register_over_channel(endpoint, cached):
            self._first_fetch = False  # off the first message's path
            self._watching = asyncio.ensure_future(self._watch())
            return None
        self._registering = asyncio.ensure_future(self._register())
        return self._registering

    async def finish_registration(self, registering: Awaitable[Endpoint | None]) -> None:
        """Take the first registration's answer (raising its error: not a consumer)."""
        self._set_endpoint(await registering)

    def delivered(self) -> None:
        """The consumer's first delivery: the Ray registration is not put off longer."""
        self._delivered.set()

    async def _register(self) -> Endpoint | None:
        endpoint = await self._endpoint.register()
        self.watched = True
        return endpoint

    async def _register_over_channel(self, endpoint: Endpoint, cached: bool) -> bool:
        """Connect the FetchChannel and register over it, the registration written
        behind the hello; False if the channel failed (counted, logged: a Ray
        registration then goes instead)."""
        timeout = REMEMBERED_CONNECT_SECONDS if cached else CONNECT_TIMEOUT_SECONDS
        spec = self.spec
        registration = Registration(
            spec.consumer_id, spec.prefetch, spec.selector, spec.subscription
        )
        # The loader's first fetch goes behind the registration: the queue reads and
        # answers it a round trip sooner than if the loader sent it once registered.
        room = max(1, min(self.targets.room(), FIRST_FETCH_MESSAGES))
        first = self._fetch_args(room, first=False)
        try:
            # (A failed connect closes the channel itself.)
            channel = await self._endpoint.connect(tuple(endpoint), timeout, registration, first)
        except BaseException as exc:
            if cached and isinstance(exc, WireBroken | NotLeader):
                raise StaleEndpoint(tuple(endpoint), exc) from None
            if isinstance(exc, WireBroken):
                self._channel_broke(exc)
                return False
            raise
        self._channel, self._channel_endpoint = channel, tuple(endpoint)
        self._channel_fetch = channel.pending_fetch  # the loader's first fetch takes it
        self._note_queue_process(self._channel_endpoint)
        return True

    async def _watch(self) -> None:
        """The Ray registration put off by ``begin``: made at the first delivery, or
        ``watch_delay`` seconds after start. Meanwhile the queue watches the channel
        instead (if it closes, the queue delivers again what we held). A failure
        marks the link to register again before its next fetch."""
        delay = WATCH_DELAY_SECONDS if self._watch_delay is None else self._watch_delay
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._delivered.wait(), delay)
        if self.closed:  # closing first: nothing left to watch
            return
        try:
            await self._register()
        except Exception as exc:  # the channel's registration succeeded: not a bad setting
            log.info("consumer %s: registering again: %s", self.spec.consumer_id, exc)
            self._register_again = True

    def use_fetch_channel(self, enabled: bool) -> None:
        """Fetch over the FetchChannel (``enabled``, the default) or through Ray calls
        only (a baseline for ``bench/latency.py``); from the next fetch."""
        self.channel_enabled = enabled

    def _set_endpoint(self, endpoint: Endpoint | None) -> None:
        """A registration's answer: the queue's FetchChannel (None: fetch by Ray)."""
        endpoint = None if endpoint is None else tuple(endpoint)
        if endpoint != self._channel_endpoint and self._channel is not None:
            self._channel.close()  # a channel to a queue actor that was replaced
            self._channel = None
        self._channel_endpoint = endpoint
        self._note_queue_process(endpoint)

    def _note_queue_process(self, endpoint: Endpoint | None) -> None:
        """A registration answered ``endpoint``: if its secret is another process's,
        what we hold was loaded from a process since replaced, which forgot it
        delivered it to us and delivers it again. It is not handed out (a stale copy
        could reach the application after the fresh one was acked): it goes back to
        the queue, which releases only what it counts as ours (a Ray fetch may have
        been answered by the new process before this registration)."""
        if endpoint is None:  # fetching by Ray: no process to tell
            return
        process = endpoint[2]
        if self._queue_process is not None and process != self._queue_process:
            offsets = self.targets.drain()
            if len(offsets):
                self._counts.stale_dropped += len(offsets)
                log.warning(
                    "consumer %s: queue %r is a new process: %d messages loaded before"
                    " not handed out (delivered again)",
                    self.spec.consumer_id,
                    self.spec.queue,
                    len(offsets),
                )
                self._stale_give_back = asyncio.ensure_future(self._give_back_stale(offsets))
            self.loader.wake()  # room again
        self._queue_process = process

    async def _give_back_stale(self, offsets: np.ndarray) -> None:
        """``_note_queue_process``'s give-back, in order with fetches (the loader's).
        Failed, they stay held by us in the queue until we close or die (logged)."""
        try:
            await self.loader.give_back(offsets)
        except Exception as exc:
            log.warning(
                "consumer %s: %d messages loaded from a replaced queue process not given back: %r",
                self.spec.consumer_id,
                len(offsets),
                exc,
            )

    def _channel_broke(self, exc: WireBroken) -> None:
        """The FetchChannel failed: fetch through Ray, and register again first (a
        queue actor restarted in place knows us only from a fetch then, without our
        handle: nothing would watch for our death) (counted, logged)."""
        self._counts.channel_failures += 1
        if self._channel is not None:
            self._channel.close()
        self._channel, self._channel_endpoint = None, None
        self._register_again = True
        log.warning("consumer %s: fetching through Ray calls: %s", self.spec.consumer_id, exc)

    # -- fetching --------------------------------------------------------------------------

    async def fetch(self, room: int) -> DirectEntry | None:
        """The loader's fetch: up to ``room`` messages. The queue's typed errors pass
        as they are (``ConsumerClosed`` included); faults become ``FetchFailed``
        naming the queue, and mark what the next fetch must do first."""
        queue = self.spec.queue
        try:
            return await self._fetch_once(room)
        except NotLeader as exc:  # a replicated queue's leader moved
            self._lost(dead=True, death=str(exc))
            raise FetchFailed(exc, restarting=True) from None
        except RayMQError:
            self._lost()
            raise
        except LinkFault as fault:
            if fault.kind is Fault.RESTARTING:
                self._lost()
                error = BrokerUnavailable(f"queue {queue!r} is unavailable: {fault.cause}")
                raise FetchFailed(error, restarting=True) from None
            if fault.kind in (Fault.GONE, Fault.MOVED):
                how = "moved" if fault.kind is Fault.MOVED else "died"
                how = "could not start again" if fault.final else how
                self._lost(dead=True, death=f"its actor {how}: {fault.cause}")
                error = BrokerUnavailable(f"queue {queue!r}: {self._death}")
                raise FetchFailed(error, restarting=not fault.final, final=fault.final) from None
            self._lost()
            error = BrokerUnavailable(f"queue {queue!r}: fetch failed: {fault.cause}")
            raise FetchFailed(error) from None

    def _lost(self, *, dead: bool = False, death: str = "") -> None:
        """A fetch failed: its Ray call is over, and the queue's actor may be a new one
        that does not know us (register again); if ``dead``, find it first."""
        self._in_flight, self._register_again = None, True
        if dead:
            self._queue_dead, self._death = True, death

    async def _fetch_once(self, room: int) -> DirectEntry | None:
        """One fetch: the link made good first (``_relink``), then a fetch sent unless
        one is under way, and its answer awaited: over the channel, else by Ray."""
        if self._in_flight is None and self._channel_fetch is None:
            first, self._first_fetch = self._first_fetch, False
            await self._relink(first)
            await self._send_fetch(room, first)
        if self._channel_fetch is not None:
            entry = await self._channel_answer()
            if entry is not None or self._in_flight is None:
                return entry
        return await self._ray_answer()

    async def _relink(self, first: bool) -> None:
        """Before a fetch: the first registration's endpoint taken, the queue's actor
        found again if it died, a registration repeated if the queue may not know us,
        and the FetchChannel opened or closed as it should be."""
        if self._registering is not None and not first:
            registering, self._registering = self._registering, None
            with contextlib.suppress(Exception):  # the owner's start raised its errors
                self._set_endpoint(await registering)
        if self._queue_dead:
            await self._endpoint.find()
            self._queue_dead = False
        if self._register_again:
            self._set_endpoint(await self._register())
            self._register_again = False
        if self._channel is not None and not self.channel_enabled:
            self._channel.close()
            self._channel = None
        if self.channel_enabled and self._channel is None and self._channel_endpoint:
            try:
                self._channel = await self._endpoint.connect(
                    self._channel_endpoint, CONNECT_TIMEOUT_SECONDS
                )
            except WireBroken as exc:
                self._channel_broke(exc)

    def _fetch_args(self, room: int, first: bool) -> tuple:
        spec = self.spec
        # The first fetch, made before the FetchChannel is known, only takes what is
        # there: a wait belongs on the channel.
        wait = 0.0 if first else LOADER_POLL_SECONDS
        return (spec.consumer_id, room, wait, spec.prefetch, spec.selector, spec.subscription)

    async def _send_fetch(self, room: int, first: bool) -> None:
        """Send a fetch of up to ``room`` messages, over the FetchChannel or by Ray.

        While deliveries are large (a deep queue), the channel only parks them and a
        Ray call takes them: a round trip and two wake-ups of the queue actor per
        fetch for nothing. They go by one Ray call then, until one brings no more
        than the channel sends inline."""
        args = self._fetch_args(room, first)
        if self._channel is not None and not self._large_fetches:
            self._channel_fetch = asyncio.ensure_future(self._channel.fetch(*args, streams=True))
        else:
            self._in_flight = InFlight(*await self._endpoint.fetch(args), kind="ray")

    async def _channel_answer(self) -> DirectEntry | None:
        """The answer of the fetch under way on the FetchChannel: rows inline, or None
        (none came; the channel broke; or the delivery was parked: then its Ray call is
        in flight for ``_ray_answer``)."""
        task = self._channel_fetch
        try:
            got = await asyncio.shield(task)  # a cancelled loader leaves it to close
        except asyncio.CancelledError:
            # A fetch that finished as the loader was cancelled (by close) keeps its
            # rows for close, which gives them back as never received.
            if task.done() and (task.cancelled() or task.exception() is not None):
                self._channel_fetch = None
            raise
        except WireBroken as exc:
            self._channel_fetch = None
            self._channel_broke(exc)
            return None  # the next fetch goes through Ray
        except BaseException:
            self._channel_fetch = None
            raise
        self._channel_fetch = None
        if got is None:
            return None
        if isinstance(got, pa.RecordBatch):  # (asked without its stream)
            got = InlineDelivery(got, b"")
        if isinstance(got, InlineDelivery):  # inline: held in this process
            self._counts.fetched["inline"] += 1
            # Its buffers' sizes (the answer's own: RecordBatch.nbytes costs 15 µs).
            return DirectEntry(got, offsets_of(got.batch), got.batch.get_total_buffer_size())
        # Parked in the queue actor (large): take it through Ray, by reference.
        self._in_flight = InFlight(*await self._endpoint.fetch_parked(got), kind="parked")
        self._large_fetches = True
        return None

    async def _ray_answer(self) -> DirectEntry:
        """The answer of the fetch in flight by Ray: references to its batches."""
        in_flight = self._in_flight
        try:
            answer = await asyncio.wait_for(
                self._endpoint.answer(in_flight.answer), self._answer_seconds
            )
        except TimeoutError:
            # Still in flight: the next attempt waits for this same fetch.
            error = BrokerUnavailable(
                f"queue {self.spec.queue!r} did not answer a fetch in {self._answer_seconds:g} s"
            )
            raise FetchFailed(error, restarting=True) from None
        self._in_flight = None
        if len(answer.offsets):
            self._counts.fetched[in_flight.kind] += 1
        if in_flight.kind == "ray":
            self._large_fetches = answer.nbytes > INLINE_BYTES
        parts = answer.parts
        if parts:  # shared rows, then those of the batch made for this delivery
            rest = len(answer.offsets) - sum(rows for _, _, rows in parts)
            parts = [*parts, (in_flight.batch, 0, rest)] if rest else parts
        return DirectEntry(in_flight.batch, answer.offsets, answer.nbytes, parts=parts or None)

    # -- giving back, the queue's view, closing -------------------------------------------

    async def give_back(self, offsets: np.ndarray) -> None:
        """The loader's give-back: ``offsets`` go back to the queue, for delivery
        again. Raises ``BrokerUnavailable`` if the queue did not take them in
        ``answer_seconds`` or could not be reached (they then stay held by this
        consumer in the queue until it closes or dies, then are delivered again)."""
        queue, n = self.spec.queue, len(offsets)
        try:
            await asyncio.wait_for(self._endpoint.give_back(offsets), self._answer_seconds)
        except TimeoutError:
            raise BrokerUnavailable(
                f"queue {queue!r} did not take {n} messages back in {self._answer_seconds:g} s"
            ) from None
        except LinkFault as fault:
            raise BrokerUnavailable(
                f"queue {queue!r} did not take {n} messages back: {fault}"
            ) from None

    async def queue_side(self) -> dict:
        """The queue's view of this consumer; a queue actor that died or moved is
        found and registered with again first. Raises a typed error."""
        try:
            return await self._endpoint.consumer_stats()
        except (NotLeader, LinkFault) as exc:
            if isinstance(exc, LinkFault) and (
                exc.kind not in (Fault.GONE, Fault.MOVED) or exc.final
            ):
                raise BrokerUnavailable(f"queue {self.spec.queue!r}: {exc}") from None
        # Replaced (a replicated queue's new leader): ask the new one, as the loader will.
        try:
            await self._endpoint.find()
        except FetchFailed as failed:  # not started again yet
            raise failed.error from None
        self._set_endpoint(await self._register())
        try:
            return await self._endpoint.consumer_stats()
        except LinkFault as fault:
            raise BrokerUnavailable(f"queue {self.spec.queue!r}: {fault}") from None

    def stop(self) -> None:
        """Load nothing more, and make no put-off registration (``close`` follows)."""
        self.closed = True
        self.loader.close()
        self._delivered.set()

    async def close(self, not_received: np.ndarray | None) -> int:
        """Give back everything not acknowledged (what the TargetList holds, the fetch
        under way, and ``not_received`` from the client) and unregister; returns how
        many went back. Call ``stop`` first, then cancel the loader."""
        self.stop()
        if self._watching is not None:  # before close_consumer, lest it register us again
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._watching, CLOSE_RETRY_SECONDS)
        rest = self.targets.drain()
        fetched = await self._unreceived_fetch()
        if len(fetched):  # taken for us by the queue, never seen by the application
            rest = np.concatenate([rest, fetched])
        if not_received is not None and len(not_received):
            rest = np.concatenate([np.asarray(not_received, dtype=np.int64), rest])
        deadline = self._clock() + CLOSE_RETRY_SECONDS
        while True:
            try:
                return await self._endpoint.close_consumer(rest)
            except LinkFault as fault:
                if fault.kind is Fault.GONE:
                    return 0  # the queue is gone for good (deleted): nothing to give back
                # Cut by a restart: ask the restarted actor (it forgot what we held, so
                # this only unregisters us).
                if fault.kind is not Fault.RESTARTING or self._clock() > deadline:
                    raise BrokerUnavailable(
                        f"queue {self.spec.queue!r}: closing consumer"
                        f" {self.spec.consumer_id}: {fault}"
                    ) from None
                await self._sleep(CLOSE_RETRY_PAUSE_SECONDS)

    async def _unreceived_fetch(self) -> np.ndarray:
        """Offsets of the fetch under way when the loader was cancelled: the queue
        counts them as held by us, so they go back as not received (else their delivery
        count would rise without any application having seen them)."""
        task, self._channel_fetch = self._channel_fetch, None
        if task is not None:  # over the FetchChannel
            if self._channel is not None:
                self._channel.finish()  # a waiting fetch ends at once, empty
            try:
                got = await asyncio.wait_for(task, CLOSE_FETCH_SECONDS)
            except Exception:  # broken, or the queue is slow: it forgot or counts them
                got = None
            if isinstance(got, InlineDelivery | pa.RecordBatch):
                return offsets_of(got.batch if isinstance(got, InlineDelivery) else got)
            if isinstance(got, int) and self._in_flight is None:  # parked: take it
                self._in_flight = InFlight(*await self._endpoint.fetch_parked(got), kind="parked")
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return np.zeros(0, dtype=np.int64)
        try:
            answer = await asyncio.wait_for(
                self._endpoint.answer(in_flight.answer), CLOSE_FETCH_SECONDS
            )
        except Exception:  # the queue restarted or is slow: it forgot or counts them
            return np.zeros(0, dtype=np.int64)
        return np.asarray(answer.offsets, dtype=np.int64)

    def stats(self) -> TargetListLinkStats:
        """A snapshot of the link's state and history."""
        fetched = self._counts.fetched
        return TargetListLinkStats(
            watched_by_queue=self.watched,
            fetch_channel=self._channel is not None,
            fetch_channel_failures=self._counts.channel_failures,
            fetches_inline=fetched["inline"],
            fetches_parked=fetched["parked"],
            fetches_by_ray=fetched["ray"],
            stale_dropped=self._counts.stale_dropped,
        )


__all__ = [
    "CLOSE_RETRY_SECONDS",
    "FETCH_ANSWER_SECONDS",
    "LOADER_POLL_SECONDS",
    "WATCH_DELAY_SECONDS",
    "ConsumerSpec",
    "Endpoint",
    "FetchChannelLike",
    "InFlight",
    "QueueEndpoint",
    "StaleEndpoint",
    "TargetListLink",
    "TargetListLinkStats",
]
