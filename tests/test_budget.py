"""Tests of raymq.core.budget: node thresholds, per-queue shares and the linked-cache split."""

from __future__ import annotations

import json
import pickle
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raymq.config import BrokerConfig, QueueConfig
from raymq.core.budget import (
    DEFAULT_FLOOR_FRACTION,
    DEFAULT_THRESHOLD_FRACTION,
    BudgetPlanner,
    ConsumerUsage,
    Plan,
    PushedBudgets,
    QueueMemory,
    QueueUsage,
    head_cache_want,
    split_queue_bytes,
    split_share,
)
from raymq.core.queue import QueueCore
from raymq.errors import InvalidSetting

MB = 10**6
GB = 10**9


def q(
    name: str,
    size: int,
    *,
    node: str = "n1",
    active: bool = True,
    delivering: bool = False,
    index: int = 0,
    max_size: int = -1,
    consumers: tuple[ConsumerUsage, ...] = (),
) -> QueueUsage:
    """A QueueUsage with the fields the planner ignores set to 0."""
    return QueueUsage(
        name=name,
        node_id=node,
        size_bytes=size,
        memory_bytes=0,
        index_bytes=index,
        active=active,
        delivering=delivering,
        max_size_bytes=max_size,
        consumers=consumers,
    )


def c(cid: str, want_direct: int, want_pending: int) -> ConsumerUsage:
    """A ConsumerUsage holding nothing now."""
    return ConsumerUsage(cid, 0, 0, want_direct, want_pending)


def shares(plan: Plan) -> dict[str, int]:
    return {name: b.share for name, b in plan.queues.items()}


def floor_of(threshold: int, n_queues: int) -> int:
    return int(threshold * DEFAULT_FLOOR_FRACTION) // n_queues


def test_queues_nobody_takes_from_follow_their_size_however_large() -> None:
    # Three queues, each beyond an equal split of the threshold, with consumers that
    # stopped taking: no working set to protect, so Qpid's proportional split decides.
    mib = 2**20
    consumer = ConsumerUsage("c", 0, 0, want_direct_bytes=mib, want_pending_bytes=mib)
    sizes = {"q1": 20 * mib, "q2": 40 * mib, "q4": 80 * mib}
    usages = [q(n, s, consumers=(consumer,)) for n, s in sizes.items()]
    plan = BudgetPlanner(64 * mib).plan(usages, {"n1": 10**9})
    share = {n: plan.queues[n].share for n in sizes}
    assert abs(share["q2"] / share["q1"] - 2) < 0.01 and abs(share["q4"] / share["q1"] - 4) < 0.01
    # The same queues while their consumers take: each keeps up to an equal split.
    usages = [q(n, s, consumers=(consumer,), delivering=True) for n, s in sizes.items()]
    plan = BudgetPlanner(64 * mib).plan(usages, {"n1": 10**9})
    assert all(abs(plan.queues[n].share - 64 * mib / 3) <= 1 for n in sizes)


def test_defaults() -> None:
    assert DEFAULT_THRESHOLD_FRACTION == 0.75
    assert DEFAULT_FLOOR_FRACTION == 0.25


def test_qpid_example() -> None:
    # Qpid Broker-J docs: 1 GB, 75 % for messages, queues of 75 MB and 100 MB -> ~320/430 MB.
    planner = BudgetPlanner(750 * MB)
    plan = planner.plan([q("a", 75 * MB), q("b", 100 * MB)], {"n1": 1 * GB})
    assert plan.threshold == 750 * MB
    assert plan.node_thresholds == {"n1": 750 * MB}
    assert abs(plan.queues["a"].share - 750 * MB * 75 / 175) <= 1
    assert abs(plan.queues["b"].share - 750 * MB * 100 / 175) <= 1
    assert round(plan.queues["a"].share / MB) == 321
    assert round(plan.queues["b"].share / MB) == 429
    assert plan.node_total("n1") == 750 * MB


