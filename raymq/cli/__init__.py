"""The ``raymq`` command: start, stop and inspect a broker; create queues, addresses and
their subscriptions, and delete addresses and subscriptions; send; consume.

Every command joins a running Ray cluster (``ray start --head`` first; ``--address``
or ``$RAY_ADDRESS``, default ``auto``: the cluster running on this machine), except
``raymq bench``, which starts its own. Ray's log lines stay out of the output.

Exit status: 0 on success; 1 on an error, printed as one line on stderr
(``raymq: error: ...``, naming the queue or setting involved), never a traceback; 2 on a
usage error (a wrong option or argument), as click does.

Layout: the ``cli`` group and ``main`` live here; each command group has a module
(``lifecycle``: start, stop; ``overview``: status; ``destinations``: queues, addresses,
subscriptions; ``sending``; ``consuming``; ``benches``), over ``common`` (sizes,
printing, ``common.connect``) and ``targets`` (what a name names).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback
from typing import NoReturn

import click

from raymq.cli.benches import BENCH_ADDRESS_ENV, available_benches, bench, bench_command
from raymq.cli.common import BYTES, PIPE_WIDTH, ByteSize, console, err_console
from raymq.cli.consuming import (
    CONSUME_POLL_SECONDS,
    SELECTOR_CHECK_BATCH,
    SELECTOR_CHECK_MESSAGES,
    consume,
    drain,
    quoted_suggestion,
    selector_warning,
    unseen_properties,
)
from raymq.cli.destinations import (
    confirm_deletion,
    create_address,
    create_queue,
    delete_address,
    kept_dead_letter_queues,
    seek,
    subscribe,
    unsubscribe,
)
from raymq.cli.lifecycle import setting_differences, start, stop
from raymq.cli.overview import (
    ADDRESS_NOTE,
    MEMORY_NOTE,
    STATS_COLUMNS,
    dead_letter_sources,
    metrics_urls,
    queue_order,
    remove_leftovers,
    status,
    subscription_sources,
    subscription_stats,
)
from raymq.cli.sending import DEFAULT_BATCH_SIZE, batches, send
from raymq.cli.targets import find_address, find_subscription, find_target
from raymq.errors import RayMQError

__all__ = [
    "ADDRESS_NOTE",
    "BENCH_ADDRESS_ENV",
    "BYTES",
    "CONSUME_POLL_SECONDS",
    "DEFAULT_BATCH_SIZE",
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_STATUS_HELP",
    "EXIT_USAGE",
    "MEMORY_NOTE",
    "PIPE_WIDTH",
    "SELECTOR_CHECK_BATCH",
    "SELECTOR_CHECK_MESSAGES",
    "STATS_COLUMNS",
    "ByteSize",
    "available_benches",
    "batches",
    "bench",
    "bench_command",
    "cli",
    "confirm_deletion",
    "console",
    "consume",
    "create_address",
    "create_queue",
    "dead_letter_sources",
    "delete_address",
    "drain",
    "err_console",
    "find_address",
    "find_subscription",
    "find_target",
    "kept_dead_letter_queues",
    "main",
    "metrics_urls",
    "one_line",
    "queue_order",
    "quoted_suggestion",
    "run",
    "selector_warning",
    "send",
    "setting_differences",
    "start",
    "status",
    "stop",
    "subscribe",
    "subscription_sources",
    "subscription_stats",
    "unseen_properties",
    "unsubscribe",
]

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

EXIT_STATUS_HELP = (
    "Exit status: 0 on success; 1 on an error (one line on stderr, naming the queue or"
    " setting involved); 2 on a usage error (a wrong option or argument)."
)


#: Set by ``--verbose``: Ray's log lines pass, and an error prints its traceback too.
_verbose = False


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


# Each command group's module defines its commands; the group takes them here (the
# modules import nothing of this one: no import cycle).
for _command in (
    start,
    stop,
    status,
    remove_leftovers,
    create_queue,
    create_address,
    subscribe,
    seek,
    delete_address,
    unsubscribe,
    send,
    consume,
    bench,
):
    cli.add_command(_command)


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


def run() -> NoReturn:
    """The ``raymq`` script: ``main``, then a quick exit with its status.

    Python's own finalization of the modules a command imported (Ray, pyarrow, numpy)
    took 0.4-0.9 s of every command, a third of a short one's time (measured: `raymq
    status` 1.8-2.3 -> 1.2-1.4 s). Once the output is flushed and Ray is left as
    ``ray.shutdown`` leaves it (what its own exit hook does), nothing of RayMQ's is left
    to run (no exit hooks; a command's consumer and sends end before it returns), so
    the process ends without it."""
    code = main()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (``| head``): nothing more to say
            code = code or EXIT_ERROR
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        # The command is over and its output out: a failing disconnect must not turn
        # into a traceback and the slow interpreter exit this function avoids.
        with contextlib.suppress(Exception):
            ray.shutdown()
    os._exit(code)
