"""``ray job submit`` and the ``raymq`` command against a real local head (with its
dashboard and job server, and Ray 2.60's token authentication as it comes).

The head runs in a child process (``tests/jobs_scenario.py``): a process joins one Ray
only, and the rest of the suite shares the session's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCENARIO = os.path.join(os.path.dirname(__file__), "jobs_scenario.py")
EXAMPLES = ["quickstart", "message_selectors", "deep_backlog", "spark_pipeline"]


@pytest.fixture(scope="module")
def observed(tmp_path_factory) -> dict:
    temp = tmp_path_factory.mktemp("ray")
    done = subprocess.run(
        [sys.executable, SCENARIO, str(temp), *EXAMPLES],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_raymq_start_status_stop(observed):
    assert observed["start"]["code"] == 0, observed["start"]["err"]
    assert observed["status"]["code"] == 0, observed["status"]["err"]
    assert observed["status"]["json"]["queues"] == {}
    assert observed["stop"]["code"] == 0, observed["stop"]["err"]
    after = observed["after_stop"]
    assert after["code"] == 1 and "raymq start" in after["err"] and observed["files_kept"]


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_example_runs_as_a_ray_job(observed, name):
    job = observed["jobs"][name]
    assert job["status"] == "SUCCEEDED" and job["exit_code"] in (0, None), job["logs"]