def test_default_threshold_is_fraction_of_each_store() -> None:
    planner = BudgetPlanner()
    nodes = {"n1": 1 * GB, "n2": 4 * GB}
    assert planner.node_thresholds(nodes) == {"n1": 750 * MB, "n2": 3 * GB}
    assert planner.plan([], nodes).threshold == 750 * MB + 3 * GB
    assert BudgetPlanner(threshold_fraction=0.5).node_thresholds(nodes) == {
        "n1": 500 * MB,
        "n2": 2 * GB,
    }


def test_queue_appearing_shrinks_existing_shares() -> None:
    planner = BudgetPlanner()
    nodes = {"n1": 1 * GB}
    t = 750 * MB
    before = shares(planner.plan([q("a", 75 * MB), q("b", 100 * MB)], nodes))
    after = shares(planner.plan([q("a", 75 * MB), q("b", 100 * MB), q("c", 50 * MB)], nodes))
    assert after["a"] < before["a"]
    assert after["b"] < before["b"]
    assert after["c"] > 0
    assert sum(after.values()) <= t
    assert abs(after["c"] - t * 50 / 225) <= 1


def test_queue_draining_falls_to_floor_and_others_grow() -> None:
    planner = BudgetPlanner()
    nodes = {"n1": 1 * GB}
    t = 750 * MB
    floor = floor_of(t, 3)
    full = shares(planner.plan([q("a", 100 * MB), q("b", 100 * MB), q("c", 100 * MB)], nodes))
    assert full == {"a": t // 3, "b": t // 3, "c": t // 3}
    drained = shares(planner.plan([q("a", 1 * MB), q("b", 100 * MB), q("c", 100 * MB)], nodes))
    assert drained["a"] == floor
    assert drained["b"] > full["b"]
    assert drained["c"] > full["c"]
    assert drained["b"] + drained["c"] == t - floor
    empty = shares(planner.plan([q("a", 0), q("b", 100 * MB), q("c", 100 * MB)], nodes))
    assert empty["a"] == floor


def test_one_huge_queue_cannot_starve_the_others() -> None:
    planner = BudgetPlanner()
    t = 750 * MB
    plan = planner.plan([q("huge", 10**12), q("tiny", 1)], {"n1": 1 * GB})
    assert plan.queues["tiny"].share == floor_of(t, 2)
    assert plan.queues["huge"].share == t - floor_of(t, 2)


def test_idle_huge_queue_gets_only_the_floor() -> None:
    planner = BudgetPlanner()
    t = 750 * MB
    plan = planner.plan([q("idle", 100 * GB, active=False), q("busy", 10 * MB)], {"n1": 1 * GB})
    floor = floor_of(t, 2)
    assert plan.queues["idle"].share == floor
    assert plan.queues["busy"].share == t - floor


def test_node_leaving_and_joining_with_explicit_threshold() -> None:
    planner = BudgetPlanner(3 * GB)
    three = {"n1": 2 * GB, "n2": 2 * GB, "n3": 2 * GB}
    queues = [q("a", 10 * MB, node="n1"), q("b", 10 * MB, node="n2"), q("c", 10 * MB, node="n3")]
    plan3 = planner.plan(queues, three)
    assert plan3.node_thresholds == {"n1": 1 * GB, "n2": 1 * GB, "n3": 1 * GB}
    assert set(plan3.queues) == {"a", "b", "c"}

    # n3 dies: its part goes to the survivors, its queue leaves the plan.
    two = {"n1": 2 * GB, "n2": 2 * GB}
    plan2 = planner.plan(queues, two)
    assert plan2.node_thresholds == {"n1": 1500 * MB, "n2": 1500 * MB}
    assert plan2.threshold == 3 * GB
    assert set(plan2.queues) == {"a", "b"}
    assert plan2.queues["a"].share > plan3.queues["a"].share
    assert plan2.node_total("n3") == 0

    # n2 dies too: n1 alone is capped at its own store.
    one = planner.plan(queues, {"n1": 2 * GB})
    assert one.node_thresholds == {"n1": 2 * GB}
    assert one.threshold == 2 * GB
    assert set(one.queues) == {"a"}

    # A bigger node joins: the others shrink, split in proportion to store size.
    joined = planner.node_thresholds({"n1": 2 * GB, "n2": 2 * GB, "n4": 8 * GB})
    assert joined == {"n1": 500 * MB, "n2": 500 * MB, "n4": 2 * GB}


def test_explicit_threshold_split_is_capped_per_node() -> None:
    planner = BudgetPlanner(10 * GB)
    # Below the stores' total the split is proportional to store size.
    split = planner.node_thresholds({"n1": 1 * GB, "n2": 100 * GB})
    assert abs(split["n1"] - 10 * GB / 101) <= 1
    assert sum(split.values()) == 10 * GB
    # Above it, each node is capped at its own store.
    assert planner.node_thresholds({"n1": 1 * GB, "n2": 2 * GB}) == {"n1": 1 * GB, "n2": 2 * GB}
    assert planner.node_thresholds({}) == {}


def test_max_size_bytes_caps_share_and_rest_goes_to_others() -> None:
    planner = BudgetPlanner()
    t = 750 * MB
    plan = planner.plan(
        [q("capped", 500 * MB, max_size=200 * MB), q("b", 100 * MB), q("c", 100 * MB)],
        {"n1": 1 * GB},
    )
    assert plan.queues["capped"].share == 200 * MB
    assert plan.queues["b"].share == plan.queues["c"].share == (t - 200 * MB) // 2
    # A cap below the floor wins over the floor.
    tiny = planner.plan([q("x", 5 * MB, max_size=1 * MB), q("y", 5 * MB)], {"n1": 1 * GB})
    assert tiny.queues["x"].share == 1 * MB
    assert tiny.queues["y"].share == t - 1 * MB
    # Everyone capped: the rest of the threshold stays unallocated.
    capped = planner.plan([q("x", 5 * MB, max_size=100 * MB)], {"n1": 1 * GB})
    assert capped.queues["x"].share == 100 * MB


def test_linked_cache_split_order() -> None:
    usage = q("a", 1, index=100, consumers=(c("c1", 300, 100), c("c2", 100, 100)))
    # Plenty of room: every consumer gets what it wants, the head cache the rest.
    roomy = split_share(usage, 10_000)
    assert roomy.index_bytes == 100
    assert roomy.direct == {"c1": 300, "c2": 100}
    assert roomy.pending == {"c1": 100, "c2": 100}
    assert roomy.queue_bytes == 10_000 - 100 - 400 - 200
    # Direct references are filled before PendingCaches.
    tight = split_share(usage, 700)
    assert tight.direct == {"c1": 300, "c2": 100}
    assert tight.pending == {"c1": 100, "c2": 100}
    assert tight.queue_bytes == 0
    tighter = split_share(usage, 400)
    assert tighter.direct == {"c1": 225, "c2": 75}  # proportional to the wants, 3:1
    assert tighter.pending == {"c1": 0, "c2": 0}
    assert tighter.queue_bytes == 0
    mid = split_share(usage, 550)
    assert mid.direct == {"c1": 300, "c2": 100}
    assert mid.pending == {"c1": 25, "c2": 25}
    assert mid.queue_bytes == 0


def test_an_addresss_subscriptions_share_one_copy_of_what_they_reference() -> None:
    # Ten subscriptions' consumers, each wanting 12 MB of direct references and 4 MB of
    # PendingCache, on a 32 MB share: references into the same shared batches.
    wants = tuple(c(f"c{i}", 12 * MB, 4 * MB) for i in range(10))
    groups = tuple((f"c{i}",) for i in range(10))
    address = replace(q("a", 1, index=MB, consumers=wants), shared_groups=groups)
    shared = split_share(address, 32 * MB)
    assert set(shared.direct.values()) == {12 * MB}
    assert set(shared.pending.values()) == {4 * MB}  # room for one eviction each
    # Holding nothing yet (they keep up), they are charged nothing: the cache has it all.
    assert shared.queue_bytes == 32 * MB - MB
    # Charged what the most loaded subscription holds, twice, at most its budgets.
    holding = tuple(ConsumerUsage(f"c{i}", i * MB // 2, 0, 12 * MB, 4 * MB) for i in range(10))
    loaded = split_share(replace(address, consumers=holding), 32 * MB)
    assert loaded.queue_bytes == 32 * MB - MB - 9 * MB  # c9 holds 4.5 MB
    full = tuple(ConsumerUsage(f"c{i}", 12 * MB, 4 * MB, 12 * MB, 4 * MB) for i in range(10))
    assert split_share(replace(address, consumers=full), 32 * MB).queue_bytes == 15 * MB
    # The same consumers of a queue hold their own batches: the head cache gets nothing.
    alone = split_share(q("a", 1, index=MB, consumers=wants), 32 * MB)
    assert sum(alone.direct.values()) == 31 * MB and alone.queue_bytes == 0
    # Competing consumers of one subscription hold different messages: summed.
    busy = tuple(ConsumerUsage(f"c{i}", 2 * MB, 0, 12 * MB, 4 * MB) for i in range(10))
    apart = split_share(replace(address, consumers=busy), 32 * MB)
    assert apart.queue_bytes == 32 * MB - MB - 4 * MB
    competing = replace(
        address, consumers=busy, shared_groups=(tuple(u.consumer_id for u in busy),)
    )
    assert split_share(competing, 32 * MB).queue_bytes == 0  # 40 MB held x2: all of it


def test_head_cache_shrinks_to_zero_under_consumer_demand_in_plan() -> None:
    planner = BudgetPlanner()
    greedy = tuple(c(f"c{i}", 200 * MB, 100 * MB) for i in range(4))
    plan = planner.plan([q("a", 10 * MB, consumers=greedy)], {"n1": 1 * GB})
    b = plan.queues["a"]
    assert b.share == 750 * MB
    assert b.queue_bytes == 0
    assert sum(b.direct.values()) == 750 * MB
    assert set(b.pending.values()) == {0}
    light = planner.plan([q("a", 10 * MB, consumers=(c("c0", MB, MB),))], {"n1": 1 * GB})
    assert light.queues["a"].queue_bytes == 750 * MB - 2 * MB


def test_index_bytes_count_against_the_share() -> None:
    usage = q("a", 1, index=1000, consumers=(c("c1", 500, 500),))
    b = split_share(usage, 1200)
    assert b.index_bytes == 1000
    assert b.direct == {"c1": 200}
    assert b.pending == {"c1": 0}
    assert b.queue_bytes == 0
    over = split_share(usage, 800)
    assert over.index_bytes == 800
    assert over.direct == {"c1": 0}
    assert over.queue_bytes == 0


def test_unknown_node_queues_are_absent() -> None:
    plan = BudgetPlanner().plan([q("a", 1, node="n1"), q("b", 1, node="gone")], {"n1": GB})
    assert set(plan.queues) == {"a"}


def test_to_dict_is_plain_json() -> None:
    plan = BudgetPlanner().plan([q("a", 1, consumers=(c("c1", 10, 10),))], {"n1": GB})
    d = plan.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["node_thresholds"] == {"n1": 750 * MB}
    assert d["node_totals"] == {"n1": 750 * MB}
    assert d["queues"]["a"]["direct"] == {"c1": 10}


@pytest.mark.parametrize(
    "kwargs, setting",
    [
        ({"threshold": 0}, "flow_to_disk_threshold"),
        ({"threshold": -5}, "flow_to_disk_threshold"),
        ({"threshold": 1.5}, "flow_to_disk_threshold"),
        ({"threshold": True}, "flow_to_disk_threshold"),
        ({"threshold_fraction": 0}, "threshold_fraction"),
        ({"threshold_fraction": 1.01}, "threshold_fraction"),
        ({"threshold_fraction": float("nan")}, "threshold_fraction"),
        ({"floor_fraction": -0.1}, "floor_fraction"),
        ({"floor_fraction": "0.5"}, "floor_fraction"),
    ],
)
def test_invalid_settings_raise(kwargs: dict, setting: str) -> None:
    with pytest.raises(InvalidSetting, match=setting):
        BudgetPlanner(**kwargs)


def test_invalid_usage_raises() -> None:
    with pytest.raises(InvalidSetting, match="max_size_bytes"):
        q("a", 1, max_size=1.5)  # type: ignore[arg-type]
    with pytest.raises(InvalidSetting, match="high_watermark_bytes"):
        c("c1", -1, 0)
    with pytest.raises(ValueError, match="size_bytes"):
        q("a", -1)
    with pytest.raises(ValueError, match="twice"):
        BudgetPlanner().plan([q("a", 1), q("a", 2)], {"n1": GB})
    with pytest.raises(ValueError, match="n1"):
        BudgetPlanner().node_thresholds({"n1": -1})


consumers_st = st.lists(st.tuples(st.integers(0, 10**9), st.integers(0, 10**9)), max_size=4).map(
    lambda ws: tuple(c(f"c{i}", d, p) for i, (d, p) in enumerate(ws))
)

queues_st = st.lists(
    st.tuples(
        st.integers(0, 10**12),  # size_bytes
        st.sampled_from(["n1", "n2", "n3", "dead"]),
        st.booleans(),  # active
        st.integers(0, 10**9),  # index_bytes
        st.one_of(st.just(-1), st.integers(1, 10**10)),  # max_size_bytes
        consumers_st,
    ),
    max_size=12,
).map(
    lambda rows: [
        q(f"q{i}", s, node=n, active=a, index=ix, max_size=m, consumers=cs)
        for i, (s, n, a, ix, m, cs) in enumerate(rows)
    ]
)

nodes_st = st.dictionaries(st.sampled_from(["n1", "n2", "n3"]), st.integers(0, 64 * GB), min_size=1)


@settings(max_examples=200, deadline=None)
@given(
    queues=queues_st,
    nodes=nodes_st,
    threshold=st.one_of(st.none(), st.integers(1, 200 * GB)),
    floor_fraction=st.floats(0.01, 1.0),
)
def test_property_budgets_within_thresholds_and_floors(
    queues: list[QueueUsage], nodes: dict[str, int], threshold: int | None, floor_fraction: float
) -> None:
    planner = BudgetPlanner(threshold, floor_fraction=floor_fraction)
    plan = planner.plan(queues, nodes)
    assert set(plan.node_thresholds) == set(nodes)
    for node_id, t in plan.node_thresholds.items():
        assert 0 <= t <= nodes[node_id]
        assert plan.node_total(node_id) <= t
    if threshold is not None:
        assert sum(plan.node_thresholds.values()) == min(threshold, sum(nodes.values()))
    assert set(plan.queues) == {u.name for u in queues if u.node_id in nodes}
    for u in queues:
        if u.node_id not in nodes:
            continue
        b = plan.queues[u.name]
        parts = [b.index_bytes, *b.direct.values(), *b.pending.values(), b.queue_bytes]
        assert all(isinstance(p, int) and p >= 0 for p in parts)
        assert sum(parts) <= b.share
        assert b.index_bytes == min(u.index_bytes, b.share)
        for cu in u.consumers:
            assert b.direct[cu.consumer_id] <= cu.want_direct_bytes
            assert b.pending[cu.consumer_id] <= cu.want_pending_bytes
        n = sum(1 for o in queues if o.node_id == u.node_id)
        floor = int(plan.node_thresholds[u.node_id] * floor_fraction) // n
        cap = u.max_size_bytes if u.max_size_bytes > 0 else None
        # Floors honoured (a cap below the floor wins); idle queues get exactly the floor.
        assert b.share >= (floor if cap is None else min(floor, cap)) - 1
        if cap is not None:
            assert b.share <= cap
        if not u.active:
            assert b.share <= (floor if cap is None else min(floor, cap)) + 1


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 10**12), min_size=1, max_size=8),
    store=st.integers(1, 64 * GB),
)
def test_property_active_uncapped_shares_fill_the_node(sizes: list[int], store: int) -> None:
    planner = BudgetPlanner()
    plan = planner.plan([q(f"q{i}", s) for i, s in enumerate(sizes)], {"n1": store})
    t = plan.node_thresholds["n1"]
    assert plan.node_total("n1") == t
    # Larger queues never get smaller shares than smaller ones (proportional, monotone).
    ordered = sorted(range(len(sizes)), key=lambda i: sizes[i])
    got = [plan.queues[f"q{i}"].share for i in ordered]
    assert all(a <= b + 1 for a, b in zip(got, got[1:], strict=False))


