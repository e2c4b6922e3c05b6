"""Same-run A/B of ``bench.throughput``'s RayMQ cases between two checkouts.

Each round runs every tree once, the first tree of a round alternating (A B, B A, ...:
the first run of a round is favoured), each in a fresh process with
that tree's own venv and working directory and a Ray of its own; the figures are the
RayMQ rates of ``bench.throughput`` (its ray.util.queue baseline is skipped). It also
reports the CPU seconds the queue actor and the client process used per case.

    python bench/compare_commits.py A=/tmp/base-1dcee2e B=/work/main --rounds 2 \
        [--cases durable,memory] [--parts batched,single] [--messages 200000] [--single 50000] \
        [--setting LABEL:NAME=INT ...]

``--setting B:head_cache_bytes=2147483648`` passes a broker setting to ``raymq.connect``
in tree B's runs only; one checkout may be given twice under two labels, with and
without a setting (what a default costs, measured in the same run).

A tree's venv is ``TREE/.venv``. ``--worker`` is the per-process half (internal).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_of(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (0 if gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS
    except OSError:
        return 0.0


def _processes() -> list[tuple[int, int, bytes]]:
    """(pid, parent pid, command line) of every process."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        out.append((int(entry), ppid, cmd))
    return out


def _my_queue_actors() -> list[int]:
    """PIDs of the queue actors of the Ray this process started (workers are children
    of its raylet, itself a child of this process): other Rays on the machine are not
    counted."""
    procs = _processes()
    raylets = {p for p, pp, cmd in procs if pp == os.getpid() and b"raylet" in cmd}
    return [p for p, pp, cmd in procs if pp in raylets and cmd.startswith(b"ray::QueueActor")]


