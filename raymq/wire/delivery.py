"""The delivery protocol: a consumer's receives from its TargetList actor over the wire.

Through Ray, a message the TargetList holds reaches the application in two hops of 1-2 ms
each here (docs/ARCHITECTURE.md): the client's ``take`` call returns references, then
``ray.get`` of a reference borrowed from the TargetList asks that actor for it. So the
TargetList actor serves this protocol (docs/WIRE.md "delivery") and its consumer's
``receive`` asks there: the answer carries the messages as an Arrow IPC stream, read
without a further copy. The TargetList still holds the consumer's direct references,
its watermark and PendingCache, and the queue its prefetch accounting.

Ops (one at a time per connection):

- ``start [settings]``: a new consumer takes a warm spare TargetList whose server
  listens already (``raymq.placement.spares``) and starts it with its first request
  rather than a Ray call (a call and its answer cost a new consumer's first message 4-5
  ms here, measured; a request well under 1 ms). ``settings``: ``TargetListActor.start``'s
  arguments by name; answered with what ``start`` returned.
- ``take [max_messages, timeout]`` (messages, seconds), answered nil (nothing arrived
  within the timeout), ``"ray"`` (more than ``INLINE_BYTES`` are ready: take them through
  Ray, read from the object store without a copy), or ``"ipc"`` with one raw buffer: an
  Arrow IPC stream of one delivery RecordBatch. A delivery that reached the TargetList
  inline over the fetch protocol and is taken whole goes on in the stream it came in
  (``Encoded``), not decoded and encoded again.

Failures: a client whose connection fails goes back to the Ray path for good
(``WireBroken``). Rows taken for an answer that could not be written are given back
(never received). A client whose connection broke with a request under way tells the
TargetList how many answers with messages it read whole (``TargetListActor.channel_broke``):
the rows of any answer written beyond those, or written on that connection from then
on, are given back too.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Awaitable, Callable
from typing import NamedTuple

import pyarrow as pa

from raymq.selector.parser import MAX_SELECTOR_LENGTH
from raymq.wire.errors import WireBroken
from raymq.wire.ipc import from_ipc, to_ipc
from raymq.wire.server import DEFERRED, Op, Protocol, ProtocolServer, Request, WireServer
from raymq.wire.sync_client import SyncClient

log = logging.getLogger("raymq.wire.delivery")

PROTOCOL = "delivery"
#: Largest answer sent inline (bytes); more goes by reference through Ray and the
#: object store, without a copy.
INLINE_BYTES = 256 * 1024
#: Longest request (bytes): a start's, with the longest selector (4 bytes a character
#: at most in UTF-8) and the other settings.
REQUEST_LIMIT = 4 * MAX_SELECTOR_LENGTH + 16 * 1024
#: Seconds a client waits to connect and for the hello's answer.
CONNECT_TIMEOUT_SECONDS = 5.0
#: Seconds a client waits for an answer beyond the timeout it asked the server for:
#: past that the connection is taken as broken and the Ray path used.
ANSWER_MARGIN_SECONDS = 15.0
#: Longest wait one request may ask for (seconds); the client asks again.
MAX_WAIT_SECONDS = 60.0
#: Connections one server serves at once (one consumer; a few for reconnects).
MAX_CONNECTIONS = 4

BY_REFERENCE = "ray"
#: Consumers open a delivery connection; False makes new consumers receive through Ray
#: calls only (``bench/latency.py`` measures that path beside it, as its baseline).
USE_CHANNEL = True


class Encoded(NamedTuple):
    """An answer's rows as the IPC stream they came in (``stream``: one RecordBatch,
    ``to_ipc``'s layout), written as it is; ``rows`` is that RecordBatch (for counts and
    give-backs)."""

    rows: pa.RecordBatch
    stream: bytes | bytearray | memoryview


def answer_of(parts: list[tuple[pa.RecordBatch, bytes | None]]) -> pa.RecordBatch | Encoded:
    """A take's answer of ``parts``, in order: (rows, the IPC stream they came in over
    the fetch protocol when they are all of it, else None). One delivery taken whole goes
    on as it came (``Encoded``): not decoded and encoded again. Otherwise one
    RecordBatch, which the server encodes: splicing several streams' record batch
    messages into one cost the TargetList and the client more than a concatenation and
    one encoding (3 deliveries of 10-100 x 1 KiB: 28-32 µs against 15-31 µs, and the
    client's read 19-24 µs against 10-13 µs; one whole delivery: 1 µs against 7-14 µs;
    measured)."""
    if len(parts) == 1 and parts[0][1] is not None:
        rows, stream = parts[0]
        return Encoded(rows, stream)
    rows = [r for r, _ in parts]
    return rows[0] if len(rows) == 1 else pa.concat_batches(rows)


#: ``take(max_messages, timeout, inline_bytes)``: up to ``max_messages`` as a RecordBatch
#: or ``Encoded`` (None if nothing came in ``timeout`` seconds), or ``BY_REFERENCE``
#: when more than ``inline_bytes`` are ready; raises the typed error ``receive`` raises.
Take = Callable[[int, float, int], Awaitable["pa.RecordBatch | Encoded | str | None"]]
#: ``give_back(batch)``: rows taken for an answer that could not be written.
GiveBack = Callable[[pa.RecordBatch], Awaitable[None]]
#: ``start(settings)``: ``TargetListActor.start`` by keyword: what it returns; raises a
#: typed error (``RayMQError``, ``TypeError``, ``ValueError``) for the client.
Start = Callable[[dict], Awaitable[object]]


# -- the TargetList actor's side -----------------------------------------------------------


class _Answers:
    """One connection's answers with messages (counted), those not yet shown read by a
    next request, and what the client said it read once the connection broke."""

    __slots__ = ("written", "unconfirmed", "abandoned", "read")

    def __init__(self) -> None:
        self.written = 0
        self.unconfirmed: list[tuple[int, pa.RecordBatch]] = []
        self.abandoned = False
        self.read = 0  # answers the client read whole, as it said after the break

    def unread(self) -> list[pa.RecordBatch]:
        """Answers written beyond those read, forgotten here (given back by the caller)."""
        out = [batch for index, batch in self.unconfirmed if index > self.read]
        self.unconfirmed = [(i, b) for i, b in self.unconfirmed if i <= self.read]
        return out


class DeliveryServer(ProtocolServer):
    """Serves one consumer's receives from its TargetList actor's event loop."""

    def __init__(self, take: Take, give_back: GiveBack, what: str, start: Start | None = None):
        self._take = take
        self._give_back = give_back
        self._start = start
        self.what = what  # "consumer <id> of queue <name>", for logs
        self.answers = 0  # answered with messages inline
        self.by_reference = 0  # answered "take them through Ray"
        self.given_back = 0  # messages of answers that could not be written, or unread
        self._latest: _Answers | None = None  # the client's connection's (it has one)
        ops = {"take": Op(self._answer_take, _check_take)}
        if start is not None:
            ops["start"] = Op(self._answer_start, _check_start)
        protocol = Protocol(
            PROTOCOL, ops, request_limit=REQUEST_LIMIT, max_connections=MAX_CONNECTIONS
        )
        self.server = WireServer(protocol, what)

    async def _answer_start(self, request: Request) -> object:
        assert self._start is not None
        return await self._start(request.args[0])

    async def give_back_unread(self, answers_read: int) -> int:
        """The client's connection broke with a request under way, after it read
        ``answers_read`` answers with messages whole: give back the rows of any answer
        written beyond those (never received), and of any written from now on; returns
        how many messages."""
        answers = self._latest
        if answers is None:
            return 0
        answers.abandoned, answers.read = True, answers_read
        return await self._give_back_unread(answers)

    async def _give_back_unread(self, answers: _Answers) -> int:
        batches = answers.unread()
        n = sum(batch.num_rows for batch in batches)
        if n:
            self.given_back += n
            log.warning(
                "%s: delivery connection broke; %d messages written unread given back", self.what, n
            )
        for batch in batches:
            await self._give_back(batch)
        return n

    async def _answer_take(self, request: Request) -> object:
        answers = request.conn.state.get("answers")
        if answers is None:
            answers = request.conn.state["answers"] = self._latest = _Answers()
        answers.unconfirmed.clear()  # a request comes only after the answer was read
        max_messages, timeout = request.args
        got = await self._take(max_messages, min(float(timeout), MAX_WAIT_SECONDS), INLINE_BYTES)
        if got is None:
            return None
        if isinstance(got, str):
            self.by_reference += 1
            return BY_REFERENCE
        rows, data = (got.rows, got.stream) if isinstance(got, Encoded) else (got, to_ipc(got))
        if not request.answer("ipc", [data], now=True):  # the application waits on it
            # Not handed to the application: the queue delivers them again (uncounted).
            self.given_back += rows.num_rows
            log.warning(
                "%s: delivery connection broke; %d messages given back", self.what, rows.num_rows
            )
            await self._give_back(rows)
            return DEFERRED
        self.answers += 1
        answers.written += 1
        answers.unconfirmed.append((answers.written, rows))
        if answers.abandoned:  # broken meanwhile: the client never reads this one
            await self._give_back_unread(answers)
        return DEFERRED


def _check_start(args: list, buffers: list) -> None:
    if len(args) != 1 or not isinstance(args[0], dict):
        raise ValueError("start takes [settings]")


def _check_take(args: list, buffers: list) -> None:
    if not (
        len(args) == 2
        and type(args[0]) is int
        and args[0] >= 1
        and isinstance(args[1], int | float)
        and not isinstance(args[1], bool)
        and args[1] >= 0
    ):
        raise ValueError(f"a malformed take: {args!r:.100}")


# -- the consumer's side ---------------------------------------------------------------------


class DeliveryChannel:
    """A consumer's connection to its TargetList actor's ``DeliveryServer``.

    Thread-safe (one request at a time). Any failure raises ``WireBroken`` and leaves
    the channel closed: the caller uses the Ray path from then on.
    """

    def __init__(self, host: str, port: int, secret: str, queue: str):
        self.queue = queue
        self._lock = threading.Lock()
        #: Answers with messages read whole: after a break the TargetList gives back the
        #: rows of any answer it wrote beyond these (``TargetListActor.channel_broke``).
        self.answers_read = 0
        # Read by the thread that takes (one request at a time): no hand-off from the
        # wire loop's thread for each answer (raymq.wire.sync_client).
        self._client = SyncClient(
            (host, port, secret), PROTOCOL, f"queue {queue!r}", timeout=CONNECT_TIMEOUT_SECONDS
        )

    @property
    def broken(self) -> WireBroken | None:
        """Why the connection broke (None while it works, as far as this side knows)."""
        return self._client.broken

    def name_queue(self, queue: str) -> None:
        """Name ``queue`` in errors from now on: a spare's channel is connected before
        the spare has a queue (``raymq.placement.spares``)."""
        self.queue = queue
        self._client.rename(f"queue {queue!r}")

    def start(self, settings: dict, timeout: float) -> object:
        """Start the TargetList (``TargetListActor.start`` by keyword, ``settings``), as
        this connection's first request; returns what it returns. Raises its typed
        error, or ``WireBroken`` (the TargetList may have started or not: the caller
        must not use it further) if no answer came within ``timeout`` seconds."""
        with self._lock:
            return self._client.call("start", [settings], within=timeout).value

    def take(self, max_messages: int, timeout: float) -> pa.RecordBatch | str | None:
        """Up to ``max_messages`` messages, waiting up to ``timeout`` seconds for the
        first: a RecordBatch, None if none came, or ``BY_REFERENCE`` (take them through
        Ray). Raises the queue's typed error, or ``WireBroken``."""
        timeout = min(max(timeout, 0.0), MAX_WAIT_SECONDS)
        with self._lock:
            answer = self._client.call(
                "take", [max_messages, timeout], within=timeout + ANSWER_MARGIN_SECONDS
            )
            if answer.value == "ipc" and len(answer.buffers) == 1:
                try:
                    got = from_ipc(answer.buffers[0])
                except (pa.ArrowInvalid, OSError) as exc:
                    self._client.close()
                    broken = WireBroken(f"queue {self.queue!r}: a take's answer: {exc!r}")
                    broken.answer_pending = True
                    raise broken from exc
                self.answers_read += 1
                return got
            if answer.value is None:
                return None
            if answer.value == BY_REFERENCE:
                return BY_REFERENCE  # (the constant: callers compare by identity)
            self._client.close()
            broken = WireBroken(f"queue {self.queue!r}: a take answered {answer.value!r:.100}")
            broken.answer_pending = True
            raise broken

    def close(self) -> None:
        """Close the connection (the server sees the end of it). From another thread
        too: a ``take`` waiting for its answer there ends at once (``WireBroken``)."""
        self._client.close()
