"""Replication without Ray (issue 14): a leader QueueCore writing every group commit to
followers' ReplicaFiles in-process. What a follower holds is a queue directory: opened
as a queue it serves exactly what the leader acknowledged. Quorum refusals, fencing by
epoch, catching up (a new follower, one that diverged) and the epoch-history cut."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil

import numpy as np
import pytest

from raymq.batch import MessageBatch
from raymq.config import BrokerConfig, QueueConfig
from raymq.core.queue import QueueCore
from raymq.core.replication import Fenced, ReplicationFollower, ReplicationLeader
from raymq.errors import NotEnoughReplicas, NotLeader
from raymq.storage.mirror import ReplicaFiles, write_epochs
from tests.storage_helpers import flip

PAGE = 16 * 1024  # small segments: several files, deletions show


class LocalLink:
    """A follower in this process (the Ray shell passes actor calls instead)."""

    def __init__(self, replica_id: str, follower: ReplicationFollower):
        self.replica_id, self.node_id = replica_id, f"node-{replica_id}"
        self.follower = follower
        self.down = False  # calls fail as if its node were gone
        self.hang = False  # calls never answer

    async def _call(self, method, *args):
        if self.hang:
            await asyncio.Event().wait()
        if self.down:
            raise ConnectionError(f"{self.replica_id} is unreachable")
        await asyncio.sleep(0)
        return method(*args)

    def apply(self, epoch, write):
        return self._call(self.follower.apply, epoch, write)

    def heartbeat(self, epoch):
        return self._call(self.follower.heartbeat, epoch)

    def state(self, epoch):
        return self._call(self.follower.state, epoch)

    def truncate_to(self, epoch, offset):
        return self._call(self.follower.truncate_to, epoch, offset)

    def write_chunk(self, epoch, name, pos, data, sync):
        return self._call(self.follower.write_chunk, epoch, name, pos, data, sync)

    def install(self, epoch, segments, small, epochs, end, seq):
        return self._call(self.follower.install, epoch, segments, small, epochs, end, seq)


class Controller:
    """Records the in-sync sets a leader reports; an epoch it no longer knows is stale."""

    def __init__(self, epoch: int = 1):
        self.epoch = epoch
        self.reports: list[list[str]] = []

    async def new_epoch(self) -> int:
        self.epoch += 1
        return self.epoch

    async def report(self, epoch: int, in_sync: list[str]) -> bool:
        if epoch != self.epoch:
            return False
        self.reports.append(list(in_sync))
        return True


def config(replicas=3, **kw) -> QueueConfig:
    return QueueConfig("rq", page_size_bytes=PAGE, replicas=replicas, **kw)


def open_leader(
    root, links, *, epoch=1, controller=None, cfg=None, replica="r0", checkpoint_interval=0.05
):
    directory = os.path.join(root, replica)
    os.makedirs(directory, exist_ok=True)
    epochs = [(epoch, 0)]
    write_epochs(directory, epochs)
    controller = controller or Controller(epoch)
    cfg = cfg or config(replicas=len(links) + 1)
    rep = ReplicationLeader(
        cfg.name,
        directory,
        replica_id=replica,
        node_id="node-" + replica,
        epoch=epoch,
        quorum=cfg.insync_quorum,
        epochs=epochs,
        report_in_sync=controller.report,
        new_epoch=controller.new_epoch,
    )
    broker = BrokerConfig(paging_directory=str(root), checkpoint_interval=checkpoint_interval)
    core = QueueCore(cfg, broker, directory=directory, replication=rep)
    core.start()
    rep.set_followers(links)
    return core, rep, controller


def follower(root, rid, epoch=1) -> LocalLink:
    return LocalLink(rid, ReplicationFollower(ReplicaFiles(os.path.join(root, rid), "rq"), epoch))


async def until_in_sync(rep: ReplicationLeader, n: int) -> None:
    async with asyncio.timeout(30):
        while len(rep.in_sync) < n:
            await asyncio.sleep(0.01)


def bodies(start: int, n: int) -> list[bytes]:
    return [f"m{i}".encode() + b"." * 300 for i in range(start, start + n)]


async def send(core, start, n, per_batch=50) -> list[int]:
    offsets = []
    for k in range(start, start + n, per_batch):
        batch = MessageBatch.from_bodies(
            bodies(k, min(per_batch, start + n - k)), None, max_message_size=2**20
        )
        first, count = await core.send_batch(batch)
        offsets += range(first, first + count)
    return offsets


async def drain_bodies(core: QueueCore, ack: bool = True) -> list[bytes]:
    got: list[bytes] = []
    while True:
        batch = await core.fetch("c", 1000, 0.2, 10_000)
        if batch is None or batch.num_rows == 0:
            return got
        got += batch.column("body").to_pylist()
        if ack:
            await core.ack("c", np.asarray(batch.column("offset")))


def reopen(root, rid) -> QueueCore:
    """A follower's directory opened as a queue (what promotion does)."""
    core = QueueCore(
        config(replicas=1),
        BrokerConfig(paging_directory=str(root)),
        directory=os.path.join(root, rid),
    )
    core.start()
    return core


