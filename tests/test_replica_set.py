"""Replication's decisions without disks: the epoch history's rule, the settings,
and the controller's placement and promotion (``raymq.core.controller.ReplicaSet``)."""

from __future__ import annotations

import pytest

from raymq.config import QueueConfig
from raymq.errors import InvalidSetting
from raymq.storage.mirror import end_of_epoch


def test_end_of_epoch_is_where_the_next_epoch_starts():
    history = [(1, 0), (3, 100), (4, 250)]
    assert end_of_epoch(history, 1, 400) == 100
    assert end_of_epoch(history, 2, 400) == 100
    assert end_of_epoch(history, 3, 400) == 250
    assert end_of_epoch(history, 4, 400) == 400


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"replicas": 0}, "replicas"),
        ({"replicas": 3, "min_insync_replicas": 1}, "between 2 and 3"),
        ({"replicas": 2, "min_insync_replicas": 3}, "between 2 and 2"),
        ({"replicas": 2, "durable": False}, "only durable"),
        ({"replicas": 2, "address": True}, "only durable"),
        ({"replicas": 1, "min_insync_replicas": 2}, "replicas >= it"),
    ],
)
def test_replication_settings_are_checked(kw, match):
    with pytest.raises(InvalidSetting, match=match):
        QueueConfig("q", **kw)


def test_default_quorum_is_all_of_two_and_two_of_three():
    assert QueueConfig("q", replicas=2).insync_quorum == 2
    assert QueueConfig("q", replicas=3).insync_quorum == 2
    assert QueueConfig("q", replicas=3, min_insync_replicas=3).insync_quorum == 3


# -- the controller's decisions (raymq.core.controller) ------------------------------


def test_replicas_go_to_distinct_nodes_the_leader_where_asked():
    from raymq.core.controller import NoNodes, ReplicaSet

    rs = ReplicaSet.place(3, ["a", "b", "c", "d"], {"b": 5, "c": 1}, preferred="b")
    assert rs.leader == "r0" and rs.nodes["r0"] == "b"
    assert len(set(rs.nodes.values())) == 3
    assert "d" in rs.nodes.values() and "a" in rs.nodes.values()  # the emptiest
    with pytest.raises(NoNodes):
        ReplicaSet.place(3, ["a", "b"], {})


def test_nodes_where_a_replica_was_lost_lately_come_last_and_never_lead():
    from raymq.core.controller import NoNodes, ReplicaSet

    # CI: right after a failover, a 3-replica queue on 4 alive nodes, 2 of them
    # suspect, was refused ("2 are"); it goes on the 2 others and one suspect.
    rs = ReplicaSet.place(3, ["a", "b", "c", "d"], {}, preferred="a", suspect={"a", "b"})
    assert rs.nodes["r0"] == "c"
    assert sorted(rs.nodes.values()) == ["a", "c", "d"]  # (of the suspects, the preferred)
    with pytest.raises(NoNodes, match="3 where a replica was lost lately"):
        ReplicaSet.place(3, ["a", "b", "c"], {}, suspect={"a", "b", "c"})
    with pytest.raises(NoNodes, match="; 2 are"):
        ReplicaSet.place(3, ["a", "b"], {}, suspect={"a"})


def test_a_failover_promotes_the_most_complete_in_sync_follower():
    from raymq.core.controller import ReplicaSet

    rs = ReplicaSet(4, "r0", {"r0": "a", "r1": "b", "r2": "c"}, ["r0", "r1", "r2"], 3)
    assert rs.promote({"r1": 100, "r2": 120}) == "r2"
    assert (rs.epoch, rs.leader, rs.in_sync) == (5, "r2", ["r2"])
    assert "r0" not in rs.nodes  # the lost leader leaves; a new follower replaces it
    rid = rs.add_replica(["a", "b", "c", "d"], {}, lost=("a",))
    assert rid == "r3" and rs.nodes[rid] == "d"


def test_a_follower_out_of_sync_is_never_promoted():
    from raymq.core.controller import ReplicaSet

    rs = ReplicaSet(1, "r0", {"r0": "a", "r1": "b", "r2": "c"}, ["r0", "r1"], 3)
    assert rs.promote({"r2": 500}) is None  # r2 has more, but may lack answered sends
    assert rs.epoch == 2 and rs.leader == "r0"
    assert ReplicaSet.from_dict(rs.to_dict()) == rs
