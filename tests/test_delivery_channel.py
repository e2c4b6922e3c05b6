"""The delivery protocol (``raymq.wire.delivery``) without Ray: a consumer's receives
over a socket to its TargetList. Messages come back inline as Arrow; a large answer goes
by reference; the queue's typed errors (and its bugs, named) cross as errors and leave
the channel usable, as a malformed request's error does; a wrong secret, a dead server
or a broken answer is ``WireBroken`` (the consumer then uses Ray), and rows the server
took for an answer it could not write are given back, not lost. Also the TargetList pieces the
server uses: ``bytes_ahead`` and the loader's ``wait``/``take_now``; and the loader's
small first fetch (a new consumer's first message waits for it), doubling after."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from types import SimpleNamespace

import msgpack
import numpy as np
import pyarrow as pa
import pytest

from raymq.batch import EMPTY_DELIVERY
from raymq.core.target_list import FIRST_FETCH_MESSAGES, DirectEntry, EagerLoader, TargetList
from raymq.errors import ConsumerClosed, RayMQError, SelectorError, StorageError
from raymq.wire import frames
from raymq.wire.delivery import (
    BY_REFERENCE,
    INLINE_BYTES,
    REQUEST_LIMIT,
    DeliveryChannel,
    DeliveryServer,
    Encoded,
    answer_of,
)
from raymq.wire.errors import WireBroken
from raymq.wire.ipc import from_ipc, to_ipc

#: Bound on a call that must return, in real seconds: only a wedge takes this long.
ANSWER_SECONDS = 30.0


def delivery(first: int, n: int, body: bytes = b"x" * 100) -> pa.RecordBatch:
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
    return pa.RecordBatch.from_pylist(rows, schema=EMPTY_DELIVERY.schema)


class Served:
    """A DeliveryServer on 127.0.0.1 with scripted answers, and a client channel
    used from a thread (as a consumer's receive is)."""

    def __init__(self, answers: list, started: list | None = None):
        self.answers = list(answers)
        self.asked: list[tuple[int, float, int]] = []
        self.given_back: list[pa.RecordBatch] = []
        #: What each start request answers (an exception is raised); None: no start.
        self.started = started
        self.starts: list[dict] = []
        self.server = DeliveryServer(
            self._take,
            self._give_back,
            "consumer c of 'q'",
            start=None if started is None else self._start,
        )

    async def _start(self, settings: dict):
        self.starts.append(settings)
        answer = self.started.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def _take(self, max_messages: int, timeout: float, inline_bytes: int):
        self.asked.append((max_messages, timeout, inline_bytes))
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def _give_back(self, batch: pa.RecordBatch) -> None:
        self.given_back.append(batch)

    async def client(self, secret: str | None = None) -> DeliveryChannel:
        host, port, real = await self.server.start("127.0.0.1")
        return await asyncio.to_thread(DeliveryChannel, host, port, secret or real, "q")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, ANSWER_SECONDS))


def test_ipc_round_trip_keeps_a_slice_s_rows_only():
    batch = delivery(10, 50).slice(5, 7)
    back = from_ipc(to_ipc(batch).to_pybytes())
    assert back.equals(batch)
    assert back.column("offset").to_pylist() == list(range(15, 22))


def test_a_delivery_that_came_inline_whole_is_handed_on_as_it_came():
    first, second = delivery(10, 5), delivery(15, 8)
    stream = to_ipc(first).to_pybytes()
    answer = answer_of([(first, stream)])
    assert isinstance(answer, Encoded)
    assert answer.stream is stream  # not decoded and encoded again
    assert answer.rows.equals(first) and from_ipc(answer.stream).equals(first)
    # Part of a delivery, or several: one batch, encoded by the server.
    assert answer_of([(first.slice(1), None)]).equals(first.slice(1))
    both = answer_of([(first, stream), (second.slice(2, 4), None)])
    assert both.equals(pa.concat_batches([first, second.slice(2, 4)]))


def test_an_encoded_answer_crosses_and_its_rows_are_given_back_if_unwritten():
    rows = delivery(0, 6)
    stream = to_ipc(rows).to_pybytes()
    given = []

    async def take(max_messages, timeout, inline_bytes):
        return answer_of([(rows, stream)])

    async def give_back(batch):
        given.append(batch.column(0).to_pylist())

    async def main():
        server = DeliveryServer(take, give_back, "test")
        host, port, secret = await server.start("127.0.0.1")
        channel = await asyncio.to_thread(DeliveryChannel, host, port, secret, "q")
        got = await asyncio.to_thread(channel.take, 10, 1.0)
        channel.close()
        server.close()
        return got

    assert run(main()).equals(rows)
    assert given == []

    async def broken():
        server = DeliveryServer(take, give_back, "test")
        await server._answer_take(unwritable([10, 0.1]))  # the consumer went away
        return server

    server = run(broken())
    assert given == [list(range(6))] and server.given_back == 6