def test_a_follower_directory_opens_as_the_queue_the_leader_acknowledged(tmp_path):
    async def main():
        links = [follower(tmp_path, "r1"), follower(tmp_path, "r2")]
        core, rep, ctl = open_leader(tmp_path, links)
        await until_in_sync(rep, 3)
        await send(core, 0, 400)
        got = await drain_bodies(core)  # acks replicated too; segments deleted
        assert got == bodies(0, 400)
        await send(core, 400, 100)
        await core.close()
        for link in links:
            link.follower.files.close()
        assert [r["in_sync"] for r in core.stats().replicas] == [True, True, True]
        for rid in ("r1", "r2"):
            copy = reopen(tmp_path, rid)
            assert copy.log.next_offset == 500
            assert await drain_bodies(copy) == bodies(400, 100)  # the acked ones are gone
            await copy.close()

    asyncio.run(main())


def test_a_send_needs_min_insync_replicas_and_is_not_served_without_them(tmp_path):
    async def main():
        links = [follower(tmp_path, "r1"), follower(tmp_path, "r2")]
        core, rep, ctl = open_leader(tmp_path, links)
        await until_in_sync(rep, 3)
        await send(core, 0, 10)
        links[0].down = True  # one follower lost: 2 of 3 still acknowledge
        await send(core, 10, 10)
        assert ctl.reports[-1] == ["r0", "r2"]  # told before the send was answered
        links[1].down = True
        with pytest.raises(NotEnoughReplicas, match="min_insync_replicas=2"):
            await send(core, 20, 10)  # the commit finds its one follower gone
        with pytest.raises(NotEnoughReplicas):
            await send(core, 20, 10)  # refused before anything is stored
        assert core.log.next_offset == 20
        assert await drain_bodies(core, ack=False) == bodies(0, 20)
        links[0].down = links[1].down = False  # back: caught up, sends resume
        await until_in_sync(rep, 3)
        assert await send(core, 20, 5) == list(range(20, 25))
        await core.close()

    asyncio.run(main())


def test_a_follower_that_does_not_answer_leaves_the_in_sync_set(tmp_path, monkeypatch):
    monkeypatch.setattr("raymq.core.replication.FOLLOWER_TIMEOUT_SECONDS", 0.2)

    async def main():
        links = [follower(tmp_path, "r1"), follower(tmp_path, "r2")]
        core, rep, ctl = open_leader(tmp_path, links)
        await until_in_sync(rep, 3)
        links[1].hang = True
        await send(core, 0, 10)
        assert rep.in_sync == ["r0", "r1"]
        assert core.stats().replicas[2]["in_sync"] is False
        await core.close()

    asyncio.run(main())


def test_a_newer_epoch_fences_the_old_leader(tmp_path):
    async def main():
        links = [follower(tmp_path, "r1"), follower(tmp_path, "r2")]
        core, rep, ctl = open_leader(tmp_path, links)
        await until_in_sync(rep, 3)
        await send(core, 0, 10)
        for link in links:  # the controller starts epoch 2 elsewhere
            link.follower.fence(2)
        with pytest.raises(NotLeader, match="epoch 2"):
            await send(core, 10, 10)
        with pytest.raises(NotLeader):
            await send(core, 10, 10)
        with pytest.raises(NotLeader):
            await core.fetch_delivery("c", 10, 0.1, 100)
        for link in links:
            assert link.follower.files.end_offset == 10  # nothing of the refused send
        await core.close()

    asyncio.run(main())


