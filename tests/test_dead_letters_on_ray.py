"""Dead-letter queues on a real local Ray: created when first needed, poison messages and
rejects moved there, and the move surviving a SIGKILL of either queue's process."""

from __future__ import annotations

import os
import signal
import time

import pytest

from raymq.client.calls import _call
from raymq.core.dead_letter import DEAD_LETTER_REASON, ORIGINAL_OFFSET, ORIGINAL_QUEUE
from tests.consumer_helpers import wait_for

#: Bound on a background move after a restart (seconds): a wedge fails, not a timing.
DEADLINE_SECONDS = 120.0


def browse_all(q) -> list:
    return list(q.browse(batch_size=5000))


def nack_the_poison(q) -> list[int]:
    """Receive until the queue has nothing more for one consumer, nacking the poison
    message and acking the others; returns the poison message's delivery counts."""
    counts = []
    deadline = time.monotonic() + DEADLINE_SECONDS
    with q.consumer(prefetch=10) as c:
        # Until the queue has nothing more for the consumer: an empty receive alone may
        # only mean that a redelivery is still on its way.
        while (got := c.receive(10, timeout=1)) or c.backlog():
            for m in got:
                if m.body == b"poison":
                    counts.append(m.delivery_count)
                    c.nack(m)
                else:
                    c.ack(m)
            assert time.monotonic() < deadline, f"still receiving after {DEADLINE_SECONDS} s"
    return counts


@pytest.mark.parametrize("durable", [True, False], ids=["durable", "memory"])
def test_a_poison_message_ends_in_the_dead_letter_queue(broker, durable):
    q = broker.create_queue("poison", durable=durable, max_delivery_attempts=3)
    q.send_batch([b"ok", b"poison", b"ok too"], [{"n": 0}, {"n": 1}, {"n": 2}])
    assert nack_the_poison(q) == [1, 2, 3]
    wait_for(lambda: q.stats()["messages_dead_lettered"] == 1, "dead-lettered")
    assert "poison.DLQ" in broker.list_queues()
    dlq = broker.get_queue("poison.DLQ")
    assert _call(dlq._actor.config).durable is durable  # the source's durability
    [letter] = browse_all(dlq)
    assert letter.body == b"poison"
    assert letter.properties == {
        "n": 1,
        ORIGINAL_QUEUE: "poison",
        ORIGINAL_OFFSET: 1,
        DEAD_LETTER_REASON: "max_delivery_attempts",
    }
    stats = q.stats()
    assert (stats["depth"], stats["in_flight"], stats["dead_letter_queue"]) == (0, 0, "poison.DLQ")


def test_reject_moves_to_a_named_dead_letter_queue(broker):
    q = broker.create_queue("orders", dead_letter_queue="bad-orders")
    q.send_batch([b"a", b"b", b"c"])
    with q.consumer(prefetch=10) as c:
        got = c.receive(3, timeout=10)
        assert c.reject(got[1]) == 1
        c.ack([got[0], got[2]])
    wait_for(lambda: q.stats()["messages_dead_lettered"] == 1, "rejected")
    [letter] = browse_all(broker.get_queue("bad-orders"))
    assert letter.body == b"b" and letter.properties[DEAD_LETTER_REASON] == "rejected"


def _sent_and_rejected(broker, n: int, kill: str) -> tuple[dict[int, bytes], object, object]:
    """Send ``n`` messages, reject them all in small steps and SIGKILL the ``kill``
    queue's process half-way (the source, or its dead-letter queue)."""
    q = broker.create_queue("src", page_size_bytes=64 * 1024)
    dlq = broker.create_queue("src.DLQ", page_size_bytes=64 * 1024)
    bodies = [f"body-{i}".encode() * 20 for i in range(n)]
    offsets = q.send_batch(bodies)
    sent = dict(zip(offsets, bodies, strict=True))
    victim = q if kill == "source" else dlq
    pid = _call(victim._actor.pid)
    c = q.consumer(prefetch=n)
    got = []
    while len(got) < n:
        got += c.receive(n - len(got), timeout=30)
    for i in range(0, n, 50):
        if i == n // 2:
            os.kill(pid, signal.SIGKILL)
            if kill == "source":
                break  # the consumer's holdings die with that process
        c.reject(got[i : i + 50])
    c.close()
    wait_for(lambda: _call(victim._actor.pid) != pid, "restart")
    return sent, q, dlq