def test_answers_come_inline_in_order_with_nothing_and_by_reference_between():
    async def main():
        served = Served([delivery(0, 3), None, BY_REFERENCE, delivery(3, 2)])
        channel = await served.client()
        got = [await asyncio.to_thread(channel.take, 100, 0.5) for _ in range(4)]
        channel.close()
        return served, got

    served, got = run(main())
    assert got[0].equals(delivery(0, 3))
    assert got[1] is None
    assert got[2] is BY_REFERENCE
    assert got[3].column("offset").to_pylist() == [3, 4]
    assert [a[:2] for a in served.asked] == [(100, 0.5)] * 4
    assert all(a[2] == INLINE_BYTES for a in served.asked)
    assert served.server.answers == 2 and served.server.by_reference == 1


def test_the_queues_typed_error_is_raised_and_the_channel_stays_usable():
    async def main():
        served = Served(
            [ConsumerClosed("consumer c of queue 'q' is closed"), StorageError("q: disk"), None]
        )
        channel = await served.client()
        errors = []
        for _ in range(2):
            try:
                await asyncio.to_thread(channel.take, 1, 0.1)
            except (ConsumerClosed, StorageError) as exc:
                errors.append(exc)
        last = await asyncio.to_thread(channel.take, 1, 0.1)
        channel.close()
        return errors, last

    errors, last = run(main())
    assert type(errors[0]) is ConsumerClosed and "'q'" in str(errors[0])
    assert type(errors[1]) is StorageError
    assert last is None


def test_a_wrong_secret_is_refused():
    async def main():
        served = Served([])
        with pytest.raises(WireBroken, match="'q'"):
            await served.client(secret="0" * 32)
        return served

    served = run(main())
    assert served.asked == []


def test_a_bug_in_the_target_list_is_an_error_naming_it_and_the_channel_stays_usable():
    async def main():
        served = Served([RuntimeError("a bug in the TargetList"), None])
        channel = await served.client()
        with pytest.raises(RayMQError, match="RuntimeError: a bug in the TargetList"):
            await asyncio.to_thread(channel.take, 1, 0.1)
        last = await asyncio.to_thread(channel.take, 1, 0.1)
        channel.close()
        return last

    assert run(main()) is None


def test_a_dead_server_breaks_the_channel_for_good():
    async def main():
        served = Served([])
        channel = await served.client()
        for conn in list(served.server.server._open):  # the TargetList's process dies
            conn.transport.abort()
        with pytest.raises(WireBroken):
            await asyncio.to_thread(channel.take, 1, 0.1)
        with pytest.raises(WireBroken):
            await asyncio.to_thread(channel.take, 1, 0.1)
        return served

    assert run(main()).asked == []


def unwritable(args: list) -> SimpleNamespace:
    """A take whose connection closed: its answer cannot be written."""

    def answer(value=None, buffers=(), *, now=False) -> bool:
        request.answered = True
        return False

    request = SimpleNamespace(args=args, answered=False, answer=answer)
    request.conn = SimpleNamespace(state={})
    return request


def test_rows_of_an_answer_that_cannot_be_written_are_given_back():
    async def main():
        served = Served([delivery(7, 4)])
        await served.server._answer_take(unwritable([10, 0.1]))
        return served

    served = run(main())
    assert len(served.given_back) == 1
    assert served.given_back[0].column("offset").to_pylist() == [7, 8, 9, 10]
    assert served.server.given_back == 4 and served.server.answers == 0


def test_a_malformed_request_is_refused_without_taking_and_the_channel_goes_on():
    async def main():
        served = Served([delivery(0, 1)])
        channel = await served.client()
        with pytest.raises(ValueError, match="malformed take"):  # not [max_messages, timeout]
            await asyncio.to_thread(channel._client.call, "take", ["x"])
        assert served.asked == []
        got = await asyncio.to_thread(channel.take, 1, 0.1)
        channel.close()
        return served, got

    served, got = run(main())
    assert [a[:2] for a in served.asked] == [(1, 0.1)]
    assert got.column("offset").to_pylist() == [0]


