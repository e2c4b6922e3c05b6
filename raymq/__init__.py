"""RayMQ: a durable message broker on Ray whose queues hold backlogs larger than memory."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from raymq import errors

if TYPE_CHECKING:
    from raymq.client import (
        Address,
        Broker,
        Consumer,
        Message,
        Messages,
        Queue,
        Subscription,
        connect,
    )

__all__ = [
    "Address",
    "Broker",
    "Consumer",
    "Message",
    "Messages",
    "Queue",
    "Subscription",
    "connect",
    "errors",
]
__version__ = "0.1.0"

_CLIENT = set(__all__) - {"errors"}


def __getattr__(name: str) -> Any:
    # The client (and so Ray) loads on first use: ``raymq.core``, ``raymq.storage`` and
    # ``raymq.selector`` import without Ray.
    if name in _CLIENT:
        from raymq import client

        return getattr(client, name)
    raise AttributeError(f"module 'raymq' has no attribute {name!r}")
