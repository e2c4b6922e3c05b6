"""Addresses through the Python handles on a real local Ray (issue 13): fan-out to
subscriptions with competing consumers and selectors, a SIGKILL of the address's actor,
typed errors, and the Queue calls a subscription handle shares."""

from __future__ import annotations

import os
import signal

import pytest

from raymq.client.calls import _call
from raymq.errors import QueueExists, QueueNotFound, SubscriptionExists, SubscriptionNotFound
from tests.consumer_helpers import receive_all
from tests.readme_blocks import run_readme_block


def test_fan_out_to_subscriptions_with_competing_consumers_and_selectors(broker):
    address = broker.create_address("orders")
    billing = address.create_subscription("billing")
    audit = address.create_subscription("audit", selector="region = 'eu'")
    offsets = address.send_batch(
        [f"order {i}".encode() for i in range(300)],
        [{"region": "eu" if i % 3 == 0 else "us"} for i in range(300)],
    )
    assert offsets == list(range(300))
    first, second = billing.consumer(prefetch=50), billing.consumer(prefetch=50)
    got = []
    while len(got) < 300:
        for c in (first, second):
            batch = c.receive(50, timeout=1)
            c.ack(batch)
            got += [m.offset for m in batch]
    assert sorted(got) == offsets  # competing: each message to one of them
    with audit.consumer(selector="JMSXDeliveryCount = 1") as c:
        eu = receive_all(c, 100)
        c.ack(eu)
    assert [m.offset for m in eu] == list(range(0, 300, 3))
    assert {m.properties["region"] for m in eu} == {"eu"}
    stats = address.stats()
    assert stats["subscriptions"] == {"billing": 0, "audit": 0}
    assert billing.stats()["messages_acked"] == 300 and audit.stats()["depth"] == 0
    first.close()
    second.close()
    assert broker.list_addresses() == ["orders"] and broker.list_queues() == []
    assert address.subscriptions() == ["billing", "audit"]


def test_subscriptions_and_their_acks_survive_a_sigkill(broker):
    address = broker.create_address("events")
    fast = address.create_subscription("fast")
    slow = address.create_subscription("slow")
    address.send_batch([f"e{i}".encode() for i in range(100)])
    with fast.consumer() as c:
        c.ack(receive_all(c, 100))
    with slow.consumer() as c:
        c.ack(receive_all(c, 40))
    pid = _call(address._actor.pid)
    os.kill(pid, signal.SIGKILL)
    again = broker.get_address("events")
    assert _call(again._actor.pid) != pid
    assert again.stats()["subscriptions"] == {"fast": 0, "slow": 60}
    with again.subscription("slow").consumer() as c:
        rest = receive_all(c, 60)
        assert [m.body for m in rest] == [f"e{i}".encode() for i in range(40, 100)]
        assert {m.delivery_count for m in rest} <= {1, 2}  # at-least-once across a kill
        c.ack(rest)
    assert again.stats()["depth"] == 0


def test_typed_errors_and_what_a_subscription_handle_refuses(broker):
    address = broker.create_address("a1")
    sub = address.create_subscription("s")
    assert address.create_subscription("s").name == "a1/s"  # idempotent
    with pytest.raises(SubscriptionExists):
        address.create_subscription("s", selector="x = 1")
    with pytest.raises(SubscriptionNotFound, match="'nope'"):
        address.subscription("nope")
    with pytest.raises(TypeError, match="send to address 'a1'"):
        sub.send(b"x")
    with pytest.raises(TypeError, match="through a subscription"):
        address.consumer()
    with pytest.raises(QueueExists, match="as an address"):
        broker.create_queue("a1")
    with pytest.raises(QueueNotFound):
        broker.get_address("missing")
    broker.create_queue("plain")
    with pytest.raises(QueueNotFound):
        broker.get_address("plain")
    address.delete_subscription("s")
    assert address.subscriptions() == []
    broker.delete_address("a1")
    assert broker.list_addresses() == []


def test_the_readme_address_tour_runs_as_typed(broker, monkeypatch, capsys):
    """README.md's ``python addresses`` block, run as written (``raymq.connect`` gives
    this test's broker instead of the default one)."""
    scope = run_readme_block("python addresses", broker, monkeypatch)
    assert [m.body for m in scope["suspicious"]] == [b"p2"]
    assert "{'ledger': 3, 'fraud': 0, 'audit': 3}" in capsys.readouterr().out
    assert scope["payments"].subscriptions() == ["ledger", "fraud"]
    assert scope["payments"].stats()["depth"] == 0


def test_a_consumer_holding_shared_batches_gets_every_message_across_a_sigkill(broker):
    # Two subscriptions: deliveries are references to batches the address's actor put
    # in the object store. Killing that actor loses them (their owner is gone) while the
    # consumer's TargetList still holds some: the restarted actor delivers them again.
    address = broker.create_address("shared")
    a, _b = address.create_subscription("a"), address.create_subscription("b")
    bodies = [f"m{i}".encode() for i in range(2000)]
    address.send_batch(bodies[:1000])
    address.send_batch(bodies[1000:])
    with a.consumer(prefetch=300) as c:
        # The consumer takes up to 300 at a time from its TargetList, which loads 300
        # more meanwhile: references nobody has read yet when the actor dies.
        first = c.receive(10, timeout=30)
        c.ack(first)
        assert address.stats()["head_cache_shared_batches"] >= 1
        pid = _call(address._actor.pid)
        os.kill(pid, signal.SIGKILL)
        got = {m.offset: m.body for m in first}
        while len(got) < 2000:
            batch = c.receive(500, timeout=30)
            assert batch, f"only {len(got)} of 2000 messages came"
            got.update((m.offset, m.body) for m in batch)
            c.ack(batch)
    assert [got[i] for i in range(2000)] == bodies
    assert _call(broker.get_address("shared")._actor.pid) != pid
    assert a.stats()["depth"] == 0
