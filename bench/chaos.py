"""Chaos soak: ``bench.soak``'s producers and churning consumers while processes die.

Every 10-25 s (``--kill-every``) a random victim is SIGKILLed: a queue's or the
address's actor (Ray restarts it in place; the new process recovers from its files and
delivers again what was not acknowledged) or a live consumer's TargetList (that
consumer is gone: its application gets a typed error and opens another; the queue
delivers what it held again). Consumers use selectors, nack, leave messages
unacknowledged and pipeline half their acks, as in ``bench.soak``.

What must hold (exit status 1 otherwise):

- lost = 0: every message a producer was told is stored is acknowledged by the end;
- stuck = 0: nothing in flight once every consumer closed, nothing left after the drain;
- unknown = misrouted = 0: nothing served that was not sent, or that a selector rejects;
- no client error other than a typed ``RayMQError``, and never ``InvalidAck`` (an
  application acking what it received is never refused);
- no queue or subscription without a delivery for ``STALL_SECONDS`` while it holds
  messages and a consumer is open on it.

Deliveries while an old copy is held and after an ack are expected here (a killed
queue process delivers again what it had not stored as acknowledged: at-least-once),
so they are printed, not failed. Typed errors are printed by type, split into those of
a consumer whose TargetList was killed (expected) and the others.

    python -m bench.chaos [--minutes 10] [--seed 12] [--kill-every 10,25]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import threading
import time
from collections import Counter

import ray

from bench.common import console, start_broker, stop_broker
from bench.soak import (
    ENDPOINTS,
    MUST_BE_0,
    TARGETS,
    Soak,
    add_address_option,
    report,
    scan_logs,
)
from raymq.errors import InvalidAck, RayMQError

#: A queue or subscription holding messages with no delivery for this long is stalled
#: (seconds).
STALL_SECONDS = 60.0
#: Bound on asking a victim for its process id (seconds).
PID_SECONDS = 10.0


class ChaosSoak(Soak):
    """``Soak`` with a killer, a stall watchdog and errors sorted by type."""

    def __init__(self, broker, args: argparse.Namespace):
        super().__init__(broker, args)
        self.rng = random.Random(args.seed * 7919)
        self.kills: Counter[str] = Counter()
        self.killed_serials: set[int] = set()
        #: Typed errors: ("expected" | "unexpected", type name) -> count.
        self.typed: Counter[tuple[str, str]] = Counter()
        #: Per queue and subscription: seconds without a delivery, holding some.
        self.stall_max = [0.0] * len(ENDPOINTS)
        self.stalls = 0

    def error(self, where: str, exc: BaseException) -> None:
        """Typed errors are counted (expected when the consumer's TargetList was
        killed); ``InvalidAck`` and anything untyped fail the run."""
        if isinstance(exc, RayMQError) and not isinstance(exc, InvalidAck):
            serial = self.serial_of.get(threading.get_ident())
            kind = "expected" if serial in self.killed_serials else "unexpected"
            with self.errors_lock:
                self.typed[(kind, type(exc).__name__)] += 1
            console.print(f"[yellow]{kind} typed error[/yellow] {where}: {exc}", soft_wrap=True)
            return
        super().error(where, exc)

    def killer(self, every: tuple[float, float]) -> None:
        """SIGKILL a queue actor or a live consumer's TargetList every ``every`` s."""
        while not self.stop_producing.wait(self.rng.uniform(*every)):
            try:
                self.kill_one()
            except Exception as exc:  # noqa: BLE001 - a victim that died meanwhile
                console.print(f"kill skipped: {type(exc).__name__}: {exc}", soft_wrap=True)

    def kill_one(self) -> None:
        with self.errors_lock:
            live = dict(self.live)
        if live and self.rng.random() < 0.5:
            serial = self.rng.choice(sorted(live))
            handle, what = live[serial].target_list, f"TargetList of consumer {serial}"
            pid = ray.get(handle.pid.remote(), timeout=PID_SECONDS)
            self.killed_serials.add(serial)
            kind = "target_list"
        else:
            qi = self.rng.randrange(len(TARGETS))  # the address's actor among them
            what, kind = f"queue actor of {TARGETS[qi]}", "queue"
            pid = ray.get(self.queues[qi]._actor.pid.remote(), timeout=PID_SECONDS)
        os.kill(pid, signal.SIGKILL)
        self.kills[kind] += 1
        console.print(f"[magenta]SIGKILL[/magenta] {what} (pid {pid})")

    def watchdog(self) -> None:
        """Every second: how long each queue or subscription holding messages went
        without a delivery while a consumer was open on it (with four of them and four
        consumer slots picking one at random, one may have no consumer for a minute)."""
        seen = [ledger.counts.delivered for ledger in self.ledgers]
        since = [time.monotonic()] * len(ENDPOINTS)
        stalled = [False] * len(ENDPOINTS)
        while not self.stop_consuming.wait(1.0):
            now = time.monotonic()
            for qi, ledger in enumerate(self.ledgers):
                delivered = ledger.counts.delivered
                if delivered != seen[qi] or self.depth[qi] == 0 or not self.consuming[qi]:
                    seen[qi], since[qi], stalled[qi] = delivered, now, False
                    continue
                waited = now - since[qi]
                self.stall_max[qi] = max(self.stall_max[qi], waited)
                if waited > STALL_SECONDS and not stalled[qi]:
                    stalled[qi] = True
                    self.stalls += 1
                    console.print(f"[red]{ENDPOINTS[qi]} stalled {waited:.0f} s[/red]")


def run(args: argparse.Namespace) -> bool:
    """One chaos soak; True if everything that must hold held."""
    broker = start_broker("bench-chaos")
    session = ray._private.worker._global_node.get_session_dir_path()
    console.print(f"Ray session {session}; seed {args.seed}; {args.minutes:g} min")
    ok = False
    try:
        soak = ChaosSoak(broker, args)
        every = tuple(float(x) for x in args.kill_every.split(","))
        closed, final, seconds = soak.run(
            lambda t0: [
                threading.Thread(target=soak.watchdog, daemon=True),
                threading.Thread(target=soak.killer, args=(every,), daemon=True),
            ]
        )
        must = tuple(k for k in MUST_BE_0 if k not in ("while_held", "after_ack"))
        ok = report(soak, final, closed, seconds, must_be_0=must)
        console.print(
            f"kills: {dict(soak.kills)}; typed errors: "
            + (", ".join(f"{k} {t} x{n}" for (k, t), n in sorted(soak.typed.items())) or "none")
            + f"; stall max per queue: {[round(s) for s in soak.stall_max]} s;"
            f" stalls over {STALL_SECONDS:g} s: {soak.stalls}; stale acks dropped:"
            f" {[s.get('stale_acks', 0) for s in final]}",
            soft_wrap=True,
        )
        ok = ok and soak.stalls == 0
        console.print("[green]CHAOS OK[/green]" if ok else "[red]CHAOS FAILED[/red]")
    finally:
        stop_broker(broker)
    scan_logs(os.path.join(session, "logs"))
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="producing time")
    parser.add_argument("--seed", type=int, default=12)
    parser.add_argument("--rate", type=float, default=3000, help="messages/s, all producers")
    parser.add_argument("--max-backlog", type=int, default=50_000)
    parser.add_argument("--drain-timeout", type=float, default=180.0, help="seconds per queue")
    parser.add_argument("--kill-every", default="10,25", help="seconds between kills: LO,HI")
    add_address_option(parser)
    sys.exit(0 if run(parser.parse_args()) else 1)


if __name__ == "__main__":
    main()
