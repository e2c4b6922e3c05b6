"""Broker and queue settings, with their validation.

Names follow Artemis where Artemis has one (``max_size_bytes``, ``page_size_bytes``,
``address_full_policy``, ``page_max_cache_size``, ``paging_directory``).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from raymq.errors import InvalidQueueName, InvalidSetting

#: Where queues keep their files unless told otherwise: ``$RAYMQ_PAGING_DIRECTORY`` or
#: ``~/.raymq/paging`` (not /tmp, which may be wiped at boot and lose durable messages).
DEFAULT_PAGING_DIRECTORY = os.environ.get(
    "RAYMQ_PAGING_DIRECTORY", os.path.join(os.path.expanduser("~"), ".raymq", "paging")
)
DEFAULT_MAX_MESSAGE_SIZE = 100 * 2**20
DEFAULT_PAGE_SIZE_BYTES = 10 * 2**20
MAX_QUEUE_NAME_BYTES = 200
#: Longest each queue actor has to flush and close when the broker stops
#: (``Broker.shutdown``, ``raymq stop``) before it is ended all the same (seconds).
STOP_SECONDS = 30.0
ADDRESS_FULL_POLICIES = ("PAGE", "DROP", "FAIL", "BLOCK")
#: A queue's dead-letter queue is named after it with this suffix unless told otherwise.
DEAD_LETTER_SUFFIX = ".DLQ"

#: Environment for Ray processes that RayMQ starts (an embedded local Ray). The raylet
#: frees unreferenced objects in batches, by default once a second: at 220 MB/s of
#: deliveries that leaves ~230 MiB of dead batches in the object store, several times
#: the flow-to-disk threshold. Every 100 ms keeps it near 24 MiB (bench/deep_backlog.py).
RAY_ENV_DEFAULTS = {"RAY_free_objects_period_milliseconds": "100"}


def apply_ray_env_defaults() -> None:
    """Set ``RAY_ENV_DEFAULTS`` in this process's environment unless already set, so
    Ray processes started from here inherit them (no effect on a running cluster)."""
    for key, value in RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


def validate_queue_name(name: object) -> str:
    """Return ``name`` if it is safe as a directory name under the paging directory.

    Raises ``TypeError`` for a non-string and ``InvalidQueueName`` for a name that is
    empty, not valid Unicode (a lone surrogate), over 200 bytes in UTF-8, contains
    ``/``, ``\\`` or NUL, or is ``.``/``..``.
    """
    if not isinstance(name, str):
        raise TypeError(f"queue name must be str, not {type(name).__name__}")
    if not name:
        raise InvalidQueueName("queue name is empty")
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: no file name can hold it
        raise InvalidQueueName(f"queue name {name!r} is not valid Unicode") from None
    if len(encoded) > MAX_QUEUE_NAME_BYTES:
        raise InvalidQueueName(f"queue name {name[:40]!r}... is over {MAX_QUEUE_NAME_BYTES} bytes")
    for bad in ("/", "\\", "\x00"):
        if bad in name:
            raise InvalidQueueName(f"queue name {name!r} contains {bad!r}")
    if name in (".", "..") or name.startswith("."):
        raise InvalidQueueName(f"queue name {name!r} may not start with '.'")
    if any(ord(c) < 32 for c in name):
        raise InvalidQueueName(f"queue name {name!r} contains a control character")
    return name


def check_int(setting: str, value: object, *, minimum: int, allow_minus_one: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{setting} must be int, not {type(value).__name__}")
    if allow_minus_one and value == -1:
        return value
    if value < minimum:
        raise InvalidSetting(f"{setting}={value} is below its minimum {minimum}")
    return value


#: Most copies of a replicated queue.
MAX_REPLICAS = 5
#: Longest ``dedup_window_s`` or redelivery delay, seconds (a week): longer is a
#: mistake (ms taken for s).
MAX_DELAY_SECONDS = 7 * 86400.0


def check_delay(value: object, queue: str, setting: str = "delay") -> float:
    """``value`` as seconds from 0 to ``MAX_DELAY_SECONDS``; ``InvalidSetting`` naming
    the queue and the setting otherwise."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 <= value <= MAX_DELAY_SECONDS
    ):
        raise InvalidSetting(
            f"{setting}={value!r} for queue {queue!r} must be seconds from 0"
            f" to {MAX_DELAY_SECONDS:g}"
        )
    return float(value)


