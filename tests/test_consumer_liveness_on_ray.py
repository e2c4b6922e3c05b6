"""The queue actor's shell of ConsumerLiveness on a real Ray: its pings reach the
TargetLists. A living silent consumer answers and is kept; one whose death the watch
never told (its watch stopped here) is found by a ping and closed, and what it held is
delivered again. The decisions themselves are tested without Ray
(tests/test_consumer_liveness.py)."""

from __future__ import annotations

import time

import ray

from tests.consumer_helpers import receive_all

#: Bound on waiting for a condition, in real seconds: only a wedge takes this long.
WAIT_SECONDS = 30.0


def _quick_pings(actor, stop_watches: bool) -> None:
    """In the queue actor's process: a round every 0.2 s pinging consumers silent for
    0.1 s; with ``stop_watches``, the death watches end untold (as if Ray never said)."""
    live = actor._liveness
    live.watch_period, live.silence, live._next_round = 0.2, 0.1, 0.0
    for task in list(actor._watches.values()):
        loop = task.get_loop()  # (this may run off the actor's event loop)
        if stop_watches:
            loop.call_soon_threadsafe(task.cancel)
        loop.call_soon_threadsafe(actor._liveness_moved.set)


def _liveness(actor) -> tuple[int, dict[str, int]]:
    live = actor._liveness
    return live.pings, {death.name: n for death, n in live.deaths.items()}


def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not condition():
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(0.05)  # polling a condition, with a deadline


def _loaded_and_watched(q, consumer, held: int) -> bool:
    side = ray.get(q._actor.consumer_stats.remote(consumer.consumer_id))
    return side.get("held") == held and side["death_watch"]


def test_a_silent_consumer_answers_its_pings_and_is_kept(broker):
    q = broker.create_queue("pinged")
    sent = q.send_batch([b"a", b"b"])
    with q.consumer(prefetch=2) as c:
        _wait_until(lambda: _loaded_and_watched(q, c, 2), "loaded and watched")
        ray.get(q._actor.__ray_call__.remote(_quick_pings, False))
        _wait_until(lambda: ray.get(q._actor.__ray_call__.remote(_liveness))[0] >= 3, "pinged")
        assert ray.get(q._actor.__ray_call__.remote(_liveness))[1] == {}
        got = receive_all(c, 2)
        assert [m.offset for m in got] == sent and [m.delivery_count for m in got] == [1, 1]
        c.ack(got, wait=True)
    assert q.stats()["depth"] == 0


def test_a_consumer_whose_death_only_a_ping_finds_is_closed_and_its_messages_come_again(
    broker,
):
    q = broker.create_queue("ping-finds")
    sent = q.send_batch([b"a", b"b", b"c"])
    c = q.consumer(prefetch=10)
    _wait_until(lambda: _loaded_and_watched(q, c, 3), "loaded and watched")
    ray.get(q._actor.__ray_call__.remote(_quick_pings, True))
    ray.kill(c.target_list, no_restart=True)
    _wait_until(lambda: ray.get(q._actor.__ray_call__.remote(_liveness))[1], "closed")
    assert ray.get(q._actor.__ray_call__.remote(_liveness))[1] == {"PING": 1}
    with q.consumer() as again:
        got = receive_all(again, 3)
        assert sorted(m.offset for m in got) == sent
        again.ack(got, wait=True)
    c.close()  # its TargetList is dead: nothing to give back
