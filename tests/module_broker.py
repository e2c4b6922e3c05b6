"""A broker the tests of one module share (the ``broker`` fixture, and ``raymq start``'s
in ``test_cli.py``), emptied after each test instead of started for each."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable
from typing import Any


class ModuleBroker:
    """A broker the tests of one module share, emptied after each test.

    A broker costs two Ray worker processes (its actor and its MemoryGovernor): about
    1 s of a test's setup and 1.7 s of CPU on 2 cores, where most tests need only queues
    and addresses of their own. After each test every address and queue is deleted; a
    broker that is gone, cannot be emptied, or whose hibernation settings or counts
    moved (a test that hibernates or revives queues counts on them starting at zero) is
    stopped, and the next test gets a new one. A test that needs a broker nobody used
    before, or settings of its own, takes ``broker_factory``.

    ``start(namespace, paging_directory)`` starts a broker and returns its handle (a
    ``raymq.Broker``); ``stop(handle)`` stops it.
    """

    def __init__(
        self,
        directory_factory: Callable[[], Any],
        start: Callable[[str, str], Any] | None = None,
        stop: Callable[[Any], object] | None = None,
    ) -> None:
        self._directory_factory = directory_factory
        self._start = start or self._connect
        self._stop = stop or (lambda b: b.shutdown())
        self._broker = None
        self._hibernation: dict | None = None

    @staticmethod
    def _connect(namespace: str, paging_directory: str) -> Any:
        import raymq

        return raymq.connect(namespace=namespace, paging_directory=paging_directory)

    def get(self) -> Any:
        """The module's broker (a ``raymq.Broker``), started if there is none."""
        if self._broker is None:
            namespace = f"raymq-test-{uuid.uuid4().hex[:8]}"
            self._broker = self._start(namespace, str(self._directory_factory()))
            self._hibernation = self._broker.hibernation_stats()
        return self._broker

    def empty(self) -> None:
        """Delete what the test left; give the broker up if it is not as it was."""
        b, self._broker = self._broker, None
        if b is None or b._shut_down or not _broker_runs(b.namespace):
            return
        try:
            for name in b.list_addresses():
                b.delete_address(name)
            for name in b.list_queues():
                b.delete_queue(name)
            if not (b.list_queues() or b.list_addresses()) and self._unchanged(b):
                self._broker = b
                return
        except Exception:  # whatever failed, the next test gets a new broker
            pass
        self._end(b)

    def _unchanged(self, b: Any) -> bool:
        now = b.hibernation_stats()
        keys = ("max_active_queues", "hibernate_after_seconds", "hibernations", "revivals")
        return all(now[k] == self._hibernation[k] for k in keys)

    def close(self) -> None:
        """Stop the broker (the module's end)."""
        b, self._broker = self._broker, None
        if b is not None:
            self._end(b)

    def _end(self, b: Any) -> None:
        with contextlib.suppress(Exception):
            self._stop(b)


def _broker_runs(namespace: str) -> bool:
    """Whether the broker actor of ``namespace`` exists (``raymq stop`` ends it)."""
    import ray

    from actors.names import BROKER_ACTOR_NAME

    try:
        ray.get_actor(BROKER_ACTOR_NAME, namespace=namespace)
    except ValueError:
        return False
    return True
