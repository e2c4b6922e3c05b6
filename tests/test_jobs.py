"""The README's cluster path, run as written: a real ``ray start --head`` (with its
dashboard, job server and Ray 2.60's token authentication), the ``raymq`` command, the
examples as Ray jobs joining the running broker, and the metrics port.

The head runs in a child process (``tests/jobs_scenario.py``, where the few deviations
from a user's machine are listed): a process joins one Ray only, and the rest of the
suite shares the session's. The commands come out of README.md's ``cluster-quickstart``
and ``cluster-commands`` blocks, so the README and this test are one text.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from tests import background
from tests.jobs_scenario import clean_up, scratch_dirs

#: The scenario (tests/background.py starts it beside the suite; the first test's setup
#: waits for it, and for the chaos soak queued before it): a head, five jobs (Spark among
#: them) and some fifteen commands, about 2.5 minutes alone on 2 cores, twice that on a
#: busy machine.
pytestmark = pytest.mark.timeout(1500)

SCENARIO = os.path.join(os.path.dirname(__file__), "jobs_scenario.py")
EXAMPLES = ["quickstart", "message_selectors", "deep_backlog", "spark_pipeline", "serve_tasks"]
#: The queues each example leaves in the running broker (drained); deep_backlog
#: deletes its 200 MiB queue.
LEFT = {
    "quickstart": ["example.orders"],
    "message_selectors": ["example.events"],
    "deep_backlog": [],
    "spark_pipeline": ["example.shop_events", "example.fraud_alerts"],
    "serve_tasks": ["example.tasks"],
}


@background.scenario("test_jobs.py")
def run_scenario() -> subprocess.CompletedProcess:
    """The scenario's process (started beside the suite by conftest.py)."""
    # The directories are made here so that the head is stopped even when the scenario
    # is killed (a timeout) before its own clean-up.
    home, ray_tmp = scratch_dirs()
    try:
        return background.run_child(
            [sys.executable, SCENARIO, "--dirs", home, ray_tmp, *EXAMPLES],
            timeout=1500,  # each step of the scenario is bounded by JOB_SECONDS (600)
            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
        )
    finally:
        clean_up(home, ray_tmp)


@pytest.fixture(scope="module")
def observed() -> dict:
    done = background.outcome("test_jobs.py")
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # For the record (pytest -s shows it): how long a newcomer waits on this machine.
    print(f"\ncluster quickstart timing: {out.get('timing')}")
    return out


def test_the_readme_cluster_quickstart_runs_as_written(observed, record_property):
    block = observed["quickstart_block"]
    assert block["code"] == 0, block["output"]
    assert "ray start --head --metrics-export-port=8080" in " ".join(block["lines"])
    timing = observed.get("timing")
    assert timing, block["output"]
    record_property("head_start_to_first_message_s", timing["head_start_to_first_message_s"])


def test_the_jobs_messages_are_in_the_running_broker(observed):
    status = observed["status"]
    assert status["code"] == 0, status["err"]
    orders = status["json"]["queues"]["example.orders"]
    assert orders["messages_in"] == 1001 and orders["messages_acked"] == 1001
    assert orders["depth"] == 0 and orders["next_offset"] == 1001


def test_token_authentication_is_on_and_the_token_private(observed):
    auth = observed["auth"]
    assert auth["code"] == 0, auth["err"]
    assert auth["status"]["mode"] == "token" and auth["status"]["warning"] is None
    assert auth["status"]["dashboard_answer"] == "token"  # asked without a worker task
    assert auth["status"]["token_path"].endswith("/.ray/auth_token")
    assert auth["status"]["permissions_fixed"]  # the scenario made it 0644 first
    assert int(auth["file_mode"], 8) == stat.S_IRUSR | stat.S_IWUSR


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_example_joins_the_running_broker(observed, name):
    if name == "quickstart":  # submitted by the README's block
        assert "joined the running RayMQ broker" in observed["quickstart_block"]["output"]
    else:
        job = observed["jobs"][name]
        assert job["status"] == "SUCCEEDED" and job["exit_code"] in (0, None), job["logs"]
        assert job["joined"], job["logs"]
    if name == "serve_tasks":
        assert "40 tasks SUCCESS" in job["logs"] and "FAILURE after 3 runs" in job["logs"]
    after = observed["status_after_jobs"]
    assert after["code"] == 0, after["err"]  # no job shut the broker down
    queues = after["json"]["queues"]
    for queue in LEFT[name]:
        assert queue in queues and queues[queue]["depth"] == 0, sorted(queues)
    assert "example.deep_backlog" not in queues


def test_a_driver_joins_with_the_join_flag(observed):
    joined = observed["join_flag"]
    assert joined["code"] == 0, joined["err"]
    assert "joined the running RayMQ broker" in joined["out"]
    assert "received and acknowledged 1001 messages" in joined["out"]


def test_the_metrics_port_shows_the_jobs_queue(observed):
    metrics = observed["metrics"]
    assert metrics["value"] == 1001, metrics
    assert 'broker="raymq"' in metrics["labels"]


def test_ray_list_actors_shows_the_broker(observed):
    actors = observed["ray_list_actors"]
    assert actors["code"] == 0, actors["err"]
    for name in ("raymq.broker", "raymq.governor", "raymq.queue.example.orders"):
        assert name in actors["names"]


def test_the_readme_raymq_commands_run_as_written(observed):
    block = observed["commands_block"]
    assert block["code"] == 0, block["output"]
    consumed = [json.loads(line) for line in block["consumed"]]
    assert [(m["body"], m["properties"]) for m in consumed] == [("hello", {"color": "red"})]


def test_raymq_stop_keeps_the_files(observed):
    after = observed["after_stop"]
    assert after["code"] == 1 and "raymq start" in after["err"]
    assert observed["files_kept"]
