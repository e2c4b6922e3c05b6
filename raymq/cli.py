"""The ``raymq`` command: start, stop and inspect a broker; create queues, addresses and
their subscriptions, and delete addresses and subscriptions; send; consume.

Every command joins a running Ray cluster (``ray start --head`` first; ``--address``
or ``$RAY_ADDRESS``, default ``auto``: the cluster running on this machine), except
``raymq bench``, which starts its own. Ray's log lines stay out of the output.

Exit status: 0 on success; 1 on an error, printed as one line on stderr
(``raymq: error: ...``, naming the queue or setting involved), never a traceback; 2 on a
usage error (a wrong option or argument), as click does.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource
from rich.console import Console
from rich.table import Table

from raymq._cli_ray import join_ray
from raymq.errors import (
    AddressFull,
    BrokerUnavailable,
    QueueNotFound,
    RayMQError,
    SubscriptionNotFound,
)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4}
#: The source checkout holding ``bench/`` (when the package runs from one).
_ROOT = Path(__file__).resolve().parent.parent
#: ``bench/`` modules that are not benchmarks.
_NOT_BENCHES = frozenset({"__init__", "common"})
#: Environment variable naming the cluster a benchmark joins (``bench/common.py`` reads
#: it); unset, a benchmark starts its own local Ray.
BENCH_ADDRESS_ENV = "RAYMQ_BENCH_ADDRESS"
#: Messages per ``send_batch`` of ``raymq send`` unless ``--batch-size`` says otherwise.
DEFAULT_BATCH_SIZE = 1000
#: Seconds each receive of ``raymq consume`` waits before it asks whether anything is
#: left for it (``Consumer.backlog``): an empty receive with no backlog ends the command.
CONSUME_POLL_SECONDS = 0.5
#: How far ``raymq consume`` looks for the property names a selector uses: at most this
#: many messages from the head of the queue, browsed this many per call (a bound on the
#: bodies one call brings back). Checking a huge queue whole would cost more than the
#: consume itself; the first messages show the usual case (a value written unquoted).
SELECTOR_CHECK_MESSAGES = 10_000
SELECTOR_CHECK_BATCH = 200
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

EXIT_STATUS_HELP = (
    "Exit status: 0 on success; 1 on an error (one line on stderr, naming the queue or"
    " setting involved); 2 on a usage error (a wrong option or argument)."
)


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
#: Progress bars: on stderr, so that stdout carries only the command's output.
err_console = Console(stderr=True)
#: Columns of a table printed to a pipe or a file: wide enough that rows are whole
#: (Rich would fit them into 80 and cut queue names short).
PIPE_WIDTH = 200
#: Set by ``--verbose``: Ray's log lines pass, and an error prints its traceback too.
_verbose = False


def _print_table(table: Table) -> None:
    """Print a table: as wide as the terminal, or ``PIPE_WIDTH`` when not a terminal."""
    if console.is_terminal:
        console.print(table)
    else:
        Console(width=PIPE_WIDTH).print(table)


def _say(text: str, **style: Any) -> None:
    """Print one message on stdout, unwrapped (a pipe gets it as one line) and taken
    literally (a queue name or path with brackets is not Rich markup)."""
    console.print(text, soft_wrap=True, markup=False, highlight=False, **style)


def _warn(text: str) -> None:
    click.echo(f"raymq: warning: {text}", err=True)


def _connect(ctx: click.Context, create: bool = False, **settings: Any):
    """Join Ray (quickly and quietly, see ``raymq._cli_ray``) and the broker."""
    import raymq

    join_ray(ctx.obj["address"], ctx.obj["namespace"], verbose=ctx.obj["verbose"])
    return raymq.connect(
        address=ctx.obj["address"], namespace=ctx.obj["namespace"], create=create, **settings
    )


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog=EXIT_STATUS_HELP)
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
@click.option(
    "-v", "--verbose", is_flag=True, help="Show Ray's own log lines, and a traceback on errors."
)
@click.pass_context
def cli(ctx: click.Context, address: str, namespace: str, verbose: bool) -> None:
    """RayMQ: a durable message broker on Ray."""
    global _verbose
    _verbose = verbose
    ctx.obj = {"address": address, "namespace": namespace, "verbose": verbose}


# -- start and stop ---------------------------------------------------------------------

#: ``raymq start`` options that are byte sizes and seconds (for showing differences).
_BYTE_SETTINGS = frozenset({"max_message_size", "head_cache_bytes", "flow_to_disk_threshold"})
_SECOND_SETTINGS = frozenset(
    {"checkpoint_interval", "housekeeping_period", "hibernate_after_seconds"}
)


def _setting_text(name: str, value: Any) -> str:
    if value is None:
        return "default"
    if name in _BYTE_SETTINGS:
        return f"{_human(value)} ({value:,} bytes)"
    if name in _SECOND_SETTINGS:
        return f"{value:g} s"
    return str(value)


def setting_differences(running: Any, asked: dict[str, Any]) -> list[str]:
    """``name: running -> asked`` for each asked setting the running broker's config
    (a ``BrokerConfig``) has with another value, in the order asked."""
    out = []
    for name, value in asked.items():
        current = getattr(running, name)
        if current != value:
            out.append(f"{name}: {_setting_text(name, current)} -> {_setting_text(name, value)}")
    return out


def _counts(broker) -> str:
    """``N queue(s)``, and ``, M address(es)`` when the broker has any."""
    addresses = len(broker.list_addresses())
    return f"{len(broker.list_queues())} queue(s)" + (
        f", {addresses} address(es)" if addresses else ""
    )


def _running_broker(ctx: click.Context):
    """The broker running in the namespace, or None."""
    try:
        return _connect(ctx)
    except BrokerUnavailable:
        import ray

        if not ray.is_initialized():  # Ray itself is missing: say that, not "no broker"
            raise
        return None


def _refuse_changes(ctx: click.Context, broker, asked: dict[str, Any]) -> None:
    """Raise a one-line error if ``asked`` differs from the running ``broker``'s settings."""
    diffs = setting_differences(broker.config, asked)
    if diffs:
        raise click.ClickException(
            f"the broker in namespace {ctx.obj['namespace']!r} runs with other settings"
            f" ({'; '.join(diffs)}); settings apply when a broker starts: `raymq stop` first"
            " (queues and their files are kept), then `raymq start` with the new settings"
        )


