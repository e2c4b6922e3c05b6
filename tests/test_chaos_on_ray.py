"""A short chaos soak on a real Ray (issue 28): producers and churning consumers
(selectors, nacks, messages left unacknowledged, pipelined acks) on two queues while a
queue's actor or a consumer's TargetList is SIGKILLed every few seconds.

It runs ``bench.chaos`` in a child process (its own Ray); ``python -m bench.chaos``
runs the 10-minute soak. What must hold is ``bench.chaos``'s: nothing acknowledged to
a producer lost, nothing in flight after the drain, nothing served that was not sent,
no error but typed RayMQ errors and never ``InvalidAck``, no queue stalled.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_short_chaos_soak_loses_nothing_and_raises_only_typed_errors(tmp_path):
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAYMQ_BENCH_DIR": str(tmp_path)}
    env.pop("RAYMQ_BENCH_ADDRESS", None)  # a Ray of its own
    done = subprocess.run(
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
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "CHAOS OK" in out, out[-8000:]
    kills = re.search(r"kills: \{([^}]*)\}", out)
    assert kills is not None and kills.group(1), "nothing was killed"
    assert "InvalidAck" not in out
