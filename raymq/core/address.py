"""An address's subscriptions (Artemis's address with its queues), the parts that do
not need the queue: a new subscription's definition checked, compared with one that
exists, written to the ``subscriptions`` file; a filtered subscription's backlog routed;
a ``Subscription`` made from its definition.

``QueueCore`` creates and deletes subscriptions with these; nothing here awaits but
``route_backlog``, which frees the event loop between its steps.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace

from raymq.config import QueueConfig, check_int, validate_queue_name
from raymq.core.subscription import Subscription, SubscriptionHost
from raymq.core.target_area import TargetArea
from raymq.errors import InvalidSetting, SubscriptionExists
from raymq.selector import Selector
from raymq.storage import SegmentLog
from raymq.storage.ack_ranges import AckRanges
from raymq.storage.files import storage_error
from raymq.storage.subscriptions import (
    MANIFEST_NAME,
    Manifest,
    SubscriptionAcks,
    SubscriptionLog,
    SubscriptionSpec,
    write_manifest,
)

#: Stored messages a new subscription's filter is applied to between two turns of the
#: event loop (about 30 ms of property reads here).
ROUTE_STEP_MESSAGES = 16384


def check_settings(
    config: QueueConfig,
    name: str,
    filter: str | None,
    max_delivery_attempts: int | None,
    dead_letter_queue: str | None,
) -> None:
    """Check every setting of a new subscription of the address of ``config`` (typed
    errors; first of all ``InvalidSetting`` if ``config`` is a queue's)."""
    address = config.name
    if not config.address:
        raise InvalidSetting(f"{address!r} is a queue, not an address: no subscriptions")
    validate_queue_name(name)
    if filter is not None:
        Selector(filter)  # SelectorError if malformed
    if max_delivery_attempts is not None:
        check_int("max_delivery_attempts", max_delivery_attempts, minimum=1)
    validate_queue_name(dead_letter_queue or f"{address}.{name}.DLQ")


def new_spec(
    name: str,
    filter: str | None,
    max_delivery_attempts: int | None,
    dead_letter_queue: str | None,
    next_id: int,
    start_offset: int,
) -> SubscriptionSpec:
    """A new subscription's definition (settings checked by ``check_settings``), with
    id ``next_id``, starting at ``start_offset`` (``retention.replay_offset``)."""
    return SubscriptionSpec(
        name=name,
        id=next_id,
        filter=filter,
        start_offset=start_offset,
        max_delivery_attempts=max_delivery_attempts,
        dead_letter_queue=dead_letter_queue,
    )


def existing_subscription(
    address: str, manifest: Manifest, spec: SubscriptionSpec
) -> SubscriptionSpec | None:
    """The subscription named as ``spec`` if ``manifest`` lists it with its settings
    (None if there is none); ``SubscriptionExists`` if it has others."""
    existing = manifest.subscriptions.get(spec.name)
    if existing is None:
        return None
    if replace(existing, id=spec.id, start_offset=spec.start_offset) != spec:
        raise SubscriptionExists(
            f"address {address!r} has a subscription {spec.name!r} with other settings: {existing}"
        )
    return existing


async def route_backlog(
    log: SegmentLog, address: str, acked: AckRanges, selector: Selector, start: int
) -> int:
    """Add to ``acked`` the stored messages from ``start`` on that ``selector`` does
    not select, ``ROUTE_STEP_MESSAGES`` at a time with the event loop free between
    steps; returns the offset it routed up to (the log's end when it returned)."""
    area = TargetArea(log, address)  # reads properties for the selector
    pos = start
    while True:
        end = log.next_offset
        got = acked.gaps(pos, end, ROUTE_STEP_MESSAGES)
        if not len(got):
            return end
        last_step = len(got) < ROUTE_STEP_MESSAGES  # it reaches the end
        pos = int(got[-1]) + 1
        got = got[~log.is_acked(got)]  # gone meanwhile: nothing to route
        if len(got):
            rejected = got[~area.select(selector, got)]
            # Its properties were read without their record's CRC: rot is found as
            # damage (quarantined, counted), not taken for a routing decision.
            log.confirm(rejected)
            acked.add(rejected)  # routed away, or lost to damage: never delivered
        if last_step:
            # Done: not one more step to find nothing new, which never comes while
            # sends are published every turn of the loop (the caller routes what is
            # published after it returns, with no await between).
            return end
        await asyncio.sleep(0)


def save_manifest(directory: str, address: str, manifest: Manifest) -> None:
    """Write the address's ``subscriptions`` file; ``StorageError`` if that fails."""
    try:
        write_manifest(directory, manifest)
    except OSError as exc:
        path = os.path.join(directory, MANIFEST_NAME)
        raise storage_error(address, "writing the subscriptions file", path, exc) from exc


def address_subscription(
    host: SubscriptionHost,
    log: SegmentLog,
    acks: SubscriptionAcks,
    spec: SubscriptionSpec,
) -> Subscription:
    """The subscription ``spec`` defines, of the address ``host`` runs."""
    cfg = host.config
    attempts = spec.max_delivery_attempts or cfg.max_delivery_attempts
    return Subscription(
        host,
        f"{cfg.name}/{spec.name}",
        SubscriptionLog(log, acks, spec.id),
        max_delivery_attempts=attempts,
        dead_letter_address=spec.dead_letter_queue or f"{cfg.name}.{spec.name}.DLQ",
        filter=spec.filter,
        sid=spec.id,
        subscription_name=spec.name,
    )


__all__ = [
    "ROUTE_STEP_MESSAGES",
    "address_subscription",
    "check_settings",
    "existing_subscription",
    "new_spec",
    "route_backlog",
    "save_manifest",
]
