"""CallBatcher without Ray: concurrent calls share batches; answers and errors reach
their own callers."""

from __future__ import annotations

import threading

import pytest

from raymq.core.call_batcher import CallBatcher


class Sender:
    """Answers each call with (op, args); holds the first batch until released, so
    that calls made meanwhile must gather into the next one."""

    def __init__(self) -> None:
        self.batches: list[list] = []
        self.first_in = threading.Event()
        self.release = threading.Event()

    def __call__(self, calls):
        self.batches.append(list(calls))
        if len(self.batches) == 1:
            self.first_in.set()
            assert self.release.wait(30)
        return [ValueError(args[0]) if op == "fail" else (op, args) for op, args in calls]


def test_calls_made_during_a_batch_share_the_next_one():
    sender = Sender()
    batcher = CallBatcher(sender)
    answers: dict[int, object] = {}

    def call(i: int, op: str = "get") -> None:
        try:
            answers[i] = batcher.call(op, (i,))
        except ValueError as exc:
            answers[i] = exc

    first = threading.Thread(target=call, args=(0,))
    first.start()
    assert sender.first_in.wait(30)
    others = [
        threading.Thread(target=call, args=(i, "fail" if i == 3 else "get")) for i in range(1, 6)
    ]
    for t in others:
        t.start()
    # Every other call waits: none is sent while the first batch is on its way.
    while len(batcher._open) < 5:
        threading.Event().wait(0.001)
    assert len(sender.batches) == 1
    sender.release.set()
    for t in [first, *others]:
        t.join(30)
    assert [len(b) for b in sender.batches] == [1, 5]
    assert answers[0] == ("get", (0,)) and answers[5] == ("get", (5,))
    assert isinstance(answers[3], ValueError) and str(answers[3]) == "3"
    assert batcher.batches == 2 and batcher.calls == 6


def test_a_failed_send_fails_every_call_of_its_batch_only():
    sent = []

    def send(calls):
        sent.append(calls)
        if len(sent) == 1:
            raise ConnectionError("store gone")
        return [args[0] for _, args in calls]

    batcher = CallBatcher(send)
    with pytest.raises(ConnectionError, match="store gone"):
        batcher.call("get", (1,))
    assert batcher.call("get", (2,)) == 2


def test_a_batch_is_at_most_max_batch_calls_and_every_caller_is_answered():
    sizes = []

    def send(calls):
        sizes.append(len(calls))
        return [args[0] for _, args in calls]

    batcher = CallBatcher(send, max_batch=3)
    got: list[int] = []
    lock = threading.Lock()

    def call(i: int) -> None:
        v = batcher.call("get", (i,))
        with lock:
            got.append(v)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(got) == list(range(50)) and max(sizes) <= 3 and sum(sizes) == 50
