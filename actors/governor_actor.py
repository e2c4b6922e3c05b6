"""MemoryGovernorActor: one broker-wide memory budget, rebalanced every housekeeping period.

One detached, named actor per broker (``raymq.governor``), restarted if it dies. Each
round it asks every running queue actor for its usage (a ``QueueUsage`` record, bytes)
and its consumers, asks every consumer's TargetList actor for its usage (a
``ConsumerUsage``), lets ``raymq.core.budget.BudgetPlanner`` compute the shares (Qpid's
proportional split, per node, with floors) and the linked-cache split (ActiveMQ), and
pushes the budgets out: every queue's each round (its actor may have restarted in
place), a consumer's only when it changed (``PushedBudgets``). It holds no state that
matters: after a restart the next round finds queues through the broker's registry and
consumers through their queues (and pushes every budget once), so nothing has to
re-register; meanwhile everyone keeps its last budget.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

import ray
from raymq.actors.names import BROKER_ACTOR_NAME, queue_actor_name
from raymq.placement.nodes import object_store_by_node

from raymq import metrics
from raymq.config import BrokerConfig
from raymq.core.budget import BudgetPlanner, ConsumerUsage, Plan, PushedBudgets, QueueUsage

log = logging.getLogger("raymq.governor")

#: Longest a round reuses the nodes' object-store sizes before asking Ray's GCS again
#: (seconds); a queue reporting a node not among them asks at once. Nodes come and go
#: seldom, and every round asking (with a name lookup per queue) was most of what the
#: GCS did for a broker at rest.
NODES_REFRESH_SECONDS = 10.0


@ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=100)
class MemoryGovernorActor:
    """The Ray shell around ``BudgetPlanner``: collect usage, plan, push budgets."""

    def __init__(self, config: BrokerConfig, namespace: str):
        self.config = config
        self.namespace = namespace
        self.planner = BudgetPlanner(config.flow_to_disk_threshold)
        self.plan: Plan | None = None
        self.rounds = 0
        self.round_seconds = 0.0
        self.round_started = 0.0  # wall-clock seconds of the last round's start and end
        self.round_finished = 0.0
        self.errors: list[str] = []
        self._usage: dict[str, QueueUsage] = {}  # of the last round, by queue name
        self._pushed = PushedBudgets()  # consumers' budgets: pushed when they change
        # Handles kept between rounds (a name lookup is a GCS call): the broker's, and
        # each running queue actor's, dropped when it does not answer (deleted and made
        # again, it is another actor) so that the next round looks it up anew.
        self._broker: Any = None
        self._queues: dict[str, Any] = {}
        self._nodes: dict[str, int] = {}  # object store bytes by node id
        self._nodes_at = float("-inf")  # monotonic seconds of that listing
        self.lookups = 0  # GCS lookups the rounds made: actor names and node listings
        self._lock = asyncio.Lock()
        self._task = asyncio.get_running_loop().create_task(self._run())
        self._metrics = asyncio.get_running_loop().create_task(self._export_metrics())

    async def _export_metrics(self) -> None:
        """Every ``metrics.EXPORT_PERIOD_SECONDS``, set the threshold and the last plan's
        budgets (``raymq.metrics``). A loop of its own, not the end of a round: Ray forgets
        a series not set for about 20 s, and rounds may be further apart than that."""
        while True:
            with metrics.guard("governor"):
                metrics.export_governor(self.stats(), self.namespace)
            await asyncio.sleep(metrics.EXPORT_PERIOD_SECONDS)

    async def _run(self) -> None:
        while True:
            try:
                await self.rebalance(fresh=False)
            except Exception as exc:  # keep governing; the error is in stats
                log.exception("memory governor round failed")
                self.errors = [*self.errors[-9:], f"{type(exc).__name__}: {exc}"]
            await asyncio.sleep(self.config.housekeeping_period)

    async def rebalance(self, fresh: bool = True) -> dict:
        """Run one round now; returns the plan as a dict. ``fresh``: with every queue
        actor and the nodes looked up again (the periodic rounds reuse them)."""
        async with self._lock:
            if fresh:
                self._broker, self._queues, self._nodes_at = None, {}, float("-inf")
            t0, started = time.perf_counter(), time.time()
            plan = await self._round()
            self.plan = plan
            self.rounds += 1
            self.round_seconds = time.perf_counter() - t0
            self.round_started, self.round_finished = started, time.time()
            return plan.to_dict()

    async def _round(self) -> Plan:
        timeout = max(self.config.housekeeping_period, 1.0)
        queues = await self._queue_handles()
        # Each queue actor answers (QueueUsage, [(consumer id, TargetList handle)]).
        reports = await _gather({name: h.usage.remote() for name, h in queues.items()}, timeout)
        for name in queues.keys() - reports.keys():
            self._queues.pop(name, None)
            self._nodes_at = float("-inf")  # its node may be gone: listed again
        consumer_handles = {cid: h for _u, consumers in reports.values() for cid, h in consumers}
        consumer_usage: dict[str, ConsumerUsage] = await _gather(
            {cid: h.usage.remote() for cid, h in consumer_handles.items()}, timeout
        )
        usages = [
            dataclasses.replace(
                usage,
                consumers=tuple(
                    consumer_usage[cid] for cid, _h in consumers if cid in consumer_usage
                ),
            )
            for usage, consumers in reports.values()
        ]
        plan = self.planner.plan(usages, self._object_stores(usages))
        self._usage = {u.name: u for u in usages}
        pushes = {}
        consumer_budgets: dict[str, tuple[int, int]] = {}
        for name, budget in plan.queues.items():
            # Every round: a queue's actor restarts in place and must get it again.
            pushes[f"queue {name}"] = queues[name].set_budget.remote(budget.queue_bytes)
            for cid, direct in budget.direct.items():
                consumer_budgets[cid] = (direct, budget.pending.get(cid, 0))
        self._pushed.keep_only(consumer_usage)
        for cid, wanted in consumer_budgets.items():
            if self._pushed.due(cid, wanted):
                pushes[f"consumer {cid}"] = consumer_handles[cid].set_budget.remote(*wanted)
        answered = await _gather(pushes, timeout)
        for cid, wanted in consumer_budgets.items():
            if f"consumer {cid}" in answered:
                self._pushed.took(cid, wanted)
        return plan

    async def _queue_handles(self) -> dict[str, object]:
        """Handles of the broker's running queue actors (stopped ones are not started),
        looked up by name only when not kept from an earlier round."""
        if self._broker is None:
            self.lookups += 1
            try:
                self._broker = ray.get_actor(BROKER_ACTOR_NAME, namespace=self.namespace)
            except ValueError:
                return {}
        try:
            names = await self._broker.list_running.remote()  # hibernated: no actor
        except ray.exceptions.RayActorError:
            self._broker = None  # stopped, or another broker now: looked up next round
            raise
        self._queues = {n: h for n, h in self._queues.items() if n in names}
        for name in names:
            if name in self._queues:
                continue
            self.lookups += 1
            try:
                self._queues[name] = ray.get_actor(queue_actor_name(name), namespace=self.namespace)
            except ValueError:
                continue
        return dict(self._queues)

    def _object_stores(self, usages: list[QueueUsage]) -> dict[str, int]:
        """Object store bytes by node id, listed again past ``NODES_REFRESH_SECONDS``
        or when a queue is on a node not listed."""
        now = time.monotonic()
        unknown = any(u.node_id not in self._nodes for u in usages)
        if unknown or now - self._nodes_at > NODES_REFRESH_SECONDS:
            self.lookups += 1
            self._nodes, self._nodes_at = object_store_by_node(), now
        return self._nodes

    def stats(self) -> dict:
        """Threshold, per-node thresholds, per-queue budgets and usage, round timing."""
        return {
            "rounds": self.rounds,
            "round_seconds": self.round_seconds,
            "round_started": self.round_started,
            "round_finished": self.round_finished,
            "housekeeping_period": self.config.housekeeping_period,
            "plan": None if self.plan is None else self.plan.to_dict(),
            "usage": {name: u.to_dict() for name, u in self._usage.items()},
            "errors": list(self.errors),
            "lookups": self.lookups,
        }


async def _gather(calls: dict, timeout: float) -> dict:
    """Await each call; those that fail or time out (a dead actor, a dead node, a busy
    queue) are left out of the result, so one of them never stalls a round."""
    if not calls:
        return {}
    keys = list(calls)

    async def one(ref):
        return await asyncio.wait_for(ref, timeout)

    results = await asyncio.gather(*(one(calls[k]) for k in keys), return_exceptions=True)
    out = {}
    for key, result in zip(keys, results, strict=True):
        if isinstance(result, BaseException):
            log.info("memory governor: %s did not answer: %s", key, result)
            continue
        out[key] = result
    return out
