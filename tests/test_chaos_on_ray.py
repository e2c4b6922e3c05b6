"""A short chaos soak on a real Ray (issue 28): producers and churning consumers
(selectors, nacks, messages left unacknowledged, pipelined acks) on two queues and an
address's two subscriptions (one with a routing selector) while a queue's or the
address's actor or a consumer's TargetList is SIGKILLed every few seconds.

It runs ``bench.chaos`` in a child process (its own Ray); ``python -m bench.chaos``
runs the 10-minute soak. What must hold is ``bench.chaos``'s: nothing acknowledged to
a producer lost, nothing in flight after the drain, nothing served that was not sent,
no error but typed RayMQ errors and never ``InvalidAck``, no queue stalled.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests import background

#: The soak (600 s at most) is the first scenario queued (tests/background.py).
pytestmark = pytest.mark.timeout(900)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@background.scenario("test_chaos_on_ray.py")
def run_scenario() -> subprocess.CompletedProcess:
    """The soak's process (started beside the suite by conftest.py)."""
    bench_dir = tempfile.mkdtemp(prefix="rmq-chaos-")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAYMQ_BENCH_DIR": bench_dir}
    env.pop("RAYMQ_BENCH_ADDRESS", None)  # a Ray of its own
    try:
        return background.run_child(
            [
                sys.executable,
                "-m",
                "bench.chaos",
                "--minutes",
                "0.5",
                "--kill-every",
                "3,6",
                "--rate",
                "1500",
                "--seed",
                "3",
            ],
            cwd=ROOT,
            env=env,
            timeout=600,
        )
    finally:
        shutil.rmtree(bench_dir, ignore_errors=True)


def test_a_short_chaos_soak_loses_nothing_and_raises_only_typed_errors():
    done = background.outcome("test_chaos_on_ray.py")
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "CHAOS OK" in out, out[-8000:]
    kills = re.search(r"kills: \{([^}]*)\}", out)
    assert kills is not None and kills.group(1), "nothing was killed"
    assert "InvalidAck" not in out
    # The address's subscriptions took part (the soak's table has a column for each).
    assert "soak.c/all" in out and "soak.c/warm" in out, out[-8000:]
