"""Soak: concurrent producers and churning consumers on two queues and an address's two
subscriptions, checked message by message at the end.

What it measures: whether every message a producer was told is stored is acknowledged
by some consumer by the end, when consumers come and go with and without selectors,
prefetch from 100 to 5,000, nack 5 % of the messages they receive, leave 3 % unacknowledged
(up to half their prefetch) and close with them, and pipeline half their acks; and the
rates, and the memory (PSS) of the Ray session's processes while it runs.

The scenario, on a Ray of its own (as every ``bench/`` script): 2 durable queues with 1
MiB pages (``soak.a`` pages past its memory, ``soak.b`` has ``address_full_policy=BLOCK``
with ``max_size_bytes``) and a durable address ``soak.c`` with two subscriptions
(``all``, and ``warm`` routing only ``color IN ('red', 'blue')``: every message sent
there must be acknowledged on each subscription that routes it); 4 producer threads
sending singles and batches of 10 and 500 messages with properties (``color``,
``producer``, ``seq``) to a random queue or the address at a bounded rate, pausing while
its depth is over ``--max-backlog``; 4 consumer slots, each a thread that opens a
consumer on a random queue or subscription for 5-30 s (selector ``color = 'red'``,
``color IN ('green', 'blue')`` or none; Python or Arrow receives), closes it and opens
another.
Every body carries its id (queue, producer, sequence) and bytes derived from it; the
properties are derived from it too. Randomness comes from ``--seed``; thread timing
does not, so two runs are alike, not identical.

At the end producers stop, every consumer closes, each queue's and subscription's
``in_flight`` is read (nothing may be held by a closed consumer), a fresh consumer per
queue and subscription drains it (until ``backlog()`` and its depth say nothing is
left, or ``--drain-timeout``).

    python -m bench.soak [--minutes 3] [--seed 12] [--rate 3000] [--max-backlog 50000]

What must hold (exit status 1 otherwise), per queue and subscription and in total:

- stuck = 0: ``in_flight`` once every consumer closed, plus messages still in the queue
  after the drain that nobody holds;
- lost = 0: ids a producer was told were stored and no consumer ever acknowledged;
- unknown = 0: received ids no producer sent, bodies or properties that differ from
  what their id says, and messages a selector consumer got that its selector rejects;
- no message delivered while a consumer holds it (received, not yet acked, nacked or
  closed), nor after its ack: only what is given back is delivered again (the bug
  fixed in 0a8e6aa, a shared consumer taking an offset twice, showed only here);
- no unexpected client error (an ``AddressFull`` of the BLOCK queue is expected).

Duplicates (deliveries of an id delivered before: nacks, closes) are printed for
information: delivery is at-least-once; they should equal the queues'
``messages_redelivered``. Tracebacks in the session's logs are listed.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import math
import os
import random
import resource
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psutil
import ray

from bench.common import console, print_table, start_broker, stop_broker
from raymq.errors import AddressFull
from raymq.properties import decode_properties

#: What producers send to: two queues and an address (a body's id names its index here).
TARGETS = ("soak.a", "soak.b", "soak.c")
ADDRESS = 2
#: The address's subscriptions: name -> (routing selector, the colours it routes).
SUBSCRIPTIONS: dict[str, tuple[str | None, set[str] | None]] = {
    "all": (None, None),
    "warm": ("color IN ('red', 'blue')", {"red", "blue"}),
}
#: What consumers consume, each with a ledger of its own: the queues, the subscriptions.
ENDPOINTS = (*TARGETS[:ADDRESS], *(f"{TARGETS[ADDRESS]}/{n}" for n in SUBSCRIPTIONS))
#: Target index -> the indexes of its endpoints.
ENDPOINTS_OF = {
    **{t: [t] for t in range(ADDRESS)},
    ADDRESS: list(range(ADDRESS, len(ENDPOINTS))),
}
PRODUCERS = 4
CONSUMER_SLOTS = 4
COLORS = ("red", "green", "blue")
#: Selectors a consumer may get (None twice: half the consumers take everything).
SELECTORS: tuple[str | None, ...] = (None, None, "color = 'red'", "color IN ('green', 'blue')")
SELECTED = {None: None, "color = 'red'": {"red"}, "color IN ('green', 'blue')": {"green", "blue"}}
#: Messages per send and how often each is chosen: singles are most calls, batches of
#: 500 most messages.
SEND_SIZES, SEND_WEIGHTS = (1, 10, 500), (70, 25, 5)
NACK_SHARE, LEAVE_SHARE, PIPELINED_SHARE = 0.05, 0.03, 0.5
#: soak.b's limit: about 12,000 messages of ~330 bytes (body, properties, metadata), so
#: that its producers block now and then (while selector consumers leave the rest).
BLOCK_QUEUE_BYTES = 4 * 2**20
#: How long a BLOCKed send waits for room before AddressFull (seconds).
SEND_TIMEOUT = 5.0
PAGE_SIZE = 2**20
FILL = bytes(range(256)) * 3
PROGRESS_SECONDS = 10.0


def body_of(q: int, p: int, s: int) -> bytes:
    """The body of message ``s`` of producer ``p`` to queue ``q``: its id, then 16 to
    512 bytes that depend on it (so a body swapped or cut is seen)."""
    start = (s * 31 + p * 7) % 256
    length = 16 + (s * 2654435761 + p) % 497
    return b"%d.%d.%d|" % (q, p, s) + FILL[start : start + length]


def properties_of(p: int, s: int) -> dict[str, Any]:
    """The properties of message ``s`` of producer ``p`` (the selectors use color)."""
    return {"color": COLORS[(s + p) % 3], "producer": p, "seq": s}


@dataclass
class Counts:
    """Counters of one queue's ledger (messages)."""

    delivered: int = 0
    duplicates: int = 0  # deliveries of an id delivered before (nack, close: expected)
    after_ack: int = 0  # deliveries of an id whose ack had been sent before
    while_held: int = 0  # deliveries of an offset a consumer had received and still held
    acked: int = 0  # distinct ids acked
    nacked: int = 0
    left_unacked: int = 0  # left for the close to give back
    unknown: int = 0
    misrouted: int = 0  # rejected by the selector of the consumer that got it
    send_calls: int = 0
    address_full: int = 0
    #: The first few bad ones of each kind (a kind that comes often, such as deliveries
    #: while held under kills, must not hide the first of a rarer one).
    examples: dict[str, list[str]] = field(default_factory=dict)