def check_ttl(ttl: object, where: str, setting: str = "ttl") -> None:
    """Raise ``InvalidSetting`` naming ``where`` unless ``ttl`` is None or a finite
    number of seconds > 0 (a message's time to live, ``raymq.core.expiry``)."""
    if ttl is None:
        return
    if isinstance(ttl, bool) or not isinstance(ttl, int | float):
        raise InvalidSetting(f"{setting}={ttl!r} for {where} must be a number of seconds")
    if not math.isfinite(ttl) or ttl <= 0:
        raise InvalidSetting(f"{setting}={ttl!r} for {where} must be finite and > 0 seconds")


#: The highest ``max_priority`` a queue may have (RabbitMQ's limit).
MAX_PRIORITY = 255


def check_priority(priority: object, where: str, setting: str = "priority") -> None:
    """Raise ``InvalidSetting`` naming ``where`` unless ``priority`` is None or an int
    from 0 to ``MAX_PRIORITY`` (``setting`` names the argument)."""
    if priority is None:
        return
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidSetting(f"{setting}={priority!r} for {where} must be an int")
    low = 1 if setting == "max_priority" else 0
    if not low <= priority <= MAX_PRIORITY:
        raise InvalidSetting(
            f"{setting}={priority!r} for {where} must be from {low} to {MAX_PRIORITY}"
        )


