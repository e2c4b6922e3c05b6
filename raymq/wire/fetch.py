"""The fetch protocol: a TargetList's fetches from its queue actor over the wire.

Through Ray, a message made durable reaches a consumer's TargetList in a ``fetch_batch``
call's answer (1-2 ms here, docs/ARCHITECTURE.md), then the TargetList reads the
delivery's reference (about 1 ms more). So a queue actor serves this protocol
(docs/WIRE.md "fetch"): a fetch waiting in the queue is answered by the group commit
that made messages visible, and a small delivery comes back inline as an Arrow IPC
stream, held by the TargetList in its own memory.

Ops (one fetch at a time per connection, the TargetList's loader being its only user):

- ``register [consumer_id, prefetch, selector, subscription]``: registers a consumer
  without the death watch (a socket round trip instead of a first Ray call, about 10 ms
  here); the TargetList sends its handle through Ray next. Until then the connection's
  end stands for the TargetList's death (``Lost``).
- ``fetch [consumer_id, max_messages, timeout, prefetch, selector, subscription,
  inline_bytes]`` (messages, seconds, bytes), answered nil (nothing came within the
  timeout), a token (an int: a delivery over ``inline_bytes`` is "parked", and the
  TargetList takes it through Ray, ``QueueActor.fetch_parked``, as a zero-copy object
  store reference), or ``"ipc"`` with one raw buffer (an Arrow IPC stream of one
  delivery RecordBatch, ``raymq.batch.DELIVERY_SCHEMA``). The client ending its side
  (``FetchChannel.finish``) ends a waiting fetch at once, answered nil.

Failures: a TargetList whose connection fails fetches through Ray calls (``WireBroken``)
until it registers again. Rows taken for an answer that could not be written are given
back (never received); an answer lost after it was written stays held by the consumer
until it closes or dies, when the queue delivers it again (at-least-once). A parked
delivery not taken within ``PARKED_SECONDS`` is dropped (counted, logged); its messages
stay held by that consumer until it closes or dies.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import NamedTuple, Protocol

import numpy as np
import pyarrow as pa

from raymq.errors import BrokerUnavailable
from raymq.wire.client import WireClient
from raymq.wire.errors import WireBroken
from raymq.wire.ipc import from_ipc, to_ipc
from raymq.wire.server import DEFERRED, Connection, Op, ProtocolServer, Request, WireServer
from raymq.wire.server import Protocol as WireProtocol

log = logging.getLogger("raymq.wire.fetch")

PROTOCOL = "fetch"
#: Largest delivery a TargetList asks to get inline (bytes); more is parked and taken
#: through Ray, without a copy.
INLINE_BYTES = 256 * 1024
#: What ``TargetListActor.start`` answers when the endpoint a client remembered did not
#: answer (the queue's actor was replaced): the client asks for the current one.
STALE_FETCH_ENDPOINT = "stale fetch endpoint"
#: How long a TargetList tries a remembered endpoint (seconds): the queue's actor on a
#: lost node does not refuse, it is silent; the client then asks for the current one.
REMEMBERED_CONNECT_SECONDS = 1.0
#: Longest request (a selector included) (bytes).
REQUEST_LIMIT = 64 * 1024
#: Seconds a client waits to connect and for the hello's answer.
CONNECT_TIMEOUT_SECONDS = 5.0
#: Seconds a client waits for an answer beyond the timeout it asked for: past that the
#: connection is taken as broken (the queue actor is stuck or gone) and Ray is used.
ANSWER_MARGIN_SECONDS = 10.0
#: Longest wait one request may ask for (seconds); the client asks again.
MAX_WAIT_SECONDS = 60.0
#: Connections one queue actor serves at once (a TargetList each); more fetch by Ray.
MAX_CONNECTIONS = 4096
#: A parked delivery not taken by its TargetList within this long is dropped (seconds).
PARKED_SECONDS = 60.0


class InlineDelivery(NamedTuple):
    """A delivery that came inline (``FetchChannel.fetch(streams=True)``): its rows, and
    the IPC stream they came in (their buffers point into it), which the TargetList's
    delivery server hands on unchanged."""

    batch: pa.RecordBatch
    stream: bytes | memoryview


class Delivery(Protocol):
    """What the server needs of ``raymq.core.subscription.Delivery``."""

    offsets: np.ndarray
    nbytes: int

    def to_batch(self) -> pa.RecordBatch: ...


#: ``fetch(consumer_id, max_messages, timeout, prefetch, selector, subscription)``: the
#: queue's delivery (``QueueCore.fetch_delivery``); raises the queue's typed errors.
Fetch = Callable[[str, int, float, int, "str | None", "str | None"], Awaitable[Delivery]]
#: ``give_back(consumer_id, offsets, subscription)``: rows taken for an answer that
#: could not be written, released uncounted (``QueueCore.give_back``).
GiveBack = Callable[[str, np.ndarray, "str | None"], object]
#: ``register(consumer_id, prefetch, selector, subscription)``: register a consumer
#: (``QueueCore.register_consumer``, no watch); raises the queue's typed errors.
Register = Callable[[str, int, "str | None", "str | None"], Awaitable[None]]


class Registration(NamedTuple):
    """A ``register`` request's arguments."""

    consumer_id: str
    prefetch: int
    selector: str | None
    subscription: str | None


