"""The wire (``raymq.wire``), one protocol suite for its four protocols without Ray.

Each protocol (send, fetch, delivery, replica) is served by its real server over a real
socket with a small stand-in for its back end (a store, a queue's fetch, a TargetList's
take, a follower). Every server's op table is wrapped so that a handler called with
arguments its op's check refuses is recorded: each test asserts there was none.

Covered: the hello (secret, protocol, version, timeout, size); every op answered, alone
and pipelined; per-request validation (a bad request gets its own error answer and the
connection goes on); fuzzed bytes after a valid hello and the frame decoder fuzzed on its
own; peers that die or go silent; ``close(refusal, grace)``; ``max_connections``; large
raw buffers and many small frames."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raymq.batch import EMPTY_DELIVERY, MessageBatch
from raymq.core.replication import Fenced
from raymq.core.subscription import Delivery
from raymq.core.tasks import FAILURE, STARTED, SUCCESS, TaskRecord
from raymq.errors import NotLeader, RayMQError
from raymq.wire import frames
from raymq.wire import server as wire_server
from raymq.wire.client import WireClient
from raymq.wire.delivery import DeliveryServer
from raymq.wire.errors import WireBroken
from raymq.wire.fetch import FetchServer
from raymq.wire.ipc import from_ipc
from raymq.wire.replica import ReplicaServer
from raymq.wire.results import ResultsServer, finish_args
from raymq.wire.send import SendServer
from raymq.wire.server import Op, Protocol, Reply, WireServer
from tests.wire_helpers import MutePeer, closed_by_peer, hello, read_frame, request

#: Bound on anything a test waits for, in real seconds: only a wedge takes this long.
WAIT_SECONDS = 30.0
#: A send's largest message here: room for the large raw buffers of ``test_large...``.
MAX_MESSAGE = 8 * 2**20
#: Bytes of a large raw buffer: well over ``frames.COPY_BYTES`` (received on its own).
LARGE = 5 * 2**20


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, WAIT_SECONDS))


def rows(first: int, n: int, body: bytes = b"x" * 10) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist(
        [
            {
                "offset": first + i,
                "timestamp": 1,
                "delivery_count": 1,
                "body": body,
                "properties": b"",
            }
            for i in range(n)
        ],
        schema=EMPTY_DELIVERY.schema,
    )


# -- the four protocols' back ends -----------------------------------------------------


class Backend:
    """A back end whose next call may be held (``hold``): ``entered`` is set once it
    waits on the gate. ``body`` is what its deliveries carry."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()
        self._holds = 0
        self.calls: list[tuple] = []
        self.body = b"x" * 10

    def hold(self) -> asyncio.Event:
        """Hold the next call until the gate returned is set (the ones after it pass)."""
        self._holds = 1
        return self.gate

    async def held(self) -> None:
        if self._holds:
            self._holds -= 1
            self.entered.set()
            await self.gate.wait()


class SendBackend(Backend):
    def __init__(self) -> None:
        super().__init__()
        self.bodies: list[bytes] = []

    async def send_batch(self, batch: MessageBatch, timeout: float | None) -> tuple[int, int]:
        self.calls.append(("send_batch", len(batch), timeout))
        await self.held()
        first = len(self.bodies)
        self.bodies.extend(batch.body(i) for i in range(len(batch)))
        return first, len(batch)

    async def ack(self, consumer_id, offsets, subscription) -> int:
        self.calls.append(("ack", consumer_id, offsets.tolist(), subscription))
        return len(offsets)

    async def nack(self, consumer_id, offsets, subscription, delay) -> int:
        self.calls.append(("nack", consumer_id, offsets.tolist(), subscription, delay))
        return len(offsets)

    async def reject(self, consumer_id, offsets, subscription) -> int:
        self.calls.append(("reject", consumer_id, offsets.tolist(), subscription))
        return len(offsets)

    def server(self) -> SendServer:
        return SendServer(
            self.send_batch, "q", MAX_MESSAGE, ack=self.ack, nack=self.nack, reject=self.reject
        )


class FetchBackend(Backend):
    async def fetch(self, consumer_id, max_messages, timeout, prefetch, selector, subscription):
        self.calls.append(("fetch", consumer_id, max_messages, timeout))
        await self.held()
        batch = rows(0, min(max_messages, 1000), self.body)  # (fuzzed: any count)
        return Delivery(np.arange(batch.num_rows, dtype=np.int64), batch.nbytes, batch=batch)

    def give_back(self, consumer_id, offsets, subscription) -> None:
        self.calls.append(("give_back", consumer_id, offsets.tolist()))

    async def register(self, consumer_id, prefetch, selector, subscription) -> None:
        self.calls.append(("register", consumer_id, prefetch, selector, subscription))

    def server(self) -> FetchServer:
        return FetchServer(self.fetch, self.give_back, "q", register=self.register, lost=list)


class DeliveryBackend(Backend):
    async def take(self, max_messages: int, timeout: float, inline_bytes: int):
        self.calls.append(("take", max_messages, timeout))
        await self.held()
        return rows(0, min(max_messages, 1000), self.body)  # (fuzzed: any count)

    async def give_back(self, batch: pa.RecordBatch) -> None:
        self.calls.append(("give_back", batch.num_rows))

    async def start(self, settings: dict) -> object:
        self.calls.append(("start", settings))
        return ["h", 1]

    def server(self) -> DeliveryServer:
        return DeliveryServer(self.take, self.give_back, "consumer c of 'q'", start=self.start)