@cli.command()
@click.option(
    "--paging-directory",
    type=click.Path(file_okay=False),
    help="Where queues keep their segment files (made absolute here).",
)
@click.option("--max-message-size", type=BYTES, help="Largest message, bytes (e.g. 100MiB).")
@click.option(
    "--head-cache-bytes",
    type=BYTES,
    help="HeadQueueCache per queue beyond its consumers' prefetch (all until budgets come), bytes.",
)
@click.option(
    "--flow-to-disk-threshold",
    type=BYTES,
    help="Message memory of the whole broker, bytes (default 75% of the object stores).",
)
@click.option(
    "--checkpoint-interval",
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds between checkpoints of each queue's index and acks.",
)
@click.option(
    "--housekeeping-period",
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds between MemoryGovernor rounds.",
)
@click.option(
    "--max-active-queues",
    type=click.IntRange(min=1),
    help="Running queue actors per node; idle ones over it hibernate (default: no cap).",
)
@click.option(
    "--hibernate-after-seconds",
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds a queue may stay idle before it hibernates (default: never).",
)
@click.pass_context
def start(ctx: click.Context, **settings: Any) -> None:
    """Start a broker on the running cluster (its actors outlive this command).

    With a broker already running in the namespace, it says so; settings that differ
    from the running ones are an error (stop the broker first to change them).
    """
    asked = {k: v for k, v in settings.items() if v is not None}
    if "paging_directory" in asked:  # relative to here, not to the queue actors' cwd
        asked["paging_directory"] = os.path.abspath(os.path.expanduser(asked["paging_directory"]))
    from raymq.config import BrokerConfig
    from raymq.errors import InvalidSetting

    BrokerConfig.from_kwargs(**asked)  # a bad value is reported as such, before Ray
    broker = _running_broker(ctx)
    started = broker is None
    if broker is not None:
        _refuse_changes(ctx, broker, asked)
    else:
        try:
            broker = _connect(ctx, create=True, **asked)
        except InvalidSetting:  # another `raymq start` won the race
            running = _running_broker(ctx)
            if running is None:
                raise
            _refuse_changes(ctx, running, asked)
            broker, started = running, False
    _say(
        f"RayMQ broker {'started' if started else 'already running'} in namespace"
        f" {broker.namespace}; paging directory {broker.config.paging_directory};"
        f" {_counts(broker)}"
    )
    from raymq.auth import check_token_auth

    auth = check_token_auth()
    if auth.permissions_fixed:
        _say(f"made {auth.token_path or 'the Ray token file'} readable by its owner only (0600)")
    if auth.warning:
        _warn(auth.warning)


@cli.command()
@click.pass_context
def stop(ctx: click.Context) -> None:
    """Stop the broker's actors; every queue's and address's files stay."""
    broker = _connect(ctx)
    kept = _counts(broker)
    broker.shutdown()
    _say(f"stopped the broker in namespace {broker.namespace}; {kept} kept")


# -- status -----------------------------------------------------------------------------

MEMORY_NOTE = (
    "head cache: undelivered messages of a durable queue kept in memory; read cache:"
    " segment records read back from disk; the two can share buffers (a head-cache refill"
    " reads through the read cache), so they are shown apart, not added up. transient:"
    " messages of a non-durable queue in memory. budget: the MemoryGovernor's share for"
    " the queue's caches."
)


def metrics_urls(nodes: Iterable[dict]) -> list[str]:
    """``http://IP:PORT/metrics`` of each alive node's Prometheus endpoint, from
    ``ray.nodes()`` entries (``NodeManagerAddress``, ``MetricsExportPort``)."""
    urls = []
    for n in nodes:
        port = n.get("MetricsExportPort")
        if n.get("Alive", True) and port and n.get("NodeManagerAddress"):
            host = n["NodeManagerAddress"]
            host = f"[{host}]" if ":" in host else host
            urls.append(f"http://{host}:{port}/metrics")
    return sorted(set(urls))


