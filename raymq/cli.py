"""The ``raymq`` command: start, stop and inspect a broker; create queues; send; consume.

Every command joins a running Ray cluster (``ray start --head`` first; ``--address``
or ``$RAY_ADDRESS``, default ``auto``). Errors print as one line on stderr with exit
status 1, never a traceback.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from raymq.errors import RayMQError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4}
_BENCHES = ("throughput", "consumers", "recovery", "deep_backlog", "shares", "slow_subscriber")


class ByteSize(click.ParamType):
    """A size in bytes: ``1048576``, ``64MiB``, ``10MB``, ``1.5GiB``."""

    name = "bytes"

    def convert(self, value: Any, param, ctx) -> int:
        if isinstance(value, int):
            return value
        m = _SIZE.match(str(value))
        if not m:
            self.fail(f"{value!r} is not a size such as 1048576, 64MiB or 10MB", param, ctx)
        number, unit = float(m.group(1)), (m.group(2) or "").lower()
        base = 1024 if "i" in unit else 1000
        scale = _UNITS[unit[:1]] if base == 1000 else base ** "bkmgt".index(unit[:1] or "b")
        return int(number * scale)


BYTES = ByteSize()
console = Console()
#: Columns of a table printed to a pipe or a file: wide enough that rows are whole
#: (Rich would fit them into 80 and cut queue names short).
PIPE_WIDTH = 200


def _print_table(table: Table) -> None:
    """Print a table: as wide as the terminal, or ``PIPE_WIDTH`` when not a terminal."""
    if console.is_terminal:
        console.print(table)
    else:
        Console(width=PIPE_WIDTH).print(table)


def _connect(ctx: click.Context, create: bool = False, **settings: Any):
    import raymq

    return raymq.connect(
        address=ctx.obj["address"], namespace=ctx.obj["namespace"], create=create, **settings
    )


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--address",
    default="auto",
    envvar="RAY_ADDRESS",
    show_default=True,
    help="Ray cluster to join (host:port, or auto for the one running on this machine).",
)
@click.option(
    "--namespace",
    default="raymq",
    envvar="RAYMQ_NAMESPACE",
    show_default=True,
    help="Ray namespace of the broker; one broker per namespace.",
)
@click.pass_context
def cli(ctx: click.Context, address: str, namespace: str) -> None:
    """RayMQ: a durable message broker on Ray."""
    ctx.obj = {"address": address, "namespace": namespace}


@cli.command()
@click.option("--paging-directory", help="Where queues keep their segment files.")
@click.option("--max-message-size", type=BYTES, help="Largest message body accepted.")
@click.option("--head-cache-bytes", type=BYTES, help="HeadQueueCache per queue until budgets come.")
@click.option(
    "--flow-to-disk-threshold",
    type=BYTES,
    help="Message memory of the whole broker (default 75% of the object stores).",
)
@click.option("--housekeeping-period", type=float, help="Seconds between governor rounds.")
@click.pass_context
def start(ctx: click.Context, **settings: Any) -> None:
    """Start a broker on the running cluster (its actors outlive this command)."""
    given = {k: v for k, v in settings.items() if v is not None}
    broker = _connect(ctx, create=True, **given)
    console.print(
        f"RayMQ broker running in namespace [bold]{broker.namespace}[/bold];"
        f" paging directory {broker.config.paging_directory};"
        f" {len(broker.list_queues())} queue(s)"
    )


@cli.command()
@click.pass_context
def stop(ctx: click.Context) -> None:
    """Stop the broker's actors; every queue's files stay."""
    broker = _connect(ctx)
    queues = broker.list_queues()
    broker.shutdown()
    console.print(
        f"stopped the broker in namespace {broker.namespace}; {len(queues)} queue(s) kept"
    )


def _status(broker) -> dict[str, Any]:
    return {"queues": broker.stats(), "governor": broker.governor_stats()}


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Queues (depth, memory, disk, consumers, budget, policy) and the MemoryGovernor."""
    data = _status(_connect(ctx))
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
        return
    table = Table(title=f"queues in namespace {ctx.obj['namespace']}")
    for col in (
        "queue",
        "depth",
        "in flight",
        "memory",
        "disk",
        "files",
        "consumers",
        "budget",
        "policy",
        "blocked",
    ):
        table.add_column(col, justify="left" if col in ("queue", "policy") else "right")
    for name, s in data["queues"].items():
        policy = s["address_full_policy"]
        if s["max_size_bytes"] > 0:
            policy += f" at {_human(s['max_size_bytes'])}"
        table.add_row(
            name,
            f"{s['depth']:,}",
            f"{s['in_flight']:,}",
            _human(s["bytes_in_memory"] + s["head_cache_bytes"]),
            _human(s["bytes_on_disk"]),
            str(s["segment_files"]),
            str(s["consumers"]),
            "-" if s["memory_budget"] < 0 else _human(s["memory_budget"]),
            policy,
            str(s["blocked_producers"]) if s["blocked_producers"] else "",
        )
    _print_table(table)
    g = data["governor"]
    plan = g.get("plan") or {}
    gov = Table(title="MemoryGovernor")
    for col in ("node", "threshold", "budgeted", "queues"):
        gov.add_column(col, justify="left" if col == "node" else "right")
    for node, threshold in (plan.get("node_thresholds") or {}).items():
        on_node = [n for n, q in plan["queues"].items() if q["node_id"] == node]
        gov.add_row(
            node[:12],
            _human(threshold),
            _human(plan["node_totals"].get(node, 0)),
            ", ".join(on_node),
        )
    _print_table(gov)
    console.print(
        f"{g['rounds']} rounds, every {g['housekeeping_period']} s,"
        f" last took {g['round_seconds'] * 1e3:.0f} ms"
        + (f"; errors: {g['errors'][-1]}" if g["errors"] else "")
    )


