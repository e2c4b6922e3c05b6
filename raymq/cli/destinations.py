"""Queues, addresses and subscriptions: ``raymq create-queue``, ``create-address``,
``subscribe``, ``delete-address`` and ``unsubscribe``."""

from __future__ import annotations

import datetime
import sys
from collections.abc import Iterable
from typing import Any

import click

from raymq.cli import common
from raymq.cli.common import BYTES, _say
from raymq.cli.overview import subscription_stats
from raymq.cli.targets import _check_selector, find_address, find_subscription
from raymq.errors import QueueNotFound

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


@click.command("create-queue")
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
@click.option(
    "--dedup-window-s",
    type=click.FloatRange(min=0),
    default=120.0,
    show_default=True,
    help="Seconds a message id is remembered: a resend with it is not stored again.",
)
@click.option(
    "--id-cache-size",
    type=click.IntRange(min=0),
    default=100_000,
    show_default=True,
    help="Most message ids remembered.",
)
@click.option(
    "--redelivery-delay-s",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Seconds a nacked message waits before it is delivered again.",
)
@click.option(
    "--default-ttl-s",
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds a message sent without --ttl lives (default: for ever).",
)
@click.option(
    "--expiry-queue",
    help="Where expired messages go (created when first needed; default: dropped).",
)
@click.option(
    "--message-expiry-scan-period-s",
    type=click.FloatRange(min=0, min_open=True),
    default=30.0,
    show_default=True,
    help="Seconds between passes that find expired messages nobody asks for.",
)
@click.option(
    "--max-priority",
    type=click.IntRange(1, 255),
    help="Deliver messages sent with a higher --priority first, up to this one"
    " (default: in order, priorities ignored).",
)
@click.pass_context
def create_queue(ctx: click.Context, name: str, **settings: Any) -> None:
    """Create a queue (or confirm it exists with these settings)."""
    optional_settings = (
        "max_delivery_attempts",
        "dead_letter_queue",
        "min_insync_replicas",
        "default_ttl_s",
        "expiry_queue",
        "max_priority",
    )
    for optional in optional_settings:
        if settings[optional] is None:  # passed only when given (older clients lack them)
            del settings[optional]
    q = common.connect(ctx).create_queue(name, **settings)
    _say(f"queue {q.name!r} ready")


@click.command("create-address")
@click.argument("name")
@_storage_options
@_node_id_option
@click.option(
    "--retention-s",
    type=click.FloatRange(min=0, min_open=True),
    help="Keep what every subscription acknowledged this many seconds, for replay"
    " (raymq seek; subscribe --start earliest).",
)
@click.option(
    "--retention-bytes",
    type=click.IntRange(min=0),
    help="Keep at least this many bytes of acknowledged messages, for replay.",
)
@click.pass_context
def create_address(ctx: click.Context, name: str, **settings: Any) -> None:
    """Create an address (or confirm it exists with these settings): each message sent
    to it is stored once and delivered to every subscription (raymq subscribe) bound
    to it when it is sent; with no subscription, nobody gets it. max_size_bytes and the
    policy count what some subscription still needs.
    """
    for optional in ("retention_s", "retention_bytes"):
        if settings[optional] is None:  # passed only when given (older clients lack them)
            del settings[optional]
    a = common.connect(ctx).create_address(name, **settings)
    _say(f"address {a.name!r} ready")


@click.command()
@click.argument("address")
@click.argument("subscription")
@click.option(
    "--selector",
    help="Route to it only the messages this JMS selector selects, e.g. \"color = 'red'\""
    " (default: all).",
)
@click.option(
    "--start",
    default="latest",
    show_default=True,
    help="latest: from the next message sent; earliest: from the oldest message the"
    " address still stores; an offset; or a time (e.g. 2030-01-31T09:00:00, local).",
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
    position = parse_position(start)  # a usage error before connecting
    a = find_address(common.connect(ctx), address)
    sub = a.create_subscription(
        subscription,
        selector=selector,
        start=position,
        max_delivery_attempts=max_delivery_attempts,
        dead_letter_queue=dead_letter_queue,
    )
    _say(f"subscription {sub.name!r} ready")


def parse_position(text: str) -> str | int | datetime.datetime:
    """A position as typed: ``latest``, ``earliest``, an offset, or an ISO time (local
    unless it names its zone); ``click.BadParameter`` otherwise."""
    if text in ("latest", "earliest"):
        return text
    if text.isdigit():
        return int(text)
    try:
        return datetime.datetime.fromisoformat(text)
    except ValueError:
        raise click.BadParameter(
            f"{text!r} is not latest, earliest, an offset or a time (2030-01-31T09:00:00)"
        ) from None


@click.command()
@click.argument("address")
@click.argument("subscription")
@click.argument("position")
@click.pass_context
def seek(ctx: click.Context, address: str, subscription: str, position: str) -> None:
    """Move SUBSCRIPTION of ADDRESS to POSITION: an offset, a time (e.g.
    2030-01-31T09:00:00, local), earliest or latest. What it acknowledged from there
    on is delivered again, as far as the address still stores it (its retention).
    """
    at = parse_position(position)
    sub = find_address(common.connect(ctx), address).subscription(subscription)
    offset = sub.seek(at)
    _say(f"subscription {sub.name!r} delivers from offset {offset}")


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


@click.command("delete-address")
@click.argument("address")
@_yes_option
@click.pass_context
def delete_address(ctx: click.Context, address: str, yes: bool) -> None:
    """Delete ADDRESS with its subscriptions, its stored messages and its files; their
    consumers are closed. Asks first (the count of what is lost), unless --yes.

    Dead-letter queues are queues of their own: they stay.
    """
    broker = common.connect(ctx)
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


@click.command()
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
    broker = common.connect(ctx)
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
