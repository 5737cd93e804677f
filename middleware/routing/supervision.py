"""A master's supervision of its slaves, without I/O: which process serves each slave,
when a second process beating as one is told to stop, and when a replacement is asked
for — a slave silent past the rule, or one whose lease came back (its connection
closed: its process died), asked again on a short schedule of timers while the dying
process may still look alive to the provisioner.

The master's driver (``roles.py``) feeds it what happened — a slave's beat, its lease
returned, a timer, the provisioner's answer, the silences its failure detector reads —
with the time, and performs what it returns: :class:`Retire` (tell that process to
stop), :class:`Provision` (ask the provisioner for a process serving that slave; its
answer comes back through :meth:`Supervision.provisioned`), ``After`` (keyed by the slave: call
:meth:`Supervision.timer` then), :class:`Note` (a warning for the log).  No clock, no
asyncio, no provisioner: the tests drive it with plain numbers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..phoenix.effects import DUE_MARGIN_S, After

__all__ = ["Check", "Effect", "Note", "Provision", "Retire", "Supervision"]


@dataclass(frozen=True, slots=True)
class Retire:
    """Tell ``process`` (its process queue), a second one beating as ``slave``, to stop."""

    slave: int
    process: str


@dataclass(frozen=True, slots=True)
class Check:
    """Before ``process``, a second one beating as ``slave``, is told to stop: is
    ``known`` (the process queue of the one serving it) still there?  A process that
    stopped cleanly hands its lease back silently, and its queue goes with its
    connection: a process restarted at once is not a second one.  Answer with
    :meth:`Supervision.checked`."""

    slave: int
    known: str
    process: str


@dataclass(frozen=True, slots=True)
class Provision:
    """Ask the provisioner for a process serving ``slave`` (``why``: for the log); tell
    :meth:`Supervision.provisioned` whether one was started."""

    slave: int
    why: str


@dataclass(frozen=True, slots=True)
class Note:
    """Something the master says in its log (a warning) of ``slave``: ``text`` with
    ``{slave}`` where the slave's name goes."""

    slave: int
    text: str


Effect = Retire | Check | Provision | After | Note

#: pauses between the tries to replace a slave whose lease came back: the broker sees
#: the connection close while the process is still exiting, so a provisioner that checks
#: the process may find it alive for a few milliseconds more
DEAD_RETRIES_S = (0.0, 0.05, 0.1, 0.2, 0.4)
#: a second process beating as a slave is told to stop at most this often
RETIRE_EVERY_S = 1.0


