"""The DeliveryServer's give-back (``raymq.wire.delivery``) of answers a broken client
never read (``TargetListActor.channel_broke``), without Ray: an answer written after the
last one the client read whole goes back to the queue; one it read does not; one written
after the break goes back too; a new request confirms the answer before it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pyarrow as pa

from raymq.batch import EMPTY_DELIVERY
from raymq.wire.delivery import DeliveryServer

#: Bound on a call that must return, in real seconds: only a wedge takes this long.
ANSWER_SECONDS = 30.0


def delivery(first: int, n: int) -> pa.RecordBatch:
    rows = [
        {"offset": first + i, "timestamp": 1, "delivery_count": 1, "body": b"x", "properties": b""}
        for i in range(n)
    ]
    return pa.RecordBatch.from_pylist(rows, schema=EMPTY_DELIVERY.schema)


class Connection:
    """One client connection's requests, each answer written (the client may not read
    them)."""

    def __init__(self) -> None:
        self.state: dict = {}
        self.written: list = []

    def take(self, max_messages: int = 10, timeout: float = 0.1) -> SimpleNamespace:
        def answer(value=None, buffers=(), *, now=False) -> bool:
            request.answered = True
            self.written.append(value)
            return True

        request = SimpleNamespace(
            conn=self, args=[max_messages, timeout], answered=False, answer=answer
        )
        return request


class Scripted:
    def __init__(self, answers: list, gate: asyncio.Event | None = None):
        self.answers = list(answers)
        self.gate = gate
        self.taking = asyncio.Event()  # a take waits in the TargetList
        self.given_back: list[list[int]] = []
        self.server = DeliveryServer(self._take, self._give_back, "consumer c of 'q'")

    async def _take(self, max_messages: int, timeout: float, inline_bytes: int):
        self.taking.set()
        if self.gate is not None:
            await self.gate.wait()
        return self.answers.pop(0)

    async def _give_back(self, batch: pa.RecordBatch) -> None:
        self.given_back.append(batch.column("offset").to_pylist())


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, ANSWER_SECONDS))


def test_an_answer_written_but_not_read_goes_back_and_a_read_one_does_not():
    async def main():
        s = Scripted([delivery(0, 2), delivery(2, 3)])
        conn = Connection()
        await s.server._answer_take(conn.take())  # read by the client, as ...
        await s.server._answer_take(conn.take())  # ... its next request shows; never read
        assert conn.written == ["ipc", "ipc"]
        n = await s.server.give_back_unread(answers_read=1)
        return s, n

    s, n = run(main())
    assert n == 3 and s.given_back == [[2, 3, 4]] and s.server.given_back == 3


def test_nothing_goes_back_when_the_client_read_every_answer():
    async def main():
        s = Scripted([delivery(0, 2)])
        conn = Connection()
        await s.server._answer_take(conn.take())
        return s, await s.server.give_back_unread(answers_read=1)

    s, n = run(main())
    assert n == 0 and s.given_back == []


def test_an_answer_written_after_the_break_goes_back_too():
    async def main():
        gate = asyncio.Event()
        s = Scripted([delivery(7, 1)], gate)
        conn = Connection()
        under_way = asyncio.ensure_future(s.server._answer_take(conn.take()))
        await s.taking.wait()  # the take is under way when the client's connection breaks
        assert await s.server.give_back_unread(answers_read=0) == 0  # nothing written yet
        gate.set()
        await under_way  # written after the break: never read
        return s

    s = run(main())
    assert s.given_back == [[7]]
