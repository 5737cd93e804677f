"""The bully election among one master's slaves (pure): who takes over when it fails.

Ranks come from :attr:`RoleId.rank` (``slave-0`` above ``slave-1``).  A slave that
suspects its master starts an election: it sends ELECTION to every live peer that
outranks it; if none does, or none answers within ``answer_s``, it wins, sends
COORDINATOR to the others and takes over.  A peer that gets ELECTION from a lower one
answers and starts its own election; one that got an answer waits ``coordinator_s`` for
the COORDINATOR and starts again if none comes.  The machine only returns effects
(:class:`Send`, :class:`Become`); the role driver sends them and switches role.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from ..phoenix.ids import RoleId

__all__ = ["Become", "Bully", "BullyState", "Send"]


class BullyState(StrEnum):
    IDLE = "idle"  # the master is trusted
    ELECTING = "electing"  # asked the higher peers, waiting for an answer
    WAITING = "waiting"  # a higher peer answered: waiting for its COORDINATOR
    WON = "won"  # this slave takes over


@dataclass(frozen=True)
class Send:
    to: RoleId
    what: str  # "election", "answer", "coordinator"


@dataclass(frozen=True)
class Become:
    """Take over the master's role (the driver switches this process to it)."""

    master: RoleId


Effect = Send | Become


@dataclass
class Bully:
    me: RoleId
    peers: list[RoleId]  # the master's other slaves
    answer_s: float
    coordinator_s: float
    state: BullyState = BullyState.IDLE
    leader: RoleId | None = None
    _deadline: float = 0.0
    rounds: int = 0
    _alive: set[RoleId] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.peers = [p for p in self.peers if p != self.me]
        self._alive = set(self.peers)

    @property
    def master(self) -> RoleId:
        return self.me.master

    def _higher(self) -> list[RoleId]:
        return sorted(
            (p for p in self.peers if p.rank > self.me.rank and p in self._alive),
            key=lambda p: p.rank,
            reverse=True,
        )

    def _win(self) -> list[Effect]:
        self.state, self.leader = BullyState.WON, self.me
        lower = [p for p in self.peers if p.rank < self.me.rank]
        return [*(Send(p, "coordinator") for p in lower), Become(self.master)]

    def master_suspected(self, now: float, alive: Iterable[RoleId] | None = None) -> list[Effect]:
        """The master is silent: elect (unless already electing or won).  ``alive``:
        the peers the detector still hears (None: all); silent ones are not asked."""
        if self.state is not BullyState.IDLE:
            return []
        if alive is not None:
            self._alive = set(alive) & set(self.peers)
        return self._start(now)

    def _start(self, now: float) -> list[Effect]:
        self.rounds += 1
        higher = self._higher()
        if not higher:
            return self._win()
        self.state, self._deadline = BullyState.ELECTING, now + self.answer_s
        return [Send(p, "election") for p in higher]

    def on_election(self, sender: RoleId, now: float) -> list[Effect]:
        """A lower peer elects: answer it, and elect too (the higher one must win)."""
        if sender not in self.peers:
            return []
        effects: list[Effect] = [Send(sender, "answer")] if sender.rank < self.me.rank else []
        if self.state is BullyState.WON:
            return [*effects, Send(sender, "coordinator")]
        if self.state is BullyState.IDLE:
            effects += self._start(now)
        return effects

    def on_answer(self, sender: RoleId, now: float) -> list[Effect]:
        if self.state is BullyState.ELECTING and sender.rank > self.me.rank:
            self.state, self._deadline = BullyState.WAITING, now + self.coordinator_s
        return []

    def on_coordinator(self, sender: RoleId, now: float) -> list[Effect]:
        """``sender`` took over: it is the master now; this slave trusts it again."""
        if sender not in self.peers or self.state is BullyState.WON:
            return []
        self.state, self.leader = BullyState.IDLE, sender
        return []

    def master_heard(self) -> None:
        """The master (old or new) beats again: no election is needed."""
        if self.state is not BullyState.WON:
            self.state = BullyState.IDLE

    def tick(self, now: float) -> list[Effect]:
        """Timeouts: no answer -> win; no COORDINATOR after an answer -> elect again."""
        if self.state is BullyState.ELECTING and now >= self._deadline:
            return self._win()
        if self.state is BullyState.WAITING and now >= self._deadline:
            self._alive -= {p for p in self.peers if p.rank > self.me.rank}  # gone since
            return self._start(now)
        return []