@dataclass(frozen=True)
class QueueConfig:
    """Settings of one queue; equal settings make ``create_queue`` idempotent."""

    name: str
    durable: bool = True
    #: Bytes of messages the queue may hold in memory; -1 means no per-queue limit.
    max_size_bytes: int = -1
    #: Largest size of one segment (page) file, bytes.
    page_size_bytes: int = DEFAULT_PAGE_SIZE_BYTES
    #: What a send does when ``max_size_bytes`` is reached: PAGE, DROP, FAIL or BLOCK.
    address_full_policy: str = "PAGE"
    #: How many segment files the queue keeps cached for reading.
    page_max_cache_size: int = 5
    #: Deliveries of one message before it goes to the dead-letter queue instead of
    #: being delivered again (Artemis's max-delivery-attempts); None: no limit.
    max_delivery_attempts: int | None = None
    #: Where dead letters go; None: ``f"{name}.DLQ"``, created when first needed.
    dead_letter_queue: str | None = None
    #: An address (Artemis's multicast address): messages stored once, delivered to
    #: each of its subscriptions; False: a queue.
    address: bool = False
    #: Copies of the queue's files, each on its own node (1: not replicated; 2 or 3:
    #: a leader and followers, see ``raymq.core.replication``).
    replicas: int = 1
    #: Replicas that must have a send durably before it is answered (Kafka's
    #: min.insync.replicas); None: all of them for 2 replicas, 2 of 3.
    min_insync_replicas: int | None = None
    #: Seconds a producer's message id (``send(message_id=...)``) is remembered: a
    #: message sent again with it meanwhile is not stored again (0: ids not checked).
    dedup_window_s: float = 120.0
    #: Most producer ids remembered (Artemis's id-cache-size), the oldest forgotten
    #: first: bounds their memory (up to ~400 bytes each) and every checkpoint's size.
    id_cache_size: int = 100_000
    #: Seconds a nacked message waits before it is delivered again (``Consumer.nack``'s
    #: ``delay`` overrides it per call); 0: at once.
    redelivery_delay_s: float = 0.0
    #: Seconds a message sent without a ``ttl`` lives (Artemis's expiry-delay); None:
    #: for ever. An expired message is never delivered (``raymq.core.expiry``).
    default_ttl_s: float | None = None
    #: Where expired messages go (created when first needed, as a dead-letter queue
    #: is); None: they are dropped. Either way they count in ``messages_expired``.
    expiry_queue: str | None = None
    #: Seconds between background passes that find expired messages nobody asks for
    #: (Artemis's message-expiry-scan-period), so that they free their files.
    message_expiry_scan_period_s: float = 30.0
    #: Highest message priority (1 to 255, RabbitMQ's x-max-priority): higher ones are
    #: delivered first (``raymq.core.priority``); None: in order, priorities ignored.
    max_priority: int | None = None
    #: An address's retention (Kafka's retention.ms and retention.bytes): messages
    #: every subscription acknowledged stay on disk, for new subscriptions and seeks,
    #: until their segment file is older than ``retention_s`` seconds and the address
    #: keeps ``retention_bytes`` of newer files (None: no such limit; both None: no
    #: retention, a segment goes once acknowledged). See ``raymq.storage.retention``.
    retention_s: float | None = None
    retention_bytes: int | None = None

    def __post_init__(self) -> None:
        validate_queue_name(self.name)
        for setting in ("durable", "address"):
            value = getattr(self, setting)
            if not isinstance(value, bool):
                raise TypeError(f"{setting} must be bool, not {type(value).__name__}")
        check_int("max_size_bytes", self.max_size_bytes, minimum=1, allow_minus_one=True)
        check_int("page_size_bytes", self.page_size_bytes, minimum=4096)
        check_int("page_max_cache_size", self.page_max_cache_size, minimum=0)
        if self.address_full_policy not in ADDRESS_FULL_POLICIES:
            raise InvalidSetting(
                f"address_full_policy={self.address_full_policy!r} for queue {self.name!r}"
                f" is not one of {', '.join(ADDRESS_FULL_POLICIES)}"
            )
        if self.max_delivery_attempts is not None:
            check_int("max_delivery_attempts", self.max_delivery_attempts, minimum=1)
        check_int("id_cache_size", self.id_cache_size, minimum=0)
        for setting in ("dedup_window_s", "redelivery_delay_s"):
            check_delay(getattr(self, setting), self.name, setting)
        if self.dead_letter_queue is not None:
            validate_queue_name(self.dead_letter_queue)
        else:  # the default name must be valid too (a name near the length limit)
            try:
                validate_queue_name(self.dead_letter_address)
            except InvalidQueueName as exc:
                raise InvalidSetting(
                    f"queue {self.name!r}: its default dead_letter_queue is not a valid name"
                    f" ({exc}); name one with dead_letter_queue="
                ) from None
        if self.dead_letter_address == self.name:
            raise InvalidSetting(f"queue {self.name!r} cannot be its own dead_letter_queue")
        self._check_expiry()
        check_priority(self.max_priority, f"queue {self.name!r}", "max_priority")
        self._check_retention()
        self._check_replicas()

    def _check_expiry(self) -> None:
        check_ttl(self.default_ttl_s, f"queue {self.name!r}", "default_ttl_s")
        if self.expiry_queue is not None:
            validate_queue_name(self.expiry_queue)
            if self.expiry_queue == self.name:
                raise InvalidSetting(f"queue {self.name!r} cannot be its own expiry_queue")
        period = self.message_expiry_scan_period_s
        check_delay(period, self.name, "message_expiry_scan_period_s")
        if period <= 0:
            raise InvalidSetting(
                f"message_expiry_scan_period_s={period!r} for queue {self.name!r} must be > 0"
            )

    @property
    def retains(self) -> bool:
        """True if acknowledged messages are kept (``retention_s``/``retention_bytes``)."""
        return self.retention_s is not None or self.retention_bytes is not None

    def _check_retention(self) -> None:
        if self.retention_s is not None:
            check_ttl(self.retention_s, f"address {self.name!r}", "retention_s")
        if self.retention_bytes is not None:
            check_int("retention_bytes", self.retention_bytes, minimum=0)
        if not self.retains:
            return
        if not self.address:
            raise InvalidSetting(
                f"retention_s/retention_bytes for queue {self.name!r}: retention is an"
                " address's (create_address), for its subscriptions to replay"
            )
        if not self.durable or self.address_full_policy != "PAGE":
            raise InvalidSetting(
                f"address {self.name!r}: retention needs durable=True and"
                f" address_full_policy='PAGE' (not {self.address_full_policy!r}): retained"
                " messages stay on disk"
            )

    def _check_replicas(self) -> None:
        check_int("replicas", self.replicas, minimum=1)
        if self.replicas > MAX_REPLICAS:
            raise InvalidSetting(
                f"replicas={self.replicas} for queue {self.name!r} is above {MAX_REPLICAS}"
            )
        if self.min_insync_replicas is not None:
            check_int("min_insync_replicas", self.min_insync_replicas, minimum=1)
        if self.replicas == 1:
            if self.min_insync_replicas not in (None, 1):
                raise InvalidSetting(
                    f"min_insync_replicas={self.min_insync_replicas} for queue {self.name!r}"
                    " needs replicas >= it"
                )
            return
        if not self.durable or self.address:
            kind = "an address" if self.address else "a non-durable queue"
            raise InvalidSetting(
                f"replicas={self.replicas} for {kind} {self.name!r}: only durable queues"
                " are replicated"
            )
        # A leader acknowledging alone could not know it still leads (a paused leader
        # is fenced by followers refusing its epoch): at least one follower must agree.
        if self.min_insync_replicas is not None and not (
            2 <= self.min_insync_replicas <= self.replicas
        ):
            raise InvalidSetting(
                f"min_insync_replicas={self.min_insync_replicas} for queue {self.name!r}"
                f" with replicas={self.replicas} must be between 2 and {self.replicas}: a"
                " leader alone cannot tell that it was replaced"
            )

    @property
    def insync_quorum(self) -> int:
        """Replicas (the leader included) that must have a commit before it is
        answered: ``min_insync_replicas``, by default all of 2, or 2 of 3."""
        if self.min_insync_replicas is not None:
            return self.min_insync_replicas
        return min(self.replicas, 2)

    @property
    def dead_letter_address(self) -> str:
        """The dead-letter queue's name: ``dead_letter_queue`` or ``f"{name}.DLQ"``."""
        return self.dead_letter_queue or f"{self.name}{DEAD_LETTER_SUFFIX}"

    def to_dict(self) -> dict[str, Any]:
        """Return the settings as a plain dict (stored as the queue's ``queue.json``)."""
        return asdict(self)


