"""Calls made while a queue actor restarts wait for it (real SIGKILLs on a local Ray)."""

from __future__ import annotations

import os
import signal

from raymq.client import _call


def test_get_queue_right_after_a_kill_waits_for_the_restart(broker):
    q = broker.create_queue("phoenix")
    q.send(b"before")
    pid = _call(q._actor.pid)
    os.kill(pid, signal.SIGKILL)
    again = broker.get_queue("phoenix")  # the broker actor's ready() call meets the death
    assert _call(again._actor.pid) != pid
    assert again.send(b"after") == 1
    assert [m.body for m in again.browse()] == [b"before", b"after"]
