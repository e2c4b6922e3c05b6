"""Message expiry on a real local Ray: sends with a ttl never received after it, moved
to the expiry queue (those the queue held, and those a consumer held when they
expired), the default TTL, and a paged backlog expiring across a SIGKILL of the queue's
process."""

from __future__ import annotations

import os
import signal
import time

import pyarrow as pa

from raymq.client.calls import _call
from raymq.core.dead_letter import DEAD_LETTER_REASON, ORIGINAL_OFFSET, ORIGINAL_QUEUE
from raymq.core.expiry import EXPIRATION_PROPERTY
from tests.consumer_helpers import wait_for
from tests.readme_blocks import run_readme_block


def wait_past(expires_ms: int) -> None:
    """Until the clock has passed an expiry (the TTL must run out: that is the test)."""
    while time.time() * 1000 <= expires_ms:
        time.sleep(max(0.0, expires_ms / 1000 - time.time()) + 0.01)


def test_expired_messages_go_to_the_expiry_queue_and_are_never_received(broker):
    q = broker.create_queue("orders", expiry_queue="orders.expired")
    q.send(b"short", {"n": 1}, ttl=0.3)
    q.send(b"live", ttl=600)
    q.send_batch([b"b1", b"b2"], ttl=0.3)
    # Past the expiry of every one sent with the short ttl (b1 and b2 were sent last:
    # theirs is the latest, later by as long as the sends took on a loaded machine).
    short = [m for m in q.browse() if m.body in (b"short", b"b1", b"b2")]
    assert len(short) == 3
    wait_past(max(m.properties[EXPIRATION_PROPERTY] for m in short))
    with q.consumer(prefetch=10) as c:
        got = c.receive(10, timeout=30)  # (returns with the first it gets)
        assert [m.body for m in got] == [b"live"]
        c.ack(got)
    wait_for(lambda: q.stats()["messages_expired"] == 3, "expired")
    moved = list(broker.get_queue("orders.expired").browse())
    assert sorted(m.body for m in moved) == [b"b1", b"b2", b"short"]
    for m in moved:
        assert m.properties[ORIGINAL_QUEUE] == "orders"
        assert m.properties[DEAD_LETTER_REASON] == "expired"
        assert EXPIRATION_PROPERTY not in m.properties
    stats = q.stats()
    assert (stats["depth"], stats["in_flight"], stats["expiry_queue"]) == (0, 0, "orders.expired")


def test_messages_a_consumer_held_when_they_expired_are_not_handed_out(broker):
    q = broker.create_queue("held", default_ttl_s=5.0)  # long enough to reach the consumer
    with q.consumer(prefetch=100) as c:
        q.send_batch([b"m"] * 50)
        first = c.receive(1, timeout=30)  # the rest wait in the TargetList or the client
        assert len(first) == 1
        wait_past(first[0].properties[EXPIRATION_PROPERTY])
        c.ack(first)
        assert not c.receive(100, timeout=0.5)
    wait_for(lambda: q.stats()["messages_expired"] == 49, "expired")
    stats = q.stats()
    assert (stats["depth"], stats["in_flight"], stats["expiry_queue"]) == (0, 0, "")


def test_a_paged_backlog_expires_across_a_sigkill_of_the_queue(broker):
    q = broker.create_queue(
        "backlog",
        page_size_bytes=64 * 1024,
        message_expiry_scan_period_s=0.2,
        expiry_queue="backlog.expired",
    )
    offsets = []
    for _ in range(20):
        offsets += q.send_batch([b"x" * 1000] * 500, ttl=1.0)
    latest_expiry = time.time() * 1000 + 1000  # every ttl'd message expires by then
    q.send_batch([b"keep"] * 10)
    files = q.stats()["segment_files"]
    pid = _call(q._actor.pid)
    # Some may expire before the kill on a slow machine (their count dies with the
    # process), so the expiry queue, not the counter, is what must hold them all.
    os.kill(pid, signal.SIGKILL)
    wait_past(latest_expiry)
    wait_for(lambda: q.stats()["depth"] == 10, "the backlog expired")
    stats = q.stats()
    assert _call(q._actor.pid) != pid
    assert stats["segment_files"] < files
    expired = broker.get_queue("backlog.expired")
    wait_for(lambda: expired.stats()["depth"] >= len(offsets), "moved to the expiry queue")
    # A move cut by the kill may leave a copy in both queues, never in neither.
    moved = {m.properties[ORIGINAL_OFFSET] for m in expired.browse()}
    assert moved == set(offsets) and len(offsets) == 10_000
    with q.consumer(prefetch=100) as c:
        got = c.receive(100, timeout=30)
        assert [m.body for m in got] == [b"keep"] * 10
        c.ack(got)


def test_the_readme_expiry_block_runs_as_typed(broker, monkeypatch):
    scope = run_readme_block("python expiry", broker, monkeypatch)
    assert [m.body for m in scope["fresh"]] == [b"GBPUSD 1.2702"]
    quotes = broker.get_queue("quotes")
    wait_for(lambda: quotes.stats()["messages_expired"] == 1, "expired")
    [moved] = list(broker.get_queue("quotes.expired").browse())
    assert moved.body == b"EURUSD 1.0841"


def test_rows_a_consumer_finds_expired_go_back_to_the_queue_as_expired(broker):
    """The consumer's own check (what expired between the queue and the application),
    driven directly: rows it holds, found expired, are handed back by its call."""
    q = broker.create_queue("late", expiry_queue="late.expired")
    # A TTL long enough that all 20 reach the consumer unexpired on a slow machine
    # (with 0.5 s, a consumer slow to start found them expired already, and waited).
    q.send_batch([b"m"] * 20, ttl=5.0)
    sent = time.time() * 1000
    with q.consumer(prefetch=100) as c:
        parts = []
        deadline = time.monotonic() + 60
        while sum(p.num_rows for p in parts) < 20:
            assert time.monotonic() < deadline, f"{sum(p.num_rows for p in parts)} of 20 received"
            parts.append(c.receive_batch(20, timeout=30))
        batch = pa.concat_batches(parts)
        wait_past(sent + 5000)  # past every one's expiry (sent before)
        assert c._without_expired(batch) is None
        assert c.messages_expired == 20
    wait_for(lambda: q.stats()["messages_expired"] == 20, "expired")
    assert broker.get_queue("late.expired").stats()["depth"] == 20