class ReplicaBackend(Backend):
    """A follower of epoch 1 (its calls are synchronous: never held)."""

    def apply(self, epoch: int, write) -> None:
        if epoch < 1:
            raise Fenced(1)
        self.calls.append(
            ("apply", epoch, [(n, at, b"".join(bytes(b) for b in d)) for n, at, d in write.records])
        )

    def heartbeat(self, epoch: int) -> None:
        if epoch < 1:
            raise Fenced(1)
        self.calls.append(("heartbeat", epoch))

    def server(self) -> ReplicaServer:
        return ReplicaServer(self, "rq")


class ResultsBackend(Backend):
    """A task-result store: a start answers a STARTED record, a finish nothing."""

    async def call(self, name: str, args: tuple) -> Any:
        self.calls.append((name, *args))
        await self.held()
        if name == "start":
            return TaskRecord(args[0], STARTED, args[1], 1.0, 2.0, runs=1)
        return None

    def server(self) -> ResultsServer:
        return ResultsServer(self.call)


def _ipc_rows(n: int) -> Callable[[Any], bool]:
    return lambda a: (
        a.value == "ipc" and len(a.buffers) == 1 and from_ipc(a.buffers[0]).num_rows == n
    )


def _nil(answer: Any) -> bool:
    return answer.value is None


#: Three offsets as an ack (nack, reject) carries them: little-endian int64.
OFFSETS = np.array([4, 5, 9], dtype="<i8").tobytes()
BATCH = MessageBatch.from_bodies([b"a", b"b"], max_message_size=MAX_MESSAGE)
FOUR = [b"\0" * 8] * 4  # four raw buffers that are not a batch


@dataclasses.dataclass
class Spec:
    """One protocol: its back end, a valid request of each op and the answer it checks
    (``ops``), malformed requests and the error each gets, an op a test may hold in its
    back end (None: its calls are synchronous)."""

    name: str
    backend: Callable[[], Backend]
    ops: list[tuple[str, list, list, Callable[[Any], bool]]]
    malformed: list[tuple[str, list, list, type[Exception]]]
    held: tuple[str, list, list] | None