@pytest.mark.parametrize("kill", ["source", "dead-letter queue"])
def test_a_sigkill_mid_move_leaves_every_message_in_the_source_or_the_dlq(broker, kill):
    sent, q, dlq = _sent_and_rejected(broker, 2000, kill)
    wait_for(lambda: q.stats()["dead_letters_pending"] == 0, "moves done")
    in_source = {m.offset: m.body for m in browse_all(q)}
    in_dlq: dict[int, bytes] = {}
    for m in browse_all(dlq):
        assert m.properties[ORIGINAL_QUEUE] == "src"
        in_dlq[m.properties[ORIGINAL_OFFSET]] = m.body
    for where in (in_source, in_dlq):  # nothing served that was not sent
        assert all(sent.get(o) == body for o, body in where.items())
    lost = set(sent) - set(in_source) - set(in_dlq)
    assert not lost, f"{len(lost)} messages in neither queue, e.g. {sorted(lost)[:5]}"
    if kill == "dead-letter queue":  # the source's moves were retried until all landed
        assert not in_source and set(in_dlq) == set(sent)


def test_closing_right_after_a_nack_does_not_count_an_unseen_delivery(broker):
    """The TargetList re-fetches a nacked message at once; closing then must give it back
    as not received, or its delivery count rises unseen (and a dead letter comes early)."""
    q = broker.create_queue("recount", max_delivery_attempts=2)
    for round_ in range(5):
        q.send(f"m{round_}".encode())
        with q.consumer(prefetch=1) as c:
            [m] = c.receive(1, timeout=60)
            assert m.delivery_count == 1
            c.nack(m)
        with q.consumer(prefetch=1) as again:
            [m2] = again.receive(1, timeout=60)
            assert (m2.offset, m2.delivery_count) == (m.offset, 2)
            again.ack(m2)
    assert q.stats()["messages_dead_lettered"] == 0


def test_what_a_closed_consumer_never_received_does_not_count_after_a_sigkill(broker):
    """The consumer's TargetList had taken the message again (that take's count on
    disk with the next commit) when the consumer closed without receiving it: close is
    answered once its give-back is on disk too, so a SIGKILL right after leaves one
    delivery counted, not two (a count too many dead-letters a message early)."""
    q = broker.create_queue("uncounted", max_delivery_attempts=2)
    q.send(b"poison")
    pid = _call(q._actor.pid)
    with q.consumer(prefetch=1) as c:
        [m] = c.receive(1, timeout=60)
        c.nack(m, delay=0)  # answered once its count is on disk
        wait_for(lambda: c.stats()["delivered"] == 2, "taken again by the TargetList")
        q.send(b"other")
        with q.consumer(prefetch=1) as other:  # its waited ack writes the take's count
            [o] = other.receive(1, timeout=60)
            assert o.body == b"other"
            assert other.ack(o, wait=True) == 1
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: _call(q._actor.pid) != pid, "restart")
    with q.consumer(prefetch=1) as c:
        got = c.receive(1, timeout=30)
        dead = q.stats()["messages_dead_lettered"]
        assert [(m.body, m.delivery_count) for m in got] == [(b"poison", 2)], f"{dead} dead"
        assert c.ack(got, wait=True) == 1


def test_a_delivery_count_survives_a_sigkill_of_the_queue(broker):
    """Nacked twice, then the queue's process SIGKILLed: the third delivery says 3, and
    a fourth never comes (the message is in the DLQ). Before delivery counts were
    durable, a restart started them again at 1."""
    q = broker.create_queue("crashy", max_delivery_attempts=3)
    q.send_batch([b"poison", b"ok"])
    with q.consumer(prefetch=1) as c:
        for n in (1, 2):
            [m] = c.receive(1, timeout=60)
            assert (m.body, m.delivery_count) == (b"poison", n)
            c.nack(m)  # answered once the count is on disk
    pid = _call(q._actor.pid)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: _call(q._actor.pid) != pid, "restart")
    assert nack_the_poison(q) == [3]
    wait_for(lambda: q.stats()["messages_dead_lettered"] == 1, "dead-lettered")
    [letter] = browse_all(broker.get_queue("crashy.DLQ"))
    assert (letter.body, letter.properties[DEAD_LETTER_REASON]) == (
        b"poison",
        "max_delivery_attempts",
    )
    assert q.stats()["depth"] == 0
