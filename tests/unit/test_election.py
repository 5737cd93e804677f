"""``recovery.election``: the bully election among one master's slaves, alone and as
simulated clusters under any crash set and message order."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from middleware.phoenix.ids import RoleId
from middleware.phoenix.protocol import Kind
from middleware.recovery import (
    Become,
    Bully,
    BullyState,
    Reign,
    Send,
    Trust,
)
from middleware.recovery.fencing import SendFence, StepDown, rival_beat
from middleware.routing.follower import Effect as FollowerEffect
from middleware.routing.follower import Follower, Promote, Signal
from middleware.routing.messages import Fence, Vote

from .bully_network import drive as _drive

MASTER = RoleId.match("B", 0)


SLAVES = [RoleId.match_slave("B", 0, j) for j in range(3)]


@pytest.mark.parametrize("dead", [set(), {SLAVES[0]}, {SLAVES[0], SLAVES[1]}])
@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_exactly_the_highest_live_slave_takes_over(dead, order) -> None:
    machines = {s: Bully(me=s, peers=SLAVES, answer_s=0.2, coordinator_s=0.5) for s in SLAVES}
    suspect = [SLAVES[i] for i in order if SLAVES[i] not in dead]
    winners = _drive(machines, suspect, dead)
    highest = max((s for s in SLAVES if s not in dead), key=lambda s: s.rank)
    assert winners == [highest]
    for s in SLAVES:
        if s not in dead and s != highest:
            assert machines[s].state is BullyState.IDLE and machines[s].leader == highest


def test_the_highest_slave_wins_at_once_and_tells_the_others() -> None:
    bully = Bully(me=SLAVES[0], peers=SLAVES, answer_s=0.2, coordinator_s=0.5)
    assert bully.master_suspected(0.0) == [
        Send(SLAVES[1], "coordinator"),
        Send(SLAVES[2], "coordinator"),
        Become(MASTER),
    ]
    assert bully.master_suspected(0.1) == []  # once


def test_a_lower_slave_waits_for_the_coordinator_and_trusts_a_beating_master() -> None:
    bully = Bully(me=SLAVES[2], peers=SLAVES, answer_s=0.2, coordinator_s=0.5)
    assert bully.master_suspected(0.0) == [Send(SLAVES[0], "election"), Send(SLAVES[1], "election")]
    bully.on_answer(SLAVES[0], 0.05)
    assert bully.state is BullyState.WAITING and bully.tick(0.3) == []
    bully.master_heard()  # a false suspicion: the master beats again
    assert bully.state is BullyState.IDLE and bully.tick(10.0) == []
    assert bully.on_election(RoleId.match_slave("B", 0, 9), 0.0) == []  # not a peer


# ------------------------------------------------------------------ fencing


def _follower(me: RoleId, trust: Trust) -> Follower:
    """The slave's real machine (routing/follower.py): answer 0.2 s, COORDINATOR 0.5 s."""
    return Follower(me, SLAVES, interval_s=0.1, misses=5, ceiling_s=0.0, trust=trust)


class _Process:
    """One slave process of the simulation: the follower machine the slaves run, and
    whether it serves the master (under which reign)."""

    def __init__(self, me: RoleId) -> None:
        self.me = me
        self.follower = _follower(me, Trust())
        self.reign: Reign | None = None  # serving the master under it
        self.dead = False

    def step_down(self, newer: Reign) -> None:
        self.reign = None
        self.follower = _follower(self.me, Trust(newer))


