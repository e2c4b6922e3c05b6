"""Same-time A/B of ``bench.latency``'s send -> receive at a fixed rate, between checkouts.

``bench.latency`` run in one tree and then in another compares two stretches of time:
on a shared 2-core VM whose speed drifts by up to 2x within minutes, a p99 ratio of two
such runs moved between 0.44x and 0.79x for the same code. Here every tree keeps a
broker running (its own venv, working directory and Ray; one durable queue) and the
trees take turns in short windows, A B B A A B ..., so that each samples the same
stretch of the machine's time. Each window is ``bench.latency.run_rate`` of that tree
(its producers, its consumer, default or tuned), and the figures pool every window's
messages. While one tree measures, the others idle (their Rays' own background work,
the same for every tree).

Printed per path: p50, p99, p99.9 and max of send -> receive (ms) for every tree, the
ratios of p50 and p99 to the first tree's, and the median of the per-round p99 ratios
(a round: one window of each tree, side by side in time).

    python bench/compare_latency.py A=/work/bench-A B=/work/main [--rate 1000] \
        [--window 4] [--rounds 8] [--paths default,tuned]

A tree's venv is ``TREE/.venv``; its ``bench.latency.run_rate(q, rate, seconds, tuned)``
is what runs (present since 4922517). ``--worker`` is the per-tree half (internal).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import NoReturn

import numpy as np
from compare_commits import tree_env

#: The object store each tree's Ray gets (bytes): several Rays share the machine's
#: memory, and 1 KiB messages at 1,000 msg/s need little of it.
OBJECT_STORE_BYTES = 512 * 2**20
#: Longest a tree's broker may take to start and warm up, and a window to answer,
#: beyond its own length (seconds).
START_SECONDS = 180.0
ANSWER_MARGIN_SECONDS = 120.0


def worker(rate: int) -> None:
    """Run in a tree's venv and cwd: a broker and one durable queue, then a window of
    ``run_rate`` for each ``run PATH SECONDS`` line read, answered with one ``RESULT``
    line; ``quit`` ends it."""
    sys.path.insert(0, os.getcwd())
    import ray

    import raymq
    from bench.latency import run_rate

    ray.init(
        address="local",
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=OBJECT_STORE_BYTES,
    )
    paging = tempfile.mkdtemp(prefix="raymq-lat-ab-")
    broker = raymq.connect(namespace="raymq-lat-ab", paging_directory=paging)
    try:
        q = broker.create_queue("lat-ab", durable=True)
        for tuned in (False, True):  # actors, channels and a spare TargetList up
            run_rate(q, rate, 1.0, tuned)
        print("READY", flush=True)
        for line in sys.stdin:
            words = line.split()
            if not words or words[0] == "quit":
                break
            path, seconds = words[1], float(words[2])
            _, e2e, achieved = run_rate(q, rate, seconds, path == "tuned")
            print("RESULT " + json.dumps({"e2e": e2e, "rate": achieved}), flush=True)
    finally:
        broker.shutdown()
        ray.shutdown()
        shutil.rmtree(paging, ignore_errors=True)


class Tree:
    """One tree's worker process, driven line by line."""

    def __init__(self, label: str, path: str, rate: int):
        self.label, self.path = label, path
        cmd = [
            os.path.join(path, ".venv/bin/python"),
            os.path.abspath(__file__),
            "--worker",
            f"--rate={rate}",
        ]
        env = tree_env()
        # Its stderr, shown if it fails; open for as long as the worker runs.
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd, cwd=path, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, text=True, bufsize=1,
        )  # fmt: skip
        # Its stdout, line by line (None when it ends): read in a thread, so that a
        # worker that hangs is waited for with a deadline, not for ever.
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def expect(self, prefix: str, seconds: float) -> str:
        """The rest of the worker's next line starting with ``prefix`` (other lines are
        skipped), within ``seconds``; exits with the worker's stderr if it ended first
        or did not answer in time (then it is killed)."""
        deadline = time.monotonic() + seconds
        while True:
            try:
                line = self._lines.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                self.proc.kill()
                self._fail(f"gave no {prefix.strip()} line within {seconds:g} s (killed)")
            if line is None:
                self._fail(f"ended: exit {self.proc.wait()}")
            elif line.startswith(prefix):
                return line[len(prefix) :]

    def _fail(self, why: str) -> NoReturn:
        self.log.seek(0)
        print(self.log.read()[-5000:], file=sys.stderr)
        raise SystemExit(f"{self.label} ({self.path}) {why}")

    def run(self, path: str, seconds: float) -> dict:
        """One window: ``seconds`` of ``path`` ("default" or "tuned")."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"run {path} {seconds}\n")
        self.proc.stdin.flush()
        return json.loads(self.expect("RESULT ", seconds + ANSWER_MARGIN_SECONDS))

    def close(self) -> None:
        """Stop the worker (its broker and Ray)."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


