"""One seeded run of the fault simulator: a queue core driven by random producers,
consumers, acks, nacks, restarts and crashes, on a ``SimDisk`` that drops unsynced
data at a crash after any system call, flips bits, fails calls with ENOSPC or EIO, and
fills up. Invariants are checked after every step and at every quiet point.

The invariants (a broken one raises ``Violation`` with the step and what was seen):

* Nothing is served that was not sent, byte for byte (body, properties and offset),
  and nothing whose send raised.
* Offsets are never reused: an offset once served or acknowledged to a producer names
  that message for ever, whatever was damaged or crashed since.
* No message is held by two consumers at once.
* At every quiet point (consumers gone, faults healed), nothing is in flight, and a
  fresh consumer receives every message acknowledged to its producer and not yet
  acknowledged by a consumer, except at most the number of messages the queue counted
  as damaged; without bit flips, nothing is counted as damaged. Sends and acks work.
* A message whose ack returned is not delivered again (unless bits were flipped).
* Every call returns or raises within ``CALL_BOUND`` seconds, and raises only typed
  errors from ``raymq.errors``.

About half the seeds (``is_address_seed``) run an *address* instead: one stored copy,
fanned out to 1-3 subscriptions created at the start (some with a routing filter), and
more created ("latest" or "earliest") and deleted as the run goes; every consumer
belongs to one subscription. The invariants above hold per subscription, and:

* A subscription is served only what it should get: what its filter selects, sent
  while it existed, or (created "earliest") what the address stored when it was
  created, that is what some subscription then had not acknowledged.
* No message is held by two consumers of one subscription; an ack returned by one
  subscription says nothing of another's.
* The subscriptions, with their acks, survive restarts and crashes: the address lists
  exactly those whose create returned and whose delete did not.

What a call observes after the crash point (the syscall after which the crash image
was taken) happened in a timeline the crash erased: its outcome is "in doubt" (a send
may or may not be stored, an ack may or may not be durable), never an invariant.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import sys
import tempfile

import msgpack
import numpy as np

from raymq.batch import MessageBatch
from raymq.config import BrokerConfig, QueueConfig
from raymq.core.expiry import EXPIRATION_PROPERTY, expiration_ms, now_ms
from raymq.core.priority import PRIORITY_PROPERTY
from raymq.core.queue import QueueCore
from raymq.core.schedule import SCHEDULED_PROPERTY
from raymq.errors import ConsumerClosed, RayMQError, StorageError, SubscriptionNotFound
from raymq.sim.address_ops import AddressOps
from raymq.sim.disk import SimDisk
from raymq.sim.environment import detach_loops, simulated
from raymq.sim.model import (
    CALL_BOUND,
    COLORS,
    DELAYS,
    FILTERS,
    MAX_PRIORITIES,
    PRIORITY_SALT,
    QUEUE,
    TTL_SALT,
    TTLS,
    Message,
    Settings,
    SimClock,
    SimConsumer,
    SimSubscription,
    Traced,
    Violation,
    is_address_seed,
    offset_runs,
)
from raymq.sim.priorities import check_priority_order
from raymq.sim.retention_ops import RETENTION_SALT, RETENTIONS, RetentionOps
from raymq.storage.subscriptions import MANIFEST_NAME


class Simulation(Traced, AddressOps, RetentionOps):
    """One run: ``Simulation(seed).run()`` returns a summary or raises ``Violation``."""

    def __init__(self, seed: int, steps: int = 300, root: str | None = None, verbose: bool = False):
        self.seed = seed
        self.steps = steps
        self.rng = random.Random(seed)
        self.ttl_rng = random.Random(seed ^ TTL_SALT)
        self.prio_rng = random.Random(seed ^ PRIORITY_SALT)
        self.max_priority: int | None = self.prio_rng.choice(MAX_PRIORITIES)
        self.ranked: list[Message] = []  # messages sent with a priority above 0
        #: Offsets from here on have their priorities indexed (see sim.priorities).
        self.indexed_from = 0
        self.settings = Settings.draw(self.rng, seed)
        self.retention_rng = random.Random(seed ^ RETENTION_SALT)
        drawn = self.retention_rng.choice(RETENTIONS) if self.settings.address else None
        self.retention = drawn or (None, None)
        self.verbose = verbose
        self._own_root = root is None
        # In memory where there is a tmpfs: the disk's behaviour is simulated anyway.
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        self.root = root or tempfile.mkdtemp(prefix=f"raymq-sim-{seed}-", dir=shm)
        self.disk = SimDisk(self.root, self.rng)
        if self.settings.address:
            self.disk.unflippable = frozenset({MANIFEST_NAME})
        self.messages: list[Message] = []
        self.by_offset: dict[int, int] = {}  # offset -> message index, for ever
        self.consumers: dict[str, SimConsumer] = {}
        #: An address's subscriptions by name, in creation order (names are not reused).
        self.subs: dict[str, SimSubscription] = {}
        self.sub_names = 0
        self.background: list[asyncio.Task] = []
        self.core: QueueCore | None = None
        self.step = 0
        self.cids = 0
        self.damage_allowed = 0  # messages the queue counted as damaged, all incarnations
        self.flipped: list[str] = []
        self.holes = False  # a crash image had unsynced pages zeroed
        self.trace: list[str] = []
        self.clock = SimClock()
        self.counts = {
            "open_failures": 0,
            "crashes": 0,
            "restarts": 0,
            "quiet_points": 0,
            "served": 0,
            "address": int(self.settings.address),
            "subscriptions_created": 0,
            "subscriptions_deleted": 0,
            "subscriptions_in_doubt": 0,  # a create or delete whose outcome an open told
            "damage_found_opening": 0,  # messages quarantined by opens, after recovery
            "expired": 0,  # messages the queue counted expired, all incarnations
            "seeks": 0,  # seeks that returned
        }

    # -- running ------------------------------------------------------------------------

    def run(self) -> dict:
        """Run every step and the final checks; the summary of what happened."""
        try:
            with simulated(self.clock, self.verbose), self.disk.installed():
                asyncio.run(self._run())
        except Violation as exc:
            raise Violation(f"seed {self.seed}, step {self.step}: {exc}") from None
        finally:
            if self._own_root:
                shutil.rmtree(self.root, ignore_errors=True)
        return {
            **self.counts,
            "messages": len(self.messages),
            "stored": sum(m.state == "stored" for m in self.messages),
            "injected_errors": len(self.disk.injected),
            "flips": len(self.flipped),
            "damaged": self.damage_allowed,
            "with_ttl": sum(m.expires is not None for m in self.messages),
            "scheduled": sum(m.due is not None for m in self.messages),
            "prioritized": len(self.ranked) if self.max_priority else 0,
        }

    async def _run(self) -> None:
        self._open()
        if self.settings.address:
            for _ in range(self.rng.randint(1, 3)):
                await self._bounded(self._op_create_subscription(), "create_subscription")
        ops = [
            (self._op_send, 30),
            (self._op_open_consumer, 6),
            (self._op_fetch, 30),
            (self._op_ack, 20),
            (self._op_nack, 5),
            (self._op_give_back, 2),
            (self._op_close_consumer, 5),
            (self._op_housekeeping, 4),
            (self._op_faults, 3),
            (self._op_restart, 1),
            (self._op_crash, 3 if self.settings.crashes else 0),
            (self._op_flip, 2 if self.settings.flips else 0),
        ]
        if self.settings.address:
            ops += [(self._op_create_subscription, 2), (self._op_delete_subscription, 1)]
        if self.retains:  # (only then: a seed without draws what it drew before)
            ops += [(self._op_seek, 2)]
        funcs, weights = zip(*ops, strict=True)
        for step in range(self.steps):
            self.step = step
            self.clock.now += 0.01
            op = self.rng.choices(funcs, weights)[0]
            self._note(op.__name__[4:])
            await self._bounded(op(), op.__name__)
            if self.disk.image is not None:
                await self._crash()
            self._check_holds()
            if self.step % 100 == 99:
                await self._quiet_point()
        await self._quiet_point()
        await self._close()

    def _open(self) -> None:
        s = self.settings
        broker = BrokerConfig(
            paging_directory=self.root,
            checkpoint_interval=s.checkpoint_interval,
            max_message_size=1 << 20,
        )
        config = QueueConfig(
            QUEUE,
            page_size_bytes=s.page_size_bytes,
            page_max_cache_size=2,
            address=s.address,
            max_priority=self.max_priority,
            retention_s=self.retention[0],
            retention_bytes=self.retention[1],
        )
        for attempt in range(1000):
            try:
                core = QueueCore(config, broker)
                break
            except RayMQError as exc:  # an injected error while opening: try again
                self._note(f"open failed: {exc}")
                self.counts["open_failures"] += 1
                if self.disk.image is not None:
                    self._restore()
                if attempt == 2:
                    # Recovery needs room for a new ack log when none can be appended
                    # to: as an operator would, free the disk.
                    self.disk.full, self.disk.fail_rate = False, 0.0
        else:
            raise Violation("the queue does not open on a healthy disk")
        recovery = core.recovery
        # Every incarnation's count, one the crash point came in too (its recovery may
        # have recorded the damage before it: the next one then finds it no more). The
        # log's count is recovery's ``lost_messages`` plus what reads and the scrub
        # found since, those made while the core opened too (an address applies its
        # filters again: a properties read may quarantine a record), added later.
        self.damage_allowed += recovery.damaged
        self._counted = recovery.lost_messages
        self.counts["damage_found_opening"] += max(
            0, core.log.damaged_messages - recovery.lost_messages
        )
        if self.disk.image is not None:  # the crash point came while opening
            self.core = core
            return
        # (Files moved aside whose messages were all acknowledged lose nothing: a
        # failed write's burned segment, for one.)
        if recovery.damaged and not (self.flipped or self.holes):
            raise Violation(f"recovery found damage with no bit flipped: {recovery.damage}")
        detach_loops(core)
        core.start()
        self.core = core
        self.indexed_from = core.log.next_offset  # until a pass has found them again
        self._check_offsets_not_reused()
        self.consumers.clear()
        if s.address:
            self._settle_subscriptions()

    def _restore(self) -> None:
        image = self.disk.image
        self.disk.fail_rate = 0.0
        self.disk.full = False
        self.disk.restore(image)
        self.counts["crashes"] += 1
        for note in image.notes:
            self._note(f"  crash image: {note}")
            # Unsynced pages written back out of order leave a hole with valid records
            # after it: recovery cannot tell it from rot, and reports it as damage.
            self.holes = self.holes or "zeroed" in note

    async def _stop_core(self) -> None:
        """Cancel everything that runs against the current core."""
        for task in self.background:
            task.cancel()
        for task in self.background:
            with contextlib.suppress(BaseException):
                await task
        self.background.clear()
        core = self.core
        if core is not None:
            self._count_damage(core)
            self.counts["expired"] += core.stats().messages_expired
            await core._tasks.cancel_all()

    def _count_damage(self, core: QueueCore) -> None:
        """Add what ``core`` counted as damaged since the last call."""
        found = core.log.damaged_messages
        if found > self._counted:
            self.damage_allowed += found - self._counted
            self._counted = found

    async def _crash(self) -> None:
        self._note("crash")
        await self._stop_core()
        self._restore()
        for m in self.messages:
            if m.state == "sending":
                m.state = "doubt"
        self._open()
        while self.disk.image is not None:  # crashed again while recovering
            self._restore()
            self._open()

    async def _close(self) -> None:
        await self._stop_core()
        if self.core is not None:
            self.core.log.close()

    # -- operations ---------------------------------------------------------------------

    def _new_message(self) -> Message:
        rng = self.rng
        n = len(self.messages)
        size = rng.randrange(self.settings.max_body + 1)
        body = f"{n}|".encode() + rng.randbytes(size)
        props = {"color": rng.choice(COLORS), "n": n} if rng.random() < 0.7 else None
        if props is not None and self.settings.address:
            props["k"] = rng.randrange(10)  # what subscription filters select on
        expires = due = None
        if props is not None and self.ttl_rng.random() < 0.25:
            expires = expiration_ms(self.ttl_rng.choice(TTLS), self.clock.time())
            props[EXPIRATION_PROPERTY] = expires
        if props is not None and self.ttl_rng.random() < 0.2:
            due = expiration_ms(self.ttl_rng.choice(DELAYS), self.clock.time())
            props[SCHEDULED_PROPERTY] = due
        priority = 0
        # (Only for a queue with priorities: a seed without draws what it drew before.)
        if props is not None and self.max_priority and self.prio_rng.random() < 0.3:
            priority = props[PRIORITY_PROPERTY] = self.prio_rng.randint(1, 11)
        m = Message(n, body, msgpack.packb(props) if props else b"", expires=expires, due=due)
        m.priority, m.sent_at = priority, self.clock.time()
        if priority:
            self.ranked.append(m)
        # Routed now: no subscription is created or deleted while a send is under way.
        for sub in self.subs.values():
            if FILTERS[sub.filter](props):
                # One in doubt may turn out to exist, holding what others still hold.
                m.routes[sub.name] = "" if sub.in_memory else "doubt"
        self.messages.append(m)
        return m

    async def _send(self, count: int) -> None:
        msgs = [self._new_message() for _ in range(count)]
        props = [msgpack.unpackb(m.properties) if m.properties else None for m in msgs]
        batch = MessageBatch.from_bodies(
            [m.body for m in msgs], props, max_message_size=1 << 20, queue=QUEUE
        )
        try:
            first, stored = await self.core.send_batch(batch)
        except RayMQError as exc:
            state = "doubt" if self.disk.image is not None else "failed"
            for m in msgs:
                m.state = state
            self._note(f"  send of {count} raised {type(exc).__name__}: {exc}")
            return
        if self.disk.image is not None:
            for m in msgs:
                m.state = "doubt"
            return
        if stored != count:
            raise Violation(f"a PAGE queue stored {stored} of {count}")
        for i, m in enumerate(msgs):
            self._record_offset(m, first + i, "stored")
            m.state = "stored"

    def _record_offset(self, m: Message, offset: int, how: str) -> None:
        index = m.index
        if m.offset is not None:
            if m.offset != offset:
                raise Violation(f"message {m.body[:12]!r} at offset {offset}, was at {m.offset}")
            return
        owner = self.by_offset.get(offset)
        if owner is not None and owner != index:
            raise Violation(f"offset {offset} reused: was message {owner}, now {index} ({how})")
        m.offset = offset
        self.by_offset[offset] = index

    async def _op_send(self) -> None:
        rng = self.rng
        sizes = [rng.choice([1, 1, 3, 10, 40]) for _ in range(rng.randint(1, 4))]
        await asyncio.gather(*(self._send(n) for n in sizes))

    async def _op_open_consumer(self) -> None:
        self.cids += 1
        selector = "color = 'red'" if self.rng.random() < 0.3 else None
        c = SimConsumer(f"c{self.cids}", self.rng.choice([1, 5, 20, 100]), selector)
        if self.settings.address:
            names = self._subscriptions_in_memory()
            if not names:
                return
            c.subscription = self.rng.choice(names)
        self.core.register_consumer(c.cid, c.prefetch, c.selector, subscription=c.subscription)
        self.consumers[c.cid] = c

    def _pick_consumer(self, holding: bool = False) -> SimConsumer | None:
        options = [c for c in self.consumers.values() if c.held or not holding]
        return self.rng.choice(options) if options else None

    async def _op_fetch(self) -> None:
        c = self._pick_consumer()
        if c is None:
            return await self._op_open_consumer()
        try:
            rows = await self.core.fetch(
                c.cid,
                self.rng.choice([1, 10, 60]),
                0.0,
                c.prefetch,
                c.selector,
                subscription=c.subscription,
            )
        except StorageError as exc:
            self._note(f"  fetch raised {exc}")
            return
        self._check_delivery(c, rows)

    def _check_delivery(self, c: SimConsumer, rows) -> None:
        offsets = rows.column("offset").to_pylist()
        bodies = rows.column("body").to_pylist()
        props = rows.column("properties").to_pylist()
        after_crash = self.disk.image is not None
        for offset, body, prop in zip(offsets, bodies, props, strict=True):
            m = self._message_of(body)
            if m is None or m.body != body or m.properties != prop:
                raise Violation(f"served offset {offset} was never sent: {body[:40]!r}")
            if m.state == "failed":
                raise Violation(f"served offset {offset}, whose send raised")
            if self._expired(m):
                raise Violation(f"served offset {offset}, expired at {m.expires} ms")
            if self._not_due(m):
                raise Violation(f"served offset {offset} before its delivery time {m.due} ms")
            if c.selector and msgpack.unpackb(prop or b"\x80").get("color") != "red":
                raise Violation(f"selector consumer {c.cid} got offset {offset}: {prop!r}")
            if c.subscription is not None and c.subscription not in m.routes:
                if not self._may_come_back(m, c.subscription):
                    why = self._why_not_routed(m, c.subscription)
                    raise Violation(f"offset {offset} served to {c.subscription}, {why}")
                m.routes[c.subscription] = "doubt"
            if self._acked(m, c.subscription) == "yes" and not self.flipped:
                raise Violation(f"offset {offset} delivered again after its ack returned")
            if after_crash:
                continue
            self._record_offset(m, offset, "served")
            for other in self.consumers.values():
                if other.subscription == c.subscription and offset in other.held:
                    raise Violation(f"offset {offset} held by {other.cid} given to {c.cid}")
            c.held.add(offset)
            self.counts["served"] += 1
        if not after_crash and not self.flipped:  # (rot may read as another priority)
            check_priority_order(self, c, offsets)
        target = self._area(c.subscription).consumers.get(c.cid)
        if not after_crash and target is not None and len(target.held) > c.prefetch:
            raise Violation(f"{c.cid} holds {len(target.held)} > prefetch {c.prefetch}")

    def _expired(self, m: Message) -> bool:
        """Whether ``m`` expired by the clock now (it may never be delivered again)."""
        return m.expires is not None and m.expires <= now_ms(self.clock.time())

    def _not_due(self, m: Message) -> bool:
        """Whether ``m``'s delivery time is still to come by the clock now."""
        return m.due is not None and m.due > now_ms(self.clock.time())

    def _waiting(self, name: str | None) -> int:
        """Messages the queue (or subscription ``name``) may still hold unacknowledged
        after a drain: those whose delivery time is to come (stored, or in doubt)."""
        return sum(
            m.state in ("stored", "doubt")
            and self._not_due(m)
            # (Unrouted may be: a subscription in doubt; acked too, if rot took acks.)
            and (self._acked(m, name) != "yes" or bool(self.flipped))
            for m in self.messages
        )

    def _waiting_anywhere(self) -> int:
        """Messages some subscription may still hold after drains (see ``_waiting``)."""
        return sum(m.state in ("stored", "doubt") and self._not_due(m) for m in self.messages)

    def _acked(self, m: Message, name: str | None) -> str:
        """What the queue (``name`` None) or a subscription acknowledged of ``m``:
        "" nothing, "doubt" an ack of unknown outcome, "yes" its ack returned."""
        return m.acked if name is None else m.routes.get(name, "")

    def _set_acked(self, m: Message, name: str | None, state: str) -> None:
        if name is None:
            m.acked = state
        elif name in m.routes:
            m.routes[name] = state

    def _area(self, name: str | None):
        """The TargetArea of the queue, or of one subscription of the address."""
        return self.core.subscription(name).area

    def _message_of(self, body: bytes) -> Message | None:
        head, sep, _ = body.partition(b"|")
        if not sep or not head.isdigit() or int(head) >= len(self.messages):
            return None
        return self.messages[int(head)]

    def _take_some(self, c: SimConsumer) -> list[int]:
        held = sorted(c.held)
        picked = sorted(self.rng.sample(held, self.rng.randint(1, len(held))))
        c.held.difference_update(picked)
        return picked

    async def _op_ack(self) -> None:
        c = self._pick_consumer(holding=True)
        if c is None:
            return await self._op_fetch()
        picked = self._take_some(c)
        if self.rng.random() < 0.5:
            await self._ack(c, picked)
        else:  # pipelined: the consumer goes on before the ack returns
            self.background.append(asyncio.create_task(self._ack(c, picked)))

    async def _ack(self, c: SimConsumer, offsets: list[int]) -> None:
        msgs = [self.messages[self.by_offset[o]] for o in offsets]
        name = c.subscription
        for m in msgs:
            self._set_acked(m, name, self._acked(m, name) or "doubt")
        try:
            await self.core.ack(c.cid, np.array(offsets, dtype=np.int64), subscription=name)
        except StorageError as exc:
            self._note(f"  ack raised {exc}")
            return
        except (ConsumerClosed, SubscriptionNotFound) as exc:
            # A pipelined ack that starts after its subscription was deleted.
            if name is None or name in self.subs:
                raise Violation(f"an ack of {c.cid} raised {type(exc).__name__}: {exc}") from None
            return
        if self.disk.image is None:
            for m in msgs:
                self._set_acked(m, name, "yes")

    async def _op_nack(self) -> None:
        c = self._pick_consumer(holding=True)
        if c is not None:
            offsets = np.array(self._take_some(c), dtype=np.int64)
            self.core.nack(c.cid, offsets, subscription=c.subscription)

    async def _op_give_back(self) -> None:
        c = self._pick_consumer(holding=True)
        if c is not None:
            offsets = np.array(self._take_some(c), dtype=np.int64)
            self.core.give_back(c.cid, offsets, subscription=c.subscription)

    async def _op_close_consumer(self) -> None:
        c = self._pick_consumer()
        if c is None:
            return
        not_received = None
        if c.held and self.rng.random() < 0.5:
            not_received = np.array(self._take_some(c), dtype=np.int64)
        # (Or its death: the same call.)
        self.core.close_consumer(c.cid, not_received, subscription=c.subscription)
        del self.consumers[c.cid]

    async def _op_housekeeping(self) -> None:
        core = self.core
        core.set_budget(self.rng.choice([0, 4096, 1 << 16, 1 << 22]))
        core.housekeeping()
        core._scrub(1.0)
        if self.ttl_rng.random() < 0.5:
            with contextlib.suppress(StorageError):
                await self._bounded(core.expiry_pass(), "an expiry pass")
                self.indexed_from = 0  # a whole pass found every stored priority

    async def _op_faults(self) -> None:
        disk = self.disk
        choice = self.rng.random()
        if choice < 0.4:
            disk.fail_rate = self.settings.fail_rate if not disk.fail_rate else 0.0
        elif choice < 0.7:
            disk.full = not disk.full
        else:
            disk.fail_rate, disk.full = 0.0, False
        self._note(f"  fail_rate={disk.fail_rate} full={disk.full}")

    async def _op_restart(self) -> None:
        for task in self.background:  # a clean stop: what is under way ends first
            with contextlib.suppress(RayMQError):
                await task
        self.background.clear()
        self._count_damage(self.core)
        with contextlib.suppress(StorageError):
            await self.core.close()
        if self.disk.image is None:
            self.counts["restarts"] += 1
            self.core.log.close()
            self._open()

    async def _op_crash(self) -> None:
        if self.disk.crash_after is None:
            self.disk.crash_after = self.rng.randrange(1, 80)

    async def _op_flip(self) -> None:
        where = self.disk.flip()
        if where:
            self.flipped.append(where)
            self._note(f"  flipped a bit of {where}")

    # -- checks -------------------------------------------------------------------------

    def _check_holds(self) -> None:
        if self.settings.address:
            listed = sorted(spec.name for spec in self.core.list_subscriptions())
            if listed != sorted(self._subscriptions_in_memory()):
                raise Violation(
                    f"the address lists subscriptions {listed}, not"
                    f" {sorted(self._subscriptions_in_memory())}"
                )
        for c in self.consumers.values():
            target = self._area(c.subscription).consumers.get(c.cid)
            held = set() if target is None else set(target.held)
            # The queue may have released what was found damaged; never more than that.
            if not held <= c.held:
                raise Violation(f"{c.cid} is held {sorted(held - c.held)[:5]} it never got")

    def _check_offsets_not_reused(self) -> None:
        top = max(self.by_offset, default=-1)
        if self.core.log.next_offset <= top:
            raise Violation(
                f"after recovery next_offset={self.core.log.next_offset} but offset {top}"
                " was given before"
            )

    async def _quiet_point(self) -> None:
        """Heal, let everything under way end, close every consumer; then nothing may
        be in flight and a fresh consumer must get every outstanding message."""
        self._note("quiet point")
        self.counts["quiet_points"] += 1
        disk = self.disk
        disk.fail_rate, disk.full = 0.0, False
        for task in self.background:
            with contextlib.suppress(StorageError):
                await self._bounded(task, "a pipelined ack")
        self.background.clear()
        if disk.image is not None:
            await self._crash()
        disk.crash_after = None
        for c in list(self.consumers.values()):
            self.core.close_consumer(c.cid, subscription=c.subscription)
        self.consumers.clear()
        self.core.housekeeping()
        stats = self.core.stats()
        if stats.in_flight:
            raise Violation(f"{stats.in_flight} messages in flight with no consumer")
        # Sends work again by themselves once the disk is healthy.
        await self._bounded(self._send(1), "a send after healing")
        if self.messages[-1].state != "stored":
            raise Violation("a send failed after the disk was healed")
        if not self.settings.address:
            drained = await self._drain()
            self._count_damage(self.core)
            self._check_outstanding(None, drained)
        else:
            # Some drains acknowledge what they get, some leave it for the next ones (an
            # "earliest" subscription starts with it).
            await self._drain_subscriptions()
        if self.damage_allowed and not (self.flipped or self.holes):
            raise Violation(f"{self.damage_allowed} messages counted damaged, no bit flipped")

    def _check_outstanding(self, name: str | None, drained: set[int]) -> None:
        """Every stored message the queue (or subscription ``name``) should still
        deliver was in ``drained``, but for what damage took."""
        outstanding = [
            i
            for i, m in enumerate(self.messages)
            if m.state == "stored"
            and (not m.acked if name is None else m.routes.get(name) == "")
            and i not in drained
            and not self._expired(m)  # expired: never delivered again
            and not self._not_due(m)  # its time is to come
        ]
        # Only rot may take a stored message (an unsynced hole never held one).
        if len(outstanding) > (self.damage_allowed if self.flipped else 0):
            sample = offset_runs(sorted(self.messages[i].offset for i in outstanding))
            of = "" if name is None else f" to {name}"
            raise Violation(
                f"{len(outstanding)} stored messages never delivered again{of} (damaged: "
                f"{self.damage_allowed}); their offsets: {sample}"
            )

    async def _drain(self, name: str | None = None, ack: bool = True) -> set[int]:
        """Everything a fresh consumer of the queue (or of subscription ``name``) gets,
        acknowledged (or, ``ack`` False, given back by closing the consumer)."""
        self.cids += 1
        # Without acks it must hold everything at once.
        prefetch = 1000 if ack else len(self.messages) + 1000
        c = SimConsumer(f"drain{self.cids}", prefetch, None, subscription=name)
        self.core.register_consumer(c.cid, c.prefetch, None, subscription=name)
        self.consumers[c.cid] = c
        got: set[int] = set()
        for _round in range(len(self.messages) + 2):  # each round takes at least one
            rows = await self._bounded(
                self.core.fetch(c.cid, 1000, 0.0, prefetch, subscription=name), "drain fetch"
            )
            if not rows.num_rows:
                break
            self._check_delivery(c, rows)
            for body in rows.column("body").to_pylist():
                got.add(int(body.partition(b"|")[0]))
            if not ack:
                continue
            picked = sorted(c.held)
            c.held.clear()
            await self._bounded(self._ack(c, picked), "drain ack")
            if any(self._acked(self.messages[self.by_offset[o]], name) != "yes" for o in picked):
                raise Violation("an ack failed after the disk was healed")
        else:
            raise Violation("a drain does not end: the same messages come back")
        self.core.close_consumer(c.cid, subscription=name)
        del self.consumers[c.cid]
        # Expired ones it met are dropped by the dead-letter mover, a task.
        await self._bounded(self.core.dead_letters_settled(name), "dropping expired messages")
        depth = self.core.log.depth if name is None else self.core.subscription_depths()[name]
        if ack and depth > self._waiting(name):
            raise Violation(f"drained, yet depth is {depth} ({self._waiting(name)} not due)")
        return got


def run_seed(seed: int, steps: int = 300, verbose: bool = False) -> dict:
    """Run one seed in a temporary directory; raises ``Violation`` with the seed."""
    return Simulation(seed, steps, verbose=verbose).run()


def repro_command(seed: int, steps: int, mode: str = "any") -> str:
    """The command that replays ``seed`` (of ``mode``: "replicated" runs apart)."""
    also = " --mode replicated" if mode == "replicated" else ""
    exe = os.path.basename(sys.executable)
    return f"{exe} -m raymq.sim --seed {seed} --steps {steps}{also} -v"


__all__ = [
    "CALL_BOUND",
    "Settings",
    "Simulation",
    "Violation",
    "is_address_seed",
    "repro_command",
    "run_seed",
]