def test_a_new_follower_is_caught_up_by_copying_what_it_lacks(tmp_path):
    async def main():
        links = [follower(tmp_path, "r1")]
        core, rep, ctl = open_leader(tmp_path, links, cfg=config(replicas=3, min_insync_replicas=2))
        await until_in_sync(rep, 2)
        await send(core, 0, 300)
        late = follower(tmp_path, "r3")
        rep.set_followers([*links, late])
        await until_in_sync(rep, 3)
        await send(core, 300, 20)
        await core.close()
        late.follower.files.close()
        copy = reopen(tmp_path, "r3")
        assert await drain_bodies(copy) == bodies(0, 320)
        await copy.close()

    asyncio.run(main())


def test_a_diverged_tail_is_cut_back_before_the_copy(tmp_path):
    """A follower holding records its leader never published (written by an older
    leader, say) is cut back to where the epoch histories agree, then caught up: what
    the old tail held is never served."""

    async def main():
        root = str(tmp_path)
        old = [follower(root, "r1"), follower(root, "r2")]
        core, rep, _ = open_leader(root, old)
        await until_in_sync(rep, 3)
        await send(core, 0, 100)
        # r2 leaves; the leader goes on with r1 and writes a tail only r1 gets
        old[1].down = True
        await send(core, 100, 50)
        await core.close()
        for link in old:
            link.follower.files.close()
        # epoch 2: r2 leads (as if r0 and r1 were lost); r1 comes back as its follower
        r1 = follower(root, "r1", epoch=2)
        files = ReplicaFiles(os.path.join(root, "r2"), "rq")
        assert files.end_offset == 100
        files.close()
        ctl = Controller(epoch=2)
        epochs = [(1, 0), (2, 100)]
        write_epochs(os.path.join(root, "r2"), epochs)
        directory = os.path.join(root, "r2")
        rep2 = ReplicationLeader(
            "rq",
            directory,
            replica_id="r2",
            node_id="n2",
            epoch=2,
            quorum=2,
            epochs=epochs,
            report_in_sync=ctl.report,
        )
        core2 = QueueCore(
            config(replicas=2),
            BrokerConfig(paging_directory=root),
            directory=directory,
            replication=rep2,
        )
        core2.start()
        rep2.set_followers([r1])
        await until_in_sync(rep2, 2)
        await send(core2, 1000, 30)  # new messages at offsets 100..129
        await core2.close()
        r1.follower.files.close()
        copy = reopen(root, "r1")
        assert await drain_bodies(copy) == bodies(0, 100) + bodies(1000, 30)
        await copy.close()

    asyncio.run(main())


def _leader_in_epoch_2(directory: str, epochs: list, ctl: Controller) -> ReplicationLeader:
    """Replica r0's leader side, restarted in place in epoch 2 (quorum 2 of 3)."""
    return ReplicationLeader(
        "rq",
        directory,
        replica_id="r0",
        node_id="n0",
        epoch=2,
        quorum=2,
        epochs=epochs,
        report_in_sync=ctl.report,
    )


def _segment_bytes(directory: str) -> int:
    return sum(
        os.path.getsize(os.path.join(directory, n))
        for n in os.listdir(directory)
        if n.endswith(".seg")
    )