class Ledger:
    """What happened to every id sent to one queue or subscription: per producer, arrays
    indexed by sequence number (an id costs 6 bytes here, not a Python object).
    ``index`` is the target the ids were sent to; ``routes``, the colours a
    subscription's selector lets through (None: all)."""

    def __init__(self, index: int, routes: set[str] | None = None):
        self.index = index
        self.routes = routes
        self.lock = threading.Lock()
        self.next_seq = [0] * PRODUCERS
        self.sent = [np.zeros(0, np.bool_) for _ in range(PRODUCERS)]
        self.acked = [np.zeros(0, np.bool_) for _ in range(PRODUCERS)]
        self.deliveries = [np.zeros(0, np.uint32) for _ in range(PRODUCERS)]
        #: offset -> the consumer (its serial) that received it and has not acked,
        #: nacked or closed yet: until then the queue may deliver it to nobody else.
        self.holding: dict[int, int] = {}
        self.counts = Counts()

    def reserve(self, p: int, n: int) -> int:
        """Sequence numbers for ``n`` messages of producer ``p``; returns the first."""
        with self.lock:
            first = self.next_seq[p]
            self.next_seq[p] = end = first + n
            if end > len(self.sent[p]):
                size = max(end, 2 * len(self.sent[p]), 4096)
                for arrays in (self.sent, self.acked, self.deliveries):
                    grown = np.zeros(size, arrays[p].dtype)
                    grown[: len(arrays[p])] = arrays[p]
                    arrays[p] = grown
            return first

    def confirm(self, p: int, first: int, n: int) -> None:
        """The queue said these ``n`` messages are stored (for a subscription: those of
        them it routes)."""
        with self.lock:
            if self.routes is None:
                self.sent[p][first : first + n] = True
            else:
                for s in range(first, first + n):
                    self.sent[p][s] = properties_of(p, s)["color"] in self.routes
            self.counts.send_calls += 1

    def _bad(self, kind: str, what: str) -> None:
        seen = self.counts.examples.setdefault(kind, [])
        if len(seen) < 5:
            seen.append(what)

    def check(
        self, offset: int, body: bytes, props: dict, selector: str | None, who: int
    ) -> tuple[int, int] | None:
        """The id (producer, seq) of a message delivered to consumer ``who``, counted;
        None if unknown. From now on ``who`` holds ``offset`` (until ``let_go``)."""
        head = body.partition(b"|")[0]
        try:
            q, p, s = (int(x) for x in head.split(b"."))
        except ValueError:
            q = p = s = -1
        with self.lock:
            c = self.counts
            c.delivered += 1
            holder = self.holding.get(offset)
            if holder is not None:
                c.while_held += 1
                self._bad("while_held", f"offset {offset} given to {who} while {holder} held it")
            self.holding[offset] = who
            if q != self.index or not 0 <= p < PRODUCERS or not 0 <= s < self.next_seq[p]:
                c.unknown += 1
                self._bad("unknown", f"unknown id {head[:40]!r}")
                return None
            if body != body_of(q, p, s) or props != properties_of(p, s):
                c.unknown += 1
                self._bad("unknown", f"{q}.{p}.{s}: body or properties differ")
                return None
            wanted = SELECTED[selector]
            if wanted is not None and props["color"] not in wanted:
                c.misrouted += 1
                self._bad("misrouted", f"{q}.{p}.{s} ({props['color']}) given to {selector!r}")
            elif self.routes is not None and props["color"] not in self.routes:
                c.misrouted += 1
                self._bad(
                    "misrouted",
                    f"{q}.{p}.{s} (offset {offset}, {props['color']}) routed to {self.routes}"
                    f" and given to consumer {who}",
                )
            if self.deliveries[p][s]:
                c.duplicates += 1
            if self.acked[p][s]:
                c.after_ack += 1
                self._bad("after_ack", f"{q}.{p}.{s} (offset {offset}) delivered after its ack")
            self.deliveries[p][s] += 1
            return p, s

    def let_go(self, offsets: list[int] | None = None, who: int | None = None) -> None:
        """The consumer is about to ack or nack ``offsets``, or consumer ``who`` is about
        to close: from then on the queue may deliver them again (unless acked)."""
        with self.lock:
            for o in offsets or []:
                self.holding.pop(o, None)
            if who is not None:
                for o in [o for o, w in self.holding.items() if w == who]:
                    del self.holding[o]

    def ack(self, keys: list[tuple[int, int]]) -> None:
        """Acks of these ids are about to be sent (before, so that a delivery racing
        with the call counts as after the ack; a failed ack fails the run anyway)."""
        with self.lock:
            for p, s in keys:
                if not self.acked[p][s]:
                    self.acked[p][s] = True
                    self.counts.acked += 1

    def totals(self) -> dict[str, int]:
        """Sent, lost (sent, never acked), never delivered, attempted and not confirmed
        (for a subscription: of what it routes)."""
        with self.lock:
            sent = lost = undelivered = unconfirmed = 0
            for p in range(PRODUCERS):
                n = self.next_seq[p]
                s, a, d = self.sent[p][:n], self.acked[p][:n], self.deliveries[p][:n]
                sent += int(s.sum())
                lost += int((s & ~a).sum())
                undelivered += int((s & (d == 0)).sum())
                routed = np.ones(n, np.bool_)
                if self.routes is not None:  # properties_of's colour of each sequence
                    colour = (np.arange(n) + p) % len(COLORS)
                    routed = np.isin(colour, [COLORS.index(c) for c in self.routes])
                unconfirmed += int((~s & routed).sum())
            return {
                "sent": sent,
                "lost": lost,
                "never_delivered": undelivered,
                "unconfirmed": unconfirmed,
            }