def test_queues_that_keep_up_keep_their_working_set_beside_a_huge_slow_one():
    """Artemis's slow-subscriber problem: one stopped consumer's queue grows without
    bound; the queues whose consumers keep up still get what they hold in flight."""
    mib = 2**20
    consumer = ConsumerUsage("c", 0, 0, want_direct_bytes=2 * mib, want_pending_bytes=16 * mib)
    fast = [
        QueueUsage(
            f"fast{k}", "n", 2 * mib, 2 * mib, 0, True, consumers=(consumer,), delivering=True
        )
        for k in range(3)
    ]
    slow = QueueUsage("slow", "n", 900 * mib, 30 * mib, 0, True)
    plan = BudgetPlanner(32 * mib).plan([*fast, slow], {"n": 10**9})
    for q in fast:
        assert plan.queues[q.name].share >= 6 * mib  # (2 + 2) MiB with head-room
        assert plan.queues[q.name].queue_bytes >= 2 * mib  # its messages stay in memory
    assert plan.queues["slow"].share >= 8 * mib  # the floor, and the rest
    assert plan.node_total("n") <= 32 * mib


# -- the queue actor's part: read cache, HeadQueueCache, transient messages -----------


def split_before_issue_12(
    budget: int | None, durable: bool, page_cache: int, max_size: int, default: int
) -> tuple[int, int]:
    """``QueueCore._apply_memory_limits`` as it was before the split moved here:
    (read cache, rest) in bytes. The reference the figures must stay equal to."""
    cap = max_size if max_size > 0 else None
    if budget is None:
        read, rest = page_cache, default
        if cap is not None:
            read = min(read, cap // 4)
            rest = min(rest, cap - read)
    else:
        total = budget if cap is None else min(budget, cap)
        read = min(page_cache, total // (4 if durable else 8))
        rest = total - read
    return read, rest


def test_queue_bytes_split_between_read_cache_and_head_cache_or_transient() -> None:
    kw = {"read_cache_max_bytes": 4 * MB, "max_size_bytes": -1, "default_bytes": 10 * MB}
    # Durable: a quarter to the read cache, the HeadQueueCache gets the rest.
    assert split_queue_bytes(8 * MB, durable=True, **kw) == QueueMemory(2 * MB, 6 * MB, 0)
    # Non-durable: an eighth; its messages in memory get the rest.
    assert split_queue_bytes(8 * MB, durable=False, **kw) == QueueMemory(1 * MB, 0, 7 * MB)
    # The read cache never exceeds its pages (page_max_cache_size * page_size_bytes).
    assert split_queue_bytes(100 * MB, durable=True, **kw) == QueueMemory(4 * MB, 96 * MB, 0)
    # A budget of 0 leaves nothing for anyone.
    assert split_queue_bytes(0, durable=True, **kw) == QueueMemory(0, 0, 0)
    # Before the governor speaks: the read cache's pages and the broker's default.
    assert split_queue_bytes(None, durable=True, **kw) == QueueMemory(4 * MB, 10 * MB, 0)
    # max_size_bytes caps it all, with or without a budget.
    capped = {**kw, "max_size_bytes": 4 * MB}
    assert split_queue_bytes(8 * MB, durable=True, **capped) == QueueMemory(1 * MB, 3 * MB, 0)
    assert split_queue_bytes(None, durable=False, **capped) == QueueMemory(1 * MB, 0, 3 * MB)


@settings(max_examples=300, deadline=None)
@given(
    budget=st.none() | st.integers(0, 10 * GB),
    durable=st.booleans(),
    page_cache=st.integers(1, GB),
    max_size=st.integers(-1, 10 * GB),
    default=st.integers(0, GB),
)
def test_property_queue_bytes_split_keeps_the_figures_and_the_total(
    budget: int | None, durable: bool, page_cache: int, max_size: int, default: int
) -> None:
    got = split_queue_bytes(
        budget,
        durable=durable,
        read_cache_max_bytes=page_cache,
        max_size_bytes=max_size,
        default_bytes=default,
    )
    read, rest = split_before_issue_12(budget, durable, page_cache, max_size, default)
    assert got == QueueMemory(read, rest if durable else 0, 0 if durable else rest)
    assert min(got.read_cache_bytes, got.head_cache_bytes, got.transient_bytes) >= 0
    assert got.read_cache_bytes <= page_cache
    if budget is not None:
        total = got.read_cache_bytes + got.head_cache_bytes + got.transient_bytes
        assert total == (budget if max_size <= 0 else min(budget, max_size))


@pytest.mark.parametrize("durable", [True, False])
def test_queue_core_applies_the_split_and_reports_a_typed_usage(tmp_path, durable) -> None:
    """QueueCore takes its limits from split_queue_bytes (no split of its own) and
    reports a QueueUsage that survives pickling (it travels through Ray)."""
    cfg = QueueConfig("q", durable=durable, page_size_bytes=64 * 1024, page_max_cache_size=5)
    core = QueueCore(cfg, BrokerConfig(paging_directory=str(tmp_path), head_cache_bytes=MB))
    for budget in (None, 0, 200_000, 10 * MB):
        if budget is not None:
            core.set_budget(budget)
        want = split_queue_bytes(
            budget,
            durable=durable,
            read_cache_max_bytes=5 * 64 * 1024,
            max_size_bytes=-1,
            default_bytes=MB,
            head_cache_want=MB,  # no consumers: the margin only
        )
        assert core.log._cache.limit_bytes == want.read_cache_bytes
        if durable:
            assert core.head_cache.max_bytes == want.head_cache_bytes
        else:
            assert core.log.memory_limit == want.transient_bytes
    usage = core.usage("node-1")
    assert isinstance(usage, QueueUsage)
    assert (usage.name, usage.node_id, usage.consumers) == ("q", "node-1", ())
    assert (usage.size_bytes, usage.max_size_bytes, usage.active) == (0, -1, False)
    assert pickle.loads(pickle.dumps(usage)) == usage
    assert json.loads(json.dumps(usage.to_dict())) == usage.to_dict()
    assert "consumers" not in usage.to_dict()


def test_usage_records_pickle_with_their_consumers() -> None:
    usage = q("a", 10, consumers=(c("c1", 100, 50),))
    back = pickle.loads(pickle.dumps(usage))
    assert back == usage and back.consumers[0].want_pending_bytes == 50


def test_head_cache_want_is_the_consumers_prefetch_plus_the_margin() -> None:
    assert head_cache_want([], 1024.0, 16 * MB) == 16 * MB
    assert head_cache_want([1000, 500], 1024.0, MB) == MB + 1500 * 1024
    assert head_cache_want([1000], 0.0, 0) == 1000  # a message is at least a byte


@pytest.mark.parametrize("budget", [None, 0, 10 * MB, 10**12])
def test_the_head_cache_want_bounds_only_the_head_cache(budget) -> None:
    """The want lowers the HeadQueueCache's part and nothing else: the read cache keeps
    its part, the total never grows."""
    kw = {"durable": True, "read_cache_max_bytes": 4 * MB, "max_size_bytes": -1}
    free = split_queue_bytes(budget, default_bytes=MB, **kw)
    bounded = split_queue_bytes(budget, default_bytes=MB, head_cache_want=2 * MB, **kw)
    assert bounded.read_cache_bytes == free.read_cache_bytes
    assert bounded.head_cache_bytes == min(free.head_cache_bytes, 2 * MB)
    assert bounded.transient_bytes == free.transient_bytes == 0


def test_a_consumer_budget_is_pushed_again_only_when_it_changes_or_was_not_taken():
    pushed = PushedBudgets()
    assert pushed.due("c1", (100, 10))  # never pushed
    pushed.took("c1", (100, 10))
    assert not pushed.due("c1", (100, 10))  # the same budget: not again
    assert pushed.due("c1", (90, 10)) and pushed.due("c1", (100, 0))  # changed
    assert pushed.due("c2", (100, 10))  # a push c2 did not answer is not taken
    pushed.keep_only(["c2"])  # c1 closed (or unreported this round)
    assert pushed.due("c1", (100, 10))  # seen again: pushed again