def dead_letter_sources(queues: dict[str, dict]) -> dict[str, list[str]]:
    """For each existing queue that is another queue's dead-letter queue, the queues
    that send their dead letters to it (from ``dead_letter_queue`` in their stats)."""
    out: dict[str, list[str]] = {}
    for name, s in queues.items():
        dlq = s.get("dead_letter_queue")
        if dlq and dlq != name and dlq in queues:
            out.setdefault(dlq, []).append(name)
    return out


def queue_order(queues: dict[str, dict]) -> list[str]:
    """Queue names sorted, each followed by its dead-letter queue (and that one's)."""
    sources = dead_letter_sources(queues)
    dlqs_of: dict[str, list[str]] = {}
    for dlq, srcs in sources.items():
        dlqs_of.setdefault(min(srcs), []).append(dlq)  # shared DLQ: beside the first
    order: list[str] = []

    def emit(name: str) -> None:
        if name in order:
            return
        order.append(name)
        for dlq in sorted(dlqs_of.get(name, ())):
            emit(dlq)

    for name in sorted(queues):
        if name not in sources:
            emit(name)
    for name in sorted(queues):  # DLQs in a cycle of DLQs
        emit(name)
    return order


ADDRESS_NOTE = (
    "an address stores each message once: its depth counts the messages some"
    " subscription still needs, and its disk and caches serve all its subscriptions."
    " A subscription's depth is its lag: messages it has not acknowledged (consume"
    " them with raymq consume ADDRESS/SUBSCRIPTION)."
)


def subscription_stats(broker, name: str) -> dict[str, dict] | None:
    """Each subscription's statistics of address ``name``, by subscription name (in the
    order they were created); None if the address is gone. A subscription deleted
    meanwhile is left out."""
    from raymq.client import Subscription

    try:
        address = broker.get_address(name)
        names = address.subscriptions()
    except QueueNotFound:
        return None
    out = {}
    for sub in names:
        with contextlib.suppress(QueueNotFound):  # SubscriptionNotFound: deleted since
            out[sub] = Subscription(address, sub).stats()
    return out


def _status(broker) -> dict[str, Any]:
    import ray

    addresses = broker.list_addresses()
    queues = broker.stats()  # queues and addresses
    by_address = {}
    for name in addresses:
        stats = queues.pop(name, None)
        if stats is not None and stats.get("state") == "hibernated":
            by_address[name] = {**stats, "subscriptions": {}}  # not woken for a status
            continue
        subs = subscription_stats(broker, name) if stats is not None else None
        if subs is not None:
            by_address[name] = {**stats, "subscriptions": subs}
    return {
        "queues": queues,
        "addresses": by_address,
        "hibernation": broker.hibernation_stats(),
        "governor": broker.governor_stats(),
        "metrics": metrics_urls(ray.nodes()),
    }


def subscription_sources(addresses: dict[str, dict]) -> dict[str, dict]:
    """Every subscription's statistics by its full name, ``address/subscription``."""
    return {
        f"{address}/{sub}": s
        for address, a in addresses.items()
        for sub, s in a.get("subscriptions", {}).items()
    }


#: Columns of the queue and address tables of ``raymq status`` (after the name).
STATS_COLUMNS = (
    "depth", "in flight", "head cache", "read cache", "transient", "disk", "files",
    "consumers", "budget", "policy", "blocked", "dead-lettered",
)  # fmt: skip


def _stats_table(title: str, first: str) -> Table:
    table = Table(title=title)
    for col in (first, *STATS_COLUMNS):
        table.add_column(col, justify="left" if col in (first, "policy") else "right")
    return table


def _stats_cells(s: dict) -> list[str]:
    """A queue's (or an address's) cells under ``STATS_COLUMNS``; a hibernated one's
    figures are not read (that would start its actor): "hibernated", then blanks."""
    if s.get("state") == "hibernated":
        return ["hibernated"] + [""] * (len(STATS_COLUMNS) - 1)
    policy = s["address_full_policy"]
    if s["max_size_bytes"] > 0:
        policy += f" at {_human(s['max_size_bytes'])}"
    transient = s.get("transient_bytes_in_memory", 0)
    return [
        f"{s['depth']:,}",
        f"{s['in_flight']:,}",
        _human(s["head_cache_bytes"]) if s.get("durable", True) else "-",
        _human(s.get("read_cache_bytes", 0)),
        "-" if s.get("durable", True) else _human(transient),
        _human(s["bytes_on_disk"]),
        str(s["segment_files"]),
        str(s["consumers"]),
        "-" if s["memory_budget"] < 0 else _human(s["memory_budget"]),
        policy,
        str(s["blocked_producers"]) if s["blocked_producers"] else "",
        _dead_lettered(s),
    ]