def worker(cases: list[str], parts: list[str], messages: int, single: int, settings: dict) -> dict:
    """Run in a tree's venv and cwd: the RayMQ cases of bench.throughput."""
    sys.path.insert(0, os.getcwd())
    import ray
    from raymq.placement import spares

    import raymq
    from bench.common import timed
    from bench.throughput import BATCH, BODY, in_threads

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    paging = tempfile.mkdtemp(prefix="raymq-ab-")
    broker = raymq.connect(namespace="raymq-ab", paging_directory=paging, **settings)
    before = set(_my_queue_actors())
    out: dict[str, dict] = {}
    try:
        for case in cases:
            durable = case == "durable"
            name = f"ab-{case}"
            q = broker.create_queue(name, durable=durable)
            q.send(b"warm")  # the actor and its send channel up
            qpids = [p for p in _my_queue_actors() if p not in before]
            n = messages - messages % (4 * BATCH)
            bodies = [BODY] * BATCH

            def run(label, fn, case=case, qpids=qpids):
                cpu_q = sum(_cpu_of(p) for p in qpids)
                cpu_c = time.process_time()
                _, rate = timed(fn)
                out[f"{case} {label}"] = {
                    "rate": rate,
                    "actor_cpu": sum(_cpu_of(p) for p in qpids) - cpu_q,
                    "client_cpu": time.process_time() - cpu_c,
                }

            if "batched" in parts:

                def produce(count, q=q, bodies=bodies):
                    for _ in range(count // BATCH):
                        q.send_batch(bodies)

                run("batched produce", lambda produce=produce, n=n: in_threads(4, n, produce))
                with q.consumer(prefetch=10 * BATCH) as c:
                    spares.wait_warm(timeout=30)
                    c.receive_batch(1, timeout=10)  # the warm message
                    c.flush()

                    def consume(c=c, n=n):
                        got = 0
                        while got < n:
                            b = c.receive_batch(BATCH, timeout=10)
                            if b.num_rows == 0:
                                raise RuntimeError(f"stalled after {got}")
                            c.ack(b, wait=False)
                            got += b.num_rows
                        c.flush()
                        return got

                    run("batched consume", consume)
            if "single" in parts:

                def one(count, q=q):
                    for _ in range(count):
                        q.send(BODY)

                run("single produce", lambda one=one: in_threads(8, single, one))
                with q.consumer(prefetch=1000) as c:
                    spares.wait_warm(timeout=30)

                    def consume_one(c=c, n=single):
                        got = 0
                        while got < n:
                            m = c.receive(1, timeout=10)
                            if not m:
                                raise RuntimeError(f"stalled after {got}")
                            c.ack(m)
                            got += len(m)
                        c.flush()
                        return got

                    run("single consume", consume_one)
            broker.delete_queue(name)
    finally:
        broker.shutdown()
        ray.shutdown()
        import shutil

        shutil.rmtree(paging, ignore_errors=True)
    return out


def _setting(text: str) -> tuple[str, int]:
    """``NAME=INT`` as (name, value)."""
    name, _, value = text.partition("=")
    return name, int(value)


def tree_env() -> dict[str, str]:
    """The environment of a tree's worker: this one's, less what would point it at
    another Ray (``RAY_ADDRESS``) or another tree's code (``PYTHONPATH``)."""
    return {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trees", nargs="*", help="LABEL=PATH of each checkout")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--cases", default="durable,memory")
    p.add_argument("--parts", default="batched,single")
    p.add_argument("--messages", type=int, default=200_000)
    # 16,000 single sends were ~2 s, the first of them warming up: the runs' spread
    # hid a 5 % difference (50,000: ~6 s at 8,000 msg/s).
    p.add_argument("--single", type=int, default=50_000, help="messages per single-send run")
    p.add_argument(
        "--setting",
        action="append",
        default=[],
        metavar="LABEL:NAME=INT",
        help="a broker setting (an int) for one tree's runs",
    )
    p.add_argument("--worker", action="store_true")
    p.add_argument("--json", help="also write every run's figures here")
    a = p.parse_args()
    cases, parts = a.cases.split(","), a.parts.split(",")
    if a.worker:
        settings = dict(_setting(s) for s in a.setting)
        result = worker(cases, parts, a.messages, a.single, settings)
        print("RESULT " + json.dumps(result), flush=True)
        return
    trees = [t.split("=", 1) for t in a.trees]
    runs: dict[str, list[dict]] = {label: [] for label, _ in trees}
    for r in range(a.rounds):
        # Which tree starts a round alternates too: the first run of a round was
        # measured up to ~25 % faster at memory consume, whichever tree it was.
        for label, path in trees if r % 2 == 0 else trees[::-1]:
            cmd = [
                os.path.join(path, ".venv/bin/python"),
                os.path.abspath(__file__),
                "--worker",
                f"--cases={a.cases}",
                f"--parts={a.parts}",
                f"--messages={a.messages}",
                f"--single={a.single}",
                *(
                    f"--setting={s.split(':', 1)[1]}"
                    for s in a.setting
                    if s.split(":", 1)[0] == label
                ),
            ]
            env = tree_env()
            t0 = time.monotonic()
            proc = subprocess.run(cmd, cwd=path, env=env, capture_output=True, text=True)
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not line:
                print(proc.stdout[-3000:], proc.stderr[-5000:], file=sys.stderr)
                raise SystemExit(f"{label} failed in round {r}")
            res = json.loads(line[0][7:])
            runs[label].append(res)
            figures = "  ".join(f"{k}={v['rate']:,.0f}" for k, v in res.items())
            print(f"round {r} {label} ({time.monotonic() - t0:.0f} s): {figures}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(runs, f, indent=1)
    labels = [label for label, _ in trees]
    keys = list(runs[labels[0]][0])
    print(f"median msg/s (each run); ratio to {labels[0]}; CPU µs per message (medians)")
    for k in keys:
        meds = {lb: statistics.median(x[k]["rate"] for x in runs[lb]) for lb in labels}
        row = f"{k:<26}"
        for lb in labels:
            rates = ", ".join(f"{x[k]['rate'] / 1000:.1f}k" for x in runs[lb])
            row += f"  {meds[lb]:>8,.0f} ({rates})"
        for lb in labels[1:]:
            row += f"  {lb}/{labels[0]} {meds[lb] / meds[labels[0]]:.2f}"
        for lb in labels:
            n = a.single if "single" in k else a.messages - a.messages % 4000
            aq = statistics.median(x[k]["actor_cpu"] for x in runs[lb]) / n * 1e6
            cl = statistics.median(x[k]["client_cpu"] for x in runs[lb]) / n * 1e6
            row += f"  {lb}: actor {aq:.1f} client {cl:.1f}"
        print(row)


if __name__ == "__main__":
    main()
