"""``python -m raymq.sim``: run seeds of the fault simulator, print what they found.

python -m raymq.sim --seeds 1000                 # seeds 0..999, on every core
python -m raymq.sim --seeds 300 --mode address   # the first 300 seeds that run an address
python -m raymq.sim --seed 42 -v                 # replay one seed, step by step
python -m raymq.sim --seeds 10000 --mode replicated   # a replicated queue, 10,000 seeds
"""

from __future__ import annotations

import argparse
import multiprocessing
import signal
import sys
import time
import traceback

from raymq.sim.replicated import run_replicated_seed
from raymq.sim.run import Violation, is_address_seed, repro_command, run_seed

#: Wall-clock seconds one seed may take (a loop that never ends is a wedge too).
SEED_BOUND = 300


class _SeedTookTooLong(Exception):
    pass


def _alarm(_signum, _frame):
    raise _SeedTookTooLong(f"the seed ran past {SEED_BOUND} s (a wedge)")


def _runner(mode: str):
    """The function that runs one seed of ``mode``."""
    return run_replicated_seed if mode == "replicated" else run_seed


def _one(args: tuple[int, int, str]) -> tuple[int, dict | None, str]:
    seed, steps, mode = args
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(SEED_BOUND)
    try:
        return seed, _runner(mode)(seed, steps), ""
    except Violation as exc:
        return seed, None, str(exc)
    except Exception:  # a crash of the simulated queue is a finding too
        return seed, None, traceback.format_exc()
    finally:
        signal.alarm(0)


def main(argv: list[str] | None = None) -> int:
    """Run the seeds asked for; exit status 1 if any broke an invariant."""
    parser = argparse.ArgumentParser(prog="python -m raymq.sim", description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=100, help="run seeds FIRST..FIRST+N-1")
    parser.add_argument(
        "--mode",
        choices=("any", "queue", "address", "replicated"),
        default="any",
        help="run only seeds of this mode: the first N of it from FIRST on (replicated:"
        " a replicated queue on four simulated nodes, every seed)",
    )
    parser.add_argument("--first", type=int, default=0, help="the first seed")
    parser.add_argument("--seed", type=int, help="run only this seed")
    parser.add_argument("--steps", type=int, default=300, help="operations per seed")
    parser.add_argument("--jobs", type=int, default=multiprocessing.cpu_count())
    parser.add_argument("-v", "--verbose", action="store_true", help="print every step")
    args = parser.parse_args(argv)
    if args.seed is not None:
        try:
            summary = _runner(args.mode)(args.seed, args.steps, verbose=args.verbose)
        except Violation as exc:
            print(f"VIOLATION {exc}")
            return 1
        print(f"seed {args.seed}: ok {summary}")
        return 0
    seeds = _seeds(args.first, args.seeds, args.mode)
    started = time.monotonic()
    failed: list[int] = []
    totals: dict[str, int] = {}
    with multiprocessing.Pool(args.jobs, maxtasksperchild=100) as pool:
        for done, (seed, summary, error) in enumerate(
            pool.imap_unordered(_one, [(s, args.steps, args.mode) for s in seeds]), 1
        ):
            if summary is None:
                failed.append(seed)
                print(f"seed {seed} FAILED: {error}")
                print(f"  reproduce: {repro_command(seed, args.steps, args.mode)}")
            else:
                for k, v in summary.items():
                    totals[k] = totals.get(k, 0) + v
            if done % 100 == 0 or done == len(seeds):
                print(
                    f"{done}/{len(seeds)} seeds, {len(failed)} failed, "
                    f"{time.monotonic() - started:.0f} s",
                    flush=True,
                )
    print("totals:", ", ".join(f"{k}={v:,}" for k, v in sorted(totals.items())))
    if failed:
        print(f"{len(failed)} of {len(seeds)} seeds broke an invariant: {sorted(failed)[:20]}")
        return 1
    print(f"all {len(seeds)} seeds held every invariant")
    return 0


def _seeds(first: int, n: int, mode: str) -> list[int]:
    """``n`` seeds from ``first`` on: every one, or only those of ``mode``."""
    if mode in ("any", "replicated"):
        return list(range(first, first + n))
    out, seed = [], first
    while len(out) < n:
        if is_address_seed(seed) == (mode == "address"):
            out.append(seed)
        seed += 1
    return out


if __name__ == "__main__":
    sys.exit(main())