def _subscription_cells(s: dict) -> list[str]:
    """A subscription's cells: its own lag, deliveries, head cache, consumers and dead
    letters; blank where the figure is its address's (disk, read cache, budget...)."""
    return [
        f"{s['depth']:,}",
        f"{s['in_flight']:,}",
        _human(s["head_cache_bytes"]) if s.get("durable", True) else "-",
        "", "", "", "",
        str(s["consumers"]),
        "", "", "",
        _dead_lettered(s),
    ]  # fmt: skip


def _dead_lettered(s: dict) -> str:
    moved, pending = s.get("messages_dead_lettered", 0), s.get("dead_letters_pending", 0)
    text = f"{moved:,}" if moved else ""
    return text + (f" (+{pending:,} waiting)" if pending else "")


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Queues (depth, caches, disk, consumers, budget, policy, dead letters);
    addresses, each with its subscriptions and their lag; the MemoryGovernor and where
    each node's Prometheus metrics are.

    \b
    Memory: "head cache" (undelivered messages of a durable queue in memory) and
    "read cache" (segment records read back from disk) can hold the same messages,
    so they are separate columns, not a sum. "transient": a non-durable queue's
    messages in memory. A subscription's depth is its lag (messages it has not
    acknowledged). --json has every figure of each queue, of each address and its
    "subscriptions" (by name), and a "metrics" list of URLs.
    """
    data = _status(_connect(ctx))
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
        return
    queues, addresses = data["queues"], data["addresses"]
    # A subscription's dead-letter queue is labelled with it, as a queue's is.
    sources = dead_letter_sources({**queues, **subscription_sources(addresses)})
    table = _stats_table(f"queues in namespace {ctx.obj['namespace']}", "queue")
    for name in queue_order(queues):
        label = name
        if name in sources:
            label += f" (DLQ of {', '.join(sorted(sources[name]))})"
        table.add_row(label, *_stats_cells(queues[name]))
    _print_table(table)
    _say(MEMORY_NOTE, style="dim")
    h = data["hibernation"]
    _say(
        f"hibernation: {sum(h['active_per_node'].values())} queue actors running"
        f" (max_active_queues={h['max_active_queues']} per node), {len(h['hibernated'])}"
        f" hibernated (after {h['hibernate_after_seconds']} s idle);"
        f" {h['hibernations']} hibernations, {h['revivals']} revivals",
        style="dim",
    )
    replicated = {n: q["replicas"] for n, q in queues.items() if q.get("replicas")}
    if replicated:
        rt = Table(title="replicas (replicated queues)")
        for col in ("queue", "replica", "node", "role", "in sync", "lag", "lag bytes"):
            rt.add_column(col, justify="right" if col.startswith("lag") else "left")
        for name in sorted(replicated):
            for r in replicated[name]:
                rt.add_row(
                    name,
                    r["replica_id"],
                    r["node_id"][:12],
                    r["role"],
                    "yes" if r["in_sync"] else "no",
                    f"{r['lag_messages']:,}",
                    _human(r["lag_bytes"]),
                )
        _print_table(rt)
    if addresses:
        table = _stats_table(f"addresses in namespace {ctx.obj['namespace']}", "address")
        for name in sorted(addresses):
            a = addresses[name]
            table.add_row(name, *_stats_cells(a))
            for sub, s in a["subscriptions"].items():
                table.add_row(f"  {name}/{sub}", *_subscription_cells(s))
        _print_table(table)
        _say(ADDRESS_NOTE, style="dim")
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
    _say(
        f"{g['rounds']} rounds, every {g['housekeeping_period']} s,"
        f" last took {g['round_seconds'] * 1e3:.0f} ms"
        + (f"; errors: {g['errors'][-1]}" if g["errors"] else "")
    )
    metrics = data["metrics"]
    _say(
        "metrics (Prometheus, ray_raymq_*): " + ", ".join(metrics)
        if metrics
        else "metrics: no node exports any (start Ray with --metrics-export-port)"
    )


# -- queues and addresses ---------------------------------------------------------------

#: The storage settings of ``create-queue`` and ``create-address`` (in help order).
_STORAGE_OPTIONS = (
    click.option(
        "--durable/--transient",
        default=True,
        show_default=True,
        help="Durable messages are fsynced; transient ones live in memory.",
    ),
    click.option(
        "--max-size-bytes",
        type=BYTES,
        default=-1,
        help="Artemis max_size_bytes: bytes of unacknowledged messages (-1: no limit).",
    ),
    click.option(
        "--page-size-bytes",
        type=BYTES,
        default=10 * 2**20,
        show_default=True,
        help="Largest segment (page) file, bytes.",
    ),
    click.option(
        "--address-full-policy",
        type=click.Choice(["PAGE", "DROP", "FAIL", "BLOCK"]),
        default="PAGE",
        show_default=True,
        help="What a send does at max_size_bytes.",
    ),
    click.option(
        "--page-max-cache-size",
        type=click.IntRange(min=0),
        default=5,
        show_default=True,
        help="Segment files kept cached for reading.",
    ),
)


def _storage_options(f):
    for option in reversed(_STORAGE_OPTIONS):  # as if stacked above ``f`` in this order
        f = option(f)
    return f


def _max_delivery_attempts_option(f):
    return click.option(
        "--max-delivery-attempts",
        type=click.IntRange(min=1),
        help="Deliveries before a message given back goes to the dead-letter queue"
        " (default: no limit).",
    )(f)


_node_id_option = click.option("--node-id", help="Node for the queue's files (default: spread).")


@cli.command("create-queue")
@click.argument("name")
@_storage_options
@_max_delivery_attempts_option
@click.option(
    "--dead-letter-queue",
    help="Where dead letters go (default NAME.DLQ, created when first needed).",
)
@_node_id_option
@click.option(
    "--replicas",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Copies of the queue's files, each on its own node (2 or 3 survive a node's loss).",
)
@click.option(
    "--min-insync-replicas",
    type=click.IntRange(min=1),
    help="Replicas that must have a send before it is answered (default: all of 2, 2 of 3).",
)
@click.pass_context
def create_queue(ctx: click.Context, name: str, **settings: Any) -> None:
    """Create a queue (or confirm it exists with these settings)."""
    for optional in ("max_delivery_attempts", "dead_letter_queue", "min_insync_replicas"):
        if settings[optional] is None:  # passed only when given (older clients lack them)
            del settings[optional]
    q = _connect(ctx).create_queue(name, **settings)
    _say(f"queue {q.name!r} ready")


@cli.command("create-address")
@click.argument("name")
@_storage_options
@_node_id_option
@click.pass_context
def create_address(ctx: click.Context, name: str, **settings: Any) -> None:
    """Create an address (or confirm it exists with these settings): each message sent
    to it is stored once and delivered to every subscription (raymq subscribe) bound
    to it when it is sent; with no subscription, nobody gets it. max_size_bytes and the
    policy count what some subscription still needs.
    """
    a = _connect(ctx).create_address(name, **settings)
    _say(f"address {a.name!r} ready")


def find_address(broker, name: str, queue_hint: str = " (raymq create-address makes an address)"):
    """The ``Address`` named; ``QueueNotFound`` (saying so when it is a queue, followed by
    ``queue_hint``) if none."""
    if name in broker.list_addresses():
        return broker.get_address(name)
    from raymq.config import validate_queue_name

    validate_queue_name(name)  # a name that can be no address says why
    if name in broker.list_queues():
        raise QueueNotFound(f"{name!r} is a queue, not an address{queue_hint}")
    raise QueueNotFound(f"address {name!r} does not exist in namespace {broker.namespace!r}")


def find_subscription(address, name: str):
    """The ``Subscription`` ``name`` of ``address``; ``SubscriptionNotFound`` (listing
    the address's subscriptions) if there is none."""
    subs = address.subscriptions()
    if name not in subs:
        raise SubscriptionNotFound(
            f"address {address.name!r} has no subscription {name!r}"
            f" (it has: {', '.join(subs) or 'none'})"
        )
    from raymq.client import Subscription

    return Subscription(address, name)


def find_target(broker, name: str):
    """What ``name`` names: ``ADDRESS/SUBSCRIPTION``, a ``Subscription``; else an
    ``Address`` or a ``Queue``. Raises ``QueueNotFound`` or ``SubscriptionNotFound``
    (listing the address's subscriptions) if there is none."""
    if "/" in name:  # no queue or address name holds one
        address_name, _, sub = name.partition("/")
        return find_subscription(find_address(broker, address_name), sub)
    if name in broker.list_addresses():
        return broker.get_address(name)
    try:
        return broker.get_queue(name)
    except QueueNotFound:
        raise QueueNotFound(
            f"no queue or address {name!r} in namespace {broker.namespace!r}"
        ) from None


def _check_selector(selector: str, where: str) -> None:
    """A malformed selector fails here, naming ``where`` (``queue 'q'``...)."""
    from raymq.errors import SelectorError
    from raymq.selector import Selector

    try:
        Selector(selector)
    except SelectorError as exc:
        raise SelectorError(f"{where}: {exc}") from None


@cli.command()
@click.argument("address")
@click.argument("subscription")
@click.option(
    "--selector",
    help="Route to it only the messages this JMS selector selects, e.g. \"color = 'red'\""
    " (default: all).",
)
@click.option(
    "--start",
    type=click.Choice(["latest", "earliest"]),
    default="latest",
    show_default=True,
    help="latest: from the next message sent; earliest: from the oldest message the"
    " address still stores.",
)
@_max_delivery_attempts_option
@click.option(
    "--dead-letter-queue",
    help="Where dead letters go (default ADDRESS.SUBSCRIPTION.DLQ, created when first needed).",
)
@click.pass_context
def subscribe(
    ctx: click.Context,
    address: str,
    subscription: str,
    selector: str | None,
    start: str,
    max_delivery_attempts: int | None,
    dead_letter_queue: str | None,
) -> None:
    """Bind SUBSCRIPTION to ADDRESS (or confirm it exists with these settings): a queue
    of its own over the address's messages; consume it with raymq consume
    ADDRESS/SUBSCRIPTION.
    """
    where = f"subscription {f'{address}/{subscription}'!r}"
    if selector is not None:
        _check_selector(selector, where)
    a = find_address(_connect(ctx), address)
    sub = a.create_subscription(
        subscription,
        selector=selector,
        start=start,
        max_delivery_attempts=max_delivery_attempts,
        dead_letter_queue=dead_letter_queue,
    )
    _say(f"subscription {sub.name!r} ready")


_yes_option = click.option(
    "-y", "--yes", is_flag=True, help="Delete without asking (needed when stdin is no terminal)."
)


def confirm_deletion(what: str, yes: bool) -> None:
    """Ask on the terminal before deleting ``what`` unless ``yes``; a no ends the command
    (``raymq: aborted``, status 1). With no terminal to ask on, refuse: a script says
    --yes."""
    if yes:
        return
    if not sys.stdin.isatty():
        raise click.ClickException(
            f"not deleting {what} without --yes (stdin is no terminal to ask on)"
        )
    click.confirm(f"delete {what}?", abort=True, err=True)


def kept_dead_letter_queues(broker, stats: Iterable[dict]) -> list[str]:
    """The dead-letter queues named in ``stats`` (of an address or its subscriptions)
    that exist: queues of their own, which a deletion leaves."""
    queues = set(broker.list_queues())
    named = {s.get("dead_letter_queue") for s in stats}
    return sorted(q for q in named if q in queues)


def _kept_text(dlqs: list[str]) -> str:
    if not dlqs:
        return ""
    return f"; dead-letter queue(s) {', '.join(repr(q) for q in dlqs)} kept (queues of their own)"


@cli.command("delete-address")
@click.argument("address")
@_yes_option
@click.pass_context
def delete_address(ctx: click.Context, address: str, yes: bool) -> None:
    """Delete ADDRESS with its subscriptions, its stored messages and its files; their
    consumers are closed. Asks first (the count of what is lost), unless --yes.

    Dead-letter queues are queues of their own: they stay.
    """
    broker = _connect(ctx)
    a = find_address(broker, address, queue_hint="")
    stats = a.stats()
    subs = subscription_stats(broker, address)
    if subs is None:  # deleted meanwhile
        raise QueueNotFound(f"address {address!r} does not exist in namespace {broker.namespace!r}")
    names = ", ".join(subs) or "none"
    confirm_deletion(
        f"address {address!r}: {stats['depth']:,} stored message(s),"
        f" {len(subs)} subscription(s) ({names})",
        yes,
    )
    broker.delete_address(address)
    kept = kept_dead_letter_queues(broker, [stats, *subs.values()])
    _say(
        f"address {address!r} deleted, with {len(subs)} subscription(s) and"
        f" {stats['depth']:,} stored message(s){_kept_text(kept)}"
    )


@cli.command()
@click.argument("address")
@click.argument("subscription")
@_yes_option
@click.pass_context
def unsubscribe(ctx: click.Context, address: str, subscription: str, yes: bool) -> None:
    """Delete SUBSCRIPTION of ADDRESS (made by raymq subscribe): its consumers are
    closed and the messages it has not acknowledged are dropped for it (the address
    keeps what other subscriptions still need). Asks first, unless --yes.

    Its dead-letter queue is a queue of its own: it stays.
    """
    broker = _connect(ctx)
    a = find_address(broker, address, queue_hint="")
    s = find_subscription(a, subscription).stats()
    confirm_deletion(
        f"subscription {f'{address}/{subscription}'!r}: {s['depth']:,} unacknowledged"
        f" message(s), {s['consumers']} consumer(s)",
        yes,
    )
    a.delete_subscription(subscription)
    kept = kept_dead_letter_queues(broker, [s])
    _say(
        f"subscription {f'{address}/{subscription}'!r} deleted, with {s['depth']:,}"
        f" unacknowledged message(s){_kept_text(kept)}"
    )


# -- send -------------------------------------------------------------------------------


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


def batches(messages: Iterable[bytes], size: int) -> Iterator[list[bytes]]:
    """``messages`` in lists of at most ``size`` (a lazy iterable stays lazy)."""
    batch: list[bytes] = []
    for m in messages:
        batch.append(m)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def _send_error(q, exc: RayMQError, batch: list[bytes], props_bytes: int, sent: int) -> str:
    """One line for a failed send: what the queue said, how many were sent before, and,
    when one batch is larger than the queue's ``max_size_bytes``, to use --batch-size."""
    text = str(exc) if repr(q.name) in str(exc) else f"queue {q.name!r}: {exc}"
    if isinstance(exc, AddressFull) and len(batch) > 1:
        try:
            limit = q.stats().get("max_size_bytes", -1)
        except RayMQError:  # the hint is a nicety: the queue's own error stands
            limit = -1
        cost = sum(len(b) + props_bytes + 24 for b in batch)  # as the queue counts it
        if 0 < limit < cost:
            text += (
                f"; a batch of {len(batch):,} messages (~{cost:,} bytes) can never fit:"
                " pass a smaller --batch-size so that sends wait for room (BLOCK)"
            )
    if sent:
        text += f" ({sent:,} message(s) were sent before)"
    return text


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
@click.option("--count", type=click.IntRange(min=1), help="Send this many generated messages.")
@click.option(
    "--size", type=BYTES, default=1024, show_default=True, help="Body size of generated messages."
)
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=DEFAULT_BATCH_SIZE,
    show_default=True,
    help="Messages per send (one write, one fsync). A batch larger than a BLOCK or FAIL"
    " queue's max_size_bytes is refused at once: make it smaller to wait for room.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0),
    help="Seconds a BLOCKed send may wait (default: for ever).",
)
@click.pass_context
def send(
    ctx: click.Context,
    queue: str,
    bodies: tuple[str, ...],
    from_stdin: bool,
    props: tuple[str, ...],
    count: int | None,
    size: int,
    batch_size: int,
    timeout: float | None,
) -> None:
    """Send messages to QUEUE (a queue or an address): BODIES, the lines of --stdin, or
    --count generated ones."""
    from raymq.client import Address, Subscription

    properties = dict(_parse_property(p) for p in props) or None
    if not bodies and not from_stdin and not count:
        raise click.UsageError("nothing to send: give BODIES, --stdin or --count")
    q = find_target(_connect(ctx), queue)
    if isinstance(q, Subscription):
        raise click.ClickException(
            f"{queue!r} is a subscription: it receives what is sent to its address"
            f" (raymq send {q.address.name} ...)"
        )
    to = f"address {queue!r}" if isinstance(q, Address) else repr(queue)
    if isinstance(q, Address) and not q.subscriptions():
        _warn(
            f"address {queue!r} has no subscription: what is sent to it reaches nobody"
            f" (raymq subscribe {queue} NAME first)"
        )
    props_bytes = len(json.dumps(properties)) if properties else 0  # an estimate, for hints
    given = [b.encode() for b in bodies]
    lines = (line.rstrip("\n").encode() for line in sys.stdin) if from_stdin else ()
    sent = wanted = 0

    def send_all(stream: Iterable[bytes], advance=None) -> None:
        nonlocal sent, wanted
        for batch in batches(stream, batch_size):
            wanted += len(batch)
            try:
                sent += len(q.send_batch(batch, properties, timeout=timeout))
            except RayMQError as exc:
                raise click.ClickException(_send_error(q, exc, batch, props_bytes, sent)) from None
            if advance is not None:
                advance(len(batch))

    send_all(itertools.chain(given, lines))  # stdin is read a batch at a time
    if count:
        from rich.progress import Progress

        body = b"x" * size
        with Progress(console=err_console, transient=True) as progress:
            task = progress.add_task(f"sending to {queue}", total=count)
            send_all((body for _ in range(count)), lambda n: progress.advance(task, n))
    dropped = f" ({wanted - sent} dropped by the DROP policy)" if sent < wanted else ""
    _say(f"sent {sent} message(s) to {to}{dropped}")


