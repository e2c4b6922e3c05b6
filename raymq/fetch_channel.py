"""FetchChannel: a TargetList's fetches over a socket to its queue actor.

Through Ray, a message made durable reaches a consumer's TargetList in a ``fetch_batch``
call's answer (1-2 ms here, docs/ARCHITECTURE.md), then the TargetList reads the delivery's
reference (about 1 ms more), and a message arriving while no fetch is waiting waits for
the next call to come in. So the queue actor also listens on a TCP socket on its node's
address, as it does for sends (``raymq.send_channel``), and each TargetList asks there:
a fetch waiting in the queue is answered by the group commit that made messages visible
(the same wake-up as a Ray fetch), and a small delivery comes back inline as an Arrow
IPC stream, held by the TargetList in its own memory. The next request follows at
once, one socket round trip (about 0.1 ms) after the answer.

A large delivery (more than the ``inline_bytes`` the request allows, as on a deep
backlog) is not copied through the socket: the server keeps it ("parks" it) and answers
with a token, and the TargetList takes it with a Ray call (``QueueActor.fetch_parked``),
as a zero-copy object-store reference owned by the TargetList, as before. A parked
delivery not taken within ``PARKED_SECONDS`` is dropped (counted, logged); its messages
stay held by that consumer until it closes or dies, when the queue delivers them again.

Failures: a TargetList that cannot connect, or whose connection breaks, fetches through
Ray calls (``ChannelBroken``; counted and logged by the TargetList) until it registers
with the queue again (after a failure of the queue actor). Rows the server took for an
answer it could not write are given back to the queue (never received); an answer lost
after it was written stays held by the consumer until it closes or dies, when the queue
delivers it again (at-least-once, its delivery count raised).

Security: as the SendChannel, the server answers only a client that first presents the
secret (got through an authenticated Ray call, ``register_consumer``), within
``HELLO_TIMEOUT_SECONDS`` (``delivery_channel.SecretServer``); frames before it are
limited to 1 KiB, requests to ``REQUEST_LIMIT`` bytes.

Registration: a new consumer's TargetList may register over the channel (a socket round
trip instead of a first Ray call to the queue actor, which costs it about 10 ms here),
then with its actor handle through Ray for the death watch, in the background. Until
that lands, the channel's end (EOF) stands for the TargetList's death: consumers
registered over a connection and still without a watch are closed when it ends
(``Lost``), and what they held is delivered again.

Frames: a 4-byte big-endian length, then msgpack (``raymq.delivery_channel.frame``). The
client's first frame is ``[secret]``, answered ``[true]``. Requests, one at a time per
connection:

- ``["register", consumer_id, prefetch, selector, subscription]``, answered
  ``["ok", 0]`` or an error;
- ``["fetch", consumer_id, max_messages, timeout, prefetch, selector, subscription,
  inline_bytes]`` (messages, seconds, bytes), answered with one of
  ``["batch", n]`` followed by ``n`` raw bytes (an Arrow IPC stream of one delivery
  RecordBatch, ``raymq.batch.DELIVERY_SCHEMA``); ``["none", 0]`` (nothing arrived
  within the timeout); ``["parked", token]`` (a delivery over ``inline_bytes``: take it
  through Ray);
- and for either, ``["error", class name, message]``: the queue's typed error.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import NamedTuple, Protocol

import msgpack
import numpy as np
import pyarrow as pa

from raymq.delivery_channel import SecretServer, _read_frame, frame, from_ipc, nodelay, to_ipc
from raymq.errors import RayMQError
from raymq.send_channel import error_of

log = logging.getLogger("raymq.fetch_channel")

#: Largest delivery a TargetList asks to get inline (bytes); more is parked and taken
#: through Ray, without a copy.
INLINE_BYTES = 256 * 1024
#: What ``TargetListActor.start`` answers when the endpoint a client remembered did not
#: answer (the queue's actor was replaced): the client asks for the current one.
STALE_FETCH_ENDPOINT = "stale fetch endpoint"
#: How long a TargetList tries a remembered endpoint (seconds): the queue's actor on a
#: lost node does not refuse, it is silent; the client then asks for the current one.
REMEMBERED_CONNECT_SECONDS = 1.0
#: Longest request frame (a selector included) (bytes).
REQUEST_LIMIT = 64 * 1024
#: Longest answer header a client reads (bytes).
HEADER_LIMIT = 64 * 1024
#: Seconds a client waits to connect and for the server's answer to its secret.
CONNECT_TIMEOUT_SECONDS = 5.0
#: Seconds a client waits for an answer beyond the timeout it asked for: past that the
#: channel is taken as broken (the queue actor is stuck or gone) and Ray is used.
ANSWER_MARGIN_SECONDS = 10.0
#: Longest wait one request may ask for (seconds); the client asks again.
MAX_WAIT_SECONDS = 60.0
#: Connections one queue actor serves at once (a TargetList each); more fetch by Ray.
MAX_CONNECTIONS = 4096
#: A parked delivery not taken by its TargetList within this long is dropped (seconds).
PARKED_SECONDS = 60.0


class ChannelBroken(ConnectionError):
    """The connection failed or answered nonsense; fetch through Ray."""


class InlineDelivery(NamedTuple):
    """A delivery that came inline (``FetchChannel.fetch(streams=True)``): its rows, and
    the IPC stream they came in (their buffers point into it), which the TargetList's
    DeliveryChannel hands on unchanged."""

    batch: pa.RecordBatch
    stream: bytes


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
#: ``lost(registered)``: a connection ended; ``registered`` are the (consumer id,
#: subscription) it registered.
Lost = Callable[[list[tuple[str, "str | None"]]], None]


# -- the queue actor's side ----------------------------------------------------------------


class FetchChannelServer(SecretServer):
    """Serves the TargetLists' fetches of one queue from its actor's event loop."""

    max_connections = MAX_CONNECTIONS

    def __init__(
        self,
        fetch: Fetch,
        give_back: GiveBack,
        queue: str,
        register: Register | None = None,
        lost: Lost | None = None,
    ):
        super().__init__()
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

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._admit(writer):
            return
        registered: list[tuple[str, str | None]] = []
        try:
            if not await self._greet(reader, writer):
                return
            while True:
                req = await _read_frame(reader, REQUEST_LIMIT)
                if _valid_fetch(req):
                    if not await self._answer_unless_ended(reader, writer, req[1:]):
                        return
                elif _valid_register(req) and self._register is not None:
                    await self._answer_register(writer, registered, *req[1:])
                else:
                    return  # not our client: drop the connection
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass  # the client went away, or never showed the secret
        except Exception:  # msgpack garbage and the like: drop that connection only
            log.exception("queue %r: fetch channel connection failed", self.queue)
        finally:
            self._leave(writer)
            if registered and self._lost is not None:
                self._lost(registered)

    async def _answer_unless_ended(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, args: list
    ) -> bool:
        """Answer one fetch. While it waits for messages, the client's end of the
        connection (its TargetList closing, or dead) cancels it: it took nothing then,
        and a closing TargetList need not wait out the poll. Once it took messages the
        answer is written whatever happens (the client still reads it). Returns False
        if the connection is to end (the client ended it, or wrote out of turn)."""
        phase = ["fetching"]
        answer = asyncio.ensure_future(self._answer(writer, *args, phase=phase))
        ended = asyncio.ensure_future(reader.read(1))  # b"": the client ended its side
        try:
            await asyncio.wait({answer, ended}, return_when=asyncio.FIRST_COMPLETED)
            cancelled = not answer.done() and phase[0] == "fetching"
            if cancelled:
                answer.cancel()
            try:
                await answer
            except asyncio.CancelledError:
                if not cancelled:
                    raise  # we are cancelled ourselves (the server closing)
                with contextlib.suppress(OSError):  # a closing client reads this
                    writer.write(frame(["none", 0]))
                    await writer.drain()
                return False
        finally:
            pending = {task for task in (answer, ended) if not task.done()}
            for task in pending:
                task.cancel()
            if pending:  # over before the next read: a reader serves one read at a time
                await asyncio.wait(pending)
        if ended.cancelled():
            return True
        ended.exception()  # (retrieved: a reset is an end like any other)
        return False

    async def _answer_register(
        self,
        writer: asyncio.StreamWriter,
        registered: list[tuple[str, str | None]],
        consumer_id: str,
        prefetch: int,
        selector: str | None,
        subscription: str | None,
    ) -> None:
        try:
            await self._register(consumer_id, prefetch, selector, subscription)
        except RayMQError as exc:
            writer.write(frame(["error", type(exc).__name__, str(exc)]))
        else:
            registered.append((consumer_id, subscription))
            writer.write(frame(["ok", 0]))
        await writer.drain()

    async def _answer(
        self,
        writer: asyncio.StreamWriter,
        consumer_id: str,
        max_messages: int,
        timeout: float,
        prefetch: int,
        selector: str | None,
        subscription: str | None,
        inline_bytes: int,
        *,
        phase: list[str] | None = None,
    ) -> None:
        """Answer one fetch; ``phase[0]`` becomes "answering" once the fetch returned
        (from then on, cancelling would lose track of what it took)."""
        try:
            delivery = await self._fetch(
                consumer_id,
                max_messages,
                min(float(timeout), MAX_WAIT_SECONDS),
                prefetch,
                selector,
                subscription,
            )
        except RayMQError as exc:
            if phase is not None:
                phase[0] = "answering"
            writer.write(frame(["error", type(exc).__name__, str(exc)]))
            await writer.drain()
            return
        if phase is not None:
            phase[0] = "answering"
        if not len(delivery.offsets):
            writer.write(frame(["none", 0]))
        elif delivery.nbytes > inline_bytes:
            self.parked += 1
            writer.write(frame(["parked", self._park(consumer_id, delivery)]))
        else:
            try:
                data = to_ipc(delivery.to_batch())
                writer.write(frame(["batch", data.size]))
                writer.write(memoryview(data))
                await writer.drain()
            except BaseException:  # the client went away, or a bug: not lost either way
                # Not handed to the TargetList: the queue delivers them again (uncounted).
                self.given_back += len(delivery.offsets)
                log.warning(
                    "queue %r: fetch channel to consumer %s broke; %d messages given back",
                    self.queue,
                    consumer_id,
                    len(delivery.offsets),
                )
                self._give_back(consumer_id, delivery.offsets, subscription)
                raise
            self.answers += 1
            return
        await writer.drain()


def _count(x: object) -> bool:
    return type(x) is int and x >= 0


def _name(x: object) -> bool:
    return x is None or isinstance(x, str)


def _valid_fetch(req: object) -> bool:
    return (
        isinstance(req, list)
        and len(req) == 8
        and req[0] == "fetch"
        and isinstance(req[1], str)
        and _count(req[2])
        and req[2] >= 1
        and isinstance(req[3], int | float)
        and not isinstance(req[3], bool)
        and req[3] >= 0
        and _count(req[4])
        and _name(req[5])
        and _name(req[6])
        and _count(req[7])
    )


def _valid_register(req: object) -> bool:
    return (
        isinstance(req, list)
        and len(req) == 5
        and req[0] == "register"
        and isinstance(req[1], str)
        and _count(req[2])
        and _name(req[3])
        and _name(req[4])
    )


# -- the TargetList's side -------------------------------------------------------------------


class FetchChannel:
    """A TargetList's connection to its queue actor's ``FetchChannelServer``.

    One request at a time (the TargetList's loader is its only user). Any failure,
    cancellation included, raises ``ChannelBroken`` or leaves the channel closed: the
    caller fetches through Ray from then on.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, queue: str):
        self.queue = queue
        self._reader = reader
        self._writer = writer
        self.closed = False

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        secret: str,
        queue: str,
        timeout: float = CONNECT_TIMEOUT_SECONDS,
    ) -> FetchChannel:
        """Connect and present ``secret`` within ``timeout`` seconds each; raises
        ``ChannelBroken`` if that fails."""
        writer = None
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
            nodelay(writer)
            writer.write(frame([secret]))
            answer = await asyncio.wait_for(_read_frame(reader, HEADER_LIMIT), timeout)
            if answer != [True]:
                raise ValueError(f"the queue refused us: {answer!r:.100}")
        except (TimeoutError, OSError, ValueError, asyncio.IncompleteReadError) as exc:
            if writer is not None:
                writer.close()
            raise ChannelBroken(f"queue {queue!r}: no fetch channel: {exc!r}") from exc
        return cls(reader, writer, queue)

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
        None if nothing came. Raises the queue's typed error, or ``ChannelBroken``."""
        if self.closed:
            raise ChannelBroken(f"queue {self.queue!r}: the fetch channel is closed")
        timeout = min(max(float(timeout), 0.0), MAX_WAIT_SECONDS)
        request = [consumer_id, max_messages, timeout, prefetch, selector, subscription]
        return await self._ask(["fetch", *request, inline_bytes], timeout, streams=streams)

    async def register(
        self, consumer_id: str, prefetch: int, selector: str | None, subscription: str | None
    ) -> None:
        """Register ``consumer_id`` with the queue (no death watch: the caller registers
        its actor handle through Ray too). Raises the queue's typed error (a malformed
        selector, a deleted subscription...), or ``ChannelBroken``."""
        if self.closed:
            raise ChannelBroken(f"queue {self.queue!r}: the fetch channel is closed")
        await self._ask(["register", consumer_id, prefetch, selector, subscription], 0.0)

    async def _ask(
        self, request: list, timeout: float, *, streams: bool = False
    ) -> pa.RecordBatch | InlineDelivery | int | None:
        try:
            self._writer.write(frame(request))
            head = await asyncio.wait_for(
                _read_frame(self._reader, HEADER_LIMIT), timeout + ANSWER_MARGIN_SECONDS
            )
            kind = head[0] if isinstance(head, list) and head else None
            if kind == "batch":
                data = await asyncio.wait_for(
                    self._reader.readexactly(int(head[1])), ANSWER_MARGIN_SECONDS
                )
                return InlineDelivery(from_ipc(data), data) if streams else from_ipc(data)
            if kind in ("none", "ok"):
                return None
            if kind == "parked" and type(head[1]) is int:
                return head[1]
            if kind == "error" and len(head) == 3:
                error = error_of(str(head[1]), str(head[2]))
            else:
                raise ValueError(f"unexpected answer {head!r:.200}")
        except BaseException as exc:  # cancelled included: the stream is mid-answer
            self.close()
            if isinstance(exc, asyncio.CancelledError | KeyboardInterrupt | SystemExit):
                raise
            if isinstance(exc, RayMQError):
                raise
            broken = (OSError, ValueError, IndexError, TypeError, asyncio.TimeoutError)
            broken += (asyncio.IncompleteReadError, msgpack.UnpackException)
            if isinstance(exc, broken):
                raise ChannelBroken(f"queue {self.queue!r}: fetch channel: {exc!r}") from exc
            raise
        raise error

    def finish(self) -> None:
        """End our side of the connection, keeping the fetch under way (if any): the
        server then answers it at once with nothing if it is still waiting, or with
        what it took. No request follows."""
        if not self.closed:
            with contextlib.suppress(OSError):  # broken: the fetch under way raises that
                self._writer.write_eof()

    def close(self) -> None:
        """Close the connection (the server sees the end of it)."""
        if not self.closed:
            self.closed = True
            self._writer.close()