#: ``lost(registered)``: a connection ended; ``registered`` are the (consumer id,
#: subscription) it registered.
Lost = Callable[[list[tuple[str, "str | None"]]], None]


# -- the queue actor's side ----------------------------------------------------------------


class FetchServer(ProtocolServer):
    """Serves the TargetLists' fetches of one queue from its actor's event loop."""

    def __init__(
        self,
        fetch: Fetch,
        give_back: GiveBack,
        queue: str,
        register: Register | None = None,
        lost: Lost | None = None,
    ):
        self._fetch = fetch
        self._give_back = give_back
        self._register = register
        self._lost = lost
        self.queue = queue
        self._tokens = itertools.count(1)
        #: token -> (monotonic time parked, consumer id, delivery)
        self._parked: dict[int, tuple[float, str, Delivery]] = {}
        self.answers = 0  # answered with messages inline
        self.parked = 0  # answered "take it through Ray"
        self.given_back = 0  # messages of answers that could not be written
        self.parked_dropped = 0  # parked deliveries never taken (messages)
        ops = {"fetch": Op(self._answer_fetch, _check_fetch, cancel_on_eof=True)}
        if register is not None:
            ops["register"] = Op(self._answer_register, _check_register)
        protocol = WireProtocol(
            PROTOCOL,
            ops,
            request_limit=REQUEST_LIMIT,
            max_connections=MAX_CONNECTIONS,
            on_connection_lost=self._connection_lost,
        )
        self.server = WireServer(protocol, f"queue {queue!r}")

    def take_parked(self, token: int) -> Delivery | None:
        """The delivery parked under ``token`` (once), None if unknown or dropped."""
        got = self._parked.pop(token, None)
        return None if got is None else got[2]

    def _park(self, consumer_id: str, delivery: Delivery) -> int:
        now = time.monotonic()
        for token, (since, who, old) in list(self._parked.items()):
            if now - since > PARKED_SECONDS:  # its TargetList is gone or stuck
                del self._parked[token]
                self.parked_dropped += len(old.offsets)
                log.warning(
                    "queue %r: a parked delivery of %d messages to consumer %s was never"
                    " taken; they are delivered again when it closes",
                    self.queue,
                    len(old.offsets),
                    who,
                )
        token = next(self._tokens)
        self._parked[token] = (now, consumer_id, delivery)
        return token

    def _connection_lost(self, conn: Connection) -> None:
        registered = conn.state.get("registered")
        if registered and self._lost is not None:
            self._lost(registered)

    async def _answer_register(self, request: Request) -> None:
        consumer_id, prefetch, selector, subscription = request.args
        # A fetch written behind this request waits for it (``_answer_fetch``).
        registering = request.conn.state.setdefault("registering", {})
        done = registering[consumer_id] = asyncio.get_running_loop().create_future()
        try:
            await self._register(consumer_id, prefetch, selector, subscription)  # type: ignore[misc]
            request.conn.state.setdefault("registered", []).append((consumer_id, subscription))
            done.set_result(None)
            # Answered before the fetch written behind it runs (its reading holds the
            # loop for milliseconds, which the TargetList's start would wait out).
            request.answer(None, now=True)
        except Exception as exc:  # the fetch behind it fails alike
            done.set_exception(exc)
            raise
        finally:
            if not done.done():  # cancelled: the server is closing
                done.set_exception(BrokerUnavailable(f"queue {self.queue!r} is closing"))
            if done.exception() is None and registering.get(consumer_id) is done:
                del registering[consumer_id]

    async def _answer_fetch(self, request: Request) -> object:
        consumer_id, max_messages, timeout, prefetch, selector, subscription, inline = request.args
        wait = min(float(timeout), MAX_WAIT_SECONDS)
        registering = request.conn.state.get("registering", {}).get(consumer_id)
        if registering is not None:  # written behind its registration: after it, or its error
            await asyncio.shield(registering)
        try:
            delivery = await self._fetch(
                consumer_id, max_messages, wait, prefetch, selector, subscription
            )
        except asyncio.CancelledError:  # the client ended its side: it took nothing
            return None
        if not len(delivery.offsets):
            return None
        if delivery.nbytes > inline:
            self.parked += 1
            return self._park(consumer_id, delivery)
        # Written now, not at the end of this turn of the loop: a consumer waits on it.
        if request.answer("ipc", [to_ipc(delivery.to_batch())], now=True):
            self.answers += 1
            return DEFERRED
        # Not handed to the TargetList: the queue delivers them again (uncounted).
        self.given_back += len(delivery.offsets)
        log.warning(
            "queue %r: fetch connection to consumer %s broke; %d messages given back",
            self.queue,
            consumer_id,
            len(delivery.offsets),
        )
        self._give_back(consumer_id, delivery.offsets, subscription)
        return DEFERRED


