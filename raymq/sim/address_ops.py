"""The fault simulator's side of an address: subscriptions created ("latest" or
"earliest", some with a routing filter) and deleted as a run goes, what each should be
served, and what an open finds of those whose create or delete was in doubt."""

from __future__ import annotations

import random

import msgpack

from raymq.core.queue import QueueCore
from raymq.errors import ConsumerClosed, StorageError, SubscriptionNotFound
from raymq.sim.disk import SimDisk
from raymq.sim.model import (
    FILTERS,
    MAX_SUBSCRIPTIONS,
    Message,
    SimConsumer,
    SimSubscription,
    Violation,
)


class AddressOps:
    """Operations and checks on an address's subscriptions, mixed into ``Simulation``
    (they use its core, generator, disk, messages, consumers and counts)."""

    core: QueueCore
    rng: random.Random
    disk: SimDisk
    messages: list[Message]
    consumers: dict[str, SimConsumer]
    subs: dict[str, SimSubscription]
    sub_names: int
    counts: dict[str, int]

    def _note(self, what: str) -> None:
        """Add ``what`` to the run's trace (``Simulation._note``)."""
        raise NotImplementedError

    async def _drain_subscriptions(self) -> None:
        """The end of a run: each subscription drained, some drains acknowledging what
        they get, some leaving it for the next ones (an "earliest" subscription starts
        with it); then what the address still needs, and what its retention keeps."""
        all_acked = True
        for name in self._subscriptions_in_memory():
            ack = self.rng.random() < 0.6
            all_acked = all_acked and ack
            drained = await self._drain(name, ack)
            self._count_damage(self.core)
            self._check_outstanding(name, drained)
        depth = self.core.stats().depth  # (retained messages are not in it)
        if all_acked and depth > self._waiting_anywhere():
            raise Violation(f"every subscription drained, yet depth is {depth}")
        self._check_retention()

    def _settle_subscriptions(self) -> None:
        """After an open: the address lists exactly the subscriptions whose create
        returned and whose delete did not; those in doubt are what it says."""
        listed = {spec.name: spec for spec in self.core.list_subscriptions()}
        for name, sub in list(self.subs.items()):
            spec = listed.get(name)
            if spec is None:
                if sub.state == "live":
                    raise Violation(f"subscription {name} is gone after a restart")
                self._note(f"  subscription {name} does not exist ({sub.state} in doubt)")
                self.counts["subscriptions_in_doubt"] += 1
                del self.subs[name]
                continue
            if spec.filter != sub.filter:
                raise Violation(
                    f"subscription {name} has filter {spec.filter!r}, not {sub.filter!r}"
                )
            if sub.state != "live":
                self._note(f"  subscription {name} exists ({sub.state} in doubt)")
                self.counts["subscriptions_in_doubt"] += 1
                sub.state = "live"
        if set(listed) - set(self.subs):
            raise Violation(f"subscriptions never created: {sorted(set(listed) - set(self.subs))}")

    def _why_not_routed(self, m: Message, name: str) -> str:
        """Why subscription ``name`` should never get ``m``, for a report."""
        sub = self.subs.get(name)
        if sub is None:
            return "which does not exist"
        props = msgpack.unpackb(m.properties) if m.properties else None
        if not FILTERS[sub.filter](props):
            return f"whose filter {sub.filter!r} rejects {props}"
        if m.index < sub.first_index and sub.start == "latest":
            return f"sent (message {m.index}) before that 'latest' subscription was created"
        if m.index < sub.first_index:
            return (
                f"acknowledged by every subscription (message {m.index}: {m.routes}) when"
                " that 'earliest' subscription was created"
            )
        return f"not routed to it (message {m.index}: {m.routes})"

    def _may_come_back(self, m: Message, name: str) -> bool:
        """Whether rot explains subscription ``name`` getting ``m``: when it was created
        "earliest", every subscription had acknowledged ``m``; rot may lose acks (a
        damaged checkpoint), and then ``m`` is stored again for all, as after an ack."""
        sub = self.subs.get(name)
        props = msgpack.unpackb(m.properties) if m.properties else None
        return (
            bool(self.flipped)
            and sub is not None
            and sub.start == "earliest"
            and m.index < sub.first_index
            and FILTERS[sub.filter](props)
        )

    def _subscriptions_in_memory(self) -> list[str]:
        """Names of the subscriptions the running core has, in creation order."""
        return [name for name, sub in self.subs.items() if sub.in_memory]

    async def _op_create_subscription(self) -> None:
        if len(self.subs) >= MAX_SUBSCRIPTIONS:
            return
        rng = self.rng
        self.sub_names += 1
        sub = SimSubscription(
            f"s{self.sub_names}",
            rng.choice(list(FILTERS)),
            rng.choice(["latest", "earliest"]),
            first_index=len(self.messages),
            state="creating",
        )
        self._note(f"  {sub.name} filter={sub.filter!r} start={sub.start}")
        # What it starts with has its priorities found by the next pass.
        self.indexed_from = max(self.indexed_from, self.core.log.next_offset)
        # What an "earliest" one starts with: what the address stores now.
        before = self._earliest_routes(sub) if sub.start == "earliest" else {}
        self.subs[sub.name] = sub
        try:
            await self.core.create_subscription(sub.name, filter=sub.filter, start=sub.start)
        except StorageError as exc:
            self._note(f"  create raised {exc}")
            # The file may be on disk (a failed directory fsync), or it is in memory and
            # its starting set not yet durable: what it gets from before is in doubt.
            before = self._in_doubt_before(sub, before)
            listed = sub.name in {spec.name for spec in self.core.list_subscriptions()}
            if listed and self.disk.image is None:
                sub.state = "live"
                self.counts["subscriptions_created"] += 1
        else:
            if self.disk.image is None:
                sub.state = "live"
                self.counts["subscriptions_created"] += 1
            else:  # the crash that follows tells whether it exists
                before = self._in_doubt_before(sub, before)
        for index, route in before.items():
            self.messages[index].routes[sub.name] = route

    def _in_doubt_before(self, sub: SimSubscription, before: dict[int, str]) -> dict[int, str]:
        """What a subscription whose create is in doubt may get of the messages sent
        before it: for an "earliest" one, any still stored, even one routed to no
        subscription (recovery cannot tell that routing from one lost with the
        subscription's starting set: it errs toward delivering)."""
        out = dict.fromkeys(before, "doubt")
        if sub.start == "earliest":
            for i in range(sub.first_index):
                if self.messages[i].state == "stored":
                    out.setdefault(i, "doubt")
        return out

    def _earliest_routes(self, sub: SimSubscription) -> dict[int, str]:
        """What a subscription created now from the earliest stored message should see
        of each message sent before: "" if one in memory still must get it (it is
        stored), "doubt" if one may still get it, nothing if every one acknowledged it
        (or it was routed to none: never stored)."""
        holders = [(name, s.in_memory) for name, s in self.subs.items()]
        select = FILTERS[sub.filter]
        out: dict[int, str] = {}
        for m in self.messages:
            routes = m.routes
            if not routes and not self.retains:
                continue
            must = may = False
            for name, in_memory in holders:
                route = routes.get(name)
                if route == "" and in_memory:
                    must = True
                    break
                may = may or route in ("", "doubt")
            if self.retains and m.state in ("stored", "doubt"):  # what it kept, maybe
                must = must or self._retained(m)
                may = True
            if (must or may) and select(msgpack.unpackb(m.properties) if m.properties else None):
                out[m.index] = "" if must else "doubt"
        return out

    async def _op_delete_subscription(self) -> None:
        names = self._subscriptions_in_memory()
        if not names:
            return
        name = self.rng.choice(names)
        sub = self.subs[name]
        consumers = [c for c in self.consumers.values() if c.subscription == name]
        try:
            await self.core.delete_subscription(name)
        except StorageError as exc:
            self._note(f"  delete raised {exc}")
            if name in {spec.name for spec in self.core.list_subscriptions()}:
                sub.state = "deleting"  # still in memory; may be gone from disk
                return
        if self.disk.image is not None:  # the crash that follows tells
            sub.state = "deleting"
            return
        self.counts["subscriptions_deleted"] += 1
        del self.subs[name]
        for c in consumers:
            del self.consumers[c.cid]
        if consumers:  # its consumers are closed: a typed error, nothing delivered
            c = consumers[0]
            try:
                await self.core.fetch(c.cid, 10, 0.0, c.prefetch, c.selector, subscription=name)
            except (ConsumerClosed, SubscriptionNotFound):
                pass
            else:
                raise Violation(f"{c.cid} fetched from deleted subscription {name}")


__all__ = ["AddressOps"]
