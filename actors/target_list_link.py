"""TargetListLink: a TargetList's link to its queue's actor (a mixin of
``TargetListActor``).

Registering (over the queue's FetchChannel, the Ray registration that hands the queue
our handle for its death watch in the background; else by a Ray call), fetching (over
the FetchChannel: small deliveries inline, large ones parked and taken by a Ray call;
by Ray alone while deliveries are large, before the channel is known and after it
broke), and following the queue when its actor fails: a fetch's failure marks the
link for a new registration, a dead actor is found again by name (the broker starts
a hibernated or ended queue again), and what was loaded from a queue process since
replaced is given back, never handed out (``_note_queue_process``).

Ray's failures of a fetch become typed errors naming the queue (``FetchFailed``); the
eager loader (``raymq.core.target_list.EagerLoader``) retries them with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import numpy as np
import pyarrow as pa
import ray
from raymq.actors.names import BROKER_ACTOR_NAME, queue_actor_name

from raymq import metrics
from raymq.batch import offsets_of
from raymq.core.target_list import (
    DirectEntry,
    FetchAnswer,
    FetchFailed,
)
from raymq.errors import BrokerUnavailable, NotLeader, RayMQError, ray_reason
from raymq.wire import fetch as fetch_channel
from raymq.wire.errors import WireBroken
from raymq.wire.fetch import (
    CONNECT_TIMEOUT_SECONDS,
    REMEMBERED_CONNECT_SECONDS,
    FetchChannel,
    InlineDelivery,
)

log = logging.getLogger("raymq.consumer")

#: Longest one fetch waits in the queue actor (seconds); the loader simply asks again.
LOADER_POLL_SECONDS = 1.0
#: A fetch not answered in this long counts as a failure of a restarting queue actor;
#: the loader waits for the same fetch again rather than ask twice (seconds).
FETCH_ANSWER_SECONDS = LOADER_POLL_SECONDS + 10.0
#: Longest a TargetList waits for its broker to start its queue's actor again (seconds):
#: a revival is a process start, a second or two here.
REVIVE_SECONDS = 60.0
#: Longest a TargetList registered over the FetchChannel puts off its Ray registration
#: (the queue's death watch), unless its first delivery comes sooner (seconds).
WATCH_DELAY_SECONDS = 0.1

#: How long ``close`` keeps asking a restarting queue actor (seconds).
CLOSE_RETRY_SECONDS = 30.0


class TargetListLink:
    """The queue side of a TargetList actor: registration, fetches, following."""

    # (Class defaults: tests make a bare instance to try one method.)
    _fetch_channel: FetchChannel | None = None
    _fetch_task: asyncio.Task | None = None
    #: The queue actor's lookup by name under way (``_queue_actor``).
    _finding: asyncio.Future | None = None
    _queue_process: str | None = None  # (``_note_queue_process``)
    _stale_give_back: asyncio.Future | None = None
    stale_dropped = 0
    #: The last fetch was larger than the FetchChannel sends inline: fetch through Ray
    #: (``_fetch_once``).
    _large_fetches = False

    async def _queue_actor(self):
        """The queue's actor handle: start's, or (started over the DeliveryChannel)
        looked up by name the first time it is needed (``_find_queue``; a replaced
        queue actor's is looked up again that way). Raises ``BrokerUnavailable`` if
        the queue's actor is not running."""
        if self.queue_actor is None:
            if not self._starting:
                raise RuntimeError("a spare TargetList: start() it first")
            if self._finding is None:  # one lookup for every caller waiting on it
                self._finding = asyncio.ensure_future(self._find_queue())
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

    async def _register(self) -> tuple[str, int, str] | None:
        """Register with the queue actor, handing it this actor's handle: it watches
        for our death to deliver again what we held. Returns the queue's FetchChannel
        endpoint (its answer)."""
        me = ray.get_runtime_context().current_actor
        queue = await self._queue_actor()
        endpoint = await queue.register_consumer.remote(
            self.consumer_id, self.prefetch, self.selector, me, self.subscription
        )
        self.watched = True
        return endpoint

    async def _broker_namespace(self) -> str:
        """The broker's Ray namespace, found once (blocking GCS calls, off the loop) while
        the queue actor is alive (``metrics.broker_of``)."""
        if self._namespace is None:
            queue_id = (await self._queue_actor())._actor_id.hex()
            name = queue_actor_name(self.queue)
            self._namespace = await asyncio.to_thread(metrics.broker_of, name, queue_id)
        return self._namespace

    async def _fetch(self, room: int) -> DirectEntry | None:
        """The loader's fetch: up to ``room`` messages from the queue actor. Ray's
        failures become typed errors naming the queue (``FetchFailed``); the queue's own
        typed errors pass as they are, ``ConsumerClosed`` included."""
        try:
            return await self._fetch_once(room)
        except ray.exceptions.RayTaskError as exc:  # (first: it is an instance of its cause)
            self._in_flight, self._register_again = None, True
            if isinstance(exc.cause, NotLeader):  # a replicated queue's leader moved
                self._queue_dead, self._death = True, str(exc.cause)
                raise FetchFailed(exc.cause, restarting=True) from None
            if isinstance(exc.cause, RayMQError):
                raise exc.cause from None
            error = BrokerUnavailable(f"queue {self.queue!r}: fetch failed: {exc.cause!r}")
            raise FetchFailed(error) from None
        except ray.exceptions.ActorUnavailableError as exc:
            self._in_flight, self._register_again = None, True
            error = BrokerUnavailable(f"queue {self.queue!r} is unavailable: {_reason(exc)}")
            raise FetchFailed(error, restarting=True) from None
        except ray.exceptions.RayActorError as exc:
            # Dead: for good if it could not start again (its files gone, say) or was
            # killed; a crash it restarts from ends the fetch under way the same way.
            self._in_flight, self._register_again, self._queue_dead = None, True, True
            how = "could not start again" if exc.actor_init_failed else "died"
            self._death = f"its actor {how}: {_reason(exc)}"
            error = BrokerUnavailable(f"queue {self.queue!r}: {self._death}")
            raise FetchFailed(error, restarting=not exc.actor_init_failed) from None
        except ray.exceptions.RayError as exc:
            self._in_flight, self._register_again = None, True
            error = BrokerUnavailable(f"queue {self.queue!r}: fetch failed: {_reason(exc)}")
            raise FetchFailed(error) from None
        except NotLeader as exc:  # over the FetchChannel: a replicated queue's leader moved
            self._register_again, self._queue_dead, self._death = True, True, str(exc)
            raise FetchFailed(exc, restarting=True) from None
        except RayMQError:  # over the FetchChannel: as the Ray path's typed errors above
            self._register_again = True
            raise

    async def _fetch_once(self, room: int) -> DirectEntry | None:
        """One fetch of up to ``room`` messages: the link to the queue made good first
        (``_relink``), then a fetch sent (``_send_fetch``) unless one is under way, and
        its answer awaited: over the FetchChannel (``_channel_answer``), else by Ray
        (``_ray_answer``)."""
        if self._in_flight is None and self._fetch_task is None:
            first, self._first_fetch = self._first_fetch, False
            await self._relink(first)
            await self._send_fetch(room, first)
        if self._fetch_task is not None:
            entry = await self._channel_answer()
            if entry is not None or self._in_flight is None:
                return entry
        return await self._ray_answer()

    async def _relink(self, first: bool) -> None:
        """Before a fetch: the registration's endpoint taken, the queue's actor found
        again if it died, a registration repeated if the queue may not know us (a new
        actor), and the FetchChannel opened or closed as it should be."""
        if self._registering is not None and not first:
            # The first fetch went without waiting for it; the next ones need the
            # FetchChannel's address it brings.
            registering, self._registering = self._registering, None
            with contextlib.suppress(Exception):  # start raises its errors
                self._set_fetch_endpoint(await registering)
        if self._queue_dead:
            self.queue_actor = await self._find_queue()
            self._queue_dead = False
        if self._register_again:
            # The queue actor watches us again; it may be a new one (a new channel).
            self._set_fetch_endpoint(await self._register())
            self._register_again = False
        if self._fetch_channel is not None and not self._fetch_channel_enabled:
            self._fetch_channel.close()
            self._fetch_channel = None
        if self._fetch_channel_enabled and not self._fetch_channel and self._fetch_endpoint:
            try:
                self._fetch_channel = await FetchChannel.connect(*self._fetch_endpoint, self.queue)
            except WireBroken as exc:
                self._fetch_channel_broke(exc)

    async def _send_fetch(self, room: int, first: bool) -> None:
        """Send a fetch of up to ``room`` messages, over the FetchChannel or by Ray."""
        args = (
            self.consumer_id,
            room,
            # The first fetch, made before the FetchChannel is known, only takes
            # what is there: a wait belongs on the channel.
            0.0 if first else LOADER_POLL_SECONDS,
            self.prefetch,
            self.selector,
            self.subscription,
        )
        # While deliveries are large (a deep queue), the channel only parks them
        # and a Ray call takes them: a socket round trip and two wake-ups of the
        # queue actor per fetch for nothing. They are fetched by one Ray call then,
        # until one brings no more than the channel sends inline.
        if self._fetch_channel is not None and not self._large_fetches:
            self._fetch_task = asyncio.ensure_future(self._fetch_channel.fetch(*args, streams=True))
        else:
            self._in_flight = (
                (await self._queue_actor()).fetch_batch.options(num_returns=2).remote(*args)
            )
            self._in_flight_kind = "ray"

    async def _channel_answer(self) -> DirectEntry | None:
        """The answer of the fetch under way on the FetchChannel: rows inline, or None
        (none came; the channel broke; or the delivery was parked: then its Ray call is
        in flight for ``_ray_answer``)."""
        task = self._fetch_task
        try:
            got = await asyncio.shield(task)  # a cancelled loader leaves it to close
        except asyncio.CancelledError:
            # A fetch that finished as the loader was cancelled (by close) keeps its
            # rows for close, which gives them back as never received: dropped here,
            # the queue would count them as delivered (a dead letter too early).
            if task.done() and (task.cancelled() or task.exception() is not None):
                self._fetch_task = None
            raise
        except WireBroken as exc:
            self._fetch_task = None
            self._fetch_channel_broke(exc)
            return None  # the next fetch goes through Ray
        except BaseException:
            self._fetch_task = None
            raise
        self._fetch_task = None
        if got is None:
            return None
        if isinstance(got, pa.RecordBatch):  # (asked without its stream)
            got = InlineDelivery(got, b"")
        if isinstance(got, InlineDelivery):  # inline: held in this process
            self.fetched["inline"] += 1
            return DirectEntry(got, offsets_of(got.batch), got.batch.nbytes)
        # Parked in the queue actor (large): take it through Ray, by reference.
        self._in_flight = (
            (await self._queue_actor()).fetch_parked.options(num_returns=2).remote(got)
        )
        self._in_flight_kind = "parked"
        self._large_fetches = True
        return None

    async def _ray_answer(self) -> DirectEntry:
        """The answer of the fetch in flight by Ray: references to its batches."""
        meta_ref, batch_ref = self._in_flight
        try:
            answer: FetchAnswer = await asyncio.wait_for(meta_ref, FETCH_ANSWER_SECONDS)
        except TimeoutError:
            # Still in flight: the next attempt waits for this same fetch.
            error = BrokerUnavailable(
                f"queue {self.queue!r} did not answer a fetch in {FETCH_ANSWER_SECONDS:.0f} s"
            )
            raise FetchFailed(error, restarting=True) from None
        self._in_flight = None
        if len(answer.offsets):
            self.fetched[self._in_flight_kind] += 1
        if self._in_flight_kind == "ray":
            self._large_fetches = answer.nbytes > fetch_channel.INLINE_BYTES
        parts = answer.parts
        if parts:  # shared rows, then those of the batch made for this delivery
            rest = len(answer.offsets) - sum(rows for _, _, rows in parts)
            parts = [*parts, (batch_ref, 0, rest)] if rest else parts
        return DirectEntry(batch_ref, answer.offsets, answer.nbytes, parts=parts or None)

    async def _register_over_channel(self, endpoint: tuple[str, int, str], cached: bool) -> bool:
        """Connect the FetchChannel and register over it; False if the channel failed
        (counted, logged: the Ray registration then stands). Raises the queue's typed
        error (a malformed selector...), and ``_StaleEndpoint`` if the ``cached``
        endpoint failed or answered ``NotLeader`` (its actor is not the queue's now)."""
        timeout = REMEMBERED_CONNECT_SECONDS if cached else CONNECT_TIMEOUT_SECONDS
        channel = None
        try:
            channel = await FetchChannel.connect(*endpoint, self.queue, timeout=timeout)
            await channel.register(
                self.consumer_id, self.prefetch, self.selector, self.subscription
            )
        except BaseException as exc:
            if channel is not None:
                channel.close()
            if cached and isinstance(exc, WireBroken | NotLeader):
                raise _StaleEndpoint(endpoint, exc) from None
            if isinstance(exc, WireBroken):
                self._fetch_channel_broke(exc)
                return False
            raise
        self._fetch_channel, self._fetch_endpoint = channel, tuple(endpoint)
        self._note_queue_process(self._fetch_endpoint)
        return True

    async def _watched_by_queue(self) -> None:
        """Make the Ray registration that hands the queue our handle (its death watch);
        if it failed, the loader registers again before its next fetch.

        Made once the consumer has its first delivery, or ``WATCH_DELAY_SECONDS``
        after start: it costs this process milliseconds (looking the queue's actor up,
        and a call carrying our handle), which a new consumer's first
        message would otherwise wait for. Meanwhile the queue watches the FetchChannel
        instead: if it closes, the queue delivers again what we held."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._delivered.wait(), WATCH_DELAY_SECONDS)
        if self._closed:  # closing first: nothing left to watch
            return
        try:
            await self._register()
        except Exception as exc:  # the channel's registration succeeded: not a bad setting
            log.info("consumer %s: registering again: %s", self.consumer_id, _reason(exc))
            self._register_again = True

    def use_fetch_channel(self, enabled: bool) -> None:
        """Fetch over the FetchChannel (``enabled``, the default) or through Ray calls
        only: the path before it, a baseline for ``bench/latency.py`` and the fallback
        tested. Takes effect from the next fetch."""
        self._fetch_channel_enabled = enabled

    def _set_fetch_endpoint(self, endpoint: tuple[str, int, str] | None) -> None:
        """Our registration's answer: the queue's FetchChannel (None: fetch by Ray)."""
        endpoint = None if endpoint is None else tuple(endpoint)
        if endpoint != self._fetch_endpoint and self._fetch_channel is not None:
            self._fetch_channel.close()  # a channel to a queue actor that was replaced
            self._fetch_channel = None
        self._fetch_endpoint = endpoint
        self._note_queue_process(endpoint)

    def _note_queue_process(self, endpoint: tuple[str, int, str] | None) -> None:
        """A registration answered ``endpoint``. Its secret is made anew by each queue
        process (one FetchChannel server each): a new one means the queue actor we
        loaded from was replaced (restarted in place, revived, a new leader), and with
        it its record of what it delivered to us. It delivers those messages again,
        so what we still hold is not handed out: a stale copy could otherwise reach
        the application after the fresh one was acked. It goes back to the queue
        instead of being dropped: a fetch by Ray may have been answered by the new
        process before this registration, and the queue releases only what it counts
        as ours (``TargetArea.release``), ignoring the old process's offsets. Counted
        in ``stale_dropped``."""
        if endpoint is None:  # fetching by Ray: the old process's references are lost
            return
        process = endpoint[2]
        if self._queue_process is not None and process != self._queue_process:
            offsets = self.targets.drain()
            if len(offsets):
                self.stale_dropped += len(offsets)
                log.warning(
                    "consumer %s: queue %r is a new process: %d messages loaded before"
                    " not handed out (delivered again)",
                    self.consumer_id,
                    self.queue,
                    len(offsets),
                )
                self._stale_give_back = asyncio.ensure_future(self._give_back_stale(offsets))
            self.loader.wake()  # room again
        self._queue_process = process

    async def _give_back_stale(self, offsets: np.ndarray) -> None:
        """``_note_queue_process``'s give-back (in order with fetches: the loader's).
        Failed, they stay held by us in the queue until we close or die (logged)."""
        try:
            await self.loader.give_back(offsets)
        except Exception as exc:
            log.warning(
                "consumer %s: %d messages loaded from a replaced queue process not given back: %r",
                self.consumer_id,
                len(offsets),
                exc,
            )

    def _fetch_channel_broke(self, exc: WireBroken) -> None:
        """The FetchChannel failed: fetch through Ray until we register again (after a
        failure of the queue actor, which may be a new one then) (counted, logged)."""
        self.fetch_channel_failures += 1
        if self._fetch_channel is not None:
            self._fetch_channel.close()
        self._fetch_channel, self._fetch_endpoint = None, None
        # A queue actor restarted in place knows us only once a fetch registers us, and
        # then without our handle: nothing would watch for our death (what we hold would
        # stay held until its next restart). Registering hands it over again.
        self._register_again = True
        log.warning("consumer %s: fetching through Ray calls: %s", self.consumer_id, exc)

    async def _find_queue(self):
        """The queue's actor, looked up by name: started again (a restart, a revival)
        it is a new actor. If none runs (it hibernated, after dropping us as silent,
        say), the broker starts it again (``get_queue``; at most ``REVIVE_SECONDS``):
        a consumer that lives is never left on a queue nobody revives. Raises
        ``FetchFailed`` with the broker's typed error, or ``BrokerUnavailable``."""
        name = queue_actor_name(self.queue)
        namespace = await self._broker_namespace()
        try:
            return await asyncio.to_thread(ray.get_actor, name, namespace)
        except ValueError:
            pass
        try:
            broker = await asyncio.to_thread(ray.get_actor, BROKER_ACTOR_NAME, namespace)
            return await asyncio.wait_for(broker.get_queue.remote(self.queue), REVIVE_SECONDS)
        except RayMQError as exc:  # (Ray's error for a typed one is one too)
            raise FetchFailed(getattr(exc, "cause", exc)) from None
        except (ValueError, TimeoutError, ray.exceptions.RayError) as exc:
            error = BrokerUnavailable(
                f"queue {self.queue!r} is not running (no actor {name!r}; {self._death})"
                f" and its broker did not start it: {exc!r}"
            )
            raise FetchFailed(error) from None


class _StaleEndpoint(Exception):
    """A remembered FetchChannel endpoint that failed: its queue actor was replaced."""

    def __init__(self, endpoint: tuple[str, int, str], cause: BaseException):
        host, port, _secret = endpoint
        super().__init__(f"the remembered fetch channel {host}:{port} failed: {cause}")


_reason = ray_reason
