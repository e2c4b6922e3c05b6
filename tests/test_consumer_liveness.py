"""ConsumerLiveness without Ray (issue 28, "Ray-free link state machines"): the queue's
one mechanism that takes consumers for dead, driven by events and a fake clock. Every
path: the death watch, the pings (answered, timed out, finding the actor gone), the
FetchChannel's unwatched consumers and their grace, re-registration, a consumer closing,
and events told twice."""

from __future__ import annotations

import pytest

from raymq.core.consumer_liveness import (
    CONSUMER_PING_TIMEOUT_SECONDS,
    CONSUMER_SILENCE_SECONDS,
    UNWATCHED_GRACE_SECONDS,
    WATCH_PERIOD_SECONDS,
    Close,
    ConsumerLiveness,
    ConsumerState,
    Death,
    Ping,
    PingOutcome,
    Unwatch,
    Watch,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def live(clock: FakeClock) -> ConsumerLiveness:
    return ConsumerLiveness(clock)


def watched(live: ConsumerLiveness, consumer_id: str = "c1", handle: object = "tl1") -> Watch:
    """Register ``consumer_id`` through Ray; its ``Watch``."""
    (watch,) = live.registered(consumer_id, None, handle)
    assert isinstance(watch, Watch)
    return watch


def next_round(live: ConsumerLiveness, clock: FakeClock) -> list:
    """Move the clock to the next round of pings (if it is not past it) and tick."""
    clock.now = max(clock.now, live.next_tick())
    return live.tick()


# -- the death watch ------------------------------------------------------------------


def test_a_registration_through_ray_starts_a_death_watch_on_its_handle(live):
    w = watched(live, "c1", "tl1")
    assert (w.consumer_id, w.subscription, w.watch) == ("c1", None, "tl1")
    assert live.state("c1", None) is ConsumerState.WATCHED


def test_a_death_told_by_the_watch_closes_the_consumer(live):
    w = watched(live)
    actions = live.watch_ended("c1", None, w.generation, died=True)
    assert actions == [Close("c1", None, Death.WATCH)]  # its watch is over: no Unwatch
    assert live.state("c1", None) is None
    assert live.deaths == {Death.WATCH: 1}


def test_a_watch_that_ends_without_a_death_leaves_the_pings_to_judge(live, clock):
    w = watched(live)
    assert live.watch_ended("c1", None, w.generation, died=False) == []
    assert live.state("c1", None) is ConsumerState.WATCHED
    clock.now += CONSUMER_SILENCE_SECONDS + 1
    assert next_round(live, clock) == [Ping("c1", None, "tl1", w.generation)]


# -- the pings ------------------------------------------------------------------------


def test_a_consumer_heard_from_is_not_pinged(live, clock):
    watched(live)
    for _ in range(5):
        clock.now += WATCH_PERIOD_SECONDS / 2
        live.heard_from("c1", None)  # a fetch or an ack
        assert live.tick() == []
    assert live.pings == 0


def test_a_silent_consumer_is_pinged_then_closed_if_its_actor_is_gone(live, clock):
    w = watched(live)
    clock.now += CONSUMER_SILENCE_SECONDS + 1
    assert next_round(live, clock) == [Ping("c1", None, "tl1", w.generation)]
    assert live.state("c1", None) is ConsumerState.PINGED
    actions = live.ping_ended("c1", None, w.generation, PingOutcome.GONE)
    assert actions == [Unwatch("c1", None), Close("c1", None, Death.PING)]
    assert live.state("c1", None) is None
    assert live.deaths == {Death.PING: 1}


def test_a_ping_answered_keeps_the_consumer_until_it_is_silent_again(live, clock):
    w = watched(live)
    clock.now += CONSUMER_SILENCE_SECONDS + 1
    (ping,) = next_round(live, clock)
    clock.now += 0.5
    assert live.ping_ended("c1", None, ping.generation, PingOutcome.ANSWERED) == []
    assert live.state("c1", None) is ConsumerState.WATCHED
    assert next_round(live, clock) == []  # heard from (the answer) one round ago
    assert next_round(live, clock) == [Ping("c1", None, "tl1", w.generation)]


def test_a_ping_unanswered_in_time_is_no_death_and_is_sent_again(live, clock):
    w = watched(live)
    clock.now += CONSUMER_SILENCE_SECONDS + 1
    (ping,) = next_round(live, clock)
    clock.now += CONSUMER_PING_TIMEOUT_SECONDS
    assert live.ping_ended("c1", None, ping.generation, PingOutcome.UNANSWERED) == []
    assert live.state("c1", None) is ConsumerState.WATCHED
    assert live.tick() == []  # not before the next round
    assert next_round(live, clock) == [Ping("c1", None, "tl1", w.generation)]
    assert live.deaths == {}


def test_a_ping_never_reported_is_sent_again_next_round(live, clock):
    watched(live)
    clock.now += CONSUMER_SILENCE_SECONDS + 1
    assert len(next_round(live, clock)) == 1  # its task lost, say: no ping_ended
    assert len(next_round(live, clock)) == 1
    assert live.pings == 2


def test_a_call_while_pinged_makes_the_answer_unneeded(live, clock):
    w = watched(live)
    clock.now += CONSUMER_SILENCE_SECONDS + 1
    next_round(live, clock)
    live.heard_from("c1", None)
    assert live.state("c1", None) is ConsumerState.WATCHED
    assert live.ping_ended("c1", None, w.generation, PingOutcome.UNANSWERED) == []
    assert next_round(live, clock) == []


def test_a_registration_over_a_channel_while_pinged_is_a_sign_of_life(live, clock):
    watched(live)
    clock.now += CONSUMER_SILENCE_SECONDS + 1
    next_round(live, clock)
    live.registered("c1", None)  # its channel reconnected
    assert live.state("c1", None) is ConsumerState.WATCHED
    assert next_round(live, clock) == []


def test_pings_go_out_in_rounds_only(live, clock):
    """However often it ticks (a channel lost wakes it), a silent consumer is pinged
    once a round."""
    watched(live)
    clock.now += CONSUMER_SILENCE_SECONDS + 1
    (ping,) = next_round(live, clock)
    live.ping_ended("c1", None, ping.generation, PingOutcome.UNANSWERED)
    for _ in range(9):
        clock.now += WATCH_PERIOD_SECONDS / 10
        assert live.tick() == []
    assert live.next_tick() == pytest.approx(clock.now + WATCH_PERIOD_SECONDS / 10)


def test_unwatched_consumers_are_never_pinged(live, clock):
    live.registered("c1", None)  # over a FetchChannel: no handle to ping
    clock.now += 10 * CONSUMER_SILENCE_SECONDS
    assert next_round(live, clock) == []


def test_a_death_ray_never_tells_is_found_by_the_pings_within_their_bound(live, clock):
    """A TargetList whose death the watch never reports (its node gone quietly), run
    by a loop that ticks at ``next_tick``: closed within a round, the silence and a
    ping's timeout of its last call."""
    w = watched(live)
    last_call = clock.now
    closed = []
    while not closed:
        clock.now = live.next_tick()
        for action in live.tick():
            assert isinstance(action, Ping)
            clock.now += CONSUMER_PING_TIMEOUT_SECONDS  # the ping times out: busy or dead?
            closed = live.ping_ended("c1", None, w.generation, PingOutcome.GONE)
    bound = WATCH_PERIOD_SECONDS + CONSUMER_SILENCE_SECONDS + CONSUMER_PING_TIMEOUT_SECONDS
    assert clock.now - last_call <= bound
    assert closed[-1] == Close("c1", None, Death.PING)


# -- the FetchChannel's unwatched consumers -------------------------------------------


def test_an_unwatched_consumer_whose_channel_was_lost_is_closed_after_the_grace(live, clock):
    assert live.registered("c1", None) == []
    assert live.state("c1", None) is ConsumerState.UNWATCHED
    live.channel_lost([("c1", None)])
    assert live.state("c1", None) is ConsumerState.CHANNEL_LOST
    assert live.next_tick() == clock.now + UNWATCHED_GRACE_SECONDS
    clock.now += UNWATCHED_GRACE_SECONDS - 0.01
    assert live.tick() == []
    clock.now = live.next_tick()
    assert live.tick() == [Close("c1", None, Death.CHANNEL)]
    assert live.state("c1", None) is None
    assert live.tick() == []
    assert live.deaths == {Death.CHANNEL: 1}


def test_an_unwatched_consumer_watched_within_the_grace_is_kept(live, clock):
    live.registered("c1", None)
    live.channel_lost([("c1", None)])
    clock.now += UNWATCHED_GRACE_SECONDS / 2
    watched(live)  # its TargetList's Ray registration
    clock.now += UNWATCHED_GRACE_SECONDS
    assert live.tick() == []
    assert live.state("c1", None) is ConsumerState.WATCHED
    assert live.next_tick() > clock.now  # no grace left to wait for


def test_an_unwatched_consumer_closed_within_the_grace_is_forgotten(live, clock):
    live.registered("c1", None)
    live.channel_lost([("c1", None)])
    assert live.closed("c1", None) == []  # nothing watched, nothing to stop
    clock.now += UNWATCHED_GRACE_SECONDS
    assert live.tick() == []
    assert live.deaths == {}


def test_a_registration_over_a_new_connection_ends_the_grace(live, clock):
    live.registered("c1", None)
    live.channel_lost([("c1", None)])
    assert live.registered("c1", None) == []  # reconnected: alive
    assert live.state("c1", None) is ConsumerState.UNWATCHED
    clock.now += UNWATCHED_GRACE_SECONDS
    assert live.tick() == []
    live.channel_lost([("c1", None)])  # the new connection ends too
    clock.now += UNWATCHED_GRACE_SECONDS
    assert live.tick() == [Close("c1", None, Death.CHANNEL)]


def test_a_lost_channel_changes_nothing_for_watched_or_unknown_consumers(live, clock):
    live.registered("c1", None)
    watched(live, "c1")  # registered over the channel, then through Ray
    live.registered("c1", None)  # over the channel again: still watched
    live.channel_lost([("c1", None), ("never", None)])
    assert live.state("c1", None) is ConsumerState.WATCHED
    assert live.state("never", None) is None
    clock.now += UNWATCHED_GRACE_SECONDS
    assert live.tick() == []


def test_only_the_consumers_of_the_lost_connection_are_judged(live, clock):
    live.registered("c1", None)
    live.registered("c2", None)
    live.channel_lost([("c1", None)])
    clock.now += UNWATCHED_GRACE_SECONDS
    assert live.tick() == [Close("c1", None, Death.CHANNEL)]
    assert live.state("c2", None) is ConsumerState.UNWATCHED


# -- registering again ---------------------------------------------------------------


def test_a_queue_restarted_in_place_watches_its_consumers_again(clock):
    """A restarted queue actor starts with a new liveness that knows nobody: the
    watches and pings of the process before report to nobody, and the consumers'
    registrations are watched afresh."""
    before = ConsumerLiveness(clock)
    old = watched(before)
    after = ConsumerLiveness(clock)
    assert after.watch_ended("c1", None, old.generation, died=True) == []
    assert after.ping_ended("c1", None, old.generation, PingOutcome.GONE) == []
    after.heard_from("c1", None)
    assert after.state("c1", None) is None
    w = watched(after, "c1", "tl1")
    assert after.state("c1", None) is ConsumerState.WATCHED
    assert after.watch_ended("c1", None, w.generation, died=True)[0].reason is Death.WATCH


def test_a_new_target_list_of_the_consumer_outlives_the_death_of_the_old_one(live, clock):
    old = watched(live, "c1", "tl-old")
    clock.now += CONSUMER_SILENCE_SECONDS + 1
    (ping,) = next_round(live, clock)
    new = watched(live, "c1", "tl-new")  # its replacement registers: a new watch
    assert new.generation != old.generation
    assert live.watch_ended("c1", None, old.generation, died=True) == []
    assert live.ping_ended("c1", None, ping.generation, PingOutcome.GONE) == []
    assert live.state("c1", None) is ConsumerState.WATCHED
    assert live.watch_ended("c1", None, new.generation, died=True) == [
        Close("c1", None, Death.WATCH)
    ]


def test_a_consumer_taken_for_dead_that_registers_again_is_watched_afresh(live):
    old = watched(live)
    live.watch_ended("c1", None, old.generation, died=True)
    new = watched(live)
    assert new.generation != old.generation
    assert live.watch_ended("c1", None, old.generation, died=True) == []  # late, told twice
    assert live.state("c1", None) is ConsumerState.WATCHED


# -- closing --------------------------------------------------------------------------


def test_a_consumer_that_closes_stops_its_watch_and_every_judgement(live, clock):
    w = watched(live)
    clock.now += CONSUMER_SILENCE_SECONDS + 1
    next_round(live, clock)  # a ping is out
    assert live.closed("c1", None) == [Unwatch("c1", None)]
    assert live.state("c1", None) is None
    assert live.watch_ended("c1", None, w.generation, died=True) == []
    assert live.ping_ended("c1", None, w.generation, PingOutcome.GONE) == []
    clock.now += 10 * WATCH_PERIOD_SECONDS
    assert live.tick() == []
    assert live.deaths == {}


def test_a_deleted_subscription_takes_its_consumers_along_only(live):
    live.registered("c1", "a/s1", "tl1")
    live.registered("c1", "a/s2", "tl2")  # one id in two subscriptions: two consumers
    live.registered("c2", "a/s1")
    assert live.subscription_deleted("a/s1") == [Unwatch("c1", "a/s1")]
    assert live.state("c1", "a/s1") is None and live.state("c2", "a/s1") is None
    assert live.state("c1", "a/s2") is ConsumerState.WATCHED


# -- events told twice ----------------------------------------------------------------


def test_events_told_twice_act_once(live, clock):
    w = watched(live)
    assert live.watch_ended("c1", None, w.generation, died=True) != []
    assert live.watch_ended("c1", None, w.generation, died=True) == []
    assert live.closed("c1", None) == []

    w = watched(live, "c2")
    clock.now += CONSUMER_SILENCE_SECONDS + 1
    next_round(live, clock)
    assert live.ping_ended("c2", None, w.generation, PingOutcome.GONE) != []
    assert live.ping_ended("c2", None, w.generation, PingOutcome.GONE) == []

    w = watched(live, "c3")
    assert live.closed("c3", None) == [Unwatch("c3", None)]
    assert live.closed("c3", None) == []
    assert live.deaths == {Death.WATCH: 1, Death.PING: 1}


def test_a_channel_lost_twice_keeps_the_first_deadline(live, clock):
    live.registered("c1", None)
    live.channel_lost([("c1", None)])
    deadline = live.next_tick()
    clock.now += UNWATCHED_GRACE_SECONDS / 2
    live.channel_lost([("c1", None)])
    assert live.next_tick() == deadline
    clock.now = deadline
    assert live.tick() == [Close("c1", None, Death.CHANNEL)]


def test_a_queue_s_own_subscription_is_none_however_it_is_named(live):
    w = watched(live, "c1")
    assert live.state("c1", "") is ConsumerState.WATCHED
    assert live.watch_ended("c1", "", w.generation, died=True) == [Close("c1", None, Death.WATCH)]


def test_the_settings_are_the_module_s_constants_unless_given(clock):
    live = ConsumerLiveness(clock)
    assert (live.watch_period, live.silence, live.ping_timeout, live.unwatched_grace) == (
        WATCH_PERIOD_SECONDS,
        CONSUMER_SILENCE_SECONDS,
        CONSUMER_PING_TIMEOUT_SECONDS,
        UNWATCHED_GRACE_SECONDS,
    )
    quick = ConsumerLiveness(clock, watch_period=1.0, silence=0.5)
    quick.registered("c1", None, "tl1")
    clock.now += 1.0
    assert [type(a) for a in quick.tick()] == [Ping]
