"""Message expiry without Ray: QueueCore on real files with an injected clock (its
``time`` module), the expiry queue, the default TTL, a paged backlog, a restart; and
the pieces of ``raymq.core.expiry``."""

from __future__ import annotations

import asyncio

import msgpack
import pyarrow as pa
import pytest

from raymq.batch import MessageBatch
from raymq.config import BrokerConfig, QueueConfig
from raymq.core import queue as queue_module
from raymq.core.dead_letter import (
    DEAD_LETTER_REASON,
    ORIGINAL_OFFSET,
    ORIGINAL_QUEUE,
    REASON_EXPIRED,
)
from raymq.core.expiry import (
    EXPIRATION_PROPERTY,
    TimesScan,
    expiration_in,
    expiration_ms,
    expired_rows,
    with_expiration,
)
from raymq.core.queue import QueueCore
from raymq.core.schedule import SCHEDULED_PROPERTY
from raymq.errors import InvalidQueueName, InvalidSetting
from raymq.properties import decode_properties, encode_properties
from tests.storage_helpers import flip

T0 = 1_800_000_000.0


class Clock:
    """Stands in for the queue core's ``time`` module."""

    def __init__(self) -> None:
        self.now = T0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now - T0


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(queue_module, "time", c)
    return c


def _core(tmp_path, sink=None, **cfg) -> QueueCore:
    broker = BrokerConfig(paging_directory=str(tmp_path), checkpoint_interval=0.05)
    return QueueCore(QueueConfig("orders", **cfg), broker, dead_letter_sink=sink)


def _batch(bodies: list[bytes], ttl: float | None = None, now: float = T0, props=None):
    batch = MessageBatch.from_bodies(bodies, props, max_message_size=2**20)
    if ttl is not None:
        batch = with_expiration(batch, expiration_ms(ttl, now), keep_existing=False)
    return batch


def _bodies(rows: pa.RecordBatch) -> list[bytes]:
    return rows.column("body").to_pylist()


async def _settled(core: QueueCore, expired: int) -> None:
    """Until the mover (a task) has taken ``expired`` messages out: woken by each batch
    it moves."""
    sub = core._own
    while sub.messages_expired < expired:
        sub._dead_letters_moved.clear()
        await asyncio.wait_for(sub._dead_letters_moved.wait(), 30)


def test_an_expired_message_is_never_delivered_and_is_counted(tmp_path, clock):
    async def scenario():
        core = _core(tmp_path)
        core.start()
        try:
            await core.send_batch(_batch([b"short"], ttl=1.0))
            await core.send_batch(_batch([b"long"], ttl=60.0))
            await core.send_batch(_batch([b"forever"]))
            clock.now += 2.0
            core.register_consumer("c", 10)
            got = await core.fetch("c", 10, 0.0, 10)
            await _settled(core, 1)
            stats = core.stats()
            await core.ack("c", got.column("offset").to_numpy())
            return _bodies(got), stats, core.stats().depth
        finally:
            await core.close()

    got, stats, depth = asyncio.run(scenario())
    assert got == [b"long", b"forever"]
    assert stats.messages_expired == 1 and stats.expiry_queue == ""
    assert stats.messages_dead_lettered == 0 and stats.dead_letters_pending == 0
    assert depth == 0  # the expired one was acknowledged (dropped)


def test_expired_messages_move_to_the_expiry_queue_with_where_they_came_from(tmp_path, clock):
    moved: list[tuple[str, MessageBatch]] = []

    async def sink(name: str, batch: MessageBatch) -> None:
        moved.append((name, batch))

    async def scenario():
        core = _core(tmp_path, sink, expiry_queue="orders.expired")
        core.start()
        try:
            props = {"kind": "a"}
            await core.send_batch(_batch([b"x", b"y"], ttl=1.0, props=props))
            clock.now += 1.5
            core.register_consumer("c", 10)
            got = await core.fetch("c", 10, 0.0, 10)
            await _settled(core, 2)
            return got.num_rows, core.stats()
        finally:
            await core.close()

    rows, stats = asyncio.run(scenario())
    assert rows == 0 and stats.messages_expired == 2 and stats.depth == 0
    assert stats.expiry_queue == "orders.expired"
    assert [name for name, _ in moved] == ["orders.expired"]
    batch = moved[0][1]
    props = [decode_properties(batch.properties_bytes(i)) for i in range(len(batch))]
    assert [batch.body(i) for i in range(len(batch))] == [b"x", b"y"]
    for i, p in enumerate(props):
        assert p["kind"] == "a" and EXPIRATION_PROPERTY not in p
        assert p[ORIGINAL_QUEUE] == "orders" and p[ORIGINAL_OFFSET] == i
        assert p[DEAD_LETTER_REASON] == REASON_EXPIRED
        assert p["RayMQOriginalExpiration"] == expiration_ms(1.0, T0)


