"""MessageBatch without Ray: property groups and the wire form SendChannel carries."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from raymq.batch import MessageBatch, consecutive_rows, stored_property_groups
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


def test_consecutive_rows_are_a_slice_of_one_batch_and_nothing_else_is():
    one = batch(PROPS, first=10)  # offsets 10..15
    got = consecutive_rows([one], np.arange(11, 14))
    assert got is not None and got.first_offset == 11 and len(got) == 3
    assert [got.body(i) for i in range(3)] == [one.body(i) for i in range(1, 4)]
    assert consecutive_rows([one], np.arange(10, 16)) is one
    assert consecutive_rows([one], np.array([11, 13])) is None  # not consecutive
    assert consecutive_rows([one], np.arange(14, 17)) is None  # past its end
    assert consecutive_rows([one, batch(PROPS, first=16)], np.arange(11, 13)) is None


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


def test_numpy_view_reads_a_slice_of_any_width():
    import pyarrow as pa

    from raymq.batch import fixed_array, numpy_view

    ints = fixed_array(pa.int32(), np.arange(10), np.int32)
    assert numpy_view(ints.slice(3, 4), np.int32).tolist() == [3, 4, 5, 6]
    assert numpy_view(fixed_array(pa.int64(), np.arange(0)), np.int64).tolist() == []


# What a queue actor runs (sends with and without properties, a consumer's fetch, ack,
# nack, close, a consumer with a selector), in a process of its own: pyarrow imports pandas
# on its first to_numpy, pa.array or Python scalar (~0.24 s of CPU), which every queue
# actor's start and revival paid.
_QUEUE_WITHOUT_PANDAS = """
import asyncio, sys
import numpy as np
from raymq.batch import MessageBatch
from raymq.config import BrokerConfig, QueueConfig
from raymq.core.queue import QueueCore

async def main(directory):
    q = QueueCore(QueueConfig("q"), BrokerConfig(paging_directory=directory))
    q.start()
    await q.send_batch(MessageBatch.from_bodies([b"a", b"b"], None, max_message_size=100))
    props = [{"color": "red"}, None, {"n": 1}]
    await q.send_batch(MessageBatch.from_bodies([b"c"] * 3, props, max_message_size=100))
    q.register_consumer("c", 100)
    first = await q.fetch_delivery("c", 3, 1.0, 100)
    assert len(first.offsets) == 3, first
    await q.ack("c", np.asarray(first.offsets[:2], dtype=np.int64))
    q.nack("c", np.asarray(first.offsets[2:], dtype=np.int64))
    again = await q.fetch_delivery("c", 10, 1.0, 100)
    assert len(again.offsets) == 3, again
    q.close_consumer("c")
    selector = "color LIKE 'r%' AND (n IS NULL OR n / 2 BETWEEN 0 AND 9) AND color IN ('red')"
    q.register_consumer("s", 100, selector)
    red = await q.fetch_delivery("s", 10, 1.0, 100, selector)
    assert len(red.offsets) == 1, red
    q.close_consumer("s")
    await q.close()

asyncio.run(main(sys.argv[1]))
print("pandas" in sys.modules)
"""


def test_a_queue_stores_selects_delivers_and_acks_without_importing_pandas(tmp_path):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _QUEUE_WITHOUT_PANDAS, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "False"
