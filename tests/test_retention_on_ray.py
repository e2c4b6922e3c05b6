"""Retention and replay on a real local Ray: a subscription replays what it acknowledged,
a new one reads the retained history from a time, and both outlive a SIGKILL of the
address's process; the README's block as typed."""

from __future__ import annotations

import datetime
import os
import signal
import time

from raymq.client.calls import _call
from tests.consumer_helpers import wait_for
from tests.readme_blocks import run_readme_block

#: Bound on a wait for messages (seconds): a wedge fails.
DEADLINE_SECONDS = 60.0


def receive_all(sub, n: int) -> list[bytes]:
    """``n`` messages from a new consumer of ``sub``, acknowledged; then nothing more."""
    got = []
    deadline = time.monotonic() + DEADLINE_SECONDS
    with sub.consumer(prefetch=1000) as c:
        while len(got) < n:
            assert time.monotonic() < deadline, f"{len(got)} of {n} received"
            batch = c.receive(n - len(got), timeout=1)
            got += batch
            c.ack(batch)
        assert not c.receive(10, timeout=0.2)
    return [m.body for m in got]


def test_a_seek_back_and_a_subscription_from_a_time_outlive_a_sigkill(broker):
    events = broker.create_address("events", retention_s=3600, page_size_bytes=64 * 1024)
    billing = events.create_subscription("billing")
    events.send_batch([b"old-%d" % i for i in range(2000)])
    middle = datetime.datetime.now()  # after the first send's commit, before the second's
    events.send_batch([b"new-%d" % i for i in range(1000)])
    everything = [b"old-%d" % i for i in range(2000)] + [b"new-%d" % i for i in range(1000)]
    assert receive_all(billing, 3000) == everything
    stats = events.stats()
    assert (stats["depth"], stats["retained"]) == (0, 3000)
    assert billing.seek(1500) == 1500
    pid = _call(events._actor.pid)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: _call(events._actor.pid) != pid, "restart")
    assert receive_all(billing, 1500) == everything[1500:]  # the seek was durable
    recent = events.create_subscription("recent", start=middle)
    assert receive_all(recent, 1000) == everything[2000:]
    assert events.stats()["retained"] == 3000


def test_the_readme_replay_block_runs_as_typed(broker, monkeypatch):
    scope = run_readme_block("python replay", broker, monkeypatch)
    assert [m.body for m in scope["first"]] == [b"e1", b"e2", b"e3"]
    assert [m.body for m in scope["again"]] == [b"e1", b"e2", b"e3"]
    assert receive_all(scope["audit"], 3) == [b"e1", b"e2", b"e3"]