# -- consume ----------------------------------------------------------------------------


def quoted_suggestion(selector: str, names: Iterable[str]) -> str:
    """``selector`` with each identifier in ``names`` written as a string literal."""
    from raymq.selector.parser import tokenize

    names = set(names)
    out, last = [], 0
    for tok in tokenize(selector):
        if tok.kind == "ident" and tok.text in names:
            out += [selector[last : tok.pos], "'", tok.text, "'"]
            last = tok.pos + len(tok.text)
    return "".join(out) + selector[last:]


def unseen_properties(q, selector: str) -> tuple[set[str], int, bool]:
    """Property names ``selector`` uses that none of the first ``SELECTOR_CHECK_MESSAGES``
    messages of queue ``q`` carries; with how many messages were looked at and whether
    that was the whole queue. Browsing stops as soon as every name has been seen."""
    from raymq.selector import Selector

    wanted = set(Selector(selector).properties)
    looked = 0
    if not wanted:
        return wanted, looked, True
    for m in q.browse(batch_size=SELECTOR_CHECK_BATCH):
        looked += 1
        wanted -= m.properties.keys()
        if not wanted or looked >= SELECTOR_CHECK_MESSAGES:
            return wanted, looked, False
    return wanted, looked, True


def selector_warning(queue: str, selector: str, unseen: set[str], looked: int, whole: bool) -> str:
    """The warning for properties no message carries: names them and suggests quotes."""
    names = ", ".join(repr(n) for n in sorted(unseen))
    where = (
        f"no message in queue {queue!r} carries"
        if whole
        else f"none of the first {looked:,} messages of queue {queue!r} carries"
    )
    return (
        f'selector "{selector}" names propert{"y" if len(unseen) == 1 else "ies"} {names},'
        f" which {where}; a string value needs quotes:"
        f' "{quoted_suggestion(selector, unseen)}"'
    )


