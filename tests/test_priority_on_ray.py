"""Priorities on a real local Ray: received highest first through the TargetList and
the consumer's buffers, found again after a SIGKILL of the queue's process, and the
README's block as typed."""

from __future__ import annotations

import os
import signal

from raymq.client.calls import _call
from tests.consumer_helpers import wait_for
from tests.readme_blocks import run_readme_block
from tests.test_schedule_on_ray import receive_until


def _priority_order(messages) -> list[int]:
    return [(m.properties or {}).get("RayMQPriority", 0) for m in messages]


def test_a_consumer_receives_the_highest_priority_first_fifo_within_each(broker):
    q = broker.create_queue("ranked", max_priority=9)
    q.send_batch([b"low-%d" % i for i in range(300)])
    for level in (3, 9, 3, 9):
        q.send_batch([b"p%d-%d" % (level, i) for i in range(5)], priority=level)
    q.send(b"too-high", priority=200)  # counts as 9
    with q.consumer(prefetch=1000) as c:
        got = receive_until(c, 321)
        c.ack(got)
    bodies = [m.body for m in got]
    nines = [b"p9-%d" % i for i in range(5)] * 2 + [b"too-high"]
    threes = [b"p3-%d" % i for i in range(5)] * 2
    assert bodies == nines + threes + [b"low-%d" % i for i in range(300)]
    assert _priority_order(got)[:11] == [9] * 10 + [200]  # the property as sent
    stats = q.stats()
    assert (stats["depth"], stats["max_priority"], stats["prioritized"]) == (0, 9, 0)


def test_priorities_survive_a_sigkill_of_the_queue(broker):
    q = broker.create_queue("ranked-kill", max_priority=5, page_size_bytes=64 * 1024)
    q.send_batch([b"x" * 100] * 5000)
    q.send_batch([b"urgent-%d" % i for i in range(50)], priority=5)
    q.send_batch([b"y" * 100] * 1000)
    pid = _call(q._actor.pid)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: _call(q._actor.pid) != pid, "restart")
    # The background pass finds them again at once after the restart.
    wait_for(lambda: q.stats()["prioritized"] == 50, "the priorities found again")
    with q.consumer(prefetch=10_000) as c:
        got = receive_until(c, 6050)
        c.ack(got)
    assert [m.body for m in got[:50]] == [b"urgent-%d" % i for i in range(50)]
    assert len({m.offset for m in got}) == 6050
    assert q.stats()["depth"] == 0


def test_the_readme_priorities_block_runs_as_typed(broker, monkeypatch):
    scope = run_readme_block("python priorities", broker, monkeypatch)
    assert [m.body for m in scope["first"]] == [b"page the on-call"]
    assert [m.body for m in scope["rest"]] == [b"report-1", b"report-2"]
    assert broker.get_queue("work").stats()["depth"] == 0