def test_the_default_ttl_applies_to_messages_sent_without_one(tmp_path, clock):
    async def scenario():
        core = _core(tmp_path, default_ttl_s=10.0)
        core.start()
        try:
            await core.send_batch(_batch([b"default"]))
            await core.send_batch(_batch([b"own"], ttl=100.0))
            stored, _ = core.browse(0, 10)
            clock.now += 11.0
            core.register_consumer("c", 10)
            got = await core.fetch("c", 10, 0.0, 10)
            return stored, _bodies(got)
        finally:
            await core.close()

    stored, got = asyncio.run(scenario())
    props = [decode_properties(p) for p in stored.column("properties").to_pylist()]
    assert props[0][EXPIRATION_PROPERTY] == expiration_ms(10.0, T0)
    assert props[1][EXPIRATION_PROPERTY] == expiration_ms(100.0, T0)  # its own kept
    assert got == [b"own"]


def test_a_pass_expires_a_paged_backlog_nobody_consumes_and_frees_its_files(tmp_path, clock):
    n = 3000

    async def scenario():
        core = _core(tmp_path, page_size_bytes=4096)
        core.start()
        try:
            for i in range(0, n, 100):
                ttl = 1.0 if i < n - 100 else 3600.0  # the last 100 live on
                await core.send_batch(_batch([b"m" * 200] * 100, ttl=ttl))
            files = core.stats().segment_files
            clock.now += 5.0
            found = await core.expiry_pass()
            await _settled(core, found)
            await core.flush_acks()
            core.housekeeping()
            return files, found, core.stats()
        finally:
            await core.close()

    files, found, stats = asyncio.run(scenario())
    assert files > 20 and found == n - 100
    assert stats.messages_expired == n - 100 and stats.depth == 100
    assert stats.segment_files < files // 4


def test_expiry_holds_across_a_restart(tmp_path, clock):
    async def first_run():
        core = _core(tmp_path)
        core.start()
        try:
            await core.send_batch(_batch([b"a", b"b"], ttl=1.0))
            await core.send_batch(_batch([b"c"]))
        finally:
            await core.close()

    async def second_run():
        core = _core(tmp_path)
        core.start()
        try:
            assert core._own.times.may_have_times  # not known until a pass looks
            core.register_consumer("c", 10)
            got = await core.fetch("c", 10, 0.0, 10)
            await _settled(core, 2)
            return _bodies(got), core.stats()
        finally:
            await core.close()

    asyncio.run(first_run())
    clock.now += 2.0
    got, stats = asyncio.run(second_run())
    assert got == [b"c"] and stats.messages_expired == 2


def test_a_queue_without_expiring_messages_stops_checking_after_one_pass(tmp_path, clock):
    async def first_run():
        core = _core(tmp_path)
        core.start()
        try:
            await core.send_batch(_batch([b"a", b"b"]))
            return core._own.times.may_have_times
        finally:
            await core.close()

    async def second_run():
        core = _core(tmp_path)
        core.start()
        try:
            scan = core._own.times
            before = scan.may_have_times
            await core.expiry_pass()
            after_pass = scan.may_have_times
            await core.send_batch(_batch([b"c"], ttl=5.0))
            return before, after_pass, scan.may_have_times
        finally:
            await core.close()

    assert asyncio.run(first_run()) is False
    assert asyncio.run(second_run()) == (True, False, True)


def test_a_selector_consumer_and_a_consumer_holding_expired_messages(tmp_path, clock):
    async def scenario():
        core = _core(tmp_path)
        core.start()
        try:
            core.register_consumer("held", 10)
            await core.send_batch(_batch([b"h"], ttl=1.0, props={"color": "blue"}))
            held = await core.fetch("held", 10, 0.0, 10)  # before it expires
            core.register_consumer("sel", 10, "color = 'red'")
            await core.send_batch(_batch([b"r1"], ttl=1.0, props={"color": "red"}))
            await core.send_batch(_batch([b"r2"], ttl=60.0, props={"color": "red"}))
            clock.now += 2.0
            sel = await core.fetch("sel", 10, 0.0, 10)
            # The client finds the one it holds expired, and hands it back.
            back = core.expire("held", held.column("offset").to_numpy())
            await _settled(core, 2)
            return _bodies(held), _bodies(sel), back, core.stats()
        finally:
            await core.close()

    held, sel, back, stats = asyncio.run(scenario())
    assert held == [b"h"] and sel == [b"r2"] and back == 1
    assert stats.messages_expired == 2 and stats.in_flight == 1  # r2, held by sel