SPECS = {
    "send": Spec(
        "send",
        SendBackend,
        [
            ("send", [b"m", b"", None], [], lambda a: type(a.value) is int),
            ("send", [b"m", msgpack.packb({"k": 1}), 2.5], [], lambda a: type(a.value) is int),
            ("send_batch", [None], BATCH.wire_buffers(), lambda a: a.value[1] == 2),
            ("ack", ["c", None], [OFFSETS], lambda a: a.value == 3),
            ("nack", ["c", "s", 0.5], [OFFSETS], lambda a: a.value == 3),
            ("nack", ["c", None, None], [OFFSETS[:8]], lambda a: a.value == 1),
            ("reject", ["c", None], [OFFSETS], lambda a: a.value == 3),
        ],
        [
            ("send", [b"m"], [], ValueError),
            ("send", [b"m", b"", None, 1], [], ValueError),
            ("send", ["m", b"", None], [], TypeError),
            ("send", [b"m", b"", "soon"], [], TypeError),
            ("send", [b"m", b"", -1], [], TypeError),
            ("send", [b"m", b"", True], [], TypeError),
            ("send", [b"m", b"", float("nan")], [], TypeError),  # a queue's timer on NaN
            ("send_batch", [None], [], ValueError),
            ("send_batch", [], BATCH.wire_buffers(), ValueError),
            ("send_batch", ["x"], BATCH.wire_buffers(), TypeError),
            ("send_batch", [float("nan")], BATCH.wire_buffers(), TypeError),
            ("send_batch", [None], FOUR, ValueError),  # offsets that do not fit the data
            ("ack", ["c", None], [OFFSETS[:7]], ValueError),  # not whole int64s
            ("nack", ["c", None], [OFFSETS], ValueError),  # no delay
            ("nack", ["c", None, "soon"], [OFFSETS], TypeError),
            ("nack", ["c", None, True], [OFFSETS], TypeError),
            ("nack", [b"c", None, 1.0], [OFFSETS], TypeError),
            ("nack", ["c", None, 1.0], [], ValueError),
            ("reject", ["c"], [OFFSETS], ValueError),
            ("reject", ["c", 7], [OFFSETS], TypeError),
        ],
        ("send", [b"held", b"", None], []),
    ),
    "fetch": Spec(
        "fetch",
        FetchBackend,
        [
            ("fetch", ["c", 3, 0.0, 10, None, None, 2**20], [], _ipc_rows(3)),
            ("fetch", ["c", 2, 1, 10, "a = 1", "s", 2**20], [], _ipc_rows(2)),
            ("fetch", ["c", 2, 0.0, 10, None, None, 0], [], lambda a: type(a.value) is int),
            ("register", ["c", 10, None, "s"], [], lambda a: a.value is None),
        ],
        [
            ("fetch", ["c"], [], ValueError),
            ("fetch", ["c", 0, 0.1, 10, None, None, 1], [], ValueError),
            ("fetch", ["c", 1, -1.0, 10, None, None, 1], [], ValueError),
            ("fetch", ["c", 1, True, 10, None, None, 1], [], ValueError),
            ("fetch", [1, 1, 0.1, 10, None, None, 1], [], ValueError),
            ("fetch", ["c", 1, 0.1, 10, 5, None, 1], [], ValueError),
            ("fetch", ["c", 1, 0.1, 10, None, None, -1], [], ValueError),
            ("register", ["c"], [], ValueError),
            ("register", ["c", -1, None, None], [], ValueError),
            ("register", ["c", 1, None, b"s"], [], ValueError),
        ],
        ("fetch", ["c", 1, 5.0, 10, None, None, 2**20], []),
    ),
    "delivery": Spec(
        "delivery",
        DeliveryBackend,
        [
            ("take", [3, 0.0], [], _ipc_rows(3)),
            ("take", [1, 2], [], _ipc_rows(1)),
            ("start", [{"queue": "q", "actor": b"\0" * 40}], [], lambda a: a.value == ["h", 1]),
        ],
        [
            ("take", [0, 0.1], [], ValueError),
            ("take", ["x", 0.1], [], ValueError),
            ("take", [1, True], [], ValueError),
            ("take", [1, -0.5], [], ValueError),
            ("take", [1], [], ValueError),
            ("start", ["x"], [], ValueError),
            ("start", [], [], ValueError),
        ],
        ("take", [1, 5.0], []),
    ),
    "replica": Spec(
        "replica",
        ReplicaBackend,
        [
            ("heartbeat", [1], [], lambda a: a.value is True),
            ("heartbeat", [0], [], lambda a: a.value == ["Fenced", 1]),
            ("apply", [1, 1, 3, [["f", 0, 3, 1]], None, [], False], [b"abc"], lambda a: a.value),
            (
                "apply",
                [1, 2, 9, [["f", 3, 6, 2]], [1, 9, 2], ["old"], True],
                [b"ack", b"def", b"ghi", b"cp"],
                lambda a: a.value is True,
            ),
        ],
        [
            ("heartbeat", ["x"], [], ValueError),
            ("heartbeat", [], [], ValueError),
            ("heartbeat", [True], [], ValueError),
            ("apply", [1, 2, 3], [], ValueError),
            ("apply", [1, 1, 3, [["f", 0, 3, 1]], None, [], 0], [b"abc"], ValueError),
            ("apply", [1, 1, 3, [["f", 0, 3, 1]], None, [], False], [], ValueError),
            ("apply", [1, 1, 3, "records", None, [], False], [b"abc"], ValueError),
            ("apply", [1, 1, 3, [["f", 0, 3, -1]], None, [], False], [], ValueError),
            ("apply", [1, 1, 3, [["f", 0, 4, 1]], None, [], False], [b"abc"], ValueError),
        ],
        None,
    ),
    "results": Spec(
        "results",
        ResultsBackend,
        [
            (
                "start",
                ["t", "add", 60.0],
                [],
                lambda a: a.value == ["t", STARTED, "add", 1.0, 2.0, 1],
            ),
            (
                "finish",
                finish_args("t", "add", 60, SUCCESS, {1: [b"x"]}),
                [],
                lambda a: a.value is None,
            ),
            ("finish", finish_args("t", "add", 1.5, FAILURE, None, "E", "e", "tb"), [], _nil),
        ],
        [
            ("start", ["t", "add"], [], TypeError),
            ("start", [1, "add", 60.0], [], TypeError),
            ("start", ["t", "add", 0], [], ValueError),
            ("start", ["t", "add", True], [], TypeError),
            ("start", ["t", "add", float("inf")], [], TypeError),
            ("finish", ["t", "add", 60.0, SUCCESS, None, None, None, None], [], TypeError),
            ("finish", ["t", "add", 60.0, SUCCESS, b"\xc1", None, None, None], [], ValueError),
            ("finish", ["t", "add", 60.0, SUCCESS, b"\xc0", 1, None, None], [], TypeError),
            ("finish", ["t", "add", 60.0, SUCCESS], [], TypeError),
        ],
        ("start", ["held", "add", 60.0], []),
    ),
}
PROTOCOLS = list(SPECS)
HELD = [name for name in PROTOCOLS if SPECS[name].held is not None]


def guard(wire: WireServer, violations: list) -> None:
    """Wrap ``wire``'s handlers: one called with a request its op refuses is recorded."""
    ops = {}
    for name, op in wire.protocol.ops.items():

        def handler(req, op=op, name=name):
            try:
                if len(req.buffers) > op.max_buffers:
                    raise ValueError("too many raw buffers")
                if op.check is not None:
                    op.check(req.args, req.buffers)
            except Exception as exc:  # noqa: BLE001 - recorded for the test
                violations.append((name, req.args, exc))
            return op.handler(req)

        ops[name] = dataclasses.replace(op, handler=handler)
    wire.protocol = dataclasses.replace(wire.protocol, ops=ops)


@dataclasses.dataclass
class Served:
    spec: Spec
    backend: Backend
    wire: WireServer
    endpoint: tuple[str, int, str]
    violations: list

    async def client(self, patience: float = 30.0) -> WireClient:
        return await WireClient.connect(self.endpoint, self.spec.name, "test", patience=patience)


@contextlib.asynccontextmanager
async def serving(name: str, dropping: bool = False, **protocol_changes):
    """The protocol's server on this event loop (its protocol changed as given);
    ``dropping``: the test makes it drop connections."""
    spec = SPECS[name]
    backend = spec.backend()
    owner = backend.server()
    wire = owner.server
    if protocol_changes:
        wire.protocol = dataclasses.replace(wire.protocol, **protocol_changes)
    violations: list = []
    guard(wire, violations)
    endpoint = await owner.start("127.0.0.1")
    try:
        yield Served(spec, backend, wire, endpoint, violations)
    finally:
        wire.close(grace=0)
    assert violations == []
    assert wire.dropped_connections == 0 or dropping  # no handler failed a connection


async def until(predicate: Callable[[], bool], what: str) -> None:
    """Until ``predicate()`` holds (another task or the server makes it true)."""
    deadline = time.monotonic() + WAIT_SECONDS
    while not predicate():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.001)


