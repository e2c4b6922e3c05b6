"""Several nodes: queues spread over a real 3-node cluster, the governor budgeting per
node, a consumer reading a queue on another node, a node removed and its budget handed on.

The cluster runs in a child process (``tests/multinode_scenario.py``) because a process
joins one Ray only, and the rest of the suite shares the session's Ray.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from raymq.core.budget import BudgetPlanner

MIB = 2**20
SCENARIO = os.path.join(os.path.dirname(__file__), "multinode_scenario.py")


@pytest.fixture(scope="module")
def observed() -> dict:
    # Our own directory, not tmp_path_factory's: with tmp_path_retention_policy = "none"
    # pytest locks no basetemp, and any other pytest session ending on this machine
    # deletes every /tmp/pytest-of-<user>/pytest-N, the cluster's temp dir included.
    root = tempfile.mkdtemp(prefix="rmq-multinode-")
    paging, temp = os.path.join(root, "paging"), os.path.join(root, "ray")
    os.mkdir(paging)
    os.mkdir(temp)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    try:
        done = subprocess.run(
            [sys.executable, SCENARIO, paging, temp],
            capture_output=True,
            text=True,
            timeout=240,
            env=env,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_queues_spread_over_the_nodes(observed):
    assert len(set(observed["queue_nodes"].values())) == 3


def test_a_consumer_reads_a_queue_on_another_node(observed):
    r = observed["remote_read"]
    assert r["received"] == 1000
    assert r["consumer_node"] == observed["head"] != r["queue_node"]


def test_budgets_are_per_node(observed):
    plan = observed["before"]
    assert len(plan["node_thresholds"]) == 3
    assert sum(plan["node_thresholds"].values()) == 60 * MIB
    for node, threshold in plan["node_thresholds"].items():
        assert plan["node_totals"].get(node, 0) <= threshold
    for name, node in observed["queue_nodes"].items():
        q = plan["queues"][name]
        assert q["node_id"] == node and 0 < q["share"] <= plan["node_thresholds"][node]


def test_a_removed_nodes_budget_goes_to_the_others(observed):
    before, after, gone = observed["before"], observed["after"], observed["removed"]
    nodes = observed["queue_nodes"]
    assert len(set(nodes.values())) == 3  # one queue per node
    lost = next(n for n, node in nodes.items() if node == gone)
    survivors = {n for n, node in nodes.items() if node != gone}
    # The whole broker-wide threshold is now split between the two nodes left, as the
    # planner splits it over the stores of the alive nodes (30 MiB each, not 20).
    assert gone not in after["node_thresholds"] and len(after["node_thresholds"]) == 2
    assert sum(after["node_thresholds"].values()) == 60 * MIB
    assert after["node_thresholds"] == BudgetPlanner(60 * MIB).node_thresholds(
        observed["after_stores"]
    )
    assert lost not in after["queues"]
    assert set(after["queues"]) == survivors, (observed["after_rounds"], after["queues"])
    for name in sorted(survivors):
        node = nodes[name]
        assert after["node_thresholds"][node] > before["node_thresholds"][node]
        # Like with like: in both rounds the queue had a consumer (so was active) and
        # held messages, whatever the machine's speed; an idle queue gets only its floor.
        for usage in (observed["before_usage"], observed["after_usage"]):
            assert usage[name]["active"] and usage[name]["size_bytes"] > 0, usage[name]
        # An active queue alone on its node may use the node's whole threshold, so
        # the removed node's part reaches the queues on the others.
        assert before["queues"][name]["share"] == before["node_thresholds"][node]
        assert after["queues"][name]["share"] == after["node_thresholds"][node]
        assert after["queues"][name]["share"] > before["queues"][name]["share"]
