"""Typed errors of RayMQ.

The class names are stable: callers match on them. Every error says which queue,
setting or file is involved, and raising one never changes or loses data.
"""

from __future__ import annotations

import re


class RayMQError(Exception):
    """Base class of every RayMQ error."""


class InvalidQueueName(RayMQError, ValueError):
    """A queue name is empty, too long, or could escape the paging directory."""


class QueueNotFound(RayMQError, LookupError):
    """No queue of that name exists in this broker."""


class QueueExists(RayMQError):
    """A queue of that name exists already with different settings."""


class MessageTooLarge(RayMQError, ValueError):
    """A message body is larger than the broker's ``max_message_size`` (bytes)."""


class InvalidProperties(RayMQError, ValueError):
    """Message properties are not a dict of str to str, int, float, bool or None."""


class InvalidSetting(RayMQError, ValueError):
    """A broker or queue setting has a value outside its allowed range."""


class InvalidAck(RayMQError, ValueError):
    """An ack or nack names messages this consumer does not hold."""


class AddressFull(RayMQError):
    """The queue is at ``max_size_bytes`` and its ``address_full_policy`` refuses the send."""


class SelectorError(RayMQError, ValueError):
    """A message selector is malformed."""


class BrokerUnavailable(RayMQError, ConnectionError):
    """The broker, or the actor of a queue, cannot be reached."""


class ConsumerClosed(RayMQError):
    """The consumer was closed; it receives, acks and nacks nothing more."""


class StorageError(RayMQError, OSError):
    """A segment or ack file could not be written; the queue refuses further writes."""


class DurabilityUnknown(StorageError):
    """A change was written but whether it outlives a crash is not known (the fsync of
    its directory failed): a subscription's seek is then in effect now, and may be found
    undone after a crash."""


class ReadStalled(BrokerUnavailable):
    """No longer raised: reads of a whole queue lease it (``raymq.data.QueueReader``)
    instead of receiving until idle. Kept so that code catching it still imports."""


class SubscriptionNotFound(QueueNotFound):
    """No subscription of that name is bound to the address."""


class SubscriptionExists(QueueExists):
    """A subscription of that name exists already on the address with different settings."""


class NotEnoughReplicas(RayMQError):
    """A replicated queue has fewer in-sync replicas than its ``min_insync_replicas``:
    the send is refused (nothing of it is served) rather than stored unreplicated."""


class NotLeader(BrokerUnavailable):
    """This replica of a replicated queue no longer leads it (a newer epoch does): it
    acknowledges nothing more; the client finds the new leader and tries again."""


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def ray_reason(exc: BaseException) -> str:
    """The last line of Ray's message for ``exc`` (where it puts the cause), without
    colour codes, at most 300 characters: Ray's errors run to many lines."""
    lines = [line.strip() for line in _ANSI.sub("", str(exc)).splitlines() if line.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:300]