class Soak:
    """The run's shared state: queues, ledgers, stop signals and errors."""

    def __init__(self, broker, args: argparse.Namespace):
        self.args = args
        self.broker = broker
        address = broker.create_address(TARGETS[ADDRESS], page_size_bytes=PAGE_SIZE)
        #: Where producers send (queues and the address), by target index: each runs in
        #: an actor of its own (``bench.chaos`` kills them).
        self.queues = [
            broker.create_queue(TARGETS[0], page_size_bytes=PAGE_SIZE),
            broker.create_queue(
                TARGETS[1],
                page_size_bytes=PAGE_SIZE,
                max_size_bytes=BLOCK_QUEUE_BYTES,
                address_full_policy="BLOCK",
            ),
            address,
        ]
        #: What consumers consume, by endpoint index (``ENDPOINTS``).
        self.endpoints = [
            *self.queues[:ADDRESS],
            *(
                address.create_subscription(name, selector=selector)
                for name, (selector, _) in SUBSCRIPTIONS.items()
            ),
        ]
        self.ledgers = [Ledger(i) for i in range(ADDRESS)] + [
            Ledger(ADDRESS, routes) for _, routes in SUBSCRIPTIONS.values()
        ]
        self.stop_producing = threading.Event()
        self.stop_consuming = threading.Event()
        # Set while a target's depth is over --max-backlog: its producers wait.
        self.paused = [threading.Event() for _ in TARGETS]
        self.errors: list[str] = []
        self.errors_lock = threading.Lock()
        self.consumers_opened = 0
        self.live_consumers = 0
        self.depth = [0] * len(ENDPOINTS)
        #: Targets and endpoints in use: without the address (``--no-address``) it
        #: stays empty, its subscriptions are drained of nothing and report zeros.
        self.in_use = (ADDRESS, ADDRESS) if args.no_address else (len(TARGETS), len(ENDPOINTS))
        self.pss_now = (0, 0)  # (Ray processes, their PSS in bytes)
        self.pss_by_kind: list[dict[str, int]] = []  # the first and the last sample
        self.pss_peak = 0
        self.queue_pss_now = 0
        self.queue_pss_peak = 0
        self.queue_pids = [ray.get(q._actor.pid.remote()) for q in self.queues]
        #: Open consumers by serial (``bench.chaos`` kills their TargetLists).
        self.live: dict[int, Any] = {}
        #: Open consumers per endpoint (``bench.chaos`` watches only those consumed).
        self.consuming = [0] * len(ENDPOINTS)
        self.serial_of: dict[int, int] = {}  # consumer thread -> its consumer's serial

    def error(self, where: str, exc: BaseException) -> None:
        """Record an unexpected client error (it fails the run)."""
        text = f"{where}: {type(exc).__name__}: {exc}"
        with self.errors_lock:
            self.errors.append(text + "\n" + "".join(traceback.format_exception(exc)[-6:]))
        console.print(f"[red]error[/red] {text}")

    # -- producers -------------------------------------------------------------------

    def produce(self, p: int) -> None:
        """Producer ``p``: random target and send size, at ``--rate / PRODUCERS`` msg/s."""
        rng = random.Random(self.args.seed * 1000 + p)
        rate = self.args.rate / PRODUCERS
        next_at = time.monotonic()
        while not self.stop_producing.is_set():
            qi = rng.randrange(self.in_use[0])
            if self.paused[qi].is_set():
                time.sleep(0.05)
                continue
            n = rng.choices(SEND_SIZES, SEND_WEIGHTS)[0]
            ledgers, queue = [self.ledgers[e] for e in ENDPOINTS_OF[qi]], self.queues[qi]
            # Only this thread reserves producer p's numbers: each ledger gives the same.
            first = {ledger.reserve(p, n) for ledger in ledgers}.pop()
            seqs = range(first, first + n)
            try:
                if n == 1:
                    stored = queue.send(
                        body_of(qi, p, first), properties_of(p, first), timeout=SEND_TIMEOUT
                    )
                    count = 0 if stored is None else 1
                else:
                    bodies = [body_of(qi, p, s) for s in seqs]
                    props = [properties_of(p, s) for s in seqs]
                    count = len(queue.send_batch(bodies, props, timeout=SEND_TIMEOUT))
                for ledger in ledgers:
                    ledger.confirm(p, first, count)
            except AddressFull:  # soak.b at max_size_bytes for SEND_TIMEOUT: nothing stored
                with ledgers[0].lock:
                    ledgers[0].counts.address_full += 1
                time.sleep(0.2)
            except Exception as exc:
                self.error(f"producer {p} on {TARGETS[qi]}", exc)
                time.sleep(1.0)
            # Bounded rate: the machine has 2 cores, shared with the queue actors.
            next_at = max(next_at + n / rate, time.monotonic() - 1.0)
            delay = next_at - time.monotonic()
            if delay > 0:
                self.stop_producing.wait(delay)

    # -- consumers -------------------------------------------------------------------

    def consume(self, slot: int) -> None:
        """Consumer slot ``slot``: one consumer after another, each for 5-30 s."""
        rng = random.Random(self.args.seed * 1000 + 100 + slot)
        while not self.stop_consuming.is_set():
            qi = rng.randrange(self.in_use[1])
            selector = rng.choice(SELECTORS)
            prefetch = int(round(10 ** rng.uniform(2, math.log10(5000))))
            life = rng.uniform(5, 30)
            arrow = rng.random() < 0.5
            try:
                self._one_consumer(rng, qi, selector, prefetch, life, arrow)
            except Exception as exc:
                self.error(f"consumer slot {slot} on {ENDPOINTS[qi]} ({selector!r})", exc)
            self.stop_consuming.wait(rng.uniform(0, 2))  # the slot stays empty a moment

    def _one_consumer(
        self,
        rng: random.Random,
        qi: int,
        selector: str | None,
        prefetch: int,
        life: float,
        arrow: bool,
    ) -> None:
        ledger = self.ledgers[qi]
        consumer = self.endpoints[qi].consumer(selector=selector, prefetch=prefetch)
        with self.errors_lock:
            self.consumers_opened += 1
            self.live_consumers += 1
            who = self.consumers_opened
            self.live[who] = consumer
            self.consuming[qi] += 1
            self.serial_of[threading.get_ident()] = who
        left = 0  # messages this consumer holds on purpose, given back by its close
        try:
            end = time.monotonic() + life
            while time.monotonic() < end and not self.stop_consuming.is_set():
                got = receive(consumer, rng.choice((1, 10, 100, 1000)), arrow)
                acks: list[int] = []
                ack_keys: list[tuple[int, int]] = []
                nacks: list[int] = []
                for offset, body, props in got:
                    key = ledger.check(offset, body, props, selector, who)
                    r = rng.random()
                    if r < NACK_SHARE:
                        nacks.append(offset)
                    elif r < NACK_SHARE + LEAVE_SHARE and left < prefetch // 2:
                        left += 1  # at most half the credit, so that it keeps receiving
                    else:
                        acks.append(offset)
                        if key is not None:
                            ack_keys.append(key)
                # Let go before the call: once it is made, a nacked message may reach
                # another consumer at once.
                if nacks:
                    ledger.let_go(nacks)
                    consumer.nack(nacks)
                if acks:
                    ledger.let_go(acks)
                    ledger.ack(ack_keys)
                    consumer.ack(acks, wait=rng.random() >= PIPELINED_SHARE)
                with ledger.lock:
                    ledger.counts.nacked += len(nacks)
        finally:
            with ledger.lock:
                ledger.counts.left_unacked += left
            with self.errors_lock:
                self.live_consumers -= 1
                self.live.pop(who, None)
                self.consuming[qi] -= 1
            ledger.let_go(who=who)
            consumer.close()  # flushes pipelined acks; the rest is delivered again

    # -- the monitor ----------------------------------------------------------------

    def monitor(self, started: float) -> None:
        """Every second: depths (pause or resume producers); every PROGRESS_SECONDS:
        progress and memory."""
        last = 0.0
        bound = self.args.max_backlog
        while not self.stop_consuming.is_set():
            try:
                stats = [q.stats() for q in self.endpoints]
            except Exception as exc:
                self.error("monitor", exc)
                stats = None
            if stats is not None:
                for i, s in enumerate(stats):
                    self.depth[i] = s["depth"]
                for t, endpoints in ENDPOINTS_OF.items():
                    depth = max(self.depth[e] for e in endpoints)
                    if depth >= bound:
                        self.paused[t].set()
                    elif depth < 0.8 * bound:
                        self.paused[t].clear()
            now = time.monotonic()
            if now - last >= PROGRESS_SECONDS:
                last = now
                self.sample_memory()
                self.progress(now - started, stats)
            self.stop_consuming.wait(1.0)

    def sample_memory(self) -> None:
        """PSS of the Ray processes and of the queue actors now, and their peaks; by
        kind of process, the first and the last sample."""
        pids = ray_pids()
        by_kind: dict[str, int] = {}
        for pid in pids:
            kind = process_kind(pid)
            by_kind[kind] = by_kind.get(kind, 0) + pss(pid)
        self.pss_by_kind = self.pss_by_kind or [by_kind]
        self.pss_by_kind[1:] = [by_kind]
        self.pss_now = (len(pids), sum(by_kind.values()))
        self.queue_pss_now = sum(pss(pid) for pid in self.queue_pids)
        self.pss_peak = max(self.pss_peak, self.pss_now[1])
        self.queue_pss_peak = max(self.queue_pss_peak, self.queue_pss_now)

    def progress(self, elapsed: float, stats: list[dict] | None) -> None:
        sent = sum(lg.totals()["sent"] for lg in self.ledgers)
        acked = sum(lg.counts.acked for lg in self.ledgers)
        delivered = sum(lg.counts.delivered for lg in self.ledgers)
        backlog = "/".join(f"{d:,}" for d in self.depth)
        in_flight = "/".join(f"{s['in_flight']:,}" for s in stats) if stats else "?"
        paused = "".join("P" if e.is_set() else "-" for e in self.paused)
        console.print(
            f"{elapsed:6.0f} s  sent {sent:,}  delivered {delivered:,}  acked {acked:,}"
            f"  backlog {backlog}  in flight {in_flight}  paused {paused}"
            f"  consumers {self.live_consumers} ({self.consumers_opened} opened)"
            f"  Ray PSS {self.pss_now[1] / 2**20:,.0f} MiB in {self.pss_now[0]} processes"
            f" (queue actors {self.queue_pss_now / 2**20:,.0f} MiB)",
            soft_wrap=True,
        )

    # -- the run ---------------------------------------------------------------------

    def run(
        self, extra: Callable[[float], list[threading.Thread]] | None = None
    ) -> tuple[list[dict], list[dict], dict[str, float]]:
        """Producers, consumer slots and the monitor (and ``extra(t0)``'s threads, which
        must end once ``stop_consuming`` is set) for ``--minutes``; then every consumer
        closes and each queue is drained. Returns the queues' stats once the consumers
        closed and after the drain, and the seconds of the phases."""
        t0 = time.monotonic()
        producers = [threading.Thread(target=self.produce, args=(p,)) for p in range(PRODUCERS)]
        consumers = [
            threading.Thread(target=self.consume, args=(i,)) for i in range(CONSUMER_SLOTS)
        ]
        helpers = [threading.Thread(target=self.monitor, args=(t0,), daemon=True)]
        helpers += extra(t0) if extra is not None else []
        for t in [*producers, *consumers, *helpers]:
            t.start()
        self.stop_producing.wait(self.args.minutes * 60)
        self.stop_producing.set()
        for t in producers:
            t.join()
        produce_seconds = time.monotonic() - t0
        console.print("producers stopped; closing consumers ...")
        self.stop_consuming.set()
        for t in [*consumers, *helpers]:
            t.join()
        self.sample_memory()
        closed = [q.stats() for q in self.endpoints]
        console.print(
            "consumers closed; in flight "
            + ", ".join(f"{n} {s['in_flight']:,}" for n, s in zip(ENDPOINTS, closed, strict=True))
            + "; draining ..."
        )
        d0 = time.monotonic()
        for qi in range(len(ENDPOINTS)):
            self.drain(qi, self.args.drain_timeout)
        drain_seconds = time.monotonic() - d0
        self.sample_memory()
        final = [q.stats() for q in self.endpoints]
        seconds = {"produce": produce_seconds, "drain": drain_seconds, "all": time.monotonic() - t0}
        return closed, final, seconds

    # -- the end ---------------------------------------------------------------------

    def drain(self, qi: int, timeout: float) -> None:
        """Receive and ack everything left in endpoint ``qi`` with one fresh consumer,
        until its backlog and depth are 0, or nothing comes for 10 s, or ``timeout``."""
        ledger = self.ledgers[qi]
        deadline = time.monotonic() + timeout
        idle_since = time.monotonic()
        who = -1 - qi  # not a serial of the consumer slots
        with self.endpoints[qi].consumer(prefetch=5000) as c:
            while time.monotonic() < deadline:
                got = receive(c, 1000, arrow=True, timeout=1.0)
                if got:
                    idle_since = time.monotonic()
                    keys = [ledger.check(o, b, p, None, who) for o, b, p in got]
                    offsets = [o for o, _, _ in got]
                    ledger.let_go(offsets)
                    ledger.ack([k for k in keys if k is not None])
                    c.ack(offsets)
                    continue
                if c.backlog() == 0 and (
                    self.endpoints[qi].stats()["depth"] == 0 or time.monotonic() - idle_since > 10
                ):
                    return
            console.print(f"[red]drain of {ENDPOINTS[qi]} timed out[/red]")


