"""Who holds what, model-based (hypothesis's stateful testing), without Ray.

A QueueCore on real files is driven by random sends, consumers with and without
selectors arriving early and late, deliveries, acks, nacks, rejects, give-backs and
closes (a dead consumer is closed the same way), checked after every step against a
small reference model: each message is held by at most one consumer, the queue's
bookkeeping agrees with itself, nothing acknowledged comes again, and once every
consumer is gone a new one gets every message that is neither acknowledged nor
dead-lettered (none stuck in flight).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from raymq.batch import MessageBatch
from raymq.config import BrokerConfig, QueueConfig
from raymq.core.queue import QueueCore
from raymq.core.target_area import DEAD_LETTER_HOLDER

COLOURS = ["red", "blue"]
SELECTORS = [None, "colour = 'red'", "colour = 'blue'"]


class Ownership(RuleBasedStateMachine):
    consumers = Bundle("consumers")

    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="rmq-model-")
        self.loop = asyncio.new_event_loop()
        self.q = QueueCore(
            QueueConfig("m", page_size_bytes=4096, max_delivery_attempts=3),
            BrokerConfig(paging_directory=self.dir, head_cache_bytes=64 * 1024),
            self._sink,
        )
        self.loop.run_until_complete(self._start())
        self.colour: dict[int, str] = {}
        self.acked: set[int] = set()
        self.dead: set[int] = set()  # dead-lettered (moved, or waiting to be)
        self.holds: dict[str, set[int]] = {}  # what each consumer holds, per the model
        self.selector: dict[str, str | None] = {}
        self.ids = 0

    async def _start(self) -> None:
        self.q.start()

    async def _sink(self, name: str, batch: MessageBatch) -> None:
        return None  # the dead-letter queue itself is tested elsewhere

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def teardown(self):
        self.run(self.q.close())
        self.loop.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- rules ---------------------------------------------------------------------

    @rule(colours=st.lists(st.sampled_from(COLOURS), min_size=1, max_size=20))
    def send(self, colours):
        batch = MessageBatch.from_bodies(
            [b"x"] * len(colours),
            [{"colour": c} for c in colours],
            max_message_size=2**20,
        )
        first, n = self.run(self.q.send_batch(batch))
        for k in range(n):
            self.colour[first + k] = colours[k]

    @rule(target=consumers, selector=st.sampled_from(SELECTORS), prefetch=st.integers(1, 30))
    def register(self, selector, prefetch):
        self.ids += 1
        cid = f"c{self.ids}"
        self.q.register_consumer(cid, prefetch, selector)
        self.holds[cid] = set()
        self.selector[cid] = selector
        return cid

    @rule(cid=consumers, k=st.integers(1, 40))
    def fetch(self, cid, k):
        if cid not in self.holds:
            return
        got = self.run(self.q.fetch(cid, k, 0, 1000))
        offsets = got.column("offset").to_pylist()
        assert offsets == sorted(offsets)
        for o in offsets:
            assert o in self.colour, f"{o} was never sent"
            assert o not in self.acked, f"{o} was acknowledged and came again"
            assert o not in self.dead, f"{o} was dead-lettered and came again"
            assert all(o not in h for h in self.holds.values()), f"{o} held twice"
            wanted = self.selector[cid]
            assert wanted is None or wanted == f"colour = '{self.colour[o]}'"
        self.holds[cid].update(offsets)

    def _some(self, cid, data) -> list[int]:
        held = sorted(self.holds.get(cid, ()))
        return data.draw(st.lists(st.sampled_from(held), unique=True)) if held else []

    @rule(cid=consumers, data=st.data(), pipelined=st.booleans())
    def ack(self, cid, data, pipelined):
        if cid not in self.holds:
            return
        chosen = self._some(cid, data)
        if pipelined:  # a gathered ack arrives as one call whatever its order
            chosen = list(reversed(chosen))
        self.run(self.q.ack(cid, np.array(chosen, dtype=np.int64)))
        self.holds[cid].difference_update(chosen)
        self.acked.update(chosen)

    @rule(cid=consumers, data=st.data())
    def nack(self, cid, data):
        if cid not in self.holds:
            return
        chosen = self._some(cid, data)
        self.q.nack(cid, np.array(chosen, dtype=np.int64))
        self.holds[cid].difference_update(chosen)
        self._note_dead_letters()

    @rule(cid=consumers, data=st.data())
    def reject(self, cid, data):
        if cid not in self.holds:
            return
        chosen = self._some(cid, data)
        self.q.reject(cid, np.array(chosen, dtype=np.int64))
        self.holds[cid].difference_update(chosen)
        self.dead.update(chosen)

    @rule(cid=consumers, data=st.data())
    def give_back(self, cid, data):
        if cid not in self.holds:
            return
        chosen = self._some(cid, data)
        self.q.give_back(cid, np.array(chosen, dtype=np.int64))
        self.holds[cid].difference_update(chosen)

    @rule(cid=consumes(consumers), data=st.data())
    def close(self, cid, data):
        if cid not in self.holds:
            return
        unseen = self._some(cid, data)  # prefetched, never handed to the application
        self.q.close_consumer(cid, np.array(unseen, dtype=np.int64))
        del self.holds[cid]
        self._note_dead_letters()

    def _note_dead_letters(self) -> None:
        self.dead.update(self.q.area.dead_letters)
        self.dead.update(o for o in self.colour if self.q.log.is_acked(np.array([o]))[0])
        self.dead.difference_update(self.acked)

    @precondition(lambda self: self.colour)
    @rule()
    def everyone_leaves_and_a_newcomer_drains(self):
        for cid in list(self.holds):
            self.q.close_consumer(cid)
            del self.holds[cid]
        self._note_dead_letters()
        self.ids += 1
        cid = f"c{self.ids}"
        self.q.register_consumer(cid, 100_000)
        got = self.run(self.q.fetch(cid, 100_000, 0, 100_000))
        offsets = set(got.column("offset").to_pylist())
        expected = set(self.colour) - self.acked - self.dead
        assert offsets == expected, (
            f"stuck: {sorted(expected - offsets)[:10]}; extra: {sorted(offsets - expected)[:10]}"
        )
        self.q.close_consumer(cid, np.array(sorted(offsets), dtype=np.int64))

    # -- invariants ----------------------------------------------------------------

    @invariant()
    def bookkeeping_agrees(self):
        area = self.q.area
        holder = area._holder
        for cid, target in area.consumers.items():
            assert target.held == self.holds.get(cid, set()), cid
            for o in target.held:
                assert holder.get(o) == cid, (o, holder.get(o), cid)
        held = {o for t in area.consumers.values() for o in t.held}
        waiting = set(area.dead_letters)
        assert set(holder) == held | waiting
        assert all(holder[o] == DEAD_LETTER_HOLDER for o in waiting)
        assert self.q.stats().in_flight == len(held)


Ownership.TestCase.settings = settings(
    # A longer hunt: RAYMQ_MODEL_EXAMPLES=2000 python -m pytest tests/test_ownership_model.py
    max_examples=int(os.environ.get("RAYMQ_MODEL_EXAMPLES", "60")),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestOwnership = Ownership.TestCase
