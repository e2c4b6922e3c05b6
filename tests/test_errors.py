"""Bad input gets a typed error naming what is wrong, and changes nothing."""

from __future__ import annotations

import os
import time

import pytest

import raymq
from raymq import errors


@pytest.mark.parametrize(
    "name", ["", "..", ".", "a/b", "../x", "a\x00b", "x" * 201, "a\\b", ".hidden"]
)
def test_invalid_queue_names_touch_no_file(broker, name):
    paging_dir = broker.config.paging_directory
    before = sorted(os.listdir(paging_dir))
    with pytest.raises(errors.InvalidQueueName):
        broker.create_queue(name)
    with pytest.raises(errors.InvalidQueueName):
        broker.get_queue(name)
    assert sorted(os.listdir(paging_dir)) == before


def test_queue_name_type(broker):
    with pytest.raises(TypeError, match="queue name must be str"):
        broker.create_queue(b"bytes")


def test_queue_not_found_and_exists(broker):
    with pytest.raises(errors.QueueNotFound, match="nope"):
        broker.get_queue("nope")
    q = broker.create_queue("same", page_size_bytes=1 << 20)
    assert broker.create_queue("same", page_size_bytes=1 << 20).name == q.name  # idempotent
    with pytest.raises(errors.QueueExists, match="same"):
        broker.create_queue("same", page_size_bytes=2 << 20)


def test_invalid_settings(broker):
    with pytest.raises(errors.InvalidSetting, match="address_full_policy"):
        broker.create_queue("p", address_full_policy="EXPLODE")
    with pytest.raises(errors.InvalidSetting, match="page_size_bytes"):
        broker.create_queue("p", page_size_bytes=10)
    with pytest.raises(TypeError, match="durable"):
        broker.create_queue("p", durable="yes")
    assert broker.list_queues() == []


def test_message_too_large(broker_factory):
    b = broker_factory(max_message_size=1024)
    q = b.create_queue("small")
    with pytest.raises(errors.MessageTooLarge, match="small"):
        q.send(b"x" * 1025)
    with pytest.raises(errors.MessageTooLarge, match="message 1"):
        q.send_batch([b"ok", b"x" * 2000])
    assert q.stats()["depth"] == 0
    assert q.send(b"x" * 1024) == 0


@pytest.mark.parametrize("props", [{"k": [1]}, {1: "v"}, {"": 1}, {"k": 2**64}, "str", {"k": b"b"}])
def test_invalid_properties(broker, props):
    q = broker.create_queue("props")
    with pytest.raises(errors.InvalidProperties):
        q.send(b"x", props)
    with pytest.raises(errors.InvalidProperties):
        q.send_batch([b"x"], [props] if isinstance(props, dict) else props)
    assert q.stats()["depth"] == 0


def test_wrong_types(broker):
    q = broker.create_queue("types")
    with pytest.raises(TypeError, match="bytes"):
        q.send("text")
    with pytest.raises(TypeError, match="message 1"):
        q.send_batch([b"a", 3])
    with pytest.raises(TypeError):
        q.send_batch(b"not a list")
    with pytest.raises(errors.InvalidSetting, match="prefetch"):
        q.consumer(prefetch=0)
    assert q.stats()["depth"] == 0


def test_malformed_selector_names_queue_and_position(broker):
    q = broker.create_queue("sel")
    q.send(b"x", {"color": "red"})
    with pytest.raises(errors.SelectorError, match=r"'sel'.*position 9"):
        q.consumer(selector="color = ")
    with pytest.raises(TypeError):
        q.consumer(selector=5)
    with q.consumer(selector="color = 'red'") as c:  # nothing was held by the failures
        assert [m.body for m in c.receive(timeout=10)] == [b"x"]


def test_unknown_broker_setting():
    with pytest.raises(errors.InvalidSetting, match="max_size"):
        raymq.connect(max_size=3)


def test_a_send_to_a_killed_queue_actor_fails_typed_or_is_stored(broker, monkeypatch):
    import ray

    from raymq.client import calls as client

    q = broker.create_queue("dead")
    q.send(b"before")
    old = q._actor
    ray.kill(old, no_restart=True)
    # ray.kill only asks for the kill: a call may still reach the actor before it
    # dies. Wait until one fails as Ray fails calls to a dead actor.
    deadline = time.monotonic() + 120
    while True:
        try:
            ray.get(old.pid.remote())
        except ray.exceptions.ActorDiedError:
            break
        except ray.exceptions.ActorUnavailableError:
            pass  # on its way down: ask again
        assert time.monotonic() < deadline, "the killed queue actor still answers"
        time.sleep(0.05)
    monkeypatch.setattr(client, "RESTART_GRACE_SECONDS", 0.5)
    # Ray will not restart it. The handle asks the broker, which may start the queue
    # again from its files (as it revives a hibernated one): either way the send ends
    # in a typed error or is stored, never in a hang or a silent loss.
    try:
        stored = q.send(b"after")
    except errors.BrokerUnavailable:
        stored = None
    bodies = [m.body for m in broker.get_queue("dead").browse()]
    assert bodies[0] == b"before" and set(bodies[1:]) <= {b"after"}
    copies = len(bodies) - 1
    # Ray reports the actor dead before its process has exited: the producer's
    # connection may still reach the old process, which stores the send and exits
    # before answering. The send then goes again to the new actor (at-least-once,
    # README "Producers"), and only then may it be stored twice.
    resent = q.producer_stats().resent_batches
    if stored is None:
        assert copies <= resent
    else:
        assert 1 <= copies <= 1 + resent
    # The old handle follows the queue to its new actor for every call, browse too.
    assert [m.body for m in q.browse()] == bodies


def test_error_classes_are_stable():
    for name in [
        "InvalidQueueName",
        "QueueNotFound",
        "QueueExists",
        "MessageTooLarge",
        "InvalidProperties",
        "AddressFull",
        "SelectorError",
        "BrokerUnavailable",
    ]:
        assert issubclass(getattr(errors, name), errors.RayMQError)
