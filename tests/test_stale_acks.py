"""Acks of stale copies, without Ray: an application that acks what it was given is
never refused (issue 28, Observed 2). A copy is stale when another consumer holds the
message now because the queue's process was replaced, or because its consumer left
and came back, since it was delivered."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from raymq.errors import InvalidAck
from tests.test_target_area import open_core, send_colors


def offsets(batch) -> np.ndarray:
    return np.array(batch.column("offset").to_pylist(), dtype=np.int64)


def test_an_ack_of_a_copy_from_a_replaced_process_is_dropped_and_counted(tmp_path):
    async def main():
        first = await open_core(tmp_path)
        await send_colors(first, ["red"] * 10)
        first.register_consumer("a", 5, None)
        stale = offsets(await first.fetch("a", 5, 0, 5))  # a's application has these
        await first.close()  # the process is replaced: nothing a held was acked

        second = await open_core(tmp_path)
        second.register_consumer("b", 10, None)
        fresh = offsets(await second.fetch("b", 10, 0, 10))
        assert set(stale) <= set(fresh)  # delivered again, to b
        second.register_consumer("a", 5, None)  # a's TargetList registers again
        assert await second.ack("a", stale) == 0  # not refused: dropped
        assert second.stats().stale_acks == len(stale)
        assert second.stats().depth == 10  # b's copies decide
        assert await second.ack("b", fresh) == 10
        assert second.stats().depth == 0
        await second.close()

    asyncio.run(main())


def test_a_consumer_that_left_and_came_back_may_ack_its_old_copies(tmp_path):
    async def main():
        core = await open_core(tmp_path)
        await send_colors(core, ["red"] * 6)
        core.register_consumer("a", 3, None)
        old = offsets(await core.fetch("a", 3, 0, 3))
        core.close_consumer("a")  # its TargetList was seen dead, say
        core.register_consumer("b", 6, None)
        taken = offsets(await core.fetch("b", 6, 0, 6))
        assert set(old) <= set(taken)
        core.register_consumer("a", 3, None)  # the same consumer, back
        assert await core.ack("a", old) == 0
        assert core.nack("a", old) == 0  # nacks of stale copies are dropped too
        assert core.stats().stale_acks == 2 * len(old)
        assert await core.ack("b", taken) == 6
        await core.close()

    asyncio.run(main())


def test_an_ack_of_another_consumers_message_is_still_refused(tmp_path):
    """Within one process, a consumer that never had the message is refused: only
    copies that may have reached the application before count as stale."""

    async def main():
        core = await open_core(tmp_path)
        await send_colors(core, ["red"] * 4)
        core.register_consumer("a", 2, None)
        core.register_consumer("b", 2, None)
        theirs = offsets(await core.fetch("b", 2, 0, 2))
        with pytest.raises(InvalidAck, match="another consumer"):
            await core.ack("a", theirs)
        with pytest.raises(InvalidAck, match="never sent"):
            await core.ack("a", np.array([10**9], dtype=np.int64))
        assert core.stats().stale_acks == 0 and core.stats().depth == 4
        await core.close()

    asyncio.run(main())
