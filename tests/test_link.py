"""QueueLink without Ray: a fake endpoint that dies, restarts in place, moves, pauses,
hibernates or is ended; every call follows the queue or raises a typed error naming
it, within the grace (issue 28, Observed 1 and 4). A fake clock: no real waiting."""

from __future__ import annotations

import pytest

from raymq.core.link import Fault, LinkFault, QueueLink
from raymq.errors import BrokerUnavailable, NotLeader, QueueNotFound, StorageError


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds


class Actor:
    """One actor of the fake queue: its state says how calls on it end."""

    def __init__(self, name: str, state: str = "up"):
        self.name = name
        self.state = state  # up | restarting | gone | unknown | moved | paused | not_leader
        self.calls = 0

    def __repr__(self) -> str:
        return f"Actor({self.name}, {self.state})"


class FakeCluster:
    """Transport and Locator at once: ``current`` is the actor the broker names."""

    def __init__(self, clock: FakeClock):
        self.clock = clock
        self.current = Actor("a1")
        self.located = 0
        self.locate_error: Exception | None = None
        #: Seconds after which a restarting actor is up again.
        self.restart_seconds = 1.0
        self._restart_at: float | None = None

    # Transport
    def call(self, handle: Actor, method: str, args: tuple, timeout: float | None):
        handle.calls += 1
        if handle.state == "restarting":
            if self._restart_at is None:
                self._restart_at = self.clock.now + self.restart_seconds
            if self.clock.now >= self._restart_at:
                handle.state = "up"
            else:
                raise LinkFault(Fault.RESTARTING, "restarting")
        if handle.state == "gone":
            raise LinkFault(Fault.GONE, "died")
        if handle.state == "unknown":  # Ray knows no such actor (another Ray session's)
            raise LinkFault(Fault.GONE, "ActorNotFound", final=True)
        if handle.state == "moved":
            raise LinkFault(Fault.MOVED, "node gone: unschedulable")
        if handle.state == "not_leader":
            raise NotLeader("queue 'q': not the leader")
        if handle.state == "paused":
            assert timeout is not None, "a call on a paused actor must be bounded"
            self.clock.now += timeout
            raise LinkFault(Fault.SILENT, f"no answer in {timeout} s")
        if method == "fail":
            raise StorageError("queue 'q': disk full")
        return (handle.name, method, args)

    # Locator
    def locate(self, failed: Actor) -> Actor:
        self.located += 1
        if self.locate_error is not None:
            raise self.locate_error
        return self.current


def link_of(cluster: FakeCluster, grace: float = 60.0, attempt: float = 1.0) -> QueueLink:
    return QueueLink(
        "queue 'q'",
        cluster.current,
        cluster,
        cluster,
        grace_seconds=grace,
        attempt_seconds=attempt,
        clock=cluster.clock.clock,
        sleep=cluster.clock.sleep,
    )


@pytest.fixture
def cluster() -> FakeCluster:
    return FakeCluster(FakeClock())


def test_a_healthy_call_is_one_call_and_no_lookup(cluster):
    link = link_of(cluster)
    assert link.call("stats", 1) == ("a1", "stats", (1,))
    assert cluster.located == 0 and cluster.current.calls == 1


def test_a_typed_error_of_the_queue_is_the_answer(cluster):
    with pytest.raises(StorageError, match="disk full"):
        link_of(cluster).call("fail")
    assert cluster.located == 0


@pytest.mark.parametrize("state", ["gone", "moved", "not_leader"])
def test_a_leader_change_is_followed(cluster, state):
    """Observed 1: after a failover (the old leader's node gone: unschedulable), every
    call of the handle goes to the new leader."""
    link = link_of(cluster)
    cluster.current.state = state
    cluster.current = Actor("a2")
    assert link.call("fetch_endpoint") == ("a2", "fetch_endpoint", ())
    assert link.handle is cluster.current
    assert link.stats().follows == 1
    assert link.call("ack") == ("a2", "ack", ())  # no lookup again
    assert cluster.located == 1


def test_a_restart_in_place_is_waited_out_on_the_same_actor(cluster):
    link = link_of(cluster)
    actor = cluster.current
    actor.state = "restarting"
    cluster.restart_seconds = 3.0
    assert link.call("send_batch")[0] == "a1"
    assert link.handle is actor and cluster.clock.now >= 3.0
    assert link.stats().faults == {"restarting": link.stats().faults["restarting"]}