def test_a_restarted_leader_counts_its_followers_in_sync_only_once_caught_up(tmp_path):
    """Found by the replicated simulator: a leader wrote a commit no follower got and
    crashed; restarted in place, it served that tail while the controller still
    counted the followers in sync from before. A failover then promoted one lacking
    the tail and gave its offsets to other messages: two bodies at one offset. Now
    its start tells the controller that it alone is in sync."""
    root = str(tmp_path)
    leader = os.path.join(root, "r0")

    async def first_life():
        links = [follower(root, "r1"), follower(root, "r2")]
        core, rep, _ = open_leader(root, links)
        await until_in_sync(rep, 3)
        await send(core, 0, 20)
        for link in links:
            link.hang = True  # the next commit reaches no follower
        before = _segment_bytes(leader)
        task = asyncio.ensure_future(send(core, 100, 5))
        async with asyncio.timeout(30):  # written here, waiting for the followers
            while _segment_bytes(leader) == before:
                await asyncio.sleep(0.01)
        shutil.copytree(leader, os.path.join(root, "image"))  # the crash
        task.cancel()
        for link in links:
            link.hang, link.down = False, True
        with contextlib.suppress(BaseException):
            await task
        await core.close()
        for link in links:
            link.follower.files.close()

    asyncio.run(first_life())
    shutil.rmtree(leader)
    os.rename(os.path.join(root, "image"), leader)

    async def restarted():
        ctl = Controller(epoch=2)
        rep = _leader_in_epoch_2(leader, [], ctl)
        core = QueueCore(
            config(), BrokerConfig(paging_directory=root), directory=leader, replication=rep
        )
        links = [follower(root, "r1", epoch=1), follower(root, "r2", epoch=1)]
        assert await rep.begin(2, links, ["r0", "r1", "r2"], lost_here=False)
        assert ctl.reports == [["r0"]]  # before it serves the tail the followers lack
        core.start()
        assert len(await drain_bodies(core, ack=False)) == 25
        await core.close()
        for link in links:
            link.follower.files.close()

    asyncio.run(restarted())


def test_an_epoch_history_that_cannot_be_written_is_a_storage_error(tmp_path, monkeypatch):
    """Found by the replicated simulator: an I/O error writing the epoch history after
    a cut-back commit escaped as a bare OSError from the send. Now a StorageError
    naming the file, and the new epoch is not adopted (the next commit asks again)."""
    from raymq.core import replication as replication_module
    from raymq.errors import StorageError

    async def main():
        ctl = Controller(epoch=1)
        rep = ReplicationLeader(
            "rq",
            str(tmp_path),
            replica_id="r0",
            node_id="n0",
            epoch=1,
            quorum=2,
            epochs=[(1, 0)],
            report_in_sync=ctl.report,
            new_epoch=ctl.new_epoch,
        )
        rep._epoch_from = 10  # a commit from offset 10 was cut back after followers took it

        def failing(directory, epochs):
            raise OSError(errno.EIO, "injected", directory)

        monkeypatch.setattr(replication_module, "write_epochs", failing)
        with pytest.raises(StorageError, match="epochs") as err:
            await rep.renew_epoch()
        assert err.value.queue == "rq"
        assert (rep.epoch, rep.epochs, rep.needs_epoch) == (1, [(1, 0)], True)
        monkeypatch.undo()
        await rep.renew_epoch()
        assert (rep.epoch, rep.epochs, rep.needs_epoch) == (3, [(1, 0), (3, 10)], False)

    asyncio.run(main())


# -- found by review: cut-backs, restarts, fences ------------------------------------


def test_a_commit_refused_for_want_of_replicas_is_cut_back_on_followers_that_took_it(tmp_path):
    """min_insync_replicas=3 and r2 lost mid-commit: r1 wrote the commit the leader then
    cut back. r1 leaves the in-sync set and is cut back before it may be promoted: the
    refused messages are never served, their offsets go to later messages."""

    async def main():
        links = [follower(tmp_path, "r1"), follower(tmp_path, "r2")]
        cfg = config(replicas=3, min_insync_replicas=3)
        core, rep, ctl = open_leader(tmp_path, links, cfg=cfg)
        await until_in_sync(rep, 3)
        await send(core, 0, 40)
        links[1].down = True
        with pytest.raises(NotEnoughReplicas):
            await send(core, 500, 10)
        assert "r1" not in rep.in_sync  # it holds what the leader cut back
        assert ctl.reports[-1] == ["r0"]
        links[1].down = False
        await until_in_sync(rep, 3)
        await send(core, 1000, 10)  # offsets 40.. again, for other messages
        await core.close()
        for link in links:
            link.follower.files.close()
        copy = reopen(tmp_path, "r1")
        assert await drain_bodies(copy) == bodies(0, 40) + bodies(1000, 10)
        await copy.close()

    asyncio.run(main())


