"""ConsumerTarget: the queue side of one consumer's TargetList (``TargetArea`` keeps
one per consumer): its credit, what it holds, and for a selector its CacheReferences
(``candidates``) and the scan a late arrival makes of what was stored before it."""

from __future__ import annotations

from dataclasses import dataclass, field

from raymq.core.offset_set import OffsetSet
from raymq.selector import Selector


@dataclass
class ConsumerTarget:
    """The queue side of one consumer's TargetList."""

    consumer_id: str
    prefetch: int
    selector: Selector | None = None
    held: set[int] = field(default_factory=set)
    delivered: int = 0
    acked: int = 0
    #: Delivered messages it gave back unseen by the application (budget cuts, close).
    given_back: int = 0
    #: Matching offsets not yet delivered to this consumer (selector consumers only).
    candidates: OffsetSet | None = None
    #: Stored messages in [scan_pos, scan_end) still to be matched (a late arrival).
    scan_pos: int = 0
    scan_end: int = 0
    segments_skipped: int = 0
    messages_scanned: int = 0
    #: Opaque handle the shell uses to check the consumer is alive (its actor).
    watch: object = None
    #: Offsets below this may have reached this consumer's application before (it
    #: left and came back with the same id: its queue side was released meanwhile).
    stale_below: int = 0

    @property
    def scanning(self) -> bool:
        """True while stored messages remain to be matched."""
        return self.scan_pos < self.scan_end
