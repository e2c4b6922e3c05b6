"""The client API: ``connect()``, and handles for the broker, queues and consumers.

Usable from a driver, a Ray task, an actor or a ``ray job submit`` job. The package:

- ``broker``: ``connect()`` and the ``Broker`` handle;
- ``handles``: ``Queue``, ``Address``, ``Subscription`` (each reaches its queue's current
  actor through a ``raymq.core.link.QueueLink``);
- ``consumer``: ``Consumer``, receiving through its TargetList actor;
- ``messages``: ``Message`` and ``Messages``;
- ``acks``: the consumer's pipelined acks (``AckPipeline``);
- ``producer``: pipelined sends (``send(wait=False)``);
- ``calls``: calls to the broker's other actors, Ray's failures as typed errors.
"""

from __future__ import annotations

from raymq.client.broker import Broker, connect
from raymq.client.consumer import Consumer
from raymq.client.handles import Address, Queue, Subscription
from raymq.client.messages import Message, Messages

__all__ = [
    "Address",
    "Broker",
    "Consumer",
    "Message",
    "Messages",
    "Queue",
    "Subscription",
    "connect",
]