async def raw(endpoint, name: str | None = None):
    """A bare TCP connection (said hello as ``name`` if given)."""
    host, port, secret = endpoint
    reader, writer = await asyncio.open_connection(host, port)
    if name is not None:
        writer.write(hello(secret, name))
        header, _ = await read_async(reader)
        assert header[:2] == [0, None]
    return reader, writer


async def read_async(reader: asyncio.StreamReader) -> tuple[list, list[bytes]]:
    n = int.from_bytes(await reader.readexactly(4), "big")
    header = msgpack.unpackb(await reader.readexactly(n), raw=False)
    return header, [await reader.readexactly(size) for size in header[3]]


async def dropped(reader: asyncio.StreamReader) -> bool:
    """True once the server closed the connection (whatever it still sent is read)."""
    with contextlib.suppress(ConnectionResetError):
        while await reader.read(65536):
            pass
    return True


# -- (a) the hello --------------------------------------------------------------------


@pytest.mark.parametrize("name", PROTOCOLS)
def test_a_client_without_the_secret_protocol_or_version_is_dropped_and_others_served(
    name, monkeypatch
):
    from raymq.wire import client as wire_client

    async def main():
        async with serving(name, dropping=True) as s:
            host, port, secret = s.endpoint
            for endpoint, protocol in [
                ((host, port, "0" * 32), name),  # not the secret
                (s.endpoint, "other"),  # another protocol
            ]:
                with pytest.raises(WireBroken):
                    await WireClient.connect(endpoint, protocol, "test")
            monkeypatch.setattr(wire_client, "WIRE_VERSION", 2)  # another version
            with pytest.raises(WireBroken):
                await s.client()
            monkeypatch.undo()
            await until(lambda: s.wire.connections == 0, "all three counted out")
            assert s.wire.dropped_connections == 3
            good = await s.client()
            assert good.caps["protocol"] == name and good.caps["version"] == 1
            assert sorted(good.caps["ops"]) == sorted({op for op, *_ in s.spec.ops})
            op, args, buffers, ok = s.spec.ops[0]
            assert ok(await good.call(op, args, buffers))
            good.close()

    run(main())


@pytest.mark.parametrize("name", PROTOCOLS)
def test_a_connection_without_a_hello_in_time_or_with_a_long_header_first_is_dropped(
    name, monkeypatch
):
    monkeypatch.setattr(wire_server, "HELLO_TIMEOUT_SECONDS", 0.2)

    async def main():
        async with serving(name, dropping=True) as s:
            good = await s.client()  # said hello in time: not closed by the timer
            silent, _ = await raw(s.endpoint)  # never says hello
            assert await dropped(silent)
            reader, writer = await raw(s.endpoint)
            writer.write(frames.header_bytes([0, "hello", ["x" * frames.HELLO_LIMIT], []]))
            assert await dropped(reader)  # over HELLO_LIMIT: the length alone tells
            reader, writer = await raw(s.endpoint)
            host, port, secret = s.endpoint
            writer.write(request(0, "hello", [secret, name, 1], [b"raw"]))  # no raw buffers
            assert await dropped(reader)
            reader, writer = await raw(s.endpoint)
            writer.write(request(1, "ping", []))  # a request before the hello
            assert await dropped(reader)
            assert s.wire.dropped_connections == 3
            op, args, buffers, ok = s.spec.ops[0]
            assert ok(await good.call(op, args, buffers))
            good.close()

    run(main())


# -- (b) every op ------------------------------------------------------------------------


@pytest.mark.parametrize("name", PROTOCOLS)
def test_every_op_is_answered_alone_and_pipelined(name):
    async def main():
        async with serving(name) as s:
            client = await s.client()
            for op, args, buffers, ok in s.spec.ops:
                answer = await client.call(op, args, buffers)
                assert ok(answer), (op, args, answer)
            # Pipelined: every request written before any answer is read.
            futures = [
                (ok, client.request(op, args, buffers))
                for _ in range(20)
                for op, args, buffers, ok in s.spec.ops
            ]
            answers = await asyncio.gather(*(f for _, f in futures))
            assert all(ok(a) for (ok, _), a in zip(futures, answers, strict=True))
            assert (await client.call("ping", [])).value is True
            client.close()
            return s.backend

    backend = run(main())
    if name == "replica":  # the raw buffers reached the follower as sent
        applied = [c for c in backend.calls if c[0] == "apply"]
        assert applied[0] == ("apply", 1, [("f", 0, b"abc")])
        assert applied[1] == ("apply", 1, [("f", 3, b"defghi")])
        assert len(applied) == 42
    if name == "send":
        assert len(backend.bodies) == 21 * 4 and backend.bodies.count(b"a") == 21


# -- (c) per-request validation ------------------------------------------------------------


@pytest.mark.parametrize("name", PROTOCOLS)
def test_each_malformed_request_gets_its_error_and_the_connection_serves_the_next(name):
    async def main():
        async with serving(name) as s:
            client = await s.client()
            op0, args0, buffers0, ok0 = s.spec.ops[0]
            for op, args, buffers, error in s.spec.malformed:
                with pytest.raises(error):
                    await client.call(op, args, buffers)
                assert ok0(await client.call(op0, args0, buffers0)), (op, args)
            for op, args in [("nothing", []), (5, []), (None, []), (op0, "not a list")]:
                with pytest.raises(ValueError, match="no op"):
                    await client.call(op, args)
            # All malformed requests pipelined, a good one after each: each its answer.
            futures = []
            for op, args, buffers, error in s.spec.malformed:
                futures.append((error, client.request(op, args, buffers)))
                futures.append((None, client.request(op0, args0, buffers0)))
            for error, fut in futures:
                if error is None:
                    assert ok0(await fut)
                else:
                    with pytest.raises(error):
                        await fut
            assert client.broken is None
            client.close()
            return s.backend

    backend = run(main())
    if name == "send":  # no malformed send reached the store
        assert set(backend.bodies) <= {b"m", b"a", b"b"}


