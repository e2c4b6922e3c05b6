"""A handle used after its Ray session was shut down and another started (a notebook
that restarted Ray, say): Ray refuses the call's submission with a bare ``Exception``
("Failed to submit task to actor ... Can't find actor"); RayMQ raises its typed error,
at once, for every call (``raymq.ray_faults.submit``). The scenario runs in a child
process: it shuts its Ray down, which the suite's own Ray must not be."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

#: A call on an actor Ray cannot find has nothing to wait for (before: 60-120 s, the
#: restart grace, spent retrying); generous against a loaded machine.
AT_ONCE_SECONDS = 10.0


def test_every_call_of_a_handle_from_a_shut_down_session_raises_a_typed_error(tmp_path):
    script = Path(__file__).with_name("stale_session_scenario.py")
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    outcomes = json.loads(done.stdout.strip().splitlines()[-1])
    # A spare deferred past ray.shutdown() is not made: its .remote() would have
    # started a Ray of its own. No RayMQ thread died of the shutdown.
    assert outcomes.pop("deferred_spare") == {"made_a_ray": False, "still_making": 0}
    assert outcomes.pop("thread_errors") == []
    assert set(outcomes) == {"send", "stats", "receive", "ack", "create_queue"}
    for call, outcome in outcomes.items():
        assert outcome["error"] == "BrokerUnavailable", (call, outcome)
        assert outcome["typed"], (call, outcome)
        assert "Can't find actor" in outcome["message"], (call, outcome)
        assert outcome["seconds"] < AT_ONCE_SECONDS, (call, outcome)
