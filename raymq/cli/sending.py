"""``raymq send``: bodies, lines of stdin or generated messages, in batches."""

from __future__ import annotations

import datetime
import itertools
import json
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import click

from raymq.cli import common
from raymq.cli.common import BYTES, _say, _warn, err_console
from raymq.cli.targets import find_target
from raymq.errors import AddressFull, RayMQError

#: Messages per ``send_batch`` of ``raymq send`` unless ``--batch-size`` says otherwise.
DEFAULT_BATCH_SIZE = 1000


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


@click.command()
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
@click.option(
    "--ttl",
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds each message lives: never delivered after (default: the queue's"
    " default_ttl_s, else for ever).",
)
@click.option(
    "--delay",
    type=click.FloatRange(min=0),
    help="Seconds from now before the messages may be delivered.",
)
@click.option(
    "--deliver-at",
    type=click.DateTime(),
    help="When the messages may be delivered (local time, e.g. 2030-01-31T09:00:00).",
)
@click.option(
    "--priority",
    type=click.IntRange(0, 255),
    help="The messages' priority: delivered first on a queue with a higher max_priority"
    " (ignored by a queue without one).",
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
    ttl: float | None,
    delay: float | None,
    deliver_at: datetime.datetime | None,
    priority: int | None,
) -> None:
    """Send messages to QUEUE (a queue or an address): BODIES, the lines of --stdin, or
    --count generated ones."""
    from raymq.client import Address, Subscription

    properties = dict(_parse_property(p) for p in props) or None
    if delay is not None and deliver_at is not None:
        raise click.UsageError("give --delay or --deliver-at, not both")
    times = {"ttl": ttl, "delay": delay, "deliver_at": deliver_at}
    if priority is not None:  # passed only when given (an older broker's handle)
        times["priority"] = priority
    if not bodies and not from_stdin and not count:
        raise click.UsageError("nothing to send: give BODIES, --stdin or --count")
    q = find_target(common.connect(ctx), queue)
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
                sent += len(q.send_batch(batch, properties, timeout=timeout, **times))
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
