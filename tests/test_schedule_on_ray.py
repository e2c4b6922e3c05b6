"""Scheduled delivery on a real local Ray: never received before its time, received
after it by a consumer waiting meanwhile, and kept across a SIGKILL of the queue's
process. (Whether a message came early is checked against the time its receive
returned: a sound check however slow the machine is.)"""

from __future__ import annotations

import os
import signal
import time

from raymq.client.calls import _call
from raymq.core.schedule import SCHEDULED_PROPERTY
from tests.consumer_helpers import wait_for
from tests.readme_blocks import run_readme_block

#: Bound on what the queue does in the background (seconds): a wedge fails.
DEADLINE_SECONDS = 120.0


def receive_until(consumer, n: int) -> list:
    """``n`` messages, however many receives it takes (bounded), each checked not to
    have come before its delivery time."""
    got: list = []
    deadline = time.monotonic() + DEADLINE_SECONDS
    while len(got) < n:
        assert time.monotonic() < deadline, f"{len(got)} of {n} received"
        got += not_early(consumer.receive(n - len(got), timeout=1))
    return got


def not_early(messages) -> list:
    """``messages`` (just received), none of which may be due after now."""
    now_ms = time.time() * 1000
    for m in messages:
        due = m.properties.get(SCHEDULED_PROPERTY) if m.properties else None
        assert due is None or due <= now_ms, f"offset {m.offset} came {due - now_ms:.0f} ms early"
    return list(messages)


def test_a_scheduled_message_is_received_at_its_time_not_before(broker):
    q = broker.create_queue("jobs")
    q.send(b"later", delay=1.0)
    q.send_batch([b"b1", b"b2"], deliver_at=time.time() + 1.5)
    q.send(b"now")
    q.send(b"far", delay=3600)
    with q.consumer(prefetch=10) as c:
        got = receive_until(c, 4)  # a receive waiting meanwhile gets them at their time
        c.ack(got)
        assert not not_early(c.receive(10, timeout=0.2))
    assert sorted(m.body for m in got) == [b"b1", b"b2", b"later", b"now"]
    assert [m.delivery_count for m in got] == [1] * 4
    stats = q.stats()
    assert (stats["depth"], stats["scheduled"], stats["in_flight"]) == (1, 1, 0)


def test_scheduled_messages_survive_a_sigkill_of_the_queue(broker):
    q = broker.create_queue("sched", page_size_bytes=64 * 1024)
    q.send_batch([b"x" * 100] * 5000, delay=3600)
    q.send_batch([b"soon"] * 100, delay=2.0)
    q.send_batch([b"now"] * 5)
    pid = _call(q._actor.pid)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: _call(q._actor.pid) != pid, "restart")
    with q.consumer(prefetch=10_000) as c:
        got = receive_until(c, 105)
        c.ack(got)
        assert not not_early(c.receive(10, timeout=0.2))
    assert sorted({m.body for m in got}) == [b"now", b"soon"]
    assert len({m.offset for m in got}) == 105
    wait_for(lambda: q.stats()["scheduled"] == 5000, "the far ones found again")
    assert q.stats()["depth"] == 5000


def test_the_readme_scheduled_block_runs_as_typed(broker, monkeypatch):
    scope = run_readme_block("python scheduled", broker, monkeypatch)
    # (A machine slower than the delay may give both at once.)
    assert b"right away" in [m.body for m in scope["now"]]
    assert sorted(m.body for m in [*scope["now"], *scope["later"]]) == [b"call back", b"right away"]
    assert broker.get_queue("reminders").stats()["depth"] == 0