def percentiles(ms: list[float]) -> tuple[float, float, float, float]:
    """p50, p99, p99.9 and max of ``ms``."""
    a = np.asarray(ms)
    p50, p99, p999 = np.percentile(a, [50, 99, 99.9])
    return float(p50), float(p99), float(p999), float(a.max())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trees", nargs="*", help="LABEL=PATH of each checkout")
    p.add_argument("--rate", type=int, default=1000, help="messages per second")
    p.add_argument("--window", type=float, default=4.0, help="seconds of each window")
    p.add_argument("--rounds", type=int, default=8, help="windows of each tree per path")
    p.add_argument("--paths", default="default,tuned")
    p.add_argument("--worker", action="store_true")
    a = p.parse_args()
    if a.worker:
        worker(a.rate)
        return
    if len(a.trees) < 2:
        p.error("give at least two trees, LABEL=PATH each")
    paths = a.paths.split(",")
    trees: list[Tree] = []
    try:
        t0 = time.monotonic()
        # One at a time: several Rays starting at once on 2 cores time out.
        for label, path in (t.split("=", 1) for t in a.trees):
            trees.append(Tree(label, path, a.rate))
            trees[-1].expect("READY", START_SECONDS)
            print(f"{label} ready ({time.monotonic() - t0:.0f} s)", flush=True)
        e2e = {(t.label, path): [] for t in trees for path in paths}
        p99s = {(t.label, path): [] for t in trees for path in paths}
        for r in range(a.rounds):
            for path in paths:
                # The tree that goes first alternates: A B, B A, ...
                for tree in trees if r % 2 == 0 else trees[::-1]:
                    got = tree.run(path, a.window)
                    e2e[tree.label, path] += got["e2e"]
                    p99s[tree.label, path].append(percentiles(got["e2e"])[1])
            line = "  ".join(
                f"{t.label} {path} p99 {p99s[t.label, path][-1]:.2f}"
                for path in paths
                for t in trees
            )
            print(f"round {r + 1}/{a.rounds} ({time.monotonic() - t0:.0f} s): {line}", flush=True)
    finally:
        for tree in trees:
            tree.close()
    first = trees[0].label
    print(
        f"send -> receive at {a.rate} msg/s, {a.rounds} windows of {a.window:g} s each "
        f"(ms: p50, p99, p99.9, max; ratios to {first})"
    )
    for path in paths:
        base = percentiles(e2e[first, path])
        for t in trees:
            f = percentiles(e2e[t.label, path])
            row = f"{path:<8} {t.label:<10} n={len(e2e[t.label, path]):<7}" + "".join(
                f" {v:8.2f}" for v in f
            )
            if t.label != first:
                per_round = np.median(
                    np.asarray(p99s[t.label, path]) / np.asarray(p99s[first, path])
                )
                row += (
                    f"   p50 {f[0] / base[0]:.2f}x  p99 {f[1] / base[1]:.2f}x"
                    f"  (median of the rounds' p99 ratios {per_round:.2f}x)"
                )
            print(row)


if __name__ == "__main__":
    main()
