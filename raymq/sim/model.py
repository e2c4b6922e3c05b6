"""What the fault simulator knows and draws: the messages it sent, its consumers and an
address's subscriptions, a seed's settings, the routing filters with what each selects,
and the clock that stands in for the queue core's ``time`` module."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, field

QUEUE = "simq"
COLORS = ("red", "green", "blue")
#: Mixed into a seed for the draw of its mode (queue or address) from a generator of its
#: own: a queue-mode seed draws the very sequence it drew before addresses came. Chosen
#: so that the seeds the tests fix for queues (0..11, and 40, 41 of ``make fuzz``) still
#: run the queue they ran; about half of all seeds run an address.
ADDRESS_SALT = 0x2EAC0
#: Mixed into a seed for the generator of its messages' expiries: drawn apart, so that a
#: seed's other draws are what they were before expiry came.
TTL_SALT = 0x77E1
#: Mixed into a seed for the generator of its queue's ``max_priority`` and its messages'
#: priorities (drawn apart, as expiries are).
PRIORITY_SALT = 0x9A1
#: A queue's ``max_priority`` as a seed draws it (None: no priorities).
MAX_PRIORITIES = (None, None, 1, 3, 9)
#: Times to live a message may be sent with (seconds; a step is 10 ms of the clock).
TTLS = (0.05, 0.3, 1.0, 5.0)
#: Delays a message may be scheduled with (seconds from its send).
DELAYS = (0.02, 0.2, 1.0, 3.0)
#: Most subscriptions an address has at once (deleted ones make room).
MAX_SUBSCRIPTIONS = 4
#: Routing filters a subscription draws, with what each selects. A message without
#: properties has none of them: NULL, so a comparison is UNKNOWN, and not selected.
FILTERS: dict[str | None, Callable[[dict | None], bool]] = {
    None: lambda p: True,
    "k < 5": lambda p: p is not None and p["k"] < 5,
    "color = 'red'": lambda p: p is not None and p["color"] == "red",
    "k >= 3 AND color <> 'blue'": lambda p: p is not None and p["k"] >= 3 and p["color"] != "blue",
}


#: Seconds any one call may take before a run calls it a wedge.
CALL_BOUND = 20.0


class Violation(AssertionError):
    """An invariant did not hold."""


class Traced:
    """A run's trace of its steps (printed as they go when ``verbose``), and the bound
    every call it makes is held to."""

    step: int
    verbose: bool
    trace: list[str]

    def _note(self, what: str) -> None:
        self.trace.append(f"{self.step}: {what}")
        if self.verbose:
            print(f"step {self.step}: {what}")

    async def _bounded(self, awaitable, what: str):
        try:
            return await asyncio.wait_for(awaitable, CALL_BOUND)
        except TimeoutError:
            raise Violation(f"{what} did not return within {CALL_BOUND} s (a wedge)") from None


@dataclass
class Message:
    """What the simulator knows of one message it sent."""

    index: int
    body: bytes
    properties: bytes
    #: "sending", "stored" (acknowledged to its producer), "failed" (its send raised),
    #: "doubt" (the outcome came after a crash point).
    state: str = "sending"
    offset: int | None = None
    #: Its ack returned (durably acked); "doubt" if the ack's outcome is not known.
    acked: str = ""
    #: An address's: what each subscription should see of it. "" it must get it (until
    #: its ack), "doubt" it may get it (its ack or its routing is in doubt), "yes" its
    #: ack returned; a subscription not named here must never get it.
    routes: dict[str, str] = field(default_factory=dict)
    #: Its ``RayMQExpiration`` (ms since the epoch by the simulator's clock), if any.
    expires: int | None = None
    #: Its ``RayMQScheduledDelivery`` (ms since the epoch), if any.
    due: int | None = None
    #: Its ``RayMQPriority`` as sent (0: none; may be above the queue's max_priority).
    priority: int = 0
    #: The simulator's clock when it was sent (seconds since the epoch).
    sent_at: float = 0.0


@dataclass
class SimConsumer:
    cid: str
    prefetch: int
    selector: str | None
    held: set[int] = field(default_factory=set)
    #: The address's subscription it consumes from (None: the queue's).
    subscription: str | None = None


@dataclass
class SimSubscription:
    """What the simulator knows of one subscription of the address."""

    name: str
    filter: str | None
    start: str  # "latest" or "earliest"
    #: Index of the first message sent after it was created.
    first_index: int
    #: "live"; "creating" (its create raised, or a crash point came during it: it is not
    #: in the core's memory, and may be on disk) or "deleting" (its delete raised or a
    #: crash point came: in memory, and may be gone from disk) until the next open.
    state: str = "live"

    @property
    def in_memory(self) -> bool:
        """The running core has it (consumers may use it)."""
        return self.state != "creating"


@dataclass
class Settings:
    """What a seed chose for its run."""

    page_size_bytes: int
    checkpoint_interval: float
    fail_rate: float
    flips: bool
    crashes: bool
    max_body: int
    #: An address with subscriptions, not a queue (see ``is_address_seed``).
    address: bool = False

    @classmethod
    def draw(cls, rng: random.Random, seed: int | None = None) -> Settings:
        """The settings of ``seed``'s run from its generator ``rng`` (and its mode from
        ``seed`` alone, so that ``rng`` draws for a queue what it always drew)."""
        return cls(
            page_size_bytes=rng.choice([4096, 8192, 32768]),
            checkpoint_interval=rng.choice([0.001, 0.001, 3600.0]),
            fail_rate=rng.choice([0.0, 0.0, 0.002, 0.01, 0.03]),
            flips=rng.random() < 0.35,
            crashes=rng.random() < 0.8,
            max_body=rng.choice([64, 600, 3000]),
            address=seed is not None and is_address_seed(seed),
        )


def is_address_seed(seed: int) -> bool:
    """Whether ``seed`` runs an address (about half the seeds do)."""
    return random.Random(seed ^ ADDRESS_SALT).random() < 0.5


class SimClock:
    """Stands in for the ``time`` module in the queue core: seconds move with steps."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return 1_700_000_000.0 + self.now


def offset_runs(offsets: list[int]) -> str:
    """Sorted offsets as "a..b" runs (b inclusive), for a report."""
    runs: list[list[int]] = []
    for o in offsets:
        if runs and o == runs[-1][1] + 1:
            runs[-1][1] = o
        else:
            runs.append([o, o])
    return ", ".join(f"{a}..{b}" if a != b else str(a) for a, b in runs[:20])


__all__ = [
    "ADDRESS_SALT",
    "COLORS",
    "DELAYS",
    "FILTERS",
    "MAX_PRIORITIES",
    "MAX_SUBSCRIPTIONS",
    "PRIORITY_SALT",
    "QUEUE",
    "TTLS",
    "TTL_SALT",
    "Message",
    "Settings",
    "SimClock",
    "SimConsumer",
    "SimSubscription",
    "Violation",
    "is_address_seed",
    "offset_runs",
]