def test_expired_rows_finds_the_rows_of_a_delivery_batch():
    props = [
        encode_properties({EXPIRATION_PROPERTY: 1000}),
        b"",
        encode_properties({EXPIRATION_PROPERTY: 3000, "k": 1}),
        encode_properties({"k": 2}),
    ]
    column = pa.array(props, pa.binary())
    assert expired_rows(column, 999) is None
    assert expired_rows(column, 1000).tolist() == [True, False, False, False]
    assert expired_rows(column, 5000).tolist() == [True, False, True, False]
    assert expired_rows(pa.array([b"", b""], pa.binary()), 10**15) is None
    # A slice looks at its own rows only (its buffers are its parent's).
    assert expired_rows(column.slice(1, 2), 5000).tolist() == [False, True]
    assert expired_rows(column.slice(3, 1), 5000) is None
    assert expired_rows(column.slice(1, 1), 5000) is None
    large = pa.array(props, pa.large_binary())
    assert expired_rows(large.slice(2), 5000).tolist() == [True, False]


def test_damaged_properties_read_without_their_crc_expire_nothing():
    """Found by the simulator: a flipped bit in properties read for matching (not
    checksummed) must not fail a delivery; the checked read quarantines the record."""
    good = encode_properties({EXPIRATION_PROPERTY: 1000})
    assert expiration_in(good) == 1000
    for bad in (b"\x81\x01" + good[2:], good[:-3], good + b"\xc1", b"\x91" + good[1:]):
        assert expiration_in(bad) in (None, 1000)  # never raises


def test_with_expiration_keeps_or_replaces_an_existing_one():
    batch = MessageBatch.from_bodies(
        [b"a", b"b"], [{EXPIRATION_PROPERTY: 5}, None], max_message_size=99
    )
    kept = with_expiration(batch, 9, keep_existing=True)
    replaced = with_expiration(batch, 9, keep_existing=False)

    def exps(b):
        return [decode_properties(b.properties_bytes(i))[EXPIRATION_PROPERTY] for i in range(2)]

    assert exps(kept) == [5, 9] and exps(replaced) == [9, 9]
    assert [kept.body(i) for i in range(2)] == [b"a", b"b"]


def test_a_pass_with_an_arrival_carrying_an_expiry_keeps_checking():
    scan = TimesScan(may_have_times=True)
    scan.start_pass()
    scan.arrived(
        MessageBatch.from_bodies(
            [b"x"], {EXPIRATION_PROPERTY: 1}, max_message_size=99
        ).property_groups()
    )
    scan.end_pass()
    assert scan.may_have_times
    scan.start_pass()
    scan.end_pass()
    assert not scan.may_have_times


@pytest.mark.parametrize(
    "setting",
    [
        {"default_ttl_s": 0},
        {"default_ttl_s": -1.0},
        {"default_ttl_s": float("inf")},
        {"default_ttl_s": "5"},
        {"expiry_queue": "orders"},
        {"expiry_queue": "a/b"},
        {"message_expiry_scan_period_s": 0},
    ],
)
def test_bad_expiry_settings_are_refused(setting):
    with pytest.raises((InvalidSetting, InvalidQueueName), match="orders|a/b"):
        QueueConfig("orders", **setting)


def test_expiration_is_never_before_its_time():
    assert expiration_ms(0.0005, 1.0) == 1001
    assert expiration_ms(1.0, 2.0) == 3000


def test_on_an_address_a_message_expires_for_every_subscription(tmp_path, clock):
    async def scenario():
        broker = BrokerConfig(paging_directory=str(tmp_path))
        core = QueueCore(QueueConfig("news", address=True, default_ttl_s=5.0), broker)
        core.start()
        try:
            await core.create_subscription("a")
            await core.create_subscription("b")
            await core.send_batch(_batch([b"old"]))
            await core.send_batch(_batch([b"new"], ttl=60.0))
            clock.now += 10.0
            got = {}
            for name in ("a", "b"):
                core.register_consumer("c", 10, subscription=name)
                rows = await core.fetch("c", 10, 0.0, 10, subscription=name)
                got[name] = _bodies(rows)
                await core.ack("c", rows.column("offset").to_numpy(), subscription=name)
                await core.dead_letters_settled(name)
            expired = {n: core.stats(n).messages_expired for n in ("a", "b")}
            return got, expired, core.stats().depth
        finally:
            await core.close()

    got, expired, depth = asyncio.run(scenario())
    assert got == {"a": [b"new"], "b": [b"new"]}
    assert expired == {"a": 1, "b": 1} and depth == 0


