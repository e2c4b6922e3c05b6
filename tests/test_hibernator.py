"""The Hibernator without Ray: queues' processes started side by side, trimmed back
under the cap, and the two races that made the first side-by-side starts (bba7ed7)
flaky, each replayed against fake processes (``raymq.core.hibernator``)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from raymq.core.hibernation import HibernationSettings
from raymq.core.hibernator import Closed, Hibernator, Unreachable
from raymq.core.link import Fault, LinkFault, QueueLink
from raymq.errors import BrokerUnavailable, QueueNotFound

#: A fake process's start (seconds): long enough for starts to overlap.
START_SECONDS = 0.02
#: A client's way from the broker's answer to its first call reaching the queue
#: (seconds): a round trip.
CLIENT_SECONDS = 0.005


class Clock:
    """Monotonic seconds, which a test can move on (a queue idle for long)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


class FakeProcess:
    """A queue actor: idle since its last call, busy while ``busy``, closed by a
    hibernation, dead once ended."""

    def __init__(self, name: str, serial: int, clock: Clock):
        self.name = name
        self.serial = serial
        self._clock = clock
        self.last_call = clock()
        self.busy = False
        self.closed = False
        self.alive = True
        self.files_deleted = False

    def call(self) -> None:
        """A client's call: ``LinkFault`` if this process cannot answer it."""
        if not self.alive:
            raise LinkFault(Fault.GONE, f"{self.name}#{self.serial} is dead")
        if self.closed:
            raise LinkFault(Fault.MOVED, f"{self.name}#{self.serial} is hibernating")
        self.last_call = self._clock()


class FakeProcesses:
    """``QueueProcesses`` over ``FakeProcess``es, one node unless told; records how
    many starts overlapped."""

    def __init__(self, nodes: dict[str, str], clock: Clock):
        self.nodes = nodes
        self.clock = clock
        self.running: dict[str, FakeProcess] = {}
        self.ended: list[FakeProcess] = []
        self.serial = 0
        self.starting = 0
        self.most_starting = 0
        #: Queue -> an event its next ``end`` waits for (to hold a sweep there).
        self.end_gates: dict[str, asyncio.Event] = {}
        #: How long an idleness probe's answer takes to come back (seconds).
        self.answer_seconds = 0.0

    def start(self, name: str) -> tuple[FakeProcess, str]:
        if name not in self.nodes:
            raise QueueNotFound(name)
        process = self.running.get(name)
        if process is None:
            self.serial += 1
            process = self.running[name] = FakeProcess(name, self.serial, self.clock)
        return process, self.nodes[name]

    async def ready(self, handle: FakeProcess) -> None:
        self.starting += 1
        self.most_starting = max(self.most_starting, self.starting)
        try:
            await asyncio.sleep(START_SECONDS)
        finally:
            self.starting -= 1
        if handle.closed:
            raise Closed(handle.name)
        handle.last_call = self.clock()  # the broker's ready is a call too

    def find(self, name: str) -> FakeProcess | None:
        return self.running.get(name)

    def same(self, a: FakeProcess, b: FakeProcess) -> bool:
        return a is b

    async def idle_seconds(self, handle: FakeProcess) -> float | None:
        if not handle.alive:
            return None
        seconds = None if handle.busy else self.clock() - handle.last_call
        if self.answer_seconds:  # the answer's way back (a loaded machine's)
            await asyncio.sleep(self.answer_seconds)
        return seconds

    async def hibernate(self, handle: FakeProcess) -> bool:
        if not handle.alive:
            raise Unreachable("gone")
        if handle.busy:
            return False
        handle.closed = True
        return True

    async def delete_files(self, name: str, handle: FakeProcess) -> None:
        if handle.alive:  # (a dead one's are left to the broker)
            handle.closed = handle.files_deleted = True

    async def end(self, name: str, handle: FakeProcess) -> None:
        gate = self.end_gates.pop(name, None)
        if gate is not None:
            await gate.wait()
        handle.alive = False
        self.ended.append(handle)
        if self.running.get(name) is handle:
            del self.running[name]


def hibernator(
    cap: int | None, names: list[str], after: float | None = None, **kwargs
) -> tuple[Hibernator, FakeProcesses]:
    """A Hibernator (``cap`` per node, ``after`` idle seconds) over fake processes of
    ``names``, all on node n1; both read ``kwargs["clock"]`` if given."""
    clock = kwargs.setdefault("clock", Clock())
    processes = FakeProcesses({n: "n1" for n in names}, clock)
    return Hibernator(HibernationSettings(cap, after), processes, **kwargs), processes


