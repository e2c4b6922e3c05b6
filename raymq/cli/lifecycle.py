"""``raymq start`` and ``raymq stop``: a broker's actors on the running cluster."""

from __future__ import annotations

import os
from typing import Any

import click

from raymq.cli import common
from raymq.cli.common import BYTES, _human, _say, _warn
from raymq.errors import BrokerUnavailable

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
        return common.connect(ctx)
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


@click.command()
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
            broker = common.connect(ctx, create=True, **asked)
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


@click.command()
@click.pass_context
def stop(ctx: click.Context) -> None:
    """Stop the broker's actors; every queue's and address's files stay."""
    broker = common.connect(ctx)
    kept = _counts(broker)
    broker.shutdown()
    _say(f"stopped the broker in namespace {broker.namespace}; {kept} kept")