def _print_message(m, as_json: bool) -> None:
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


def drain(consumer, max_messages: int, timeout: float, handle) -> int:
    """Receive up to ``max_messages``, passing each list to ``handle``; returns how many.

    Stops when a receive comes back empty and ``consumer.backlog()`` is 0 (nothing left
    for this consumer: a late selector consumer still scanning counts as not empty), or
    when nothing arrived for ``timeout`` seconds.
    """
    got = 0
    idle_until = time.monotonic() + timeout
    while got < max_messages:
        wait = max(0.0, min(CONSUME_POLL_SECONDS, idle_until - time.monotonic()))
        messages = consumer.receive(max_messages - got, timeout=wait)
        if messages:
            handle(messages)
            got += len(messages)
            idle_until = time.monotonic() + timeout
        elif consumer.backlog() == 0 or time.monotonic() >= idle_until:
            break
    return got


@cli.command()
@click.argument("queue")
@click.option(
    "--selector",
    help="JMS message selector, e.g. \"color = 'red'\" (for a subscription: on top of its own).",
)
@click.option(
    "-n",
    "--max-messages",
    type=click.IntRange(min=1),
    default=10,
    show_default=True,
    help="Stop after this many messages.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0),
    default=5.0,
    show_default=True,
    help="Stop when nothing arrives for this many seconds (at once when the queue has"
    " nothing more for this consumer).",
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
    """Receive (and acknowledge) messages of QUEUE, a queue or an address's subscription
    (ADDRESS/SUBSCRIPTION), and print them.

    A selector naming a property that no message of the queue carries (among the first
    10,000) gets a warning on stderr: an unquoted value such as colour = red compares
    two properties and matches nothing.
    """
    from raymq.client import Address, Subscription

    broker = _connect(ctx)
    q = find_target(broker, queue)
    if isinstance(q, Address):
        subs = q.subscriptions()
        raise click.ClickException(
            f"{queue!r} is an address: consume one of its subscriptions,"
            f" raymq consume {queue}/SUBSCRIPTION (it has: {', '.join(subs) or 'none'})"
        )
    if selector is not None:
        kind = "subscription" if isinstance(q, Subscription) else "queue"
        _check_selector(selector, f"{kind} {queue!r}")  # before browsing
        unseen, looked, whole = unseen_properties(q, selector)
        if unseen and looked:  # an empty queue says nothing about names
            _warn(selector_warning(queue, selector, unseen, looked, whole))

    def handle(messages) -> None:
        for m in messages:
            _print_message(m, as_json)
        if not no_ack:
            c.ack(messages)

    # --no-ack holds every message it prints (closing gives them back, counted as a
    # delivery): it needs that much credit. A nack before the close would let the
    # consumer's loader take them again while it closes.
    prefetch = max_messages if no_ack else min(max_messages, 1000)
    with q.consumer(selector=selector, prefetch=prefetch) as c:
        got = drain(c, max_messages, timeout, handle)
    if not as_json:
        _say(f"{got} message(s) from {queue!r}", style="dim")


# -- bench ------------------------------------------------------------------------------


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


@cli.command(
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


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# -- entry point ------------------------------------------------------------------------


def one_line(exc: BaseException) -> str:
    """An exception as one line: its first non-empty line (Ray's errors run to many)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    more = " (more with raymq --verbose)" if len(lines) > 1 and not _verbose else ""
    return lines[0] + more


def _expected_errors() -> tuple[type[BaseException], ...]:
    """Errors from bad input or an unavailable cluster: one line, no traceback."""
    errors: tuple[type[BaseException], ...] = (
        RayMQError,
        ConnectionError,
        ValueError,
        TypeError,
        LookupError,
        OSError,
    )
    try:
        from ray.exceptions import RayError

        errors += (RayError,)
    except ImportError:
        pass
    return errors


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``raymq`` script; returns the exit status (see the module's
    docstring: 0, 1 for errors, 2 for usage errors)."""
    global _verbose
    _verbose = False
    try:
        rv = cli.main(args=argv, prog_name="raymq", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("raymq: aborted", err=True)
        return EXIT_ERROR
    except click.UsageError as exc:
        hint = f" (see `{exc.ctx.command_path} --help`)" if exc.ctx is not None else ""
        click.echo(f"raymq: error: {exc.format_message()}{hint}", err=True)
        return EXIT_USAGE
    except click.ClickException as exc:
        click.echo(f"raymq: error: {exc.format_message()}", err=True)
        return exc.exit_code
    except KeyboardInterrupt:
        click.echo("raymq: interrupted", err=True)
        return EXIT_INTERRUPTED
    except _expected_errors() as exc:
        if _verbose:
            traceback.print_exc()
        click.echo(f"raymq: error: {one_line(exc)}", err=True)
        return EXIT_ERROR
    except Exception as exc:  # a bug: still one line, the traceback with --verbose
        if _verbose:
            traceback.print_exc()
        click.echo(f"raymq: error: unexpected {type(exc).__name__}: {one_line(exc)}", err=True)
        return EXIT_ERROR
    return rv if isinstance(rv, int) else 0


if __name__ == "__main__":
    sys.exit(main())
