"""``raymq consume``: receive, print and acknowledge; a selector naming properties that
no message carries gets a warning."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable

import click

from raymq.cli import common
from raymq.cli.common import _say, _warn
from raymq.cli.targets import _check_selector, find_target
from raymq.placement import spares

#: Seconds each receive of ``raymq consume`` waits before it asks whether anything is
#: left for it (``Consumer.backlog``): an empty receive with no backlog ends the command.
CONSUME_POLL_SECONDS = 0.5
#: How far ``raymq consume`` looks for the property names a selector uses: at most this
#: many messages from the head of the queue, browsed this many per call (a bound on the
#: bodies one call brings back). Checking a huge queue whole would cost more than the
#: consume itself; the first messages show the usual case (a value written unquoted).
SELECTOR_CHECK_MESSAGES = 10_000
SELECTOR_CHECK_BATCH = 200


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


@click.command()
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

    broker = common.connect(ctx)
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
    with spares.none_started():  # the command ends after this consumer: no next spare
        consumer = q.consumer(selector=selector, prefetch=prefetch)
    with consumer as c:
        got = drain(c, max_messages, timeout, handle)
    if not as_json:
        _say(f"{got} message(s) from {queue!r}", style="dim")