def test_a_restarted_leader_cuts_back_followers_holding_its_lost_tail(tmp_path):
    """The leader's last commit reached the followers but not its own disk (a power
    loss tore it), and no follower was in sync: restarted in a new epoch, it cuts them
    back to its recovered end, so no follower keeps records the leader gives other
    messages to. (With an in-sync one it steps down instead: the test below.)"""

    async def main():
        root = str(tmp_path)
        links = [follower(root, "r1"), follower(root, "r2")]
        core, rep, _ = open_leader(root, links)
        await until_in_sync(rep, 3)
        await send(core, 0, 90)
        shutil.copytree(os.path.join(root, "r0"), os.path.join(root, "image"))  # all synced
        await send(core, 5000, 10)  # on every copy; then lost from the leader's disk
        await core.close()
        for link in links:
            link.follower.files.close()
        shutil.rmtree(os.path.join(root, "r0"))
        os.rename(os.path.join(root, "image"), os.path.join(root, "r0"))
        epochs = [(1, 0), (2, 90)]  # what QueueActor._begin_epoch writes after recovery
        write_epochs(os.path.join(root, "r0"), epochs)
        ctl = Controller(epoch=2)
        rep2 = ReplicationLeader(
            "rq",
            os.path.join(root, "r0"),
            replica_id="r0",
            node_id="n0",
            epoch=2,
            quorum=2,
            epochs=epochs,
            report_in_sync=ctl.report,
        )
        core2 = QueueCore(
            config(),
            BrokerConfig(paging_directory=root),
            directory=os.path.join(root, "r0"),
            replication=rep2,
        )
        assert core2.log.next_offset == 90
        core2.start()
        again = [follower(root, "r1", epoch=2), follower(root, "r2", epoch=2)]
        rep2.set_followers(again)
        await until_in_sync(rep2, 3)
        await send(core2, 7000, 10)  # offsets 90..99 again, for other messages
        await core2.close()
        for link in again:
            link.follower.files.close()
        copy = reopen(root, "r1")
        assert await drain_bodies(copy) == bodies(0, 90) + bodies(7000, 10)
        await copy.close()

    asyncio.run(main())


def test_a_fenced_leader_answers_no_ack_as_durable(tmp_path):
    async def main():
        links = [follower(tmp_path, "r1"), follower(tmp_path, "r2")]
        core, rep, _ = open_leader(tmp_path, links)
        await until_in_sync(rep, 3)
        await send(core, 0, 5)
        batch = await core.fetch("c", 5, 1.0, 100)
        for link in links:
            link.follower.fence(2)
        with pytest.raises(NotLeader):
            await core.ack("c", np.asarray(batch.column("offset")))
        await core.close()

    asyncio.run(main())


def test_a_follower_remembers_its_fence_across_a_restart(tmp_path):
    directory = str(tmp_path / "f")
    f = ReplicationFollower(ReplicaFiles(directory, "rq"), epoch=1)
    f.fence(3)
    f.files.close()
    again = ReplicationFollower(ReplicaFiles(directory, "rq"), epoch=1)  # as Ray restarts it
    assert again.epoch == 3
    with pytest.raises(Fenced):
        again.heartbeat(2)


# -- the ReplicaChannel (raymq.wire.replica): commits over a socket -----------------


class ChannelLink(LocalLink):
    """Commits and heartbeats over a real ReplicaChannel to the follower's server."""

    def __init__(self, replica_id, follower, endpoint):
        super().__init__(replica_id, follower)
        from raymq.wire.replica import ReplicaChannel

        self.channel = ReplicaChannel(*endpoint, replica=replica_id)

    def apply(self, epoch, write):
        return self.channel.apply(epoch, write)

    def heartbeat(self, epoch):
        return self.channel.heartbeat(epoch)