def run(coro, seconds: float = 10.0):
    """``coro`` on a new event loop, failing after ``seconds``."""
    return asyncio.run(asyncio.wait_for(coro, seconds))


@pytest.mark.parametrize("answer_seconds", [0.0, 0.001])
def test_queues_started_together_start_side_by_side_and_are_trimmed_to_the_cap(answer_seconds):
    # With the probes' answers slow to come back, a probe's measuring is early in its
    # round trip (a queue handed out and not called yet must still be told apart).
    names = [f"q{i}" for i in range(6)]

    async def scenario() -> None:
        hib, processes = hibernator(2, names)
        processes.answer_seconds = answer_seconds

        async def create(name: str) -> None:
            handle = await hib.handle(name, new=True)
            await asyncio.sleep(CLIENT_SECONDS)
            handle.call()  # its client's first call: the handle it got is alive

        await asyncio.gather(*(create(n) for n in names))
        assert processes.most_starting > 1  # side by side, not one at a time
        deadline = time.monotonic() + 5
        while hib.over_any_cap() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert hib.policy.active_per_node() == {"n1": 2}
        assert len(processes.running) == 2
        # Two starts never hibernated the same queue (the per-node room lock).
        assert hib.counts["hibernations"] == len(processes.ended) == 4
        assert len({p.name for p in processes.ended}) == 4

    run(scenario())


def test_a_queue_handed_out_and_not_called_yet_is_not_trimmed():
    """The race: a queue started over the cap (the others busy) looks idle to the
    trimmer until its client's first call arrives; hibernated in that window, its
    client finds a dead actor. It is held back until the call, then trimmed."""

    async def scenario() -> None:
        hib, processes = hibernator(1, ["busy", "late"])
        busy = await hib.handle("busy", new=True)
        busy.busy = True  # a consumer holds messages of it
        late = await hib.handle("late", new=True)  # over the cap: the trimmer starts
        await asyncio.sleep(0.1)  # a slow client: several trimmer sweeps meanwhile
        late.call()  # its first call reaches the actor it was given
        deadline = time.monotonic() + 5
        while late.alive and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert not late.alive and busy.alive  # then the trimmer brought n1 to its cap
        assert hib.policy.active() == ["busy"]

    run(scenario())


def test_a_client_following_its_queue_is_not_trimmed_for_its_whole_grace():
    """The race as CI saw it: a client's QueueLink follows its hibernated queue; the
    broker revives it over the cap (the others busy), and the trimmer hibernated it
    again before the client's call arrived, each time, until the link's grace ran
    out ("a queue's handle refreshed onto a dead actor for the whole retry grace")."""
    hib, processes = hibernator(1, ["busy", "q"])
    loop = asyncio.new_event_loop()  # the broker's, in a thread: the link blocks
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def on_loop(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=10)

    class Transport:
        def call(self, handle, method, args, timeout):
            time.sleep(0.03)  # the answer's way back to the client, and its next call
            return handle.call()

    class Locator:
        def locate(self, failed):
            return on_loop(hib.handle("q"))

    try:
        busy = on_loop(hib.handle("busy", new=True))
        busy.busy = True
        first = on_loop(hib.handle("q", new=True))
        first.call()
        on_loop(hib.hibernate("q"))  # as a sweep did: its client's handle is now dead
        link = QueueLink("queue 'q'", first, Transport(), Locator(), grace_seconds=2.0)
        link.call("send")  # follows to a revival, which must survive until the call
        assert link.stats().follows >= 1
        assert link.stats().follows <= 2, link.stats()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def test_a_sweep_hibernates_only_the_process_it_probed():
    """The second race: a sweep chose two idle queues and hibernates them one at a
    time; while it ends the first, another start hibernated the second and revived it
    for a client. The new process, never probed, is not hibernated on the old one's
    idle time."""

    async def scenario() -> None:
        hib, processes = hibernator(None, ["a", "z"], after=50.0)
        for name in ("a", "z"):
            handle = await hib.handle(name, new=True)
            await asyncio.sleep(CLIENT_SECONDS)
            handle.call()
        processes.clock.offset += 100  # both idle past hibernate_after
        old_z = processes.running["z"]
        gate = processes.end_gates["a"] = asyncio.Event()
        sweep = asyncio.create_task(hib.sweep())
        while "a" in processes.end_gates:  # the sweep is ending "a"
            await asyncio.sleep(0.001)
        assert await hib.hibernate("z")  # meanwhile: another sweep hibernated "z"...
        new_z = await hib.handle("z")  # ...and a client had it revived
        await asyncio.sleep(CLIENT_SECONDS)
        new_z.call()
        gate.set()
        assert (await sweep).hibernated == 1  # "a" only
        assert new_z.alive and not new_z.closed and new_z is not old_z
        assert processes.running["z"] is new_z and hib.policy.is_active("z")

    run(scenario())