def _rot_a_time(path: str, value: int, bit: int) -> None:
    """Flip ``bit`` of the msgpack uint64 ``value`` stored in the file at ``path``."""
    packed = msgpack.packb(value)
    assert packed[0] == 0xCF  # a uint64: 8 big-endian bytes follow
    with open(path, "rb") as f:
        at = f.read().index(packed)
    flip(path, at + 1 + 7 - bit // 8, 1 << (bit % 8))


#: (property, its value, the bit flipped): an expiry far off rotted into the past, and
#: a delivery time past rotted into the far future.
ROTTED_TIMES = [
    (EXPIRATION_PROPERTY, int((T0 + 3600) * 1000), int(T0 * 1000).bit_length() - 1),
    (SCHEDULED_PROPERTY, int((T0 - 1) * 1000), int(T0 * 1000).bit_length()),
]


@pytest.mark.parametrize("path", ["fetch", "pass"])
@pytest.mark.parametrize(("prop", "value", "bit"), ROTTED_TIMES)
def test_rot_in_a_time_read_without_its_checksum_holds_nothing_back(
    tmp_path, clock, path, prop, value, bit
):
    """A message's expiry or delivery time read from disk for a take or the background
    pass is not checksummed (only its properties are read). A flipped bit in a delivery
    time made a message wait for a time decades off (set aside, never counted): the
    record is read checked before a message is set aside now. An expiry was confirmed
    already: the mover reads what it drops, checked. Either way the record fails, and
    is counted as damaged, not as expired or scheduled."""

    async def scenario():
        core = _core(tmp_path)
        core.start()
        try:
            await core.send_batch(_batch([b"rotten"], props={prop: value}))
            await core.send_batch(_batch([b"fine"]))
            core.set_budget(0)  # no copy in memory: its properties come from the file
            cached = core.head_cache.get(0, 1) is not None
            _rot_a_time(core.log.segment_of(0).path, value, bit)
            core.register_consumer("c", 10)
            if path == "pass":
                await core.expiry_pass()
            got = await core.fetch("c", 10, 0.0, 10)
            await core.dead_letters_settled()  # an expired one dropped by the mover
            return cached, _bodies(got), core.stats()
        finally:
            await core.close()

    cached, got, stats = asyncio.run(scenario())
    assert not cached  # the scenario
    assert got == [b"fine"]
    assert stats.damaged_messages == 1
    assert stats.messages_expired == 0 and stats.scheduled == 0


def test_a_pass_that_finds_rot_takes_the_expired_beside_it_out_as_damage(tmp_path, clock):
    """Found in review: a pass confirmed a message it would set aside; its record
    failed and was quarantined, but the expired message beside it in the same record
    went on to the mover as a dead letter, which could not read it: with an expiry
    queue it failed for ever (every later dead letter waiting behind it), without one
    it was counted as expired as well as damaged."""
    moved: list[str] = []

    async def sink(name: str, batch: MessageBatch) -> None:
        moved.append(name)

    async def scenario():
        core = _core(tmp_path, sink, expiry_queue="orders.expired")
        core.start()
        try:
            soon, future = int((T0 + 1) * 1000), int((T0 + 3600) * 1000)
            props = [{EXPIRATION_PROPERTY: soon}, {SCHEDULED_PROPERTY: future}]
            await core.send_batch(_batch([b"expired-body", b"later-body"], props=props))
            await core.send_batch(_batch([b"stale"], ttl=1.0))  # a dead letter after them
            core.set_budget(0)  # no copy in memory: its properties come from the file
            path = core.log.segment_of(0).path
            with open(path, "rb") as f:
                at = f.read().index(b"expired-body")
            flip(path, at)  # a body byte: the properties still read well
            clock.now += 2
            await core.expiry_pass()
            await asyncio.wait_for(core.dead_letters_settled(), 10)
            return core.stats()
        finally:
            await core.close()

    stats = asyncio.run(scenario())
    assert stats.damaged_messages == 2
    assert stats.messages_expired == 1 and moved == ["orders.expired"]  # "stale" only
    assert stats.depth == 0 and stats.scheduled == 0 and stats.dead_letters_pending == 0