def test_commits_over_the_replica_channel_make_the_same_copy(tmp_path):
    from raymq.wire.errors import WireBroken
    from raymq.wire.replica import ReplicaChannel, ReplicaServer

    async def main():
        root = str(tmp_path)
        links, servers = [], []
        for rid in ("r1", "r2"):
            f = ReplicationFollower(ReplicaFiles(os.path.join(root, rid), "rq"), 1)
            server = ReplicaServer(f, "rq")
            servers.append(server)
            links.append(ChannelLink(rid, f, await server.start("127.0.0.1")))
        core, rep, _ = open_leader(root, links)
        await until_in_sync(rep, 3)
        await send(core, 0, 300)  # several segments, acks, checkpoints
        assert await drain_bodies(core) == bodies(0, 300)
        await send(core, 300, 50)
        links[0].follower.fence(5)  # a newer epoch: the channel carries the refusal
        with pytest.raises(NotLeader):
            await send(core, 350, 10)
        await core.close()
        host, port, _secret = await servers[1].start("127.0.0.1")
        wrong = ReplicaChannel(host, port, "not the secret", "r2")
        with pytest.raises(WireBroken):
            await wrong.heartbeat(1)
        for link, server in zip(links, servers, strict=True):
            link.channel.close()
            server.close()
            link.follower.files.close()
        copies = {}
        for rid in ("r1", "r2"):
            copy = reopen(root, rid)
            copies[rid] = await drain_bodies(copy)
            await copy.close()
        assert copies["r1"] == bodies(300, 50)  # it refused the fenced leader's commit
        # r2 took it: a tail never acknowledged, which the next leader's epoch cuts off
        assert copies["r2"][:50] == bodies(300, 50)

    asyncio.run(main())


def test_an_idle_leader_takes_a_follower_that_misses_a_heartbeat_out_of_sync(tmp_path, monkeypatch):
    monkeypatch.setattr("raymq.core.replication.HEARTBEAT_SECONDS", 0.05)

    async def main():
        links = [follower(tmp_path, "r1"), follower(tmp_path, "r2")]
        core, rep, ctl = open_leader(tmp_path, links)
        await until_in_sync(rep, 3)
        await send(core, 0, 10)
        hb = asyncio.get_running_loop().create_task(rep.heartbeat_loop())
        links[1].down = True  # no commit goes out: only a heartbeat can notice
        async with asyncio.timeout(30):
            while "r2" in rep.in_sync:
                await asyncio.sleep(0.01)
        assert ctl.reports[-1] == ["r0", "r1"]
        hb.cancel()
        await core.close()

    asyncio.run(main())


def test_a_commit_cut_back_after_followers_took_it_starts_a_new_epoch(tmp_path):
    """The leader's own write fails after both followers wrote the commit: it takes a
    new epoch starting where the commit started, so that a later leader cuts a follower
    still holding it back there, although the same offsets went to other messages."""
    from raymq.errors import StorageError

    async def main():
        root = str(tmp_path)
        links = [follower(root, "r1"), follower(root, "r2")]
        core, rep, ctl = open_leader(root, links)
        await until_in_sync(rep, 3)
        await send(core, 0, 40)
        real_write = core.log.write

        def failing_write(prepared):  # as the writer does when pwritev fails
            prepared.records_error = StorageError("disk gone (test)")
            raise prepared.records_error

        core.log.write = failing_write
        with pytest.raises(StorageError):
            await send(core, 500, 10)  # r1 and r2 wrote it; the leader cut it back
        core.log.write = real_write
        assert rep.in_sync == ["r0"] and rep.needs_epoch
        links[0].down = True  # r1 keeps the cut-back commit
        await until_in_sync(rep, 2)  # r2 is cut back and caught up
        await send(core, 1000, 20)  # offsets 40..59, in a new epoch
        assert rep.epoch == 2 and rep.epochs[-1] == (2, 40)
        await core.close()
        for link in links:
            link.follower.files.close()
        # r0 is lost: r2 leads epoch 3 from its own files; r1 comes back
        r2 = os.path.join(root, "r2")
        from raymq.storage.mirror import read_epochs

        epochs = [*read_epochs(r2)]
        assert (2, 40) in epochs
        ctl3 = Controller(epoch=3)
        rep3 = ReplicationLeader(
            "rq",
            r2,
            replica_id="r2",
            node_id="n2",
            epoch=3,
            quorum=2,
            epochs=[*epochs, (3, 60)],
            report_in_sync=ctl3.report,
        )
        core3 = QueueCore(
            config(), BrokerConfig(paging_directory=root), directory=r2, replication=rep3
        )
        core3.start()
        r1 = follower(root, "r1", epoch=3)
        rep3.set_followers([r1])
        await until_in_sync(rep3, 2)
        await core3.close()
        r1.follower.files.close()
        copy = reopen(root, "r1")
        assert await drain_bodies(copy) == bodies(0, 40) + bodies(1000, 20)
        await copy.close()

    asyncio.run(main())