class _Cluster:
    """The slaves of one master whose master died, with a network that delivers what
    the machines return in whatever order a test picks.  What the drivers do is done
    here by the same pure code: the follower's effects, and a master's judgement of
    another reign's beat (``fencing.rival_beat``)."""

    def __init__(self) -> None:
        self.procs = {s: _Process(s) for s in SLAVES}
        self.net: list[tuple[RoleId, RoleId, Kind, Reign]] = []  # to, from, kind, reign
        self.now = 0.0
        self.thawed = False  # the old master was frozen, not dead, and runs again

    def enact(self, proc: _Process, effects: list[FollowerEffect]) -> None:
        for effect in effects:
            if isinstance(effect, Promote):
                proc.reign = effect.reign
            elif isinstance(effect, Signal) and isinstance(effect.message, Vote):
                vote = effect.message
                self.net.append((effect.to, proc.me, vote.kind, Reign(vote.epoch, vote.by)))

    def deliver(self, i: int) -> None:
        to, sender, kind, reign = self.net.pop(i % len(self.net))
        proc = self.procs[to]
        if proc.dead:
            return
        if proc.reign is not None:  # a master at its former control queue: a late vote
            if kind is Kind.ELECTION:
                self.net.append((sender, to, Kind.COORDINATOR, proc.reign))
            return
        self.enact(proc, proc.follower.vote(sender.owner, kind, reign, self.now))

    def masters(self) -> list[_Process]:
        return [p for p in self.procs.values() if p.reign is not None and not p.dead]

    def serving(self) -> list[Reign]:
        """The reigns served now: the promoted masters', the thawed old master's."""
        return [p.reign for p in self.masters() if p.reign] + [Reign()] * self.thawed

    def _beat_to(self, other: _Process, reign: Reign) -> bool:
        """A master of ``reign`` beats to ``other``: whether it must step down."""
        if other.reign is not None:  # another master: the older reign steps down
            lineage = {"promoted_from": other.me.slave, "slaves": frozenset(range(3))}
            outcome = rival_beat(other.reign, reign, "its process", **lineage)
            if isinstance(outcome, StepDown):
                other.step_down(outcome.reign)
            return isinstance(outcome, SendFence)
        effects = other.follower.beat(
            MASTER.owner, reign, "its process", None, stale=False, now=self.now
        )
        return any(isinstance(e, Signal) and isinstance(e.message, Fence) for e in effects)

    def beat(self) -> None:
        """Every master beats; slaves judge the beats; masters judge each other's (a
        promoted master still reads the control queue it had as a slave)."""
        for other in self.procs.values():
            if self.thawed and not other.dead and self._beat_to(other, Reign()):
                self.thawed = False  # fenced: the master as started steps down
        for master in self.masters():
            for other in self.procs.values():
                if other is master or other.dead or master.reign is None:
                    continue
                if self._beat_to(other, master.reign):
                    assert master.reign is not None
                    master.step_down(other.reign or other.follower.trust.reign)

    def suspect(self, proc: _Process) -> None:
        if not proc.dead and proc.reign is None:
            self.enact(proc, proc.follower.lease_returned(self.now))

    def tick(self, dt: float) -> None:
        self.now += dt
        for proc in self.procs.values():
            if not proc.dead and proc.reign is None:
                self.enact(proc, proc.follower.look(self.now, 0.0))

    def settle(self) -> None:
        """Messages stop being reordered: FIFO delivery, beats, the detector's verdict
        (a slave whose trusted reign nobody serves suspects), timeouts."""
        for _ in range(400):
            while self.net:
                self.deliver(0)
            self.beat()
            served = self.serving()
            for proc in self.procs.values():
                if proc.follower.trust.reign not in served:
                    self.suspect(proc)
            self.tick(0.05)
            served = self.serving()
            slaves = [p for p in self.procs.values() if not p.dead and p.reign is None]
            if (
                not self.net
                and len(served) == 1
                and all(p.follower.trust.reign == served[0] for p in slaves)
            ):
                return


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["deliver", "tick", "suspect", "crash", "beat", "thaw"]),
        st.integers(0, 99),
    ),
    max_size=60,
)


@given(_OPS, st.sets(st.integers(0, 2), max_size=2))
def test_any_crash_set_and_message_order_leaves_exactly_one_master(ops, dead_at_start) -> None:
    """Hypothesis picks which slaves are dead from the start, and then interleaves
    deliveries in any order, timeouts, suspicions, beats and crashes (a winner too);
    once messages stop being reordered, exactly one live process serves the master and
    every live slave trusts its reign.  The master as started may come back (it was
    frozen past the timeout): it serves on only if no election was won meanwhile."""
    cluster = _Cluster()
    for i in dead_at_start:
        cluster.procs[SLAVES[i]].dead = True
    crashes = len(dead_at_start)
    for op, n in ops:
        proc = cluster.procs[SLAVES[n % 3]]
        if op == "deliver" and cluster.net:
            cluster.deliver(n)
        elif op == "tick":
            cluster.tick(n / 200)
        elif op == "suspect":
            cluster.suspect(proc)
        elif op == "crash" and crashes < 2 and not proc.dead:  # one slave always lives
            proc.dead, crashes = True, crashes + 1
        elif op == "beat":
            cluster.beat()
        elif op == "thaw" and n < 10:  # the master as started comes back
            cluster.thawed = True
    cluster.settle()
    served = cluster.serving()
    assert len(served) == 1
    assert all(
        p.follower.trust.reign == served[0]
        for p in cluster.procs.values()
        if not p.dead and p.reign is None
    )
    masters = cluster.masters()
    if cluster.thawed:  # no election was won meanwhile: the old master serves on
        assert not masters
        return
    assert len(masters) == 1
    assert all(
        p.follower.trust.reign == masters[0].reign
        for p in cluster.procs.values()
        if not p.dead and p.reign is None
    )