def receive(
    consumer, n: int, arrow: bool, timeout: float = 1.0
) -> list[tuple[int, bytes, dict[str, Any]]]:
    """Up to ``n`` messages as (offset, body, properties), by ``receive`` or
    ``receive_batch`` (the Arrow path: both are what applications use)."""
    if not arrow:
        return [(m.offset, m.body, m.properties) for m in consumer.receive(n, timeout=timeout)]
    batch = consumer.receive_batch(n, timeout=timeout)
    if batch.num_rows == 0:
        return []
    offsets = batch.column("offset").to_pylist()
    bodies = batch.column("body").to_pylist()
    props = [decode_properties(p) for p in batch.column("properties").to_pylist()]
    return list(zip(offsets, bodies, props, strict=True))


def ray_pids() -> list[int]:
    """Processes of this script's Ray session: those Ray started (GCS, raylet, dashboard
    agent, ...) and their descendants (the worker processes of every actor)."""
    node = getattr(ray._private.worker, "_global_node", None)
    if node is None:
        return []
    roots = [
        info.process.pid
        for infos in node.all_processes.values()
        for info in infos
        if info.process is not None
    ]
    pids: set[int] = set()
    for pid in roots:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            pids.add(pid)
            pids.update(c.pid for c in proc.children(recursive=True))
    return sorted(pids)