@dataclass
class Supervision:
    """One master's view of its slaves' processes (slaves by number)."""

    replace_after_s: float
    replace_retry_s: float
    can_provision: bool = True
    #: slave -> the process queue serving it (the first heard, or the next one heard
    #: once the known one is taken for gone)
    processes: dict[int, str] = field(default_factory=dict)
    #: slaves whose known process is taken for gone (lease back, or silent past the rule)
    gone: set[int] = field(default_factory=set)
    #: a second process's queue -> when it was told to stop
    retired: dict[str, float] = field(default_factory=dict)
    #: slave -> when a replacement was last asked for
    asked: dict[int, float] = field(default_factory=dict)
    #: slaves whose lease came back, -> the next try's index in DEAD_RETRIES_S
    dying: dict[int, int] = field(default_factory=dict)

    # ------------------------------------------------------------------ inputs
    def beat(self, slave: int, process: str | None, now: float) -> tuple[bool, list[Effect]]:
        """A beat from ``process`` as ``slave``: whether that process serves the slave
        (a sign of life), and what to do (a second process is told to stop)."""
        if process is None:
            return True, []  # beats without a process queue: nothing to tell apart
        known = self.processes.get(slave)
        if known == process:
            self.gone.discard(slave)  # it was only slow
            return True, []
        if known is None or slave in self.gone:
            self.gone.discard(slave)
            self.processes[slave] = process
            said: list[Effect] = []
            if known is not None:
                said.append(Note(slave, "{slave} served by another process now"))
            return True, said
        if now - self.retired.get(process, -1.0) < RETIRE_EVERY_S:
            return False, []
        self.retired[process] = now
        return False, [Check(slave, known, process)]

    def checked(self, slave: int, known: str, process: str, known_there: bool) -> list[Effect]:
        """The answer to a :class:`Check`: the known process is still there (``process``
        is a second one: told to stop), or it ended cleanly (the slave is taken for
        gone: ``process``'s next beat makes it the one serving the slave)."""
        if self.processes.get(slave) != known or slave in self.gone:
            return []  # the slave's process changed meanwhile: the beats decide
        if known_there:
            return [
                Note(slave, "a second process beats as {slave}: told to stop"),
                Retire(slave, process),
            ]
        self.gone.add(slave)
        self.retired.pop(process, None)
        return [Note(slave, "the process serving {slave} ended cleanly: the next one serves it")]

    def heard(self, slave: int) -> None:
        """A sign of life of ``slave`` (its serving process's beat or load report)."""
        self.asked.pop(slave, None)

    def is_gone(self, slave: int) -> bool:
        """Whether ``slave``'s known process is taken for gone (a late report of it is
        no sign of life)."""
        return slave in self.gone

    def lease_returned(self, slave: int) -> list[Effect]:
        """``slave``'s process died (its lease came back): replace it now."""
        self._forget(slave)
        self.dying[slave] = 0
        return [After(DEAD_RETRIES_S[0], slave)]

    def timer(self, slave: int, alive: bool, now: float) -> list[Effect]:
        """An ``After`` fired; ``alive``: whether the slave is heard again."""
        if slave not in self.dying:
            return []
        if alive:  # served again (a fenced master stepped down into it)
            del self.dying[slave]
            return []
        self.asked.pop(slave, None)
        asked = self._ask(slave, now, "whose lease came back")
        return asked or self._next_try(slave)

    def provisioned(self, slave: int, started: bool) -> list[Effect]:
        """The provisioner answered a :class:`Provision` for ``slave``."""
        if slave not in self.dying:
            return []
        if started:
            del self.dying[slave]
            return []
        return self._next_try(slave)

    def silences(
        self, silent_for: Mapping[int, float | None], timeout_s: float, now: float
    ) -> list[Effect]:
        """Every beat interval: the slaves' silences (None: never watched); a replacement
        for each silent past ``replace_after_s`` (and the detector's timeout), asked once
        per ``replace_retry_s``."""
        if not self.can_provision:
            return []
        after = max(self.replace_after_s, timeout_s)
        effects: list[Effect] = []
        for slave, silent in sorted(silent_for.items()):
            if silent is not None and silent > after:
                self._forget(slave)
                effects += self._ask(slave, now, f"silent for {silent:.1f} s")
        return effects

    def next_check_in(
        self, silent_for: Mapping[int, float | None], timeout_s: float, step_s: float
    ) -> float:
        """How long the driver may wait before its next :meth:`silences`: until the
        first watched slave has been silent for the rule's bound (a beat only moves that
        later), at most half the bound; ``step_s`` (a beat interval) while one is past
        it.  A master whose slaves beat looks twice every ``replace_after_s``."""
        after = max(self.replace_after_s, timeout_s)
        cap = after / 2
        if not self.can_provision:
            return cap  # nothing to ask for: the checks change nothing
        left = [after - silent for silent in silent_for.values() if silent is not None]
        if not left:
            return cap
        first = min(left)
        return step_s if first <= 0 else min(cap, first + DUE_MARGIN_S)

    # ----------------------------------------------------------------- inside
    def _forget(self, slave: int) -> None:
        """The process serving ``slave`` is taken for gone: the next one beating as the
        slave serves it (a load report or a late beat does not bring it back)."""
        if slave in self.processes:
            self.gone.add(slave)

    def _ask(self, slave: int, now: float, why: str) -> list[Effect]:
        asked = self.asked.get(slave)
        if not self.can_provision or (asked is not None and now - asked < self.replace_retry_s):
            return []
        self.asked[slave] = now
        return [Provision(slave, why)]

    def _next_try(self, slave: int) -> list[Effect]:
        step = self.dying[slave] + 1
        if step >= len(DEAD_RETRIES_S):
            del self.dying[slave]
            self.asked.pop(slave, None)  # the silence rule asks again
            return []
        self.dying[slave] = step
        return [After(DEAD_RETRIES_S[step], slave)]
