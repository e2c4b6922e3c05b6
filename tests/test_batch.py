"""MessageBatch without Ray: property groups and the wire form SendChannel carries."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from raymq.batch import MessageBatch, stored_property_groups
from raymq.selector import Selector

PROPS = [{"color": "red"}, None, {"color": "blue"}, {"color": "red"}, None, {"n": 1}]


def batch(props, first: int = 0) -> MessageBatch:
    b = MessageBatch.from_bodies([b"x"] * len(props), props, max_message_size=100)
    b.first_offset = first
    return b


def test_property_groups_name_each_message_s_distinct_map():
    groups = batch(PROPS).property_groups()
    decoded = [msgpack.unpackb(d) if d else None for d in groups.distinct]
    assert len(decoded) == 4  # red, none, blue, n
    assert [decoded[i] for i in groups.index] == PROPS
    assert groups.counts.tolist() == [PROPS.count(d) for d in decoded]


def test_property_groups_of_a_batch_without_properties():
    groups = batch([None] * 3).property_groups()
    assert groups.distinct == [b""] and groups.index.tolist() == [0, 0, 0]
    assert groups.counts.tolist() == [3]


def test_stored_groups_span_batches_with_gaps_between_them():
    parts = [batch(PROPS[:3], first=10), batch(PROPS[3:], first=20)]  # 13..19 missing
    groups, offsets = stored_property_groups(parts)
    assert offsets.tolist() == [10, 11, 12, 20, 21, 22]
    mask = Selector("color = 'red'").match_groups(groups.distinct, groups.index)
    assert offsets[mask].tolist() == [10, 20]


@pytest.mark.parametrize("text", ["color = 'red'", "color IS NULL", "n > 0 OR color = 'blue'"])
def test_matching_groups_equals_matching_each_message(text):
    sel = Selector(text)
    b = batch(PROPS)
    groups = b.property_groups()
    assert (
        sel.match_groups(groups.distinct, groups.index) == sel.match([p or {} for p in PROPS])
    ).all()


def test_the_wire_form_round_trips_and_refuses_offsets_that_do_not_fit():
    b = batch(PROPS)
    wire = [bytes(memoryview(x).cast("B")) for x in b.wire_buffers()]
    back = MessageBatch.from_wire(wire, "q")
    assert [back.properties_bytes(i) for i in range(len(back))] == [
        b.properties_bytes(i) for i in range(len(b))
    ]
    bad = list(wire)
    bad[0] = np.array([0, 1, 5, 3, 4, 5, 6], dtype="<i8").tobytes()  # goes backwards
    with pytest.raises(ValueError, match="queue 'q'"):
        MessageBatch.from_wire(bad, "q")
    with pytest.raises(ValueError, match="4 buffers"):
        MessageBatch.from_wire(wire[:3], "q")