def test_a_spare_is_started_by_its_first_request_and_its_typed_error_crosses():
    settings = {"queue": "q", "selector": "x > 1", "queue_actor": b"\x00" * 400}
    refused = SelectorError("queue 'q': malformed selector")

    async def main():
        served = Served([delivery(0, 2)], started=[refused, "stale fetch endpoint", ["h", 1]])
        channel = await served.client()
        got = []
        with pytest.raises(SelectorError, match="'q'"):
            await asyncio.to_thread(channel.start, settings, 5.0)
        for _ in range(2):  # a start the TargetList did not carry out may be asked again
            got.append(await asyncio.to_thread(channel.start, settings, 5.0))
        got.append(await asyncio.to_thread(channel.take, 10, 0.1))
        channel.close()
        return served, got

    served, got = run(main())
    assert served.starts == [settings] * 3
    assert got[:2] == ["stale fetch endpoint", ["h", 1]]
    assert got[2].column("offset").to_pylist() == [0, 1]


def test_a_start_to_a_server_without_one_is_refused_and_the_channel_goes_on():
    async def main():
        plain = Served([None])
        other = await plain.client()
        with pytest.raises(ValueError, match="no op 'start'"):  # it cannot start anything
            await asyncio.to_thread(other.start, {"queue": "q"}, 5.0)
        got = await asyncio.to_thread(other.take, 1, 0.0)
        other.close()
        return plain, got

    plain, got = run(main())
    assert got is None and [a[:2] for a in plain.asked] == [(1, 0.0)]


def test_a_start_request_over_its_limit_drops_the_connection_unstarted():
    async def main():
        served = Served([], started=[["h", 1]])
        channel = await served.client()
        with pytest.raises(WireBroken):
            await asyncio.to_thread(channel.start, {"selector": "x" * REQUEST_LIMIT}, 5.0)
        return served

    assert run(main()).starts == []


# -- the TargetList side ------------------------------------------------------------------


def test_bytes_ahead_counts_the_next_messages_across_entries():
    t = TargetList(high_watermark=100, high_watermark_bytes=10**9, pending_cache_bytes=0)
    t.loaded(DirectEntry("a", np.arange(0, 10), 1000))  # 100 bytes each
    t.loaded(DirectEntry("b", np.arange(10, 20), 2000))  # 200 bytes each
    assert t.bytes_ahead(5) == 500
    assert t.bytes_ahead(15) == 1000 + 1000
    assert t.bytes_ahead(1000) == 3000
    t.take(5)
    assert t.bytes_ahead(10) == 500 + 1000


def test_loader_wait_returns_on_arrival_and_take_now_hands_out():
    async def main():
        t = TargetList(high_watermark=10, high_watermark_bytes=10**9, pending_cache_bytes=0)
        loaded = asyncio.Event()

        async def fetch(room: int):
            await loaded.wait()
            loaded.clear()
            return DirectEntry("r", np.arange(0, 3), 300)

        loader = EagerLoader(t, fetch, queue="q")
        task = asyncio.create_task(loader.run())
        waiting = asyncio.create_task(loader.wait(ANSWER_SECONDS))
        await asyncio.sleep(0)
        assert not waiting.done()
        loaded.set()
        await waiting  # returns on arrival, long before its timeout
        out = loader.take_now(2)
        rest = loader.take_now(5)
        empty = loader.take_now(5)
        loader.close()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return out, rest, empty

    out, rest, empty = run(main())
    assert out == [("r", 0, 2)] and rest == [("r", 2, 1)] and empty == []


def test_the_loaders_first_fetch_is_small_and_each_one_doubles_up_to_the_room():
    async def main():
        t = TargetList(high_watermark=10_000, high_watermark_bytes=10**12, pending_cache_bytes=0)
        asked: list[int] = []
        done = asyncio.Event()

        async def fetch(room: int):
            asked.append(room)
            if sum(asked) >= 10_000:
                done.set()
                await asyncio.Event().wait()  # no more: the loader waits here
            return DirectEntry("r", np.arange(sum(asked) - room, sum(asked)), room)

        loader = EagerLoader(t, fetch, queue="q")
        task = asyncio.create_task(loader.run())
        await done.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return asked

    doubling = [FIRST_FETCH_MESSAGES]
    while sum(doubling) + 2 * doubling[-1] < 10_000:
        doubling.append(2 * doubling[-1])
    assert run(main()) == [*doubling, 10_000 - sum(doubling)]


