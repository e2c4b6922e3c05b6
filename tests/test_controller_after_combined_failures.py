"""The replication controller after failures combined, on the fake cluster of
``tests/test_replication_controller.py``: what the simulator's replicated mode found
left a queue unavailable for good though a copy held every acknowledged send (an
in-sync follower replaced while silent, a fenced leader never started again, a
hand-over to a replica lost before it led)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from raymq.core.cluster_ops import Unreachable
from raymq.core.replication_controller import LOST_NODE_SECONDS
from raymq.errors import BrokerUnavailable
from tests.test_replication_controller import QUEUE, Fault, Gone, _created


def test_a_silent_follower_still_in_sync_is_kept_for_the_failover_that_needs_it():
    """Found by the replicated simulator: the leader's node lost while its one in-sync
    follower restarts. Replaced after two silent rounds, that follower took with it the
    only copy a failover could promote: the queue stayed unavailable for good. Kept,
    it is promoted once it answers, with every acknowledged message."""

    async def main():
        s = await _created()
        rs = s.controller.queues[QUEUE].replicas
        s.cluster.kill_node(rs.nodes["r2"])
        s.cluster.write(QUEUE, 5)  # r2 leaves the in-sync set; r1 holds everything
        r1 = s.cluster.follower_of(QUEUE, "r1")
        s.cluster.pause(r1)  # restarting: silent
        s.cluster.kill_node(rs.leader_node)
        for _ in range(3):  # the monitor's loop logs what a round raises
            with contextlib.suppress(BrokerUnavailable):
                await s.controller.monitor_once(QUEUE)
        assert "r1" in rs.nodes and "r1" in rs.in_sync
        r1.paused = False
        s.clock.advance(LOST_NODE_SECONDS)
        for _ in range(3):
            with contextlib.suppress(BrokerUnavailable):
                await s.controller.monitor_once(QUEUE)
        assert rs.leader == "r1"
        assert s.cluster.copies[(QUEUE, "r1")] >= s.cluster.acked[QUEUE]

    asyncio.run(main())


@pytest.mark.parametrize("followers", ["silent", "out of sync"])
def test_a_fenced_leader_that_answers_starts_again_when_no_follower_can_be_promoted(followers):
    """Found by the replicated simulator: a failover that promoted no one fenced the
    leader (it was only slow); its in-sync followers then went silent, or none was in
    sync. Left fenced, it kept the queue unavailable for good though it held every
    acknowledged send; it starts again in place, in the next epoch."""

    async def main():
        s = await _created()
        rs = s.controller.queues[QUEUE].replicas
        old = s.cluster.leader_of(QUEUE)
        old.fenced = True
        if followers == "silent":
            for rid in rs.followers:
                s.cluster.pause(s.cluster.follower_of(QUEUE, rid))
        else:
            rs.in_sync = [rs.leader]  # as its last report said
        await s.controller.check_leader(QUEUE)
        new = s.cluster.leader_of(QUEUE)
        assert new is not old and old.ended
        assert (new.rid, new.begun, new.fenced, new.epoch) == ("r0", True, False, rs.epoch)
        assert not s.cluster.violations

    asyncio.run(main())


def test_a_hand_over_whose_promoted_replica_is_lost_before_it_leads_fails_over_again():
    """Found by the replicated simulator: the promoted follower's node was lost before
    its leader started, and every later check resumed the hand-over to it, for ever.
    It never led, so the other follower in sync before holds every acknowledged send:
    it is promoted instead."""

    async def main():
        s = await _created()
        rs = s.controller.queues[QUEUE].replicas
        s.cluster.kill_node(rs.leader_node)
        s.cluster.fail_next("leader_ready")  # the promoted one does not start yet
        with contextlib.suppress(Fault):
            await s.controller.check_leader(QUEUE)
        promoted = rs.leader
        other = next(r for r in ("r1", "r2") if r != promoted)
        s.cluster.kill_node(rs.nodes[promoted])
        for _ in range(2):
            with contextlib.suppress(BrokerUnavailable, Unreachable, Gone):
                await s.controller.check_leader(QUEUE)
        assert rs.leader == other
        leader = s.cluster.leader_of(QUEUE)
        assert leader.rid == other and leader.begun and s.cluster.reachable(leader)
        assert s.cluster.copies[(QUEUE, other)] >= s.cluster.acked[QUEUE]
        assert not s.cluster.violations

    asyncio.run(main())