def test_a_hibernated_queue_is_revived_by_the_locator(cluster):
    link = link_of(cluster)
    cluster.current.state = "gone"
    cluster.locate_error = BrokerUnavailable("the broker is reviving it")
    cluster.clock.now = 0.0

    def revived(failed):  # two lookups fail, then the broker has started a new actor
        cluster.located += 1
        if cluster.located <= 2:
            raise BrokerUnavailable("queue 'q': starting")
        return Actor("a2")

    cluster.locate = revived  # type: ignore[method-assign]
    assert link.call("stats")[0] == "a2"
    assert link.stats().locate_failures == 2


def test_an_ended_queue_raises_queue_not_found(cluster):
    link = link_of(cluster)
    cluster.current.state = "gone"
    cluster.locate_error = QueueNotFound("queue 'q' does not exist")
    with pytest.raises(QueueNotFound):
        link.call("stats")


def test_a_dead_actor_nobody_replaces_ends_in_broker_unavailable_within_the_grace(cluster):
    """Observed 4: the handle must not keep a dead actor silently, nor retry it for
    ever: the last fault is named, within the grace."""
    link = link_of(cluster, grace=10.0)
    cluster.current.state = "gone"  # and the locator names the same dead actor
    with pytest.raises(BrokerUnavailable, match=r"queue 'q'.*10 s.*died"):
        link.call("stats")
    assert 10.0 <= cluster.clock.now <= 11.0
    assert cluster.located >= 2  # asked again on every attempt


def test_an_actor_gone_for_good_that_nobody_replaces_fails_at_once(cluster):
    """A handle of a Ray session since shut down: Ray knows neither its actor nor the
    broker's. Waiting out the grace cannot help; the typed error comes at once."""
    link = link_of(cluster, grace=60.0)
    cluster.current.state = "unknown"
    cluster.locate_error = BrokerUnavailable("the broker's actor is unknown too")
    with pytest.raises(BrokerUnavailable, match=r"queue 'q'.*gone for good.*ActorNotFound"):
        link.call("stats")
    assert cluster.clock.now == 0.0 and cluster.located == 1


def test_an_actor_gone_for_good_is_followed_to_the_one_the_broker_names(cluster):
    link = link_of(cluster)
    cluster.current.state = "unknown"
    cluster.current = Actor("a2")
    assert link.call("stats") == ("a2", "stats", ())


def test_a_paused_actor_costs_at_most_the_grace(cluster):
    """Observed 4: a SIGSTOPped queue actor: calls are bounded, then a typed error; a
    call not answered is not tried again (a send could be stored twice)."""
    link = link_of(cluster, grace=20.0)
    cluster.current.state = "paused"
    with pytest.raises(BrokerUnavailable, match="did not answer stats.*unknown"):
        link.call("stats")
    assert cluster.clock.now == 20.0 and cluster.current.calls == 1


def test_an_attempt_that_reached_its_actor_may_outlast_a_short_grace(cluster):
    """A call to a live actor is given ``attempt_seconds`` even when little of the
    grace is left: cutting it short would leave a send's outcome unknown."""
    link = link_of(cluster, grace=0.5, attempt=60.0)
    cluster.current.state = "gone"
    cluster.current = Actor("a2", "paused")
    with pytest.raises(BrokerUnavailable, match="unknown"):
        link.call("send_batch")
    assert cluster.clock.now >= 60.0


def test_a_call_that_waits_by_design_is_bounded_beyond_the_grace(cluster):
    link = link_of(cluster, grace=5.0, attempt=1.0)
    seen: list[float | None] = []
    real = cluster.call

    def spy(handle, method, args, timeout):
        seen.append(timeout)
        return real(handle, method, args, timeout)

    cluster.call = spy  # type: ignore[method-assign]
    link.call("send_batch", answer_seconds=30.0)
    link.call("send_batch", answer_seconds=None)
    assert seen == [35.0, None]


def test_only_one_thread_follows_a_failed_actor(cluster):
    link = link_of(cluster)
    old = cluster.current
    cluster.current = Actor("a2")
    assert link.follow(old) is True and cluster.located == 1
    assert link.follow(old) is True and cluster.located == 1  # moved on already


def test_a_link_fault_survives_pickling():
    # Ray pickles an exception that crosses an actor call: the default pickling (the
    # message as the one argument) could not be rebuilt (UnserializableException).
    import pickle

    fault = LinkFault(Fault.GONE, RuntimeError("killed by ray.kill"), final=True)
    back = pickle.loads(pickle.dumps(fault))
    assert type(back) is LinkFault and back.kind is Fault.GONE and back.final
    assert str(back) == str(fault) == "gone: killed by ray.kill"