def test_close_from_another_thread_ends_a_take_waiting_for_its_answer_at_once():
    # The server never answers (it waits longer than the test): close() must not wait
    # behind the take's lock for its socket timeout (the wait plus ANSWER_MARGIN).
    async def main():
        never = asyncio.Event()

        async def take(max_messages: int, timeout: float, inline_bytes: int):
            await never.wait()

        async def give_back(batch: pa.RecordBatch) -> None:
            pass

        server = DeliveryServer(take, give_back, "consumer c of 'q'")
        host, port, secret = await server.start("127.0.0.1")
        channel = await asyncio.to_thread(DeliveryChannel, host, port, secret, "q")
        waiting = asyncio.create_task(asyncio.to_thread(channel.take, 10, 50.0))
        while not channel._lock.locked():  # the take holds the lock while it waits
            await asyncio.sleep(0.001)
        await asyncio.to_thread(channel.close)
        with pytest.raises(WireBroken):
            await waiting
        with pytest.raises(WireBroken, match="closed"):
            await asyncio.to_thread(channel.take, 1, 0.1)
        never.set()
        server.close()

    run(main())  # within ANSWER_SECONDS (30 s); before, close took 65 s


def test_a_break_mid_answer_says_an_answer_was_pending_and_how_many_were_read():
    # The client's half of giving back an answer it never read (the consumer asks its
    # TargetList for the rows of answers beyond ``answers_read``).
    async def main():
        async def read_header(reader) -> list:
            (n,) = struct.unpack(">I", await reader.readexactly(4))
            return msgpack.unpackb(await reader.readexactly(n))

        async def serve(reader, writer):
            await read_header(reader)  # the hello
            writer.write(frames.header_bytes([0, None, {}, []]))
            for answer in range(2):
                req_id = (await read_header(reader))[0]
                data = to_ipc(delivery(answer * 10, 3))
                head, raw = frames.encode([req_id, None, "ipc"], [data])
                writer.write(head)
                # The second answer breaks off half-way.
                writer.write(raw if answer == 0 else raw[:10])
                await writer.drain()
            writer.close()

        secret = "s" * 32
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        channel = await asyncio.to_thread(DeliveryChannel, "127.0.0.1", port, secret, "q")
        first = await asyncio.to_thread(channel.take, 3, 1.0)
        assert first.column("offset").to_pylist() == [0, 1, 2] and channel.answers_read == 1
        with pytest.raises(WireBroken) as broken:
            await asyncio.to_thread(channel.take, 3, 1.0)
        server.close()
        return broken.value, channel.answers_read

    broken, read = run(main())
    assert broken.answer_pending and read == 1


def test_a_take_is_written_at_once_not_at_the_end_of_the_loops_turn():
    """A take's answer is flushed as soon as it is made: the application waits on it."""
    seen: dict[str, bool] = {}

    def answer(value=None, buffers=(), *, now=False) -> bool:
        request.answered, seen["now"] = True, now
        return True

    request = SimpleNamespace(args=[10, 0.1], answered=False)
    request.answer, request.conn = answer, SimpleNamespace(state={})

    async def main():
        await Served([delivery(7, 4)]).server._answer_take(request)

    run(main())
    assert seen == {"now": True}


def _written_by_arrow(batch: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.RecordBatchStreamWriter(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


@pytest.mark.parametrize(
    "batch",
    [
        delivery(0, 1),
        delivery(10, 50).slice(5, 7),
        delivery(0, 0),
        delivery(0, 2000),
        pa.record_batch([pa.array([1, 2])], names=["x"]),  # another schema
    ],
    ids=["one", "slice", "empty", "large", "other-schema"],
)
def test_an_ipc_stream_is_the_one_arrow_writes_and_reads_back_into_its_buffer(batch):
    stream = to_ipc(batch).to_pybytes()
    assert stream == _written_by_arrow(batch)  # readable by any Arrow reader
    data = bytearray(stream)
    back = from_ipc(data)
    assert back.equals(batch) and back.schema.equals(batch.schema, check_metadata=True)
    if batch.num_rows:  # zero-copy: the rows' buffers lie in the bytes received
        start = np.frombuffer(data, np.uint8).ctypes.data
        assert start <= back.column(0).buffers()[1].address < start + len(data)


def test_a_stream_cut_short_or_without_its_batch_is_arrow_invalid_or_os_error():
    stream = to_ipc(delivery(0, 3)).to_pybytes()
    schema = pa.ipc.open_stream(stream).schema.serialize().to_pybytes()
    assert stream.startswith(schema)
    without_batch = schema + stream[-8:]  # the schema's message, then the end marker
    for data in (b"", stream[:10], stream[: len(schema) + 20], stream[:-20], without_batch):
        with pytest.raises((pa.ArrowInvalid, OSError)):
            from_ipc(data)
