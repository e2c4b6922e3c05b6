"""Message selectors (not ``selectors.py``: that would shadow the standard library
module of that name for the script): consumers with different JMS selectors share one queue.

Each consumer receives only what its selector matches, each message goes to one of
them, and a message nobody selects waits for a consumer that will. A red message behind
thousands of blue ones is found without anyone consuming the blue.

``python examples/message_selectors.py`` runs it on an embedded local Ray of its own;
``ray job submit --working-dir examples -- python message_selectors.py`` (or ``--join``)
joins the running broker and leaves its queue ``example.events`` there, drained.
"""

from __future__ import annotations

from _common import example_broker


def receive_all(consumer) -> list:
    """Receive and acknowledge until the queue has nothing more for ``consumer``."""
    got = []
    while True:
        messages = consumer.receive(max_messages=1000, timeout=1)
        if not messages:
            if consumer.backlog() == 0:  # not merely slow: nothing left for it
                return got
            continue
        consumer.ack(messages)
        got.extend(messages)


def main() -> None:
    with example_broker("selectors") as example:
        events = example.broker.create_queue("example.events")
        colors = ["blue"] * 8 + ["green", "red"]
        events.send_batch(
            [f"event {i}".encode() for i in range(10_000)],
            [{"color": colors[i % 10], "size": i % 100} for i in range(10_000)],
        )
        events.send_batch([b"the red one at the end"], {"color": "red", "size": 1000})
        print("sent 10,001 events: 80% blue, 10% green, 10% red")

        with (
            events.consumer(selector="color = 'red' AND size >= 50") as big_red,
            events.consumer(selector="color IN ('green', 'red')") as warm,
        ):
            reds = receive_all(big_red)
            print(f"'color = red AND size >= 50' received {len(reds)}: last {reds[-1].body!r}")
            warms = receive_all(warm)
            print(f"'color IN (green, red)' received {len(warms)} (the rest of red, all green)")
            assert all(m.properties["color"] in ("green", "red") for m in warms)
            assert not {m.offset for m in reds} & {m.offset for m in warms}

        print(f"blue still waiting for a consumer: {events.stats()['depth']:,} messages")
        with events.consumer(selector="color = 'blue'") as blue:
            print(f"'color = blue' received {len(receive_all(blue)):,}")
        print(f"queue depth now {events.stats()['depth']}")


if __name__ == "__main__":
    main()
