"""A broker on a real three-node Ray cluster on one machine (``ray.cluster_utils.Cluster``).

Run by ``tests/test_multinode.py`` in its own process (one Ray per process, and the rest
of the suite shares another). Prints one JSON object of observations on stdout; the
test makes the assertions.

Usage: python tests/multinode_scenario.py PAGING_DIR RAY_TEMP_DIR
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import ray
from ray.cluster_utils import Cluster
from raymq.placement.nodes import alive_nodes, object_store_by_node

import raymq

MIB = 2**20
STORE = 100 * MIB
THRESHOLD = 60 * MIB


def main(paging_dir: str, temp_dir: str) -> dict:
    # Cluster writes its address to <RAY_TMPDIR or /tmp>/ray/ray_current_cluster and
    # deletes it on shutdown: keep that file in our own temp dir. /tmp/ray need not
    # exist on a fresh machine (FileNotFoundError), and belongs to any other Ray there.
    os.environ["RAY_TMPDIR"] = temp_dir
    os.makedirs(os.path.join(temp_dir, "ray"), exist_ok=True)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "object_store_memory": STORE,
            "include_dashboard": False,
            "temp_dir": temp_dir,
            # notice a dead node in about a second, not fifteen
            "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3},
        },
    )
    workers = [cluster.add_node(num_cpus=1, object_store_memory=STORE) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    out: dict = {}
    try:
        broker = raymq.connect(
            namespace="multinode",
            paging_directory=paging_dir,
            flow_to_disk_threshold=THRESHOLD,
            housekeeping_period=0.5,
        )
        head = ray.get_runtime_context().get_node_id()
        out["head"] = head
        queues = {name: broker.create_queue(name) for name in ("q0", "q1", "q2")}
        out["queue_nodes"] = broker.queue_nodes()
        for i, q in enumerate(queues.values()):
            q.send_batch([b"m" * 1024] * (1000 * (i + 1)))
        # a consumer on the head node reading a queue that lives on another node
        remote_name = next(n for n, node in out["queue_nodes"].items() if node != head)
        with queues[remote_name].consumer(prefetch=500, node_id=head) as c:
            got, deadline = 0, time.monotonic() + 120
            while got < 1000 and time.monotonic() < deadline:
                # The queue may hold more: ask for no more than the 1,000 to read. An
                # empty receive is only a slow one (test_multinode asserts the 1,000).
                batch = c.receive_batch(min(500, 1000 - got), timeout=10)
                if batch.num_rows:
                    c.ack(batch)
                    got += batch.num_rows
            out["remote_read"] = {
                "queue": remote_name,
                "queue_node": out["queue_nodes"][remote_name],
                "consumer_node": c.stats()["node_id"],
                "received": got,
            }
        # The node to remove later: the remote queue's, a worker holding a queue.
        victim = out["queue_nodes"][remote_name]
        survivors = {n for n, node in out["queue_nodes"].items() if node != victim}
        with contextlib.ExitStack() as consumers:
            # Like with like: the governor gives a queue with no consumer and no traffic
            # since its last round only its floor, and whether the sends above are still
            # "recent" at a rebalance depends on the machine's speed. A registered
            # consumer keeps a queue active in every round, so each surviving queue is
            # active in both plans compared below. (Consumers on the head: the removed
            # node takes nothing of theirs with it.)
            for name in sorted(survivors):
                consumers.enter_context(queues[name].consumer(prefetch=10, node_id=head))
            out["before"], out["before_usage"], out["before_rounds"] = rebalanced(
                broker, set(queues)
            )
            out["before_stores"] = object_store_by_node()
            # remove a worker node holding a queue: its budget goes to the others
            worker = next(w for w in workers if w.node_id == victim)
            cluster.remove_node(worker)
            deadline = time.monotonic() + 30
            while any(n["NodeID"] == victim for n in alive_nodes()):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"node {victim} still alive after 30 s")
                time.sleep(0.1)
            out["removed"] = victim
            out["after"], out["after_usage"], out["after_rounds"] = rebalanced(broker, survivors)
            out["after_stores"] = object_store_by_node()
        broker.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
    return out


def rebalanced(broker, expected: set[str], wait: float = 30.0) -> tuple[dict, dict, int]:
    """A governor round's plan that budgets every queue in ``expected``, the usage it
    was computed from (by queue name) and how many rounds that took.

    A queue whose usage does not arrive within the governor's per-call timeout (a busy
    actor on a loaded machine) is left out of that round's plan; this waits (up to
    ``wait`` seconds) for a round that heard from all of them. The usage comes from
    ``governor_stats()``, the last round's: possibly a background round just after
    ours, which sees the same queues, sizes and consumers when no one sends or acks.
    """
    deadline = time.monotonic() + wait
    rounds = 0
    while True:
        plan = broker.rebalance()
        usage = broker.governor_stats()["usage"]
        rounds += 1
        heard = expected <= set(plan["queues"]) and expected <= set(usage)
        if heard or time.monotonic() > deadline:
            return plan, usage, rounds  # the test says what is missing
        time.sleep(0.2)


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
