"""The DeliveryChannel server's give-back of answers a broken client never read
(``TargetListActor.channel_broke``), without Ray: an answer written after the last
one the client read whole goes back to the queue; one it read does not; one written
after the break goes back too; a new request confirms the answer before it."""

from __future__ import annotations

import asyncio

import pyarrow as pa

from raymq.batch import EMPTY_DELIVERY
from raymq.delivery_channel import DeliveryChannelServer, _Connection

#: Bound on a call that must return, in real seconds: only a wedge takes this long.
ANSWER_SECONDS = 30.0


def delivery(first: int, n: int) -> pa.RecordBatch:
    rows = [
        {"offset": first + i, "timestamp": 1, "delivery_count": 1, "body": b"x", "properties": b""}
        for i in range(n)
    ]
    return pa.RecordBatch.from_pylist(rows, schema=EMPTY_DELIVERY.schema)


class Writer:
    """A connection's writer that takes every write (the client may not read them)."""

    def __init__(self) -> None:
        self.data = b""

    def write(self, data) -> None:
        self.data += bytes(data)

    async def drain(self) -> None:
        pass


class Scripted:
    def __init__(self, answers: list):
        self.answers = list(answers)
        self.given_back: list[list[int]] = []
        self.server = DeliveryChannelServer(self._take, self._give_back, "consumer c of 'q'")

    async def _take(self, max_messages: int, timeout: float, inline_bytes: int):
        return self.answers.pop(0)

    async def _give_back(self, batch: pa.RecordBatch) -> None:
        self.given_back.append(batch.column("offset").to_pylist())


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, ANSWER_SECONDS))


def test_an_answer_written_but_not_read_goes_back_and_a_read_one_does_not():
    async def main():
        s = Scripted([delivery(0, 2), delivery(2, 3)])
        conn = s.server._latest = _Connection()
        await s.server._answer(Writer(), 10, 0.1, conn=conn)  # read by the client ...
        conn.unconfirmed.clear()  # ... which its next request shows
        await s.server._answer(Writer(), 10, 0.1, conn=conn)  # written, never read
        n = await s.server.give_back_unread(answers_read=1)
        return s, n

    s, n = run(main())
    assert n == 3 and s.given_back == [[2, 3, 4]] and s.server.given_back == 3


def test_nothing_goes_back_when_the_client_read_every_answer():
    async def main():
        s = Scripted([delivery(0, 2)])
        conn = s.server._latest = _Connection()
        await s.server._answer(Writer(), 10, 0.1, conn=conn)
        return s, await s.server.give_back_unread(answers_read=1)

    s, n = run(main())
    assert n == 0 and s.given_back == []


def test_an_answer_written_after_the_break_goes_back_too():
    async def main():
        s = Scripted([delivery(7, 1)])
        conn = s.server._latest = _Connection()
        assert await s.server.give_back_unread(answers_read=0) == 0  # nothing written yet
        await s.server._answer(Writer(), 10, 0.1, conn=conn)  # the take was under way
        return s

    s = run(main())
    assert s.given_back == [[7]]