@cli.command("create-queue")
@click.argument("name")
@click.option(
    "--durable/--transient",
    default=True,
    show_default=True,
    help="Durable messages are fsynced; transient ones live in memory.",
)
@click.option("--max-size-bytes", type=BYTES, default=-1, help="Artemis max_size_bytes.")
@click.option(
    "--page-size-bytes",
    type=BYTES,
    default=10 * 2**20,
    show_default=True,
    help="Largest segment (page) file.",
)
@click.option(
    "--address-full-policy",
    type=click.Choice(["PAGE", "DROP", "FAIL", "BLOCK"]),
    default="PAGE",
    show_default=True,
    help="What a send does at max_size_bytes.",
)
@click.option(
    "--page-max-cache-size",
    type=int,
    default=5,
    show_default=True,
    help="Segment files kept cached for reading.",
)
@click.option("--node-id", help="Node for the queue's files (default: spread).")
@click.pass_context
def create_queue(ctx: click.Context, name: str, **settings: Any) -> None:
    """Create a queue (or confirm it exists with these settings)."""
    q = _connect(ctx).create_queue(name, **settings)
    console.print(f"queue {q.name!r} ready")


def _parse_property(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise click.BadParameter(f"{text!r} is not key=value", param_hint="--property")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    if isinstance(value, list | dict):
        value = raw
    return key, value


@cli.command()
@click.argument("queue")
@click.argument("bodies", nargs=-1)
@click.option("--stdin", "from_stdin", is_flag=True, help="Send each line of stdin.")
@click.option(
    "-p",
    "--property",
    "props",
    multiple=True,
    help="key=value on every message (value as JSON if it parses).",
)
@click.option("--count", type=int, help="Send this many generated messages.")
@click.option(
    "--size", type=BYTES, default=1024, show_default=True, help="Body size of generated messages."
)
@click.option("--timeout", type=float, help="Seconds a BLOCKed send may wait.")
@click.pass_context
def send(
    ctx: click.Context,
    queue: str,
    bodies: tuple[str, ...],
    from_stdin: bool,
    props: tuple[str, ...],
    count: int | None,
    size: int,
    timeout: float | None,
) -> None:
    """Send messages: BODIES, the lines of --stdin, or --count generated ones."""
    properties = dict(_parse_property(p) for p in props) or None
    messages = [b.encode() for b in bodies]
    if from_stdin:
        messages += [line.rstrip("\n").encode() for line in sys.stdin]
    if not messages and not count:
        raise click.UsageError("nothing to send: give BODIES, --stdin or --count")
    q = _connect(ctx).get_queue(queue)
    sent = 0
    for start in range(0, len(messages), 1000):
        sent += len(q.send_batch(messages[start : start + 1000], properties, timeout=timeout))
    if count:
        from rich.progress import Progress

        with Progress(console=console, transient=True) as progress:
            task = progress.add_task(f"sending to {queue}", total=count)
            for start in range(0, count, 1000):
                n = min(1000, count - start)
                sent += len(q.send_batch([b"x" * size] * n, properties, timeout=timeout))
                progress.advance(task, n)
    wanted = len(messages) + (count or 0)
    dropped = f" ({wanted - sent} dropped by the DROP policy)" if sent < wanted else ""
    console.print(f"sent {sent} message(s) to {queue!r}{dropped}")


@cli.command()
@click.argument("queue")
@click.option("--selector", help="JMS message selector, e.g. \"color = 'red'\".")
@click.option(
    "-n",
    "--max-messages",
    type=int,
    default=10,
    show_default=True,
    help="Stop after this many messages.",
)
@click.option(
    "--timeout",
    type=float,
    default=5.0,
    show_default=True,
    help="Stop when nothing arrives for this many seconds.",
)
@click.option("--no-ack", is_flag=True, help="Do not acknowledge: they are delivered again.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per message.")
@click.pass_context
def consume(
    ctx: click.Context,
    queue: str,
    selector: str | None,
    max_messages: int,
    timeout: float,
    no_ack: bool,
    as_json: bool,
) -> None:
    """Receive (and acknowledge) messages and print them."""
    q = _connect(ctx).get_queue(queue)
    got = 0
    with q.consumer(selector=selector, prefetch=min(max(max_messages, 1), 1000)) as c:
        while got < max_messages:
            messages = c.receive(max_messages - got, timeout=timeout)
            if not messages:
                break
            for m in messages:
                body = m.body.decode("utf-8", "backslashreplace")
                if as_json:
                    click.echo(
                        json.dumps(
                            {
                                "offset": m.offset,
                                "body": body,
                                "properties": m.properties,
                                "delivery_count": m.delivery_count,
                                "timestamp": m.timestamp,
                            }
                        )
                    )
                else:
                    click.echo(f"{m.offset}\t{body}\t{json.dumps(m.properties)}")
            if no_ack:
                c.nack(messages)
            else:
                c.ack(messages)
            got += len(messages)
    if not as_json:
        console.print(f"{got} message(s) from {queue!r}", style="dim")


@cli.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("name", type=click.Choice(_BENCHES))
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(name: str, args: tuple[str, ...]) -> None:
    """Run a benchmark of the source checkout's bench/ (ARGS go to it; try -- --help).

    They start their own embedded Ray and print figures against baselines.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isfile(os.path.join(root, "bench", f"{name}.py")):
        raise click.ClickException(
            f"bench/{name}.py not found beside the raymq package ({root}):"
            " benchmarks run from a source checkout"
        )
    done = subprocess.run([sys.executable, "-m", f"bench.{name}", *args], cwd=root)
    if done.returncode:
        raise click.ClickException(f"bench {name} exited with status {done.returncode}")


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``raymq`` script; returns the exit status."""
    try:
        cli.main(args=argv, prog_name="raymq", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("raymq: aborted", err=True)
        return 1
    except click.ClickException as exc:
        click.echo(f"raymq: error: {exc.format_message()}", err=True)
        return exc.exit_code
    except (RayMQError, ConnectionError, ValueError, TypeError, LookupError) as exc:
        click.echo(f"raymq: error: {exc}", err=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
