"""Failures combined (issue 31), Jepsen-style: producers and churning consumers on a
replicated queue while, one after the other, its leader is paused for 10 s and resumed,
then the (new) leader's node is removed, then a follower's disk fills.

It is ``bench/failover_soak.py`` (the same producers, consumers, ledger, watchdog and
checks: nothing acknowledged lost, nothing unknown served, nothing stuck, no stall over
60 s while a backlog waits, only typed errors, never ``InvalidAck`` for the
application's own ack) with this plan instead of a node lost every minute:

1. after ``--warm`` seconds, the leader's process is SIGSTOPped for ``--pause`` seconds
   and SIGCONTed: the controller fails over meanwhile, the old leader (fenced: it can
   acknowledge nothing) rejoins as a follower;
2. once the set is whole and in sync, the leader's node is removed and its processes
   SIGKILLed (a fresh node added first);
3. once in sync again, a follower's disk fills: each replica's copy is on a tmpfs of
   its own (``--disk-mib``), mounted before the queue is made, and a file fills the
   follower's for ``--full`` seconds, then goes.

With ``--replicas 3`` (the default) two of three replicas acknowledge, so sends go on
while the follower's disk is full; with 2 they are refused (``NotEnoughReplicas``)
until it has room again. Needs root (mount). Prints "COMBINED FAILURES OK" and exits 0
when every check holds.

    python -m bench.combined_failures [--minutes 4] [--seed 1] [--replicas 3]
        [--warm 20] [--pause 10] [--full 20] [--disk-mib 256] [--rate 400]
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import signal
import subprocess
import sys
import time

import ray
from raymq.actors.names import queue_actor_name

from bench.common import console
from bench.failover_soak import NAMESPACE, QUEUE, FailoverSoak, report

#: Replica ids given tmpfs disks before the queue exists (ids are never reused).
REPLICA_DISKS = 12


class CombinedFailures(FailoverSoak):
    """The failover soak with the plan above."""

    def __init__(self, args: argparse.Namespace):
        super().__init__(args)
        self.mounts: list[str] = []
        self.steps: list[str] = []

    def before_queue(self) -> None:
        """Each replica's copy on a tmpfs of its own, mounted before the queue exists."""
        paging = self.bench.paging
        for i in range(REPLICA_DISKS):
            path = os.path.join(paging, QUEUE, f"r{i}")
            os.makedirs(path, mode=0o700)
            options = f"size={self.args.disk_mib}m,mode=0700"
            done = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", options, "tmpfs", path],
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                raise RuntimeError(f"mounting a tmpfs at {path} failed: {done.stderr.strip()}")
            self.mounts.append(path)

    def close(self) -> None:
        try:
            super().close()
        finally:
            for path in self.mounts:
                subprocess.run(["umount", "-l", path], capture_output=True)

    def step(self, text: str) -> None:
        self.steps.append(f"{time.monotonic() - self.t0:6.1f} s  {text}")
        console.print(f"[magenta]{text}[/magenta]", soft_wrap=True)

    def failer(self, end: float) -> None:
        """The plan, then producing until ``end``; a failed step fails the run."""
        self.t0 = time.monotonic()
        try:
            time.sleep(self.args.warm)
            self.pause_leader()
            self.fail_over()
            leads = self.replica_set()["leader"]
            self.step(f"leader's node removed; in sync again ({leads} leads)")
            self.fill_a_followers_disk()
        except Exception as exc:  # noqa: BLE001 - reported, fails the run
            self.fail_problems.append(f"plan step failed: {exc!r}")
            console.print(f"[red]plan step failed[/red]: {exc!r}", soft_wrap=True)
        time.sleep(max(0.0, end - time.monotonic()))

    def pause_leader(self) -> None:
        self.wait_in_sync("before the pause")
        rid = self.replica_set()["leader"]
        leader = ray.get_actor(queue_actor_name(QUEUE), namespace=NAMESPACE)
        pid = ray.get(leader.pid.remote(), timeout=30)
        before = len(self.failover_log())
        os.kill(pid, signal.SIGSTOP)
        self.step(f"leader {rid} (pid {pid}) paused for {self.args.pause:g} s")
        try:
            time.sleep(self.args.pause)
        finally:
            with contextlib.suppress(ProcessLookupError):  # the failover ended it
                os.kill(pid, signal.SIGCONT)
        failed_over = [r for r in self.failover_log()[before:] if r["queue"] == QUEUE]
        self.step(
            f"leader {rid} resumed; failovers meanwhile: "
            f"{[(r['old_leader'], r['leader']) for r in failed_over]}"
        )
        self.wait_in_sync("after the pause")
        rs = self.replica_set()
        self.step(f"in sync again: leader {rs['leader']}, replicas {sorted(rs['nodes'])}")

    def fill_a_followers_disk(self) -> None:
        self.wait_in_sync("before the full disk")
        rs = self.replica_set()
        rid = sorted(r for r in rs["nodes"] if r != rs["leader"])[0]
        disk = next(p for p in self.mounts if os.path.basename(p) == rid)
        filler = os.path.join(disk, "filler")
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while True:
                os.write(fd, b"\0" * (1 << 20))
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
        finally:
            os.close(fd)
        self.step(f"follower {rid}'s disk full for {self.args.full:g} s")
        t = time.monotonic()
        while rid in self.replica_set()["in_sync"] and time.monotonic() - t < self.args.full:
            time.sleep(0.25)  # the pace of looking, not a wait for anything
        dropped = rid not in self.replica_set()["in_sync"]
        self.step(
            f"follower {rid} out of sync after {time.monotonic() - t:.1f} s"
            if dropped
            else f"follower {rid} still in sync (no commit reached its full disk)"
        )
        time.sleep(max(0.0, self.args.full - (time.monotonic() - t)))
        with contextlib.suppress(FileNotFoundError):
            os.remove(filler)
        self.step(f"follower {rid}'s disk has room again")
        self.wait_in_sync("after the full disk")
        self.step(f"in sync again: {sorted(self.replica_set()['in_sync'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=4.0, help="producing time")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--replicas", type=int, default=3, choices=(2, 3))
    parser.add_argument("--rate", type=float, default=400, help="messages/s, all producers")
    parser.add_argument("--max-backlog", type=int, default=5000)
    parser.add_argument("--consume-share", type=float, default=0.8)
    parser.add_argument("--drain-timeout", type=float, default=300.0, help="seconds")
    parser.add_argument("--store-mib", type=int, default=100, help="object store per node")
    parser.add_argument("--warm", type=float, default=20.0, help="seconds before the pause")
    parser.add_argument("--pause", type=float, default=10.0, help="seconds the leader pauses")
    parser.add_argument("--full", type=float, default=20.0, help="seconds the disk is full")
    parser.add_argument("--disk-mib", type=int, default=256, help="each replica's tmpfs")
    args = parser.parse_args()
    args.fail_every = "0,0"  # (unused: the plan replaces the periodic losses)
    console.width = max(console.width, 140)
    console.print(
        f"combined failures: {args.minutes:g} min, seed {args.seed}, replicas={args.replicas};"
        f" machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}"
    )
    run = CombinedFailures(args)
    ok = False
    try:
        run.start()
        out = run.run()
        ok = report(run, out)
        console.print("plan:\n" + "\n".join(run.steps))
    finally:
        run.close()
    console.print("COMBINED FAILURES OK" if ok else "[red]COMBINED FAILURES FAILED[/red]")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
