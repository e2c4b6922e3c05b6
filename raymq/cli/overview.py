"""``raymq status``: queues, addresses and their subscriptions, replicas, the
MemoryGovernor and where the metrics are."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterable
from typing import Any

import click
from rich.table import Table

from raymq.cli import common
from raymq.cli.common import _human, _print_table, _say
from raymq.errors import QueueNotFound

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
        "leftovers": broker.leftovers(),
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
    "consumers", "budget", "policy", "blocked", "scheduled", "dead-lettered", "expired",
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
        f"{s['scheduled']:,}" if s.get("scheduled") else "",
        _dead_lettered(s),
        _expired(s),
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
        f"{s['scheduled']:,}" if s.get("scheduled") else "",
        _dead_lettered(s),
        _expired(s),
    ]  # fmt: skip


def _dead_lettered(s: dict) -> str:
    moved, pending = s.get("messages_dead_lettered", 0), s.get("dead_letters_pending", 0)
    text = f"{moved:,}" if moved else ""
    return text + (f" (+{pending:,} waiting)" if pending else "")


def _expired(s: dict) -> str:
    """Messages expired since the queue's actor started, and where they went."""
    n = s.get("messages_expired", 0)
    if not n:
        return ""
    where = s.get("expiry_queue") or "dropped"
    return f"{n:,} ({where})"


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Queues (depth, caches, disk, consumers, budget, policy, scheduled, dead letters,
    expired);
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
    data = _status(common.connect(ctx))
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
        return
    namespace = ctx.obj["namespace"]
    queues, addresses = data["queues"], data["addresses"]
    _print_queues(namespace, queues, addresses)
    _say(MEMORY_NOTE, style="dim")
    _say(_hibernation_line(data["hibernation"]), style="dim")
    _print_replicas(queues)
    _print_leftovers(data["leftovers"])
    if addresses:
        _print_addresses(namespace, addresses)
        _say(ADDRESS_NOTE, style="dim")
    _print_governor(data["governor"])
    _say(_metrics_line(data["metrics"]))


def _print_queues(namespace: str, queues: dict[str, dict], addresses: dict[str, dict]) -> None:
    """The queue table: each queue followed by its dead-letter queues, each of those
    labelled with the queues (and subscriptions of ``addresses``) it serves."""
    # A subscription's dead-letter queue is labelled with it, as a queue's is.
    sources = dead_letter_sources({**queues, **subscription_sources(addresses)})
    table = _stats_table(f"queues in namespace {namespace}", "queue")
    for name in queue_order(queues):
        label = name
        if name in sources:
            label += f" (DLQ of {', '.join(sorted(sources[name]))})"
        table.add_row(label, *_stats_cells(queues[name]))
    _print_table(table)


def _hibernation_line(h: dict) -> str:
    """One line on hibernation from the broker's ``hibernation_stats()`` (seconds)."""
    return (
        f"hibernation: {sum(h['active_per_node'].values())} queue actors running"
        f" (max_active_queues={h['max_active_queues']} per node), {len(h['hibernated'])}"
        f" hibernated (after {h['hibernate_after_seconds']} s idle);"
        f" {h['hibernations']} hibernations, {h['revivals']} revivals"
    )


def _print_replicas(queues: dict[str, dict]) -> None:
    """The replica table of the replicated queues among ``queues`` (none, no table)."""
    replicated = {n: q["replicas"] for n, q in queues.items() if q.get("replicas")}
    if not replicated:
        return
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


def _print_leftovers(leftovers: list[dict]) -> None:
    """The copies replicas left on their nodes (none, no table)."""
    if not leftovers:
        return
    table = Table(title="replica copies left behind (raymq remove-leftovers removes them)")
    for col in ("queue", "replica", "node", "why", "since", "remove-leftovers"):
        table.add_column(col)
    for left in leftovers:
        since = time.strftime("%Y-%m-%d %H:%M", time.localtime(left["since"]))
        table.add_row(
            left["queue"],
            left["replica_id"],
            left["node_id"][:12],
            left["why"],
            since,
            left["verdict"],
        )
    _print_table(table)


@click.command("remove-leftovers")
@click.option("--dry-run", is_flag=True, help="Say what would be removed; change nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_context
def remove_leftovers(ctx: click.Context, dry_run: bool, as_json: bool) -> None:
    """Remove the copies replicated queues' replicas left on their nodes (shown by
    ``raymq status``), each on its node. A copy a replica uses is never removed; one
    whose node is not alive is kept until it is. Exits 1 if a removal failed."""
    done = common.connect(ctx).remove_leftovers(dry_run=dry_run)
    if as_json:
        click.echo(json.dumps(done, indent=2))
    elif not done:
        _say("no replica copies left behind")
    for left in [] if as_json else done:
        _say(f"{left['queue']}/{left['replica_id']} on {left['node_id'][:12]}: {left['outcome']}")
    if any(left["outcome"].startswith("failed") for left in done):
        ctx.exit(1)


def _print_addresses(namespace: str, addresses: dict[str, dict]) -> None:
    """The address table: each address, then a row per subscription of it."""
    table = _stats_table(f"addresses in namespace {namespace}", "address")
    for name in sorted(addresses):
        a = addresses[name]
        table.add_row(name, *_stats_cells(a))
        for sub, s in a["subscriptions"].items():
            table.add_row(f"  {name}/{sub}", *_subscription_cells(s))
    _print_table(table)


def _print_governor(g: dict) -> None:
    """The MemoryGovernor's table (each node's threshold, what it budgeted and its
    queues, in bytes) and a line on its rounds, from ``governor_stats()``."""
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


def _metrics_line(metrics: list[str]) -> str:
    """Where the nodes' Prometheus metrics are, or how to get some."""
    return (
        "metrics (Prometheus, ray_raymq_*): " + ", ".join(metrics)
        if metrics
        else "metrics: no node exports any (start Ray with --metrics-export-port)"
    )
