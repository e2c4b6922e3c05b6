"""This process's SendChannels: one connection per (Ray job, queue actor), shared by
every handle, producer and consumer of that queue in the process (``raymq.wire.send``).

A channel is opened on first use: by the caller (``_send_channel``: a send waits for
it) or in a daemon thread while the caller goes through Ray (``_send_channel_soon``:
pipelined acks must not wait). One that failed to open is tried again
``CHANNEL_RETRY_SECONDS`` later; one that broke after working is opened again at once.
Keyed by the queue actor too: a queue revived or failed over is another actor, another
channel.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import ray

from raymq.wire.send import SendChannel

_log = logging.getLogger("raymq.client")


class Queue(Protocol):
    """What the registry uses of a queue's handle (``raymq.client.handles.Queue``):
    named here so that this module does not import the handles'."""

    name: str
    _actor: Any

    def _invoke(self, method: str, *args: Any, answer_seconds: float | None = -1.0) -> Any: ...


#: Seconds before a process tries again to open a queue's SendChannel after it failed
#: to connect (a channel that broke after working is opened again at once).
CHANNEL_RETRY_SECONDS = 30.0
#: Longest a background opening of a SendChannel waits for the queue's actor (seconds).
CHANNEL_OPEN_SECONDS = 30.0
_channels_lock = threading.Lock()
#: (job id, queue actor id) -> this process's SendChannel, the monotonic time to try
#: connecting again, or None while a thread is connecting.
_channels: dict[tuple[str, str], SendChannel | float | None] = {}


def _send_channel(queue: Queue, *, connect: bool = True) -> SendChannel | None:
    """This process's SendChannel to ``queue``'s actor, opened on first use; None when
    the queue has none, it is being opened, or opening it failed lately (single sends
    then go through Ray calls). ``connect=False``: only a channel open already (no
    blocking call: asyncio code opens one in a worker thread)."""
    key = _channel_key(queue)
    if connect and _reserve_channel(key):
        # follows a revived queue's new actor
        return _connect_send_channel(
            queue, key, lambda: (queue._invoke("send_endpoint"), queue._actor)
        )
    return _open_channel(key)


def _send_channel_soon(queue: Queue) -> SendChannel | None:
    """The SendChannel to ``queue``'s actor if open, else None at once, and one is
    opened in a daemon thread for the calls that follow (unless one is being opened,
    or opening it failed lately). For callers that must not wait: a consumer's
    pipelined acks, sent by the linger thread too."""
    key = _channel_key(queue)
    if _reserve_channel(key):
        actor = queue._actor
        # The thread waits on a Python future, never inside a Ray call: a process may
        # end meanwhile (Ray's shutdown under a thread blocked in its C++ core can
        # crash the interpreter).
        threading.Thread(
            target=_connect_send_channel,
            args=(
                queue,
                key,
                lambda: (
                    actor.send_endpoint.remote().future().result(CHANNEL_OPEN_SECONDS),
                    actor,
                ),
            ),
            name="raymq-send-channel",
            daemon=True,
        ).start()
        return None
    return _open_channel(key)


def _channel_key(queue: Queue) -> tuple[str, str]:
    return (ray.get_runtime_context().get_job_id(), queue._actor._actor_id.hex())


def _open_channel(key: tuple[str, str]) -> SendChannel | None:
    got = _channels.get(key)
    return got if isinstance(got, SendChannel) and got.broken is None else None


def _reserve_channel(key: tuple[str, str]) -> bool:
    """True if the caller is to open the channel of ``key`` now (marked as being
    opened): none is open, none is being opened and none failed lately."""
    with _channels_lock:
        got = _channels.get(key, 0.0)
        if isinstance(got, SendChannel) and got.broken is None:
            return False
        if got is None or (isinstance(got, float) and time.monotonic() < got):
            return False
        _channels[key] = None  # this thread connects; the others use Ray meanwhile
        return True


def _connect_send_channel(
    queue: Queue, key: tuple[str, str], ask_endpoint: Callable[[], tuple[Any, Any]]
) -> SendChannel | None:
    """Open the SendChannel of ``key`` (reserved by ``_reserve_channel``) to the
    endpoint ``ask_endpoint`` returns with the actor that answered (the queue actor's
    ``send_endpoint``), and record it, or when it failed the time to try again, under
    ``key`` and under that actor (another after a revival)."""
    channel: SendChannel | None = None
    new_key = key
    try:
        endpoint, actor = ask_endpoint()
        new_key = (key[0], actor._actor_id.hex())
        if endpoint is not None:
            channel = SendChannel(*endpoint, queue=queue.name)
    except Exception as exc:  # noqa: BLE001 - unreachable port, refused, the actor
        # gone, a timeout...: Ray carries the calls, and the key must not stay None
        # (connecting) for good
        _log.info("queue %r: no send channel: %r", queue.name, exc)
    with _channels_lock:
        _channels[key] = channel or time.monotonic() + CHANNEL_RETRY_SECONDS
        _channels[new_key] = _channels[key]
    return channel
