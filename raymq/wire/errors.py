"""The wire's errors: a broken connection, and a server's typed error carried by name."""

from __future__ import annotations

from raymq import errors


class WireBroken(ConnectionError):
    """A connection failed, went silent or answered nonsense. What was asked on it may
    or may not have been done: its callers go through Ray calls instead, as each
    protocol's module says (docs/WIRE.md)."""

    #: The break came after a request was written: the server may have done it (and
    #: written an answer that was never read).
    answer_pending: bool = False


def envelope(error: BaseException) -> list[str]:
    """``error`` as an answer carries it: ``[class name, message]``."""
    return [type(error).__name__, str(error)]


def error_of(name: str, message: str) -> Exception:
    """The typed error a server named: RayMQ's (``raymq.errors``), ``TypeError`` or
    ``ValueError``; anything else as a ``RayMQError`` naming it."""
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, errors.RayMQError):
        return cls(message)
    if name == "TypeError":
        return TypeError(message)
    if name == "ValueError":
        return ValueError(message)
    return errors.RayMQError(f"{name}: {message}")
