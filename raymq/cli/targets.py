"""What a name on the command line names: an address, a subscription
(``ADDRESS/SUBSCRIPTION``) or a queue; and selectors checked before any is used."""

from __future__ import annotations

from raymq.errors import QueueNotFound, SubscriptionNotFound


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
