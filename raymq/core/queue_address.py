"""An address's side of ``QueueCore``: its subscriptions coming and going, their
seeks, and its retention (``raymq.storage.retention``). A part of ``QueueCore``
(a base class of it), written apart so that each file has one job.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from raymq.config import QueueConfig
from raymq.core.address import (
    address_subscription,
    check_settings,
    existing_subscription,
    new_spec,
    route_backlog,
    save_manifest,
)
from raymq.core.group_commit import GroupCommit
from raymq.core.subscription import Subscription
from raymq.errors import DurabilityUnknown, InvalidSetting, SubscriptionNotFound
from raymq.selector import Selector
from raymq.storage import SegmentLog
from raymq.storage.retention import Position, expired_segments, replay_offset
from raymq.storage.subscriptions import Manifest, SubscriptionAcks, SubscriptionSpec

log = logging.getLogger("raymq.queue")


class AddressPart:
    """An address's subscriptions, seeks and retention (the attributes below are
    ``QueueCore``'s)."""

    name: str
    directory: str
    config: QueueConfig
    log: SegmentLog
    commits: GroupCommit
    subscriptions: dict[str, Subscription]
    _manifest: Manifest
    _subscription_acks: SubscriptionAcks | None
    retention_deleted: int

    def _apply_retention(self) -> None:
        """Acknowledge in the log the oldest segments the retention lets go (every
        subscription acknowledged them, past both limits); the next commit deletes
        them (``raymq.storage.retention``)."""
        cfg = self.config
        acks = self._subscription_acks
        gone = expired_segments(
            self.log, acks.released, int(self.now() * 1e6), cfg.retention_s, cfg.retention_bytes
        )
        freed = 0
        for seg in gone:
            freed += self.log.ack(self.log.unacked(seg.base_offset, seg.count, seg.end_offset))
        if freed:
            self.retention_deleted += freed
            self.commits.wake()  # the commit that deletes their files

    async def seek(self, subscription: str, position: Position) -> int:
        """Move an address's subscription to ``position`` (``"earliest"``, ``"latest"``,
        an offset or a ``datetime``, as ``create_subscription``'s ``start``): what it
        acknowledged from there on is delivered again (as far as the address still
        stores it: retained, or not yet acknowledged by every subscription), what lies
        before is acknowledged. What its consumers hold stays theirs to ack. Returns
        the offset it now starts at, once that is durable (a checkpoint); a seek that
        cannot be made durable is undone and raises ``StorageError``
        (``DurabilityUnknown``: written, in effect, but a crash may undo it). Its acks
        wait meanwhile, and apply to the outcome."""
        if not self.config.address:
            raise InvalidSetting(f"{self.name!r} is a queue: only an address's subscriptions seek")
        sub = self.subscription(subscription)
        at = replay_offset(self.log, position, f"subscription {sub.name!r}", "position")
        while sub.seeking is not None:  # one seek at a time
            await sub.seeking.wait()
        sub.seeking = asyncio.Event()
        try:
            await self._seek(sub, at)
        finally:
            sub.seeking.set()
            sub.seeking = None
        self.signal_freed()
        log.info("address %r: subscription %r sought offset %d", self.name, sub.name, at)
        return at

    async def _seek(self, sub: Subscription, at: int) -> None:
        acks = self._subscription_acks
        # Its filter's decisions were acks: made again first, in a set of its own (a
        # read that fails changes nothing), a step at a time as a new subscription's.
        initial, published = acks.starting_set(at), self.log.next_offset
        if sub.filter is not None:
            await route_backlog(self.log, self.name, initial, sub.filter, at)
            if self.subscriptions.get(sub.subscription_name) is not sub:
                raise SubscriptionNotFound(f"{sub.name!r} was deleted during its seek")
            # What was published meanwhile was routed (and maybe acked) as usual.
            initial.add_ranges(acks.acked[sub.sid].ranges(published))
        spec = self._manifest.subscriptions[sub.subscription_name]
        if at < spec.start_offset:  # recovery acknowledges what lies below it: lowered
            moved = replace(spec, start_offset=at)
            subs = {**self._manifest.subscriptions, spec.name: moved}
            manifest = Manifest(subs, self._manifest.next_id)
            save_manifest(self.directory, self.name, manifest)  # first: a failure changes nothing
            self._manifest = manifest
        before, released, installed = acks.acked[sub.sid], acks.released, self.log.next_offset
        acks.seek(sub.sid, at, initial)
        sub.rewound(at)
        acks.settle()  # a seek forward may complete what the others did
        if not self.config.durable:
            return
        try:
            await self.commits.checkpoint()
        except DurabilityUnknown:
            raise  # written: in effect (a crash may find it undone)
        except BaseException:
            # Not durable: undone (a restart would find the old set), what was
            # published meanwhile kept as it was routed.
            before.add_ranges(acks.acked[sub.sid].ranges(installed))
            acks.acked[sub.sid], acks.released = before, released
            acks.settle()
            sub.rewound(at)
            raise

    async def create_subscription(
        self,
        name: str,
        *,
        filter: str | None = None,
        start: Position = "latest",
        max_delivery_attempts: int | None = None,
        dead_letter_queue: str | None = None,
    ) -> SubscriptionSpec:
        """Bind a subscription to this address; returns its definition once durable.

        ``filter``: a selector; only the messages it selects are routed to the
        subscription. ``start``: ``"latest"`` (from the next message sent),
        ``"earliest"`` (from the oldest the address still stores, retained ones
        included), an offset, or a ``datetime`` (``retention.replay_offset``).
        Idempotent with the same settings; ``SubscriptionExists`` with others.
        """
        settings = (filter, max_delivery_attempts, dead_letter_queue)
        check_settings(self.config, name, *settings)  # InvalidSetting first for a queue
        where = f"subscription {name!r} of address {self.name!r}"
        at = replay_offset(self.log, start, where)
        spec = new_spec(name, *settings, self._manifest.next_id, at)
        existing = existing_subscription(self.name, self._manifest, spec)
        if existing is not None:
            return existing
        # A filter over what is stored (start="earliest"): routed step by step, the
        # actor serving everything else in between, in a set of its own that no ack
        # record or checkpoint holds until the file lists the subscription.
        initial, routed_to = None, spec.start_offset
        if spec.filter is not None and spec.start_offset < self.log.next_offset:
            initial = self._subscription_acks.starting_set(spec.start_offset)
            selector = Selector(spec.filter)
            routed_to = await route_backlog(self.log, self.name, initial, selector, routed_to)
            existing = existing_subscription(self.name, self._manifest, spec)  # made meanwhile
            if existing is not None:
                return existing
            spec = replace(spec, id=self._manifest.next_id)
        manifest = Manifest({**self._manifest.subscriptions, name: spec}, spec.id + 1)
        # Routed before it exists on disk (a read that fails leaves nothing behind), and
        # with nothing awaited until it is in the file: nothing may publish in between.
        self._subscription_acks.create(spec.id, spec.start_offset, initial)
        sub = address_subscription(self, self.log, self._subscription_acks, spec)
        try:
            sub.route_again(routed_to)  # what was published during the steps, if any
            save_manifest(self.directory, self.name, manifest)
            self._manifest = manifest
        except BaseException:
            self._subscription_acks.remove(spec.id)
            raise
        self.subscriptions[name] = sub
        if self.commits.started:
            sub.start()
        self._apply_memory_limits()
        if self.config.durable:
            await self.flush_acks()  # its starting set
        log.info("address %r: subscription %r created (from %d)", self.name, name, at)
        return spec

    async def delete_subscription(self, name: str) -> None:
        """Unbind a subscription: its consumers are closed, and what every other
        subscription has acknowledged is acknowledged in the address (segments go)."""
        sub = self.subscription(name)
        left = {n: s for n, s in self._manifest.subscriptions.items() if n != name}
        manifest = Manifest(left, self._manifest.next_id)
        save_manifest(self.directory, self.name, manifest)
        self._manifest = manifest
        del self.subscriptions[name]
        sub.close()
        self._subscription_acks.remove(sub.sid)
        self._apply_memory_limits()
        self.signal_freed()
        if self.config.durable:
            await self.flush_acks()
        log.info("address %r: subscription %r deleted", self.name, name)

    def list_subscriptions(self) -> list[SubscriptionSpec]:
        """The address's subscriptions, in the order they were created."""
        return list(self._manifest.subscriptions.values())

    def subscription_depths(self) -> dict[str, int]:
        """Each subscription's depth (its lag: messages it has not acknowledged)."""
        return {name: sub.log.depth for name, sub in self.subscriptions.items()}
