"""The simulator's replicated mode (``python -m raymq.sim --mode replicated``, issue
31): fixed seeds run here, every invariant checked; ``make fuzz-replicated SEEDS=N``
runs many more. And the simulator's own test: a replication that breaks a promise
(a leader that does not wait for its followers, a controller that promotes a copy
out of sync, a follower whose fence is not durable) breaks an invariant in a seed."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest

from raymq.core import replication
from raymq.core.controller import ReplicaSet
from raymq.sim.model import Violation
from raymq.sim.replicated import run_replicated_seed
from raymq.sim.run import repro_command
from raymq.storage.mirror import ReplicaFiles

#: Chosen to cover what the mode draws: crashes of leaders and followers, failovers,
#: paused leaders (their kill lost too), lost nodes, failing and full follower disks.
FIXED_SEEDS = list(range(10))


@functools.cache
def _run(seed: int) -> dict:
    return run_replicated_seed(seed, steps=300)


@pytest.mark.parametrize("seed", FIXED_SEEDS)
def test_a_fixed_replicated_seed_holds_every_invariant(seed):
    try:
        summary = _run(seed)
    except Violation as exc:
        pytest.fail(f"{exc}\nreproduce: {repro_command(seed, 300, 'replicated')}")
    assert summary["acknowledged"] > 0 and summary["served"] > 0


def test_the_fixed_replicated_seeds_fail_over_crash_pause_and_lose_nodes():
    """The fixed seeds exercise what they are meant to (else they prove little)."""
    totals: dict[str, int] = {}
    for seed in FIXED_SEEDS:
        for k, v in _run(seed).items():
            totals[k] = totals.get(k, 0) + v
    for what in ("failovers", "crashes", "pauses", "kills_lost", "lost_nodes"):
        assert totals[what] > 0, what
    assert totals["injected_errors"] > 0 and totals["refused"] > 0
    assert totals["consumer_acks"] > 0 and totals["quiet_points"] >= 4 * len(FIXED_SEEDS)


def _breaks(seeds: list[int]) -> list[str]:
    found = []
    for seed in seeds:
        try:
            run_replicated_seed(seed, steps=300)
        except Violation as exc:
            found.append(str(exc))
    return found


def test_the_simulator_finds_a_leader_that_does_not_wait_for_its_followers(monkeypatch):
    async def finish(self, round):  # answered before any follower has the commit
        for fut in round.calls:
            fut.add_done_callback(lambda f: None if f.cancelled() else f.exception())

    monkeypatch.setattr(replication.ReplicationLeader, "finish", finish)
    found = _breaks([0, 1])
    assert any("acknowledged messages lost" in f or "acknowledged for message" in f for f in found)


def test_the_simulator_finds_a_controller_that_promotes_a_copy_out_of_sync(monkeypatch):
    def promote(self, ends):  # the least complete follower that answered, in sync or not
        self.epoch += 1
        candidates = [r for r in ends if r != self.leader and r in self.nodes]
        if not candidates:
            return None
        new = min(candidates, key=lambda r: (ends[r], r))
        self.remove_replica(self.leader)
        self.leader, self.in_sync = new, [new]
        return new

    monkeypatch.setattr(ReplicaSet, "promote", promote)
    found = _breaks([3, 8])
    assert any("acknowledged messages lost" in f or "acknowledged for message" in f for f in found)


def test_the_simulator_finds_a_follower_whose_fence_is_not_durable(monkeypatch):
    monkeypatch.setattr(ReplicaFiles, "write_fence", lambda self, epoch: None)
    found = _breaks([1, 4])
    assert any("after a crash it knows only epoch" in f for f in found)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_make_fuzz_replicated_and_its_replay_command_run_as_the_readme_says():
    fuzz = subprocess.run(
        ["make", "-s", "fuzz-replicated", "SEEDS=2", "FIRST=40"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert fuzz.returncode == 0, fuzz.stdout[-2000:] + fuzz.stderr[-2000:]
    assert "all 2 seeds held every invariant" in fuzz.stdout
    replay = repro_command(41, 60, "replicated").split()
    assert replay[1:3] == ["-m", "raymq.sim"] and "replicated" in replay
    one = subprocess.run(
        [sys.executable, *replay[1:]], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-2000:]
    assert "seed 41: ok" in one.stdout and "step 59:" in one.stdout