@pytest.mark.parametrize("name", PROTOCOLS)
def test_a_request_with_too_many_raw_buffers_gets_an_error(name):
    """More raw buffers than an op takes: an error answer (empty ones here: a protocol
    whose requests carry no raw bytes, ``payload_limit`` 0, drops a connection that
    sends some, below)."""

    async def main():
        async with serving(name, dropping=True) as s:
            reader, writer = await raw(s.endpoint, name)
            ops = s.wire.protocol.ops
            for k, (op_name, op) in enumerate(sorted(ops.items())):
                count = op.max_buffers + 1  # (a replica's commit may carry a million)
                writer.write(frames.header_bytes([k, op_name, [], [0] * count]))
            answers = {}
            for _ in ops:
                (req_id, error, _value, _sizes), _ = await read_async(reader)
                answers[req_id] = error
            assert len(answers) == len(ops)
            for error in answers.values():
                assert error[0] == "ValueError" and "raw buffers" in error[1], answers
            writer.write(request(99, "ping", []))
            assert (await read_async(reader))[0] == [99, None, True, []]
            if s.wire.protocol.payload_limit == 0:
                writer.write(request(100, "ping", [], [b"x"]))
                assert await dropped(reader)
                assert s.wire.dropped_connections == 1
            writer.close()

    run(main())


