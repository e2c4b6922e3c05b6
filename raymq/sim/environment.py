"""What the simulator changes in the queue core while a seed runs, so that a seed
replays exactly: no thread, no wall clock, no background pass or retry that waits on
real time. ``simulated`` applies it all and undoes it all."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

from raymq.core import admission, group_commit, replication
from raymq.core import dead_letter_mover as mover_module
from raymq.core import queue as queue_module
from raymq.core.queue import QueueCore
from raymq.core.subscription import Subscription
from raymq.sim.model import SimClock

#: The queue core's modules that read the clock: the simulator's clock stands in for
#: their ``time`` module.
CLOCKED_MODULES = (queue_module, group_commit, admission)


async def inline(func, /, *args, **kwargs):
    """``asyncio.to_thread``, run in the caller instead (the order of a seed's events
    must not depend on threads)."""
    return func(*args, **kwargs)


async def forever() -> None:
    """A background loop the simulator runs itself, when it says."""
    await asyncio.Event().wait()


async def forever_method(self) -> None:
    """``forever``, as a method."""
    await asyncio.Event().wait()


def detach_loops(core: QueueCore) -> None:
    """Housekeeping and the scrub of ``core`` run when the simulator says, not on the
    wall clock."""
    core._tick_loop = core._scrub_loop = forever


@contextlib.contextmanager
def simulated(clock: SimClock, verbose: bool, *, replicated: bool = False) -> Iterator[None]:
    """Run the core inline on ``clock``; quiet unless ``verbose``. ``replicated``: a
    follower's commit is waited for until it answers (the simulator decides when a
    leader is cut off; a wall-clock timeout would fire at random), and a failed
    catch-up is tried again at once."""
    quiet = logging.getLogger("raymq")
    level = quiet.level
    if not verbose:
        quiet.setLevel(logging.CRITICAL)
    to_thread, clocks = asyncio.to_thread, [m.time for m in CLOCKED_MODULES]
    # The subscriptions' background passes and delivery-time timers wait on the wall
    # clock: they run when the simulator says (housekeeping; fetches release what is
    # due).
    loops = Subscription._expiry_loop, Subscription._schedule_loop
    Subscription._expiry_loop = Subscription._schedule_loop = forever_method
    # A failed dead-letter move (an injected I/O error) is retried at once, not after a
    # wall-clock wait (the run would stall, not replay differently).
    retry = mover_module.DEAD_LETTER_RETRY_FIRST_SECONDS
    mover_module.DEAD_LETTER_RETRY_FIRST_SECONDS = 0.0
    waits = replication.FOLLOWER_TIMEOUT_SECONDS, replication.CATCH_UP_RETRY_SECONDS
    if replicated:
        replication.FOLLOWER_TIMEOUT_SECONDS = 1e9
        replication.CATCH_UP_RETRY_SECONDS = 0.0
    # The queue hands big writes and unlinks to threads; here they run inline, and its
    # clock is the simulator's.
    asyncio.to_thread = inline
    for module in CLOCKED_MODULES:
        module.time = clock
    try:
        yield
    finally:
        asyncio.to_thread = to_thread
        Subscription._expiry_loop, Subscription._schedule_loop = loops
        mover_module.DEAD_LETTER_RETRY_FIRST_SECONDS = retry
        replication.FOLLOWER_TIMEOUT_SECONDS, replication.CATCH_UP_RETRY_SECONDS = waits
        for module, saved in zip(CLOCKED_MODULES, clocks, strict=True):
            module.time = saved
        quiet.setLevel(level)


__all__ = ["CLOCKED_MODULES", "detach_loops", "forever", "inline", "simulated"]