def test_a_handed_out_queue_is_held_until_its_first_call_or_its_grace():
    clock = Clock()
    hib, _ = hibernator(1, ["a"], clock=clock)
    p = hib.policy
    p.started("a", "n1")
    p.started("b", "n1")
    p.handed_out("a")
    now = clock()
    # No call since the handout (its idle time is longer than the handout's age).
    assert p.awaits_call("a", 5.0, now)
    assert p.choose_and_held({"a": 5.0, "b": 1.0}, None, {"a": now}) == (["b"], ["a"])
    assert not p.awaits_call("a", 0.0, now + 0.5)  # a call came after it
    assert not p.awaits_call("a", 50.0, now + 11.0)  # its grace is over
    assert not p.awaits_call("a", None, now)  # busy: not held, simply not chosen


def test_a_start_that_waited_for_its_queue_s_lock_is_refused_once_the_broker_stops():
    async def scenario() -> None:
        stopping = False
        hib, processes = hibernator(None, ["a"], stopping=lambda: stopping)
        async with hib.lock_of("a"):  # as stop_queues holds it while it stops "a"
            start = asyncio.create_task(hib.handle("a"))
            await asyncio.sleep(0)
            stopping = True
        with pytest.raises(BrokerUnavailable):
            await start
        assert not processes.running

    run(scenario())


def test_a_failed_start_no_longer_counts_toward_the_cap():
    async def scenario() -> None:
        hib, processes = hibernator(2, ["a"])

        async def broken(handle) -> None:
            raise RuntimeError("its process died while starting")

        processes.ready = broken
        with pytest.raises(RuntimeError):
            await hib.handle("a", new=True)
        assert hib.policy.active() == []

    run(scenario())


def test_a_queue_deleted_before_its_start_raises_queue_not_found():
    async def scenario() -> None:
        hib, _ = hibernator(2, [])
        with pytest.raises(QueueNotFound):
            await hib.handle("gone", new=True)

    run(scenario())


def test_deleting_a_hibernated_queue_starts_no_process_for_it():
    async def scenario() -> None:
        hib, processes = hibernator(2, ["a"])
        await hib.handle("a", new=True)
        assert await hib.hibernate("a")
        forgotten = []
        assert not await hib.delete("a", lambda: forgotten.append(processes.nodes.pop("a")))
        assert forgotten == ["n1"] and processes.serial == 1 and processes.running == {}
        assert hib.policy.active() == [] and hib.counts["revivals"] == 0

    run(scenario())


def test_deleting_a_running_queue_deletes_its_files_and_ends_its_process():
    async def scenario() -> None:
        hib, processes = hibernator(2, ["a"])
        process = await hib.handle("a", new=True)
        assert await hib.delete("a", lambda: processes.nodes.pop("a"))
        assert process.files_deleted and not process.alive and processes.ended == [process]
        assert hib.policy.active() == []

    run(scenario())


def test_a_revival_waiting_for_a_deletion_finds_the_queue_deleted():
    """A client's call that revives the queue while it is being deleted waits for the
    deletion (the queue's lock), then raises ``QueueNotFound``: no process is started
    for a deleted queue (it would make its directory again)."""

    async def scenario() -> None:
        hib, processes = hibernator(2, ["a"])
        await hib.handle("a", new=True)
        gate = processes.end_gates["a"] = asyncio.Event()  # holds the deletion in its lock
        deleting = asyncio.create_task(hib.delete("a", lambda: processes.nodes.pop("a")))
        while not hib.lock_of("a").locked():
            await asyncio.sleep(0)
        reviving = asyncio.create_task(hib.handle("a"))
        await asyncio.sleep(START_SECONDS)  # time enough to start, were it not waiting
        assert not reviving.done() and processes.serial == 1
        gate.set()
        assert await deleting
        with pytest.raises(QueueNotFound):
            await reviving
        assert processes.serial == 1 and processes.running == {}
        assert hib.policy.active() == []

    run(scenario())