@dataclass(frozen=True)
class BrokerConfig:
    """Settings of the whole broker."""

    #: Directory holding one sub-directory of segment files per queue.
    paging_directory: str = DEFAULT_PAGING_DIRECTORY
    #: Largest message body accepted, bytes.
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE
    #: Bytes of undelivered messages a durable queue keeps in its HeadQueueCache beyond
    #: what its consumers can take at once (their prefetch), within its memory budget;
    #: all of its HeadQueueCache until the MemoryGovernor gives it a budget. Small: a
    #: backlog held in memory that no consumer will take soon slows fills and restarts
    #: down (bench/memory_defaults.py); the rest is read from the segment files.
    head_cache_bytes: int = 16 * 2**20
    #: Seconds between checkpoints of a queue's index and ack state.
    checkpoint_interval: float = 1.0
    #: Bytes of messages the whole broker keeps in memory before they flow to disk
    #: (Qpid's threshold). None: 75 % of each alive node's Ray object store memory.
    flow_to_disk_threshold: int | None = None
    #: Seconds between two rounds of the MemoryGovernor (collect usage, push budgets).
    housekeeping_period: float = 1.0
    #: Bytes per second each durable queue re-reads to verify its stored records' CRCs,
    #: so that rot is found before a consumer needs the data; 0 turns the scrub off.
    scrub_bytes_per_second: int = 4 * 2**20
    #: Running unreplicated queue actors per node; over it the least recently used idle
    #: queues hibernate (their files stay; the next call revives them). None: no cap.
    max_active_queues: int | None = None
    #: Seconds a queue may stay idle before it hibernates. None: never for idleness.
    hibernate_after_seconds: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.paging_directory, str | os.PathLike):
            raise TypeError("paging_directory must be a path")
        object.__setattr__(self, "paging_directory", os.fspath(self.paging_directory))
        check_int("max_message_size", self.max_message_size, minimum=1)
        check_int("head_cache_bytes", self.head_cache_bytes, minimum=0)
        for name in ("checkpoint_interval", "housekeeping_period"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise InvalidSetting(f"{name}={value!r} must be a number of seconds > 0")
        check_int("scrub_bytes_per_second", self.scrub_bytes_per_second, minimum=0)
        if self.flow_to_disk_threshold is not None:
            check_int("flow_to_disk_threshold", self.flow_to_disk_threshold, minimum=1)
        from raymq.core.hibernation import HibernationSettings  # checks both (no cycle)

        HibernationSettings(self.max_active_queues, self.hibernate_after_seconds)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> BrokerConfig:
        """Build a config from ``connect(**broker_config)``; unknown names are an error."""
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        unknown = set(kwargs) - known
        if unknown:
            raise InvalidSetting(
                f"unknown broker setting(s) {sorted(unknown)}; known: {sorted(known)}"
            )
        return cls(**kwargs)
