"""The simulator's invariant for priorities: a delivery never leaves behind a message of
a higher priority that the consumer could have been given instead.

A queue finds the priorities of messages stored before it opened only with a background
pass (``raymq.core.priority``): until one has completed, offsets below ``indexed_from``
(the log's end when it opened, or when a subscription was created) are not held to it.
"Could have been given" is the TargetArea's own ``_usable`` (unacknowledged, held by
nobody, not set aside) and the simulator's knowledge (stored, not expired, due, routed
to the subscription and selected by the consumer's selector).
"""

from __future__ import annotations

import msgpack
import numpy as np

from raymq.sim.model import Message, SimConsumer, Violation


def level(m: Message, max_priority: int) -> int:
    """``m``'s priority as the queue ranks it."""
    return min(m.priority, max_priority)


def check_priority_order(sim, c: SimConsumer, offsets: list[int]) -> None:
    """After ``c`` was given ``offsets`` (recorded already): one priority per delivery,
    and nothing of a higher priority that it could have had instead."""
    top = sim.max_priority
    if top is None or not offsets:
        return
    if c.selector and sim._area(c.subscription)._unoffered:
        return  # a failed read left some to housekeeping to match (TargetArea._unoffered)
    delivered = [sim.messages[sim.by_offset[o]] for o in offsets]
    indexed = [m for m in delivered if m.offset >= sim.indexed_from]
    levels = {level(m, top) for m in indexed}
    if len(levels) > 1:
        raise Violation(f"one delivery to {c.cid} mixed priorities {sorted(levels)}: {offsets}")
    lowest = min(level(m, top) for m in delivered)
    area = sim._area(c.subscription)
    for m in sim.ranked:
        if level(m, top) <= lowest or not _could_have(sim, c, m):
            continue
        if area._usable(np.array([m.offset], dtype=np.int64))[0]:
            raise Violation(
                f"{c.cid} was given priority {lowest} ({offsets[:5]}) while offset"
                f" {m.offset} of priority {level(m, top)} waited"
            )


def _could_have(sim, c: SimConsumer, m: Message) -> bool:
    """Whether ``c`` may certainly be given ``m`` now, by what the simulator knows."""
    if m.state != "stored" or m.offset is None or m.offset < sim.indexed_from:
        return False
    if sim._expired(m) or sim._not_due(m):
        return False
    if c.subscription is None:
        if m.acked:
            return False
    elif m.routes.get(c.subscription) != "":
        return False
    if c.selector:
        return msgpack.unpackb(m.properties or b"\x80").get("color") == "red"
    return True


__all__ = ["check_priority_order", "level"]