def _count(x: object) -> bool:
    return type(x) is int and x >= 0


def _name(x: object) -> bool:
    return x is None or isinstance(x, str)


def _check_fetch(args: list, buffers: list) -> None:
    if not (
        len(args) == 7
        and isinstance(args[0], str)
        and _count(args[1])
        and args[1] >= 1
        and isinstance(args[2], int | float)
        and not isinstance(args[2], bool)
        and args[2] >= 0
        and _count(args[3])
        and _name(args[4])
        and _name(args[5])
        and _count(args[6])
    ):
        raise ValueError(f"a malformed fetch: {args!r:.200}")


def _check_register(args: list, buffers: list) -> None:
    if not (
        len(args) == 4
        and isinstance(args[0], str)
        and _count(args[1])
        and _name(args[2])
        and _name(args[3])
    ):
        raise ValueError(f"a malformed register: {args!r:.200}")


# -- the TargetList's side -------------------------------------------------------------------


class FetchChannel:
    """A TargetList's connection to its queue actor's ``FetchServer``, on the actor's
    event loop. Any failure raises ``WireBroken`` and leaves the channel closed: the
    caller fetches through Ray from then on."""

    def __init__(self, client: WireClient, queue: str):
        self.queue = queue
        self._client = client
        #: The first fetch, written behind the registration by ``connect``.
        self.pending_fetch: asyncio.Task | None = None

    @property
    def closed(self) -> bool:
        """True once the connection is closed or broken."""
        return self._client.broken is not None

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        secret: str,
        queue: str,
        timeout: float = CONNECT_TIMEOUT_SECONDS,
        register: Registration | None = None,
        fetch: tuple | None = None,
    ) -> FetchChannel:
        """Connect and say hello within ``timeout`` seconds; ``WireBroken`` if not.

        ``register``: a consumer registered as by ``register``, its request written
        behind the hello (one round trip for both, not two); raises what ``register``
        raises, the channel then closed. ``fetch``: ``fetch``'s arguments (with
        ``register``): that consumer's first fetch, written behind the registration,
        which the queue answers once the registration is done; its answer's task is
        ``pending_fetch`` (``fetch(..., streams=True)``'s), cancelled if the
        registration fails."""
        first = None
        if register is not None:
            first = ("register", list(register), ANSWER_MARGIN_SECONDS)
        client = await WireClient.connect(
            (host, port, secret), PROTOCOL, f"queue {queue!r}", timeout=timeout, first=first
        )
        channel = cls(client, queue)
        if client.first is not None:
            if fetch is not None:  # written as the task first runs: while we wait below
                channel.pending_fetch = asyncio.ensure_future(channel.fetch(*fetch, streams=True))
            try:
                await client.first
            except BaseException:
                channel.close()
                if channel.pending_fetch is not None:
                    channel.pending_fetch.cancel()
                    channel.pending_fetch = None
                raise
        return channel

    async def fetch(
        self,
        consumer_id: str,
        max_messages: int,
        timeout: float,
        prefetch: int,
        selector: str | None,
        subscription: str | None,
        inline_bytes: int = INLINE_BYTES,
        *,
        streams: bool = False,
    ) -> pa.RecordBatch | InlineDelivery | int | None:
        """Up to ``max_messages`` for ``consumer_id``, waiting up to ``timeout`` seconds:
        a delivery RecordBatch (its buffers in this process; with ``streams``, an
        ``InlineDelivery``), a parked delivery's token (an int: take it through Ray), or
        None if nothing came. Raises the queue's typed error, or ``WireBroken``."""
        timeout = min(max(float(timeout), 0.0), MAX_WAIT_SECONDS)
        args = [consumer_id, max_messages, timeout, prefetch, selector, subscription]
        answer = await self._ask("fetch", [*args, inline_bytes], timeout)
        if answer.value == "ipc" and len(answer.buffers) == 1:
            data = answer.buffers[0]
            try:
                batch = from_ipc(data)
            except (pa.ArrowInvalid, OSError) as exc:
                self.close()
                raise WireBroken(f"queue {self.queue!r}: a fetch answer: {exc!r}") from exc
            return InlineDelivery(batch, data) if streams else batch
        if answer.value is None or type(answer.value) is int:
            return answer.value
        self.close()
        raise WireBroken(f"queue {self.queue!r}: a fetch answered {answer.value!r:.100}")

    async def register(
        self, consumer_id: str, prefetch: int, selector: str | None, subscription: str | None
    ) -> None:
        """Register ``consumer_id`` with the queue (no death watch: the caller registers
        its actor handle through Ray too). Raises the queue's typed error (a malformed
        selector, a deleted subscription...), or ``WireBroken``."""
        await self._ask("register", [consumer_id, prefetch, selector, subscription], 0.0)

    async def _ask(self, op: str, args: list, timeout: float):
        try:
            return await self._client.call(op, args, within=timeout + ANSWER_MARGIN_SECONDS)
        except asyncio.CancelledError:  # mid-answer: the stream cannot be used again
            self.close()
            raise

    def finish(self) -> None:
        """End our side of the connection, keeping the fetch under way (if any): the
        server then answers it at once with nothing if it is still waiting, or with
        what it took. No request follows."""
        self._client.half_close()

    def close(self) -> None:
        """Close the connection (the server sees the end of it)."""
        self._client.close()
