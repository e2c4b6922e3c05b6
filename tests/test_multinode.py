"""Several nodes: queues spread over a real 3-node cluster, the governor budgeting per
node, a consumer reading a queue on another node, a node removed and its budget handed on.

The cluster runs in a child process (``tests/multinode_scenario.py``) because a process
joins one Ray only, and the rest of the suite shares the session's Ray.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

MIB = 2**20
SCENARIO = os.path.join(os.path.dirname(__file__), "multinode_scenario.py")


@pytest.fixture(scope="module")
def observed(tmp_path_factory) -> dict:
    paging = tmp_path_factory.mktemp("paging")
    temp = tmp_path_factory.mktemp("ray")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run(
        [sys.executable, SCENARIO, str(paging), str(temp)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
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
    assert gone not in after["node_thresholds"] and len(after["node_thresholds"]) == 2
    assert sum(after["node_thresholds"].values()) == 60 * MIB
    lost = next(n for n, node in observed["queue_nodes"].items() if node == gone)
    assert lost not in after["queues"]
    for name, q in after["queues"].items():
        node = q["node_id"]
        assert after["node_thresholds"][node] > before["node_thresholds"][node]
        assert q["share"] > before["queues"][name]["share"]