def process_kind(pid: int) -> str:
    """What a Ray process is: ``ray::QueueActor``, ``raylet``, ``gcs_server``, ...
    (Ray names its workers after their actor class, or ``ray::IDLE``)."""
    try:
        cmd = psutil.Process(pid).cmdline()
    except psutil.Error:
        return "gone"
    if not cmd:
        return "?"
    first = cmd[0].split()[0]
    if first.startswith("ray::"):
        return first.split(".")[0]
    scripts = [a for a in cmd[1:] if a.endswith(".py")]  # a Python helper: its script
    if os.path.basename(first).startswith("python") and scripts:
        return os.path.basename(scripts[0])
    return os.path.basename(first)


def pss(pid: int) -> int:
    """Proportional set size of a process (bytes; 0 when gone): shared pages (the
    object store, libraries) are split between the processes mapping them, so the sum
    over processes counts each page once."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


#: The rows of the final table: key, label.
FIGURES = (
    ("sent", "sent (stored, as told to the producer)"),
    ("delivered", "delivered (receipts)"),
    ("acked", "acked (distinct ids)"),
    ("stuck", "STUCK in flight"),
    ("lost", "LOST"),
    ("unknown", "UNKNOWN (no such id, bad body/properties)"),
    ("misrouted", "MISROUTED (its selector rejects it)"),
    ("duplicates", "duplicates delivered"),
    ("while_held", "DELIVERED WHILE A CONSUMER HELD IT"),
    ("after_ack", "DELIVERED AGAIN AFTER ITS ACK"),
    ("nacked", "nacked"),
    ("left_unacked", "left unacked at close"),
    ("never_delivered", "sent, never delivered"),
    ("unconfirmed", "not sent (error, AddressFull)"),
    ("address_full", "AddressFull (BLOCK timeouts)"),
)


def figures(ledger: Ledger, closed: dict, final: dict) -> dict[str, int]:
    """One queue's or subscription's figures (``FIGURES``) from its ledger and its stats
    once every consumer closed (``closed``) and after the drain (``final``)."""
    t, c = ledger.totals(), ledger.counts
    # Stuck: in flight once every consumer closed, plus what the drain could not get
    # that nobody holds (held ones are in flight, counted already).
    undrained = max(0, final["depth"] - final["in_flight"])
    return {
        **t,
        "delivered": c.delivered,
        "acked": c.acked,
        "stuck": closed["in_flight"] + undrained,
        "unknown": c.unknown,
        "misrouted": c.misrouted,
        "duplicates": c.duplicates,
        "after_ack": c.after_ack,
        "while_held": c.while_held,
        "nacked": c.nacked,
        "left_unacked": c.left_unacked,
        "address_full": c.address_full,
    }


#: Figures that must be 0 for the run to pass.
MUST_BE_0 = ("stuck", "lost", "unknown", "misrouted", "while_held", "after_ack")


def report(
    soak: Soak,
    final: list[dict],
    closed: list[dict],
    seconds: dict[str, float],
    must_be_0: tuple[str, ...] = MUST_BE_0,
) -> bool:
    """Print the figures; returns True if everything that must hold held (the figures
    ``must_be_0``, and no client error)."""
    rows = [figures(lg, closed[i], final[i]) for i, lg in enumerate(soak.ledgers)]
    total = {k: sum(r[k] for r in rows) for k, _ in FIGURES}
    for qi, ledger in enumerate(soak.ledgers):
        for example in [e for kind in ledger.counts.examples.values() for e in kind]:
            console.print(f"  {ENDPOINTS[qi]}: {example}", markup=False)
    print_table(
        f"Soak: {soak.args.minutes:g} min, seed {soak.args.seed}, "
        f"{soak.consumers_opened} consumers opened",
        ["messages", *ENDPOINTS, "total"],
        [[label, *(f"{r[k]:,}" for r in rows), f"{total[k]:,}"] for k, label in FIGURES],
    )
    produce, everything = seconds["produce"], seconds["all"]
    console.print(
        f"rates: {total['sent'] / produce:,.0f} msg/s sent while producing ({produce:.0f} s);"
        f" {total['acked'] / everything:,.0f} msg/s acked and"
        f" {total['delivered'] / everything:,.0f} deliveries/s over the whole run"
        f" ({everything:.0f} s, of which {seconds['drain']:.1f} s draining)",
        soft_wrap=True,
    )
    for qi, name in enumerate(ENDPOINTS):
        s, c = final[qi], closed[qi]
        console.print(
            f"{name}: queue stats in {s['messages_in']:,}  out {s['messages_out']:,}"
            f"  acked {s['messages_acked']:,}  redelivered {s['messages_redelivered']:,}"
            f" (duplicates seen: {soak.ledgers[qi].counts.duplicates:,});"
            f" once consumers closed: in flight {c['in_flight']:,}, consumers"
            f" {c['consumers']}; after the drain: depth {s['depth']:,}, in flight"
            f" {s['in_flight']:,}; task restarts {s['task_restarts']}, internal errors"
            f" {s['internal_errors']}, storage errors {s['storage_errors']}",
            soft_wrap=True,
        )
    driver = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    console.print(
        f"memory: Ray processes {soak.pss_peak / 2**20:,.0f} MiB PSS at peak (sampled every"
        f" {PROGRESS_SECONDS:g} s), of which queue actors {soak.queue_pss_peak / 2**20:,.0f}"
        f" MiB; driver {driver / 2**20:,.0f} MiB RSS at peak",
        soft_wrap=True,
    )
    if len(soak.pss_by_kind) == 2:
        first, last = soak.pss_by_kind
        kinds = sorted(set(first) | set(last), key=lambda k: -last.get(k, 0))
        console.print(
            "PSS by process kind, first sample -> last (MiB): "
            + ", ".join(
                f"{k} {first.get(k, 0) / 2**20:,.0f} -> {last.get(k, 0) / 2**20:,.0f}"
                for k in kinds
            ),
            soft_wrap=True,
        )
    if soak.errors:
        console.print(f"[red]{len(soak.errors)} client errors[/red]; the first:")
        console.print(soak.errors[0], markup=False)
    bad = any(total[k] for k in must_be_0)
    ok = not (bad or soak.errors)
    console.print("[green]OK[/green]" if ok else "[red]FAILED[/red]")
    return ok


def scan_logs(logs_dir: str) -> None:
    """List the session's log files holding a Python traceback, and the distinct lines
    the actors wrote to stderr (RayMQ's warnings go there)."""
    found = subprocess.run(
        ["grep", "-rl", "Traceback", logs_dir], capture_output=True, text=True, check=False
    )
    files = sorted(found.stdout.split())
    console.print(f"log files with a traceback: {len(files)}", soft_wrap=True)
    for path in files:
        console.print(f"  {path}", soft_wrap=True, markup=False)
    lines: dict[str, int] = {}
    # Ray moves the logs of workers that ended (each closed consumer's) to logs/old.
    for name in sorted(glob.glob(os.path.join(logs_dir, "**", "worker-*.err"), recursive=True)):
        with open(name, errors="replace") as f:
            for line in f:
                line = line.rstrip()[:160]
                if line and not line.startswith((":job_id:", ":actor_name:", ":task_name:")):
                    lines[line] = lines.get(line, 0) + 1
    console.print(f"distinct lines on actors' stderr: {len(lines)}")
    for line, n in sorted(lines.items(), key=lambda kv: -kv[1])[:15]:
        console.print(f"  {n:5d} x {line}", soft_wrap=True, markup=False)


def add_address_option(parser: argparse.ArgumentParser) -> None:
    """``--no-address``: send to and consume from the two queues only."""
    parser.add_argument(
        "--no-address",
        action="store_true",
        help="the two queues only: nothing sent to the address or its subscriptions",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=3.0, help="producing time")
    parser.add_argument("--seed", type=int, default=12)
    parser.add_argument("--rate", type=float, default=3000, help="messages/s, all producers")
    parser.add_argument(
        "--max-backlog", type=int, default=50_000, help="depth above which producers pause"
    )
    parser.add_argument("--drain-timeout", type=float, default=180.0, help="seconds per queue")
    add_address_option(parser)
    args = parser.parse_args()

    broker = start_broker("bench-soak")
    session = ray._private.worker._global_node.get_session_dir_path()
    console.print(f"Ray session {session}; seed {args.seed}; {args.minutes:g} min")
    ok = False
    try:
        soak = Soak(broker, args)
        closed, final, seconds = soak.run()
        ok = report(soak, final, closed, seconds)
    finally:
        stop_broker(broker)
    scan_logs(os.path.join(session, "logs"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
