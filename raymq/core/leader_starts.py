"""Which replicated queues' leaders are starting: the controller does not fail over a
leader mid-start for not answering its ping (it answers none until its start ends).

Two kinds of start: one the controller makes (``leader``: it creates the actor and
waits for its start, however long recovery takes), and one a leader makes by itself
(a restart in place: it asks the controller for its epoch, ``begin_epoch``, and for the
in-sync set, ``in_sync_replicas``, surveys its followers, then reports its own set,
``update_in_sync``). Only a start asks ``in_sync_replicas``; a leader that runs may ask
``begin_epoch`` again (a commit cut back), which is no start.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

#: How long a leader's start may take from its ``in_sync_replicas`` to its report
#: (seconds) before unanswered pings fail it over: it surveys the followers (at most
#: ``FOLLOWER_TIMEOUT_SECONDS``, 3 s) and reports to the controller. A restart in place
#: on a loaded 2-core machine took over the ping's 1 s: the controller failed it over
#: mid-start, killing it.
LEADER_START_SECONDS = 5.0


class LeaderStarts:
    """The starts under way, by queue name; times are the controller's clock (s)."""

    def __init__(self) -> None:
        #: Queue -> how many starts the controller is making.
        self._made: dict[str, int] = {}
        #: Queue -> (epoch, when) its leader's start asked for the in-sync set, and has
        #: not reported its own since.
        self._began: dict[str, tuple[int, float]] = {}

    @contextlib.contextmanager
    def making(self, name: str) -> Iterator[None]:
        """Around a start the controller makes and waits for."""
        self._made[name] = self._made.get(name, 0) + 1
        try:
            yield
        finally:
            self._made[name] -= 1
            if not self._made[name]:
                del self._made[name]

    def made_here(self, name: str) -> bool:
        """True while the controller makes a start of ``name``'s leader."""
        return name in self._made

    def began(self, name: str, epoch: int, now: float) -> None:
        """``name``'s leader, starting in ``epoch``, asked for the in-sync set at
        ``now`` (``in_sync_replicas``)."""
        self._began[name] = (epoch, now)

    def reported(self, name: str) -> None:
        """``name``'s leader reported its in-sync set: its start ended (it reports
        once at the end of its start; later reports change nothing here)."""
        self._began.pop(name, None)

    def since(self, name: str, epoch: int, now: float) -> float | None:
        """When ``name``'s leader, starting in ``epoch``, asked for the in-sync set, if
        it has not reported since and ``LEADER_START_SECONDS`` have not passed by
        ``now``; else None."""
        began = self._began.get(name)
        if began is None or began[0] != epoch or now - began[1] >= LEADER_START_SECONDS:
            return None
        return began[1]