# -- (d) fuzzing --------------------------------------------------------------------------

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=12)
    | st.binary(max_size=12)
)
VALUES = st.recursive(
    SCALARS,
    lambda children: (
        st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=16,
)


def valid_frames(spec: Spec) -> list[bytes]:
    return [request(k, op, args, buffers) for k, (op, args, buffers, _) in enumerate(spec.ops)]


def garbage(spec: Spec) -> st.SearchStrategy[bytes]:
    """What a broken or hostile peer sends after a valid hello."""
    good = st.sampled_from(valid_frames(spec))
    op_names = st.sampled_from([op for op, *_ in spec.ops] + ["ping", "hello"]) | st.text(
        max_size=8
    )
    small = st.lists(st.binary(max_size=40), max_size=5)

    def flipped(data: bytes, bits: list[int]) -> bytes:
        out = bytearray(data)
        for bit in bits:
            out[bit // 8 % len(out)] ^= 1 << (bit % 8)
        return bytes(out)

    return st.one_of(
        st.binary(max_size=300),  # random bytes
        st.tuples(good, st.integers(0, 10**6)).map(lambda t: t[0][: t[1] % len(t[0])]),
        st.tuples(good, st.lists(st.integers(0, 10**6), min_size=1, max_size=3)).map(
            lambda t: flipped(*t)
        ),
        VALUES.map(frames.header_bytes),  # a header of any shape
        st.lists(VALUES, min_size=4, max_size=4).map(frames.header_bytes),
        # sizes lying about the raw buffers that follow
        st.tuples(
            st.integers(0, 2**32),
            op_names,
            VALUES,
            st.lists(st.integers(0, 5000), max_size=4),
            st.binary(max_size=300),
        ).map(lambda t: frames.header_bytes([t[0], t[1], t[2], t[3]]) + t[4]),
        # a known op with any arguments and raw buffers: the checks' business
        st.tuples(st.integers(0, 2**32), op_names, st.lists(VALUES, max_size=8), small).map(
            lambda t: request(t[0], t[1], t[2], t[3])
        ),
        st.tuples(
            st.integers(0, 2**32), op_names, st.lists(SCALARS, min_size=1, max_size=8), small
        ).map(lambda t: request(t[0], t[1], t[2], t[3])),
    )


class ThreadServer:
    """A protocol's server on an event loop in its own thread (raw blocking sockets
    from the test's thread poke it)."""

    def __init__(self, name: str):
        self.spec = SPECS[name]
        self.loop = asyncio.new_event_loop()
        self.violations: list = []
        ready = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(self.loop)
            self.backend = self.spec.backend()
            owner = self.backend.server()
            self.wire = owner.server
            guard(self.wire, self.violations)
            self.endpoint = self.loop.run_until_complete(owner.start("127.0.0.1"))
            ready.set()
            self.loop.run_forever()
            self.wire.close(grace=0)
            self.loop.run_until_complete(asyncio.sleep(0))
            self.loop.close()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        assert ready.wait(WAIT_SECONDS)

    def connect(self) -> socket.socket:
        host, port, secret = self.endpoint
        sock = socket.create_connection((host, port), timeout=WAIT_SECONDS)
        sock.sendall(hello(secret, self.spec.name))
        assert read_frame(sock)[0][:2] == [0, None]
        return sock

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(WAIT_SECONDS)


class Errors(logging.Handler):
    """Collects what the wire logs as errors: a handler's bug (an error answer it did
    not mean), or a connection that failed other than by bytes that are no frame."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.getMessage()} {record.exc_info and record.exc_info[1]!r}")


@pytest.mark.parametrize("name", PROTOCOLS)
def test_fuzzed_bytes_after_a_hello_never_break_the_server_nor_reach_a_handler_unchecked(name):
    errors = Errors()
    logging.getLogger("raymq.wire").addHandler(errors)
    served = ThreadServer(name)
    witness = served.connect()  # another client: answered after every poke
    pokes = [0]

    @settings(
        max_examples=200,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(st.lists(garbage(served.spec), min_size=1, max_size=3).map(b"".join))
    def poke(data: bytes) -> None:
        sock = served.connect()
        with contextlib.suppress(OSError):  # dropped while we write: as it may be
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        assert closed_by_peer(sock)  # the server ends it: answered or dropped
        sock.close()
        pokes[0] += 1
        witness.sendall(request(pokes[0], "ping", []))
        assert read_frame(witness) == ([pokes[0], None, True, []], [])

    try:
        poke()
        for k, data in enumerate(valid_frames(served.spec)):  # still serving, and right
            witness.sendall(data)
            (req_id, error, _value, _sizes), _ = read_frame(witness)
            assert (req_id, error) == (k, None)
    finally:
        witness.close()
        served.close()
        logging.getLogger("raymq.wire").removeHandler(errors)
    assert served.violations == []
    assert errors.records == []
    assert pokes[0] >= 100


def frame_lists():
    """Frames to encode: (header start, raw buffers), some large (received on their
    own), some empty."""
    pattern = bytes(range(251)) * 1200  # ~300 KB: slices of it are large buffers
    large = st.integers(frames.COPY_BYTES - 2, 2 * frames.COPY_BYTES).map(
        lambda n: pattern[n % 251 : n % 251 + n]
    )
    buffers = st.lists(st.binary(max_size=300) | large, max_size=4).filter(
        lambda bs: sum(map(len, bs)) <= 4 * frames.COPY_BYTES
    )
    start = st.tuples(st.integers(0, 2**64 - 1), VALUES, VALUES).map(list)
    return st.lists(st.tuples(start, buffers), max_size=6)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frame_lists(), st.lists(st.integers(1, 2 * frames.COPY_BYTES), max_size=20))
def test_any_chunking_of_a_stream_of_frames_decodes_exactly_those_frames(frame_list, cuts):
    stream = b"".join(bytes(p) for start, bufs in frame_list for p in frames.encode(start, bufs))
    got = []
    decoder = frames.FrameDecoder(
        lambda header, bufs: got.append((header, [bytes(b) for b in bufs])), 2**20, 2**24
    )
    pos = 0
    for cut in cuts:
        decoder.feed(stream[pos : pos + cut])
        pos += cut
    decoder.feed(stream[pos:])
    expected = [
        (msgpack.unpackb(msgpack.packb([*s, [len(b) for b in bufs]])), bufs)
        for s, bufs in frame_list
    ]
    assert got == expected


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=600) | VALUES.map(frames.header_bytes), st.integers(1, 64))
def test_arbitrary_bytes_decode_or_raise_frame_error_and_nothing_else(data, chunk):
    decoder = frames.FrameDecoder(lambda header, bufs: None, 1024, 4096)
    with contextlib.suppress(frames.FrameError):
        for pos in range(0, len(data), chunk):
            decoder.feed(data[pos : pos + chunk])


def test_the_decoder_refuses_headers_and_raw_buffers_over_its_limits():
    decoder = frames.FrameDecoder(lambda header, bufs: None, 64, 100)
    with pytest.raises(frames.FrameError, match="header of"):
        decoder.feed(frames.header_bytes([1, "x" * 64, None, []]))
    decoder = frames.FrameDecoder(lambda header, bufs: None, 64, 100)
    with pytest.raises(frames.FrameError, match="raw buffers of 101"):
        decoder.feed(frames.header_bytes([1, None, None, [50, 51]]))
    for bad in [[1, 2, 3], [-1, None, None, []], [True, None, None, []], [1, None, None, [-1]]]:
        decoder = frames.FrameDecoder(lambda header, bufs: None, 64, 100)
        with pytest.raises(frames.FrameError):
            decoder.feed(frames.header_bytes(bad))


def test_empty_raw_buffers_are_decoded_as_sent():
    got = []
    decoder = frames.FrameDecoder(lambda header, bufs: got.append(bufs), 64, 100)
    for bufs in [[b""], [b"", b""], [b"", b"x"], []]:
        decoder.feed(b"".join(bytes(p) for p in frames.encode([1, None, None], bufs)))
    assert [[bytes(b) for b in bufs] for bufs in got] == [[b""], [b"", b""], [b"", b"x"], []]


# -- (e) peers that die --------------------------------------------------------------------


@pytest.mark.parametrize("name", PROTOCOLS)
def test_a_server_killed_mid_request_fails_it_answer_pending_and_later_ones_at_once(name):
    async def main():
        async with serving(name) as s:
            client = await s.client()
            op, args, buffers, _ = s.spec.ops[0]
            (conn,) = s.wire._open
            conn.transport.pause_reading()  # the request is written, never answered
            waiting = client.request(op, args, buffers)
            conn.transport.abort()  # the server's process dies
            with pytest.raises(WireBroken) as broken:
                await waiting
            assert broken.value.answer_pending
            later = client.request(op, args, buffers)
            assert later.done()  # at once: broken stays broken
            with pytest.raises(WireBroken):
                later.result()
            assert s.backend.calls == []

    run(main())


@pytest.mark.parametrize("name", HELD)
def test_a_client_that_dies_mid_request_leaves_the_server_serving_others(name):
    async def main():
        async with serving(name) as s:
            s.backend.hold()
            dying = await s.client()
            op, args, buffers = s.spec.held
            waiting = dying.request(op, args, buffers)
            await s.backend.entered.wait()  # held in the back end
            dying.close()  # the client's process dies: its socket closes
            with pytest.raises(WireBroken):
                await waiting
            other = await s.client()
            op, args, buffers, ok = s.spec.ops[0]
            assert ok(await other.call(op, args, buffers))  # while the dead one's is held
            s.backend.gate.set()  # its answer has nowhere to go: its connection ends
            await until(lambda: s.wire.connections == 1, "the dead client counted out")
            assert ok(await other.call(op, args, buffers))
            other.close()

    run(main())


# -- (f) silent peers ---------------------------------------------------------------------


@pytest.mark.parametrize("name", PROTOCOLS)
def test_a_silent_server_is_pinged_and_the_client_breaks_within_twice_its_patience(name):
    patience = 0.3
    peer = MutePeer()  # answers the hello, then reads and answers nothing

    async def main():
        client = await WireClient.connect(peer.endpoint(), name, "test", patience=patience)
        op, args, buffers, _ = SPECS[name].ops[0]
        started = time.monotonic()
        with pytest.raises(WireBroken, match="ping") as broken:
            await client.call(op, args, buffers)
        assert broken.value.answer_pending
        return time.monotonic() - started

    try:
        took = run(main())
    finally:
        peer.close()
    assert 2 * patience * 0.9 <= took < 2 * patience + 10.0  # bounded (a loaded machine stalls)


@pytest.mark.parametrize("name", PROTOCOLS)
def test_a_request_with_a_bound_breaks_the_connection_after_it(name):
    peer = MutePeer()

    async def main():
        client = await WireClient.connect(peer.endpoint(), name, "test")  # patience 30 s
        op, args, buffers, _ = SPECS[name].ops[0]
        started = time.monotonic()
        with pytest.raises(WireBroken, match="no answer in 0.3 s"):
            await client.call(op, args, buffers, within=0.3)
        took = time.monotonic() - started
        with pytest.raises(WireBroken):
            await client.call(op, args, buffers)
        return took

    try:
        took = run(main())
    finally:
        peer.close()
    assert 0.3 <= took < 10.0  # the bound, not the 30 s patience (a loaded machine stalls)


#: The busy-server tests' patience (seconds): short, so that pings come soon, but not so
#: short that a process stalled on a loaded machine misses a ping's answer (each
#: answered ping is then a second wait past the patience).
PING_PATIENCE_SECONDS = 0.3


@pytest.mark.parametrize("name", HELD)
def test_a_busy_server_answers_pings_and_its_client_waits_past_its_patience(name):
    async def main():
        async with serving(name) as s:
            s.backend.hold()
            client = await s.client(patience=PING_PATIENCE_SECONDS)
            op, args, buffers = s.spec.held
            waiting = client.request(op, args, buffers)
            await until(lambda: s.wire.pings_answered >= 2, "two pings answered")
            assert not waiting.done()
            s.backend.gate.set()
            answer = await waiting
            assert client.broken is None
            client.close()
            return answer

    assert run(main()).value is not None


# -- (g) close(refusal, grace) -------------------------------------------------------------


@pytest.mark.parametrize("name", HELD)
def test_a_closing_server_refuses_new_requests_answers_those_under_way_then_closes(name):
    async def main():
        async with serving(name) as s:
            s.backend.hold()
            client = await s.client()
            op, args, buffers = s.spec.held
            under_way = client.request(op, args, buffers)
            await s.backend.entered.wait()
            s.wire.close(NotLeader("gone: ask the broker"), grace=WAIT_SECONDS)
            for op2, args2, buffers2, _ in s.spec.ops:
                with pytest.raises(NotLeader, match="ask the broker"):
                    await client.call(op2, args2, buffers2)
            with pytest.raises(WireBroken):  # no longer listening
                await s.client()
            assert not under_way.done() and client.broken is None
            started = time.monotonic()
            s.backend.gate.set()
            answer = await under_way  # answered before the connection closes ...
            await client.wait_closed()  # ... which it does at once, not after the grace
            return answer, time.monotonic() - started

    answer, took = run(main())
    assert answer.value is not None and took < WAIT_SECONDS / 2


@pytest.mark.parametrize("name", HELD)
def test_a_request_unanswered_after_the_close_grace_fails_wire_broken(name):
    async def main():
        async with serving(name) as s:
            s.backend.hold()  # never released
            client = await s.client()
            op, args, buffers = s.spec.held
            under_way = client.request(op, args, buffers)
            await s.backend.entered.wait()
            s.wire.close(NotLeader("gone"), grace=0.2)
            with pytest.raises(WireBroken) as broken:
                await under_way
            assert broken.value.answer_pending
            s.backend.gate.set()

    run(main())


def test_a_released_follower_drops_its_leaders_connection_at_once():
    async def main():
        backend = ReplicaBackend()
        follower = backend.server()
        client = await WireClient.connect(await follower.start("127.0.0.1"), "replica", "test")
        assert (await client.call("heartbeat", [1])).value is True
        assert follower.connections == 1
        follower.close()  # released: it takes no more commits
        await client.wait_closed()
        with pytest.raises(WireBroken):
            await client.call("heartbeat", [1])
        return backend

    assert run(main()).calls == [("heartbeat", 1)]


# -- (h) max_connections -------------------------------------------------------------------


@pytest.mark.parametrize("name", PROTOCOLS)
def test_connections_over_max_connections_are_closed_at_once(name):
    async def main():
        async with serving(name, max_connections=2) as s:
            kept = [await s.client(), await s.client()]
            with pytest.raises(WireBroken):
                await s.client()
            assert s.wire.refused_connections == 1 and s.wire.connections == 2
            op, args, buffers, ok = s.spec.ops[0]
            for client in kept:  # those within the cap are served
                assert ok(await client.call(op, args, buffers))
            kept.pop().close()
            await until(lambda: s.wire.connections == 1, "the closed one counted out")
            again = await s.client()  # room again
            assert ok(await again.call(op, args, buffers))
            again.close()
            kept[0].close()

    run(main())


# -- (i) large raw buffers and many small frames --------------------------------------------


def test_large_raw_buffers_cross_intact_both_ways():
    async def echo(req):
        return Reply(len(req.buffers), [bytes(b)[::-1] for b in req.buffers])

    protocol = Protocol(
        "echo", {"echo": Op(echo, max_buffers=4)}, request_limit=1024, payload_limit=4 * LARGE
    )

    async def main():
        wire = WireServer(protocol, "echo")
        endpoint = await wire.start("127.0.0.1")
        client = await WireClient.connect(endpoint, "echo", "test")
        payloads = [
            (bytes(range(256)) * (LARGE // 256))[: LARGE - 7],
            b"small",
            b"",
            np.arange(LARGE // 8, dtype=np.int64),  # any buffer: not copied to be sent
        ]
        answers = await asyncio.gather(*(client.call("echo", [], payloads) for _ in range(3)))
        client.close()
        wire.close()
        return payloads, answers

    payloads, answers = run(main())
    for answer in answers:
        assert answer.value == 4
        assert [bytes(b) for b in answer.buffers] == [bytes(memoryview(p))[::-1] for p in payloads]


def test_an_answer_given_now_leaves_while_its_handler_still_holds_the_loop():
    """``Request.answer(now=True)`` writes the answer at once, before the handler gives
    the event loop back (the queue's register answers so before the fetch behind it
    reads), where a plain answer would leave at the end of the loop's turn."""
    seen = threading.Event()
    held: list[bool] = []

    def first(req):
        req.answer("first", now=True)
        # The loop is held here until the client has read the answer (a wedge if the
        # answer waited for the loop: the wait then ends unseen after WAIT_SECONDS).
        held.append(seen.wait(WAIT_SECONDS))
        return wire_server.DEFERRED

    protocol = Protocol("now", {"first": Op(first)})
    answers: list[tuple] = []

    def read(sock: socket.socket) -> None:
        answers.append(read_frame(sock)[0])  # the hello's answer
        answers.append(read_frame(sock)[0])
        seen.set()

    async def main():
        wire = WireServer(protocol, "now")
        host, port, secret = await wire.start("127.0.0.1")
        sock = socket.create_connection((host, port), timeout=WAIT_SECONDS)
        reader = threading.Thread(target=read, args=(sock,), daemon=True)
        try:
            reader.start()
            sock.sendall(hello(secret, "now") + request(1, "first", []))
            await asyncio.to_thread(reader.join, WAIT_SECONDS)
        finally:
            sock.close()  # a reader still blocked (a wedge) ends with an error
            wire.close()

    run(main())
    assert held == [True], "the answer stayed queued while the handler held the loop"
    assert answers[1][:3] == [1, None, "first"]


def test_large_commits_and_deliveries_cross_intact():
    async def main():
        record = (bytes(range(256)) * (LARGE // 256 + 1))[:LARGE]
        async with serving("replica") as s:
            client = await s.client()
            args = [1, 1, LARGE, [["f", 0, LARGE, 2]], None, [], False]
            half = LARGE // 2
            assert (await client.call("apply", args, [record[:half], record[half:]])).value
            applied = s.backend.calls[-1]
            client.close()
        async with serving("fetch") as s:
            s.backend.body = b"y" * (LARGE // 1000 + 100)
            client = await s.client()
            answer = await client.call("fetch", ["c", 1000, 0.0, 10, None, None, 2**30])
            client.close()
        return record, applied, answer

    record, applied, answer = run(main())
    assert applied == ("apply", 1, [("f", 0, record)])
    batch = from_ipc(answer.buffers[0])
    assert answer.buffers[0].nbytes > LARGE and batch.num_rows == 1000
    assert set(batch.column("body").to_pylist()) == {b"y" * (LARGE // 1000 + 100)}


@pytest.mark.parametrize("name", PROTOCOLS)
def test_many_small_frames_in_one_write_are_each_answered(name):
    async def main():
        async with serving(name) as s:
            reader, writer = await raw(s.endpoint, name)
            good = valid_frames(s.spec)  # ids 0, 1, ...
            writer.write(
                b"".join(request(k, "ping", []) for k in range(1000, 3000)) + b"".join(good) * 10
            )
            answers = [(await read_async(reader))[0] for _ in range(2000 + 10 * len(good))]
            writer.close()
            client = await s.client()
            many = [client.request("ping", []) for _ in range(2000)]  # answers joined
            assert all(a.value is True for a in await asyncio.gather(*many))
            client.close()
            return answers, len(good)

    answers, kinds = run(main())
    assert all(h[1] is None for h in answers)  # no error
    pings = [h for h in answers if h[0] >= 1000]
    assert sorted(h[0] for h in pings) == list(range(1000, 3000))
    assert all(h[2] is True for h in pings)
    others = sorted(h[0] for h in answers if h[0] < 1000)
    assert others == sorted(list(range(kinds)) * 10)


def test_errors_carry_their_type_by_name():
    from raymq.wire.errors import envelope, error_of

    assert type(error_of(*envelope(NotLeader("x")))) is NotLeader
    assert type(error_of(*envelope(TypeError("x")))) is TypeError
    assert type(error_of(*envelope(ValueError("x")))) is ValueError
    other = error_of(*envelope(KeyError("k")))
    assert type(other) is RayMQError and "KeyError" in str(other)