def _restarted_leader(root: str, *, lose_tail: bool, rot: bool):
    """A leader and two in-sync followers hold 100 acknowledged messages (offsets
    90..99 the last commit); then the leader's copy lost that commit (``lose_tail``:
    a power loss) or a byte of an early record rotted (``rot``). Returns the leader
    restarted in place in epoch 2, before it leads, and the epochs before its own."""

    async def first_life():
        links = [follower(root, "r1"), follower(root, "r2")]
        # No checkpoint after the start's: recovery scans only past the checkpointed
        # size, so damage that one covered would be found by the scrub, not by the
        # recovery this test is about (with 0.05 s, a slow run checkpointed mid-way).
        core, rep, _ = open_leader(root, links, checkpoint_interval=3600.0)
        await until_in_sync(rep, 3)
        await send(core, 0, 90)
        shutil.copytree(os.path.join(root, "r0"), os.path.join(root, "image"))
        await send(core, 5000, 10)
        await core.close()
        for link in links:
            link.follower.files.close()

    asyncio.run(first_life())
    leader = os.path.join(root, "r0")
    if lose_tail:
        shutil.rmtree(leader)
        os.rename(os.path.join(root, "image"), leader)
    if rot:
        seg = sorted(f for f in os.listdir(leader) if f.endswith(".seg"))[0]
        flip(os.path.join(leader, seg), 200)  # inside the first record's body
    history = [(1, 0)]
    return leader, history


@pytest.mark.parametrize("lost", ["tail", "damage"])
def test_a_restarted_leader_that_lost_records_an_in_sync_follower_holds_steps_down(tmp_path, lost):
    """Issue 31: the leader's copy lost acknowledged records (its tail torn by a power
    loss, or damage found by recovery) that in-sync followers hold. Restarted in place
    it cuts nothing and steps down (NotLeader), for the controller to fail over to the
    most complete follower, which still serves every message."""
    root = str(tmp_path)
    leader, history = _restarted_leader(root, lose_tail=lost == "tail", rot=lost == "damage")

    async def restarted():
        epochs = [*history, (2, 0)]
        rep = _leader_in_epoch_2(leader, epochs, Controller(epoch=2))
        core = QueueCore(
            config(), BrokerConfig(paging_directory=root), directory=leader, replication=rep
        )
        rep.epochs = [*history, (2, core.log.next_offset)]
        links = [follower(root, "r1", epoch=1), follower(root, "r2", epoch=1)]
        lost_here = core.recovery.damaged > 0
        # Not in sync: not trusted. In sync: the holder.
        assert await rep.holder_of_lost_records(links, ["r0"], history, lost_here) is None
        holder = await rep.holder_of_lost_records(links, ["r0", "r1", "r2"], history, lost_here)
        assert holder == "r1"
        rep.step_down(holder)
        core.start()
        with pytest.raises(NotLeader, match="steps down"):
            await send(core, 7000, 1)
        await core.close()
        for link in links:
            link.follower.files.close()
        return rep.stepped_down

    assert asyncio.run(restarted()) == 1

    async def promoted():  # what the controller's failover opens: r1's copy
        copy = reopen(root, "r1")
        got = await drain_bodies(copy)
        await copy.close()
        return got

    assert asyncio.run(promoted()) == bodies(0, 90) + bodies(5000, 10)
