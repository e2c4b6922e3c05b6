"""The fetch protocol (``raymq.wire.fetch``) without Ray: a TargetList's fetches over a
socket to its queue actor. A small delivery comes back inline as Arrow; a large one is
parked for a Ray call and taken once; registration works over it, and the end of a
connection reports the consumers it registered (the queue closes those not yet watched);
the queue's typed errors (and its bugs, named) cross as errors and leave the channel
usable, as a malformed request's error does; a wrong secret, a dead server or a
cancelled fetch end the channel (``WireBroken``: the TargetList then fetches through
Ray); rows the server took for an answer it could not write are given back, not lost; a
parked delivery nobody takes is dropped and counted."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest

from raymq.batch import EMPTY_DELIVERY, offsets_of
from raymq.core.subscription import NOTHING, Delivery
from raymq.errors import ConsumerClosed, RayMQError, SelectorError
from raymq.wire import fetch
from raymq.wire.errors import WireBroken
from raymq.wire.fetch import FetchChannel, FetchServer, Registration

#: Bound on a call that must return, in real seconds: only a wedge takes this long.
ANSWER_SECONDS = 30.0


def delivery(first: int, n: int, body: bytes = b"x" * 100) -> Delivery:
    rows = [
        {
            "offset": first + i,
            "timestamp": 1_700_000_000_000_000 + i,
            "delivery_count": 1,
            "body": body + str(first + i).encode(),
            "properties": b"",
        }
        for i in range(n)
    ]
    batch = pa.RecordBatch.from_pylist(rows, schema=EMPTY_DELIVERY.schema)
    return Delivery(np.arange(first, first + n, dtype=np.int64), batch.nbytes, batch=batch)


class Served:
    """A FetchServer on 127.0.0.1 with scripted deliveries (each answer waits
    for ``gate`` if given), and a client channel."""

    def __init__(self, answers: list, gate: asyncio.Event | None = None):
        self.answers = list(answers)
        self.asked: list[tuple] = []
        self.given_back: list[tuple[str, list[int], str | None]] = []
        self.gate = gate
        self.registered: list[tuple] = []
        self.register_gate: asyncio.Event | None = None
        self.lost: list[list] = []
        self.server = FetchServer(
            self._fetch, self._give_back, "q", register=self._register, lost=self.lost.append
        )

    async def _register(self, *args):
        if self.register_gate is not None:  # a registration that takes a while
            await self.register_gate.wait()
        if args[2] == "bad =":
            raise SelectorError("malformed selector 'bad ='")
        self.registered.append(args)

    async def _fetch(self, *args):
        self.asked.append(args)
        if self.gate is not None:
            await self.gate.wait()
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def _give_back(self, consumer_id: str, offsets: np.ndarray, subscription: str | None):
        self.given_back.append((consumer_id, offsets.tolist(), subscription))

    async def client(
        self,
        secret: str | None = None,
        register: Registration | None = None,
        fetch: tuple | None = None,
    ) -> FetchChannel:
        host, port, real = await self.server.start("127.0.0.1")
        return await FetchChannel.connect(
            host, port, secret or real, "q", register=register, fetch=fetch
        )


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, ANSWER_SECONDS))


def test_small_deliveries_come_inline_nothing_as_none_and_large_ones_parked_once():
    big = delivery(100, 50, body=b"y" * 2000)

    async def main():
        served = Served([delivery(7, 3), NOTHING, big, delivery(150, 1)])
        channel = await served.client()
        got = [
            await channel.fetch("c1", 10, 0.5, 100, "a = 1", "sub", inline_bytes=10_000)
            for _ in range(4)
        ]
        return served, got

    served, (inline, nothing, token, after) = run(main())
    assert inline.column("offset").to_pylist() == [7, 8, 9]
    assert inline.column("body").to_pylist()[0] == b"x" * 100 + b"7"
    assert nothing is None
    assert type(token) is int  # over 10,000 bytes: parked for a Ray call
    assert after.column("offset").to_pylist() == [150]
    # Every request carried the fetch's arguments as they were.
    assert served.asked == [("c1", 10, 0.5, 100, "a = 1", "sub")] * 4
    assert served.server.take_parked(token) is big
    assert served.server.take_parked(token) is None  # once
    assert served.server.answers == 2 and served.server.parked == 1


def test_the_queues_typed_error_is_raised_and_the_channel_stays_usable():
    async def main():
        served = Served([ConsumerClosed("consumer c1 of queue 'q' is closed"), delivery(0, 1)])
        channel = await served.client()
        with pytest.raises(ConsumerClosed, match="'q'"):
            await channel.fetch("c1", 1, 0.1, 10, None, None)
        return await channel.fetch("c1", 1, 0.1, 10, None, None)

    assert run(main()).column("offset").to_pylist() == [0]


def test_a_wrong_secret_is_refused():
    async def main():
        served = Served([])
        with pytest.raises(WireBroken):
            await served.client(secret="0" * 32)
        return served

    assert run(main()).asked == []


def test_a_bug_in_the_queue_is_an_error_naming_it_and_the_channel_stays_usable():
    async def main():
        served = Served([RuntimeError("a bug in the queue"), delivery(0, 1)])
        channel = await served.client()
        with pytest.raises(RayMQError, match="RuntimeError: a bug in the queue"):
            await channel.fetch("c1", 1, 0.1, 10, None, None)
        return await channel.fetch("c1", 1, 0.1, 10, None, None)

    assert run(main()).column("offset").to_pylist() == [0]


def test_a_dead_server_breaks_the_channel_for_good():
    async def main():
        gate = asyncio.Event()  # never set: the fetch waits in the server
        served = Served([delivery(0, 1)], gate)
        channel = await served.client()
        task = asyncio.create_task(channel.fetch("c1", 1, 5.0, 10, None, None))
        while not served.asked:
            await asyncio.sleep(0.001)
        for conn in list(served.server.server._open):  # the queue actor's process dies
            conn.transport.abort()
        with pytest.raises(WireBroken) as broken:
            await task
        assert broken.value.answer_pending
        assert channel.closed
        with pytest.raises(WireBroken):
            await channel.fetch("c1", 1, 0.1, 10, None, None)

    run(main())


def test_a_cancelled_fetch_closes_the_channel():
    async def main():
        gate = asyncio.Event()  # never set: the fetch waits in the server
        served = Served([delivery(0, 1)], gate)
        channel = await served.client()
        task = asyncio.create_task(channel.fetch("c1", 1, 5.0, 10, None, None))
        while not served.asked:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(WireBroken, match="closed"):  # mid-answer: not used again
            await channel.fetch("c1", 1, 0.1, 10, None, None)

    run(main())


def unwritable(args: list) -> SimpleNamespace:
    """A request whose connection closed: its answer cannot be written."""

    def answer(value=None, buffers=(), *, now=False) -> bool:
        request.answered = True
        return False

    request = SimpleNamespace(args=args, answered=False, answer=answer)
    request.conn = SimpleNamespace(state={})
    return request


def test_rows_of_an_answer_that_cannot_be_written_are_given_back():
    async def main():
        served = Served([delivery(7, 4)])
        request = unwritable(["c1", 10, 0.1, 10, None, "s", 10_000])
        await served.server._answer_fetch(request)
        assert request.answered
        return served

    served = run(main())
    assert served.given_back == [("c1", [7, 8, 9, 10], "s")]
    assert served.server.given_back == 4 and served.server.answers == 0


def test_a_malformed_request_is_refused_without_fetching_and_the_channel_goes_on():
    async def main():
        served = Served([delivery(0, 1)])
        channel = await served.client()
        with pytest.raises(ValueError, match="malformed fetch"):
            await channel._client.call("fetch", ["c1", 1, 0.1])  # too short
        assert served.asked == []
        got = await channel.fetch("c1", 1, 0.1, 10, None, None)
        return served, got

    served, got = run(main())
    assert served.asked == [("c1", 1, 0.1, 10, None, None)]
    assert got.column("offset").to_pylist() == [0]


def test_a_parked_delivery_nobody_takes_is_dropped_and_counted(monkeypatch):
    monkeypatch.setattr(fetch, "PARKED_SECONDS", -1.0)  # stale at once
    server = FetchServer(None, None, "q")
    first = server._park("c1", delivery(0, 5))
    second = server._park("c1", delivery(5, 5))  # the first one is stale by now
    assert server.take_parked(first) is None
    assert server.parked_dropped == 5
    assert server.take_parked(second).offsets.tolist() == [5, 6, 7, 8, 9]


def test_registering_over_the_channel_and_its_end_reports_whom_it_registered():
    async def main():
        served = Served([])
        channel = await served.client()
        await channel.register("c1", 100, None, "sub")
        with pytest.raises(SelectorError, match="bad ="):  # the typed error; not registered
            await channel.register("c2", 100, "bad =", None)
        assert served.lost == []  # still connected
        channel.close()
        while not served.lost:  # the server sees the end of the connection
            await asyncio.sleep(0.001)
        return served

    served = run(main())
    assert served.registered == [("c1", 100, None, "sub")]
    assert served.lost == [[("c1", "sub")]]


def test_a_registration_written_behind_the_hello_registers_before_the_first_fetch():
    async def main():
        served = Served([delivery(0, 2)])
        channel = await served.client(register=Registration("c1", 100, None, "sub"))
        assert served.registered == [("c1", 100, None, "sub")]  # answered before connect returned
        got = await channel.fetch("c1", 10, 0.1, 100, None, "sub")
        return served, got

    served, got = run(main())
    assert got.column("offset").to_pylist() == [0, 1]


def test_a_registration_behind_the_hello_raises_the_queues_typed_error_and_closes():
    async def main():
        served = Served([])
        with pytest.raises(SelectorError, match="bad ="):
            await served.client(register=Registration("c2", 100, "bad =", None))
        while served.server.server.connections:  # closed: the server sees its end
            await asyncio.sleep(0.001)
        return served

    served = run(main())
    assert served.registered == [] and served.lost == []  # nobody registered on it


def test_a_fetch_written_behind_a_slow_registration_is_served_after_it():
    async def main():
        served = Served([delivery(0, 2)])
        served.register_gate = asyncio.Event()
        registration = Registration("c1", 100, None, "sub")
        connecting = asyncio.ensure_future(
            served.client(register=registration, fetch=("c1", 10, 0.5, 100, None, "sub"))
        )
        while not served.server.server.connections:  # hello, register and fetch written
            await asyncio.sleep(0.001)
        for _ in range(20):  # turns of the loop: the fetch is read, and must wait
            await asyncio.sleep(0)
        asked_before = list(served.asked)
        served.register_gate.set()
        channel = await connecting
        got = await channel.pending_fetch
        return served, asked_before, got

    served, asked_before, got = run(main())
    assert asked_before == []  # not fetched while the registration was under way
    assert served.registered == [("c1", 100, None, "sub")]
    assert got.batch.column("offset").to_pylist() == [0, 1]


def test_a_fetch_written_behind_a_failed_registration_fetches_nothing():
    async def main():
        served = Served([delivery(0, 2)])
        registration = Registration("c2", 100, "bad =", None)
        with pytest.raises(SelectorError, match="bad ="):
            await served.client(register=registration, fetch=("c2", 10, 0.5, 100, "bad =", None))
        while served.server.server.connections:
            await asyncio.sleep(0.001)
        return served

    served = run(main())
    assert served.asked == [] and served.registered == []  # the queue never fetched for it


def test_a_registration_behind_a_refused_hello_is_never_made():
    async def main():
        served = Served([])
        with pytest.raises(WireBroken):
            await served.client(secret="0" * 32, register=Registration("c3", 1, None, None))
        return served

    assert run(main()).registered == []


def test_finishing_ends_a_waiting_fetch_at_once_with_nothing_taken():
    async def main():
        gate = asyncio.Event()  # never set: the fetch waits in the server
        served = Served([delivery(0, 1)], gate)
        channel = await served.client()
        task = asyncio.create_task(channel.fetch("c1", 1, 50.0, 10, None, None))
        while not served.asked:
            await asyncio.sleep(0.001)
        channel.finish()  # a closing TargetList: no further request
        return served, await task  # long before the 50 s poll

    served, got = run(main())
    assert got is None
    assert len(served.answers) == 1  # its delivery was never taken
    assert served.server.answers == 0 and served.given_back == []


def test_finishing_after_the_fetch_took_messages_still_delivers_them():
    async def main():
        gate = asyncio.Event()
        served = Served([delivery(3, 2)], gate)
        channel = await served.client()
        task = asyncio.create_task(channel.fetch("c1", 5, 50.0, 10, None, None))
        while not served.asked:
            await asyncio.sleep(0.001)
        gate.set()  # the messages arrive, and are taken ...
        while served.answers:
            await asyncio.sleep(0.001)
        channel.finish()  # ... before the TargetList closes: it still reads them
        return served, await task

    served, got = run(main())
    assert got.column("offset").to_pylist() == [3, 4]
    assert served.given_back == []


def test_offsets_of_reads_a_slice_s_offsets_without_pandas():
    batch = delivery(100, 10).batch
    assert offsets_of(batch).tolist() == list(range(100, 110))
    assert offsets_of(batch.slice(3, 4)).tolist() == [103, 104, 105, 106]
    assert offsets_of(EMPTY_DELIVERY).tolist() == []


def test_a_delivery_is_written_at_once_not_at_the_end_of_the_loops_turn():
    """A fetch's answer is flushed as soon as it is made: a consumer waits on it."""
    seen: dict[str, bool] = {}

    def answer(value=None, buffers=(), *, now=False) -> bool:
        request.answered, seen["now"] = True, now
        return True

    request = SimpleNamespace(args=["c1", 10, 0.1, 10, None, "s", 10_000], answered=False)
    request.answer, request.conn = answer, SimpleNamespace(state={})

    async def main():
        await Served([delivery(7, 4)]).server._answer_fetch(request)

    run(main())
    assert seen == {"now": True}
