"""``raymq bench``: run a benchmark of the source checkout's ``bench/``, on a Ray of its
own unless told to join a cluster."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import click
from click.core import ParameterSource

#: The source checkout holding ``bench/`` (when the package runs from one).
_ROOT = Path(__file__).resolve().parent.parent.parent
#: ``bench/`` modules that are not benchmarks.
_NOT_BENCHES = frozenset({"__init__", "common"})
#: Environment variable naming the cluster a benchmark joins (``bench/common.py`` reads
#: it); unset, a benchmark starts its own local Ray.
BENCH_ADDRESS_ENV = "RAYMQ_BENCH_ADDRESS"


def available_benches(root: Path = _ROOT) -> list[str]:
    """Names of the benchmarks in the source checkout's ``bench/`` (none if installed
    without one)."""
    return sorted(p.stem for p in (root / "bench").glob("*.py") if p.stem not in _NOT_BENCHES)


def bench_command(
    name: str, args: Iterable[str], address: str | None, environ: dict[str, str] | None = None
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a benchmark run: its own new local Ray unless
    ``address`` names a cluster to join. ``RAY_ADDRESS`` is left out, so neither the
    benchmark nor anything it starts joins the cluster it names by accident."""
    env = dict(os.environ if environ is None else environ)
    env.pop("RAY_ADDRESS", None)
    env.pop(BENCH_ADDRESS_ENV, None)
    if address:
        env[BENCH_ADDRESS_ENV] = address
    return [sys.executable, "-m", f"bench.{name}", *args], env


@click.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    epilog=f"Benchmarks: {', '.join(available_benches()) or 'none (no source checkout)'}.",
)
@click.argument("name")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option(
    "--address",
    "bench_address",
    help="Join this cluster (host:port, or auto) instead of starting a Ray of its own.",
)
@click.pass_context
def bench(ctx: click.Context, name: str, args: tuple[str, ...], bench_address: str | None) -> None:
    """Run benchmark NAME of the source checkout's bench/ (ARGS go to it; try -- --help).

    A benchmark starts its own local Ray and broker even when a cluster runs on this
    machine or RAY_ADDRESS is set, so it never loads a production broker by accident;
    join a cluster only by asking: raymq bench NAME --address HOST:PORT (or raymq
    --address HOST:PORT bench NAME).
    """
    benches = available_benches()
    if not benches:
        raise click.ClickException(
            f"no bench/ beside the raymq package ({_ROOT}): benchmarks run from a source checkout"
        )
    if name not in benches:
        raise click.UsageError(f"no benchmark {name!r}; there are: {', '.join(benches)}")
    parent = ctx.parent
    # `raymq --address X bench NAME` asks too; $RAY_ADDRESS and the default `auto` do not.
    if (
        bench_address is None
        and parent is not None
        and parent.get_parameter_source("address") == ParameterSource.COMMANDLINE
    ):
        bench_address = parent.params["address"]
    argv, env = bench_command(name, args, bench_address)
    done = subprocess.run(argv, cwd=_ROOT, env=env)
    if done.returncode:
        raise click.ClickException(f"bench {name} exited with status {done.returncode}")
