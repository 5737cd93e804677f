"""A routing master's view of its links to other clusters (pure): which are down, the
detour found for each, and when a flood must run.

The driver (``RouterMaster``) asks :meth:`LinkTable.path` where to send a message bound
for cluster ``dest``: the direct link while it works, else the detour the last flood
found (its first hop, then the hops each forwards along), else ``None`` — the message
waits (in the router's inbox: nothing is acknowledged before it left) until a flood finds
a way or the direct link answers again.  It reports what happened with
:meth:`failed` (a send to a hop was not confirmed), :meth:`found`/:meth:`timed_out`
(the flood's answers) and :meth:`healed` (the direct link answered a round trip), and
gets back the probes to send and the floods whose timers to start.

Rules:

- a failed send to ``hop`` marks the link to ``hop`` down and floods for ``hop`` (once:
  a flood already running is not started again);
- a failed send to ``hop`` on the way to another ``dest`` over a detour drops that detour
  and floods for ``dest`` again, now without ``hop`` (a detour through a cluster that
  then fails is replaced);
- a flood's FOUND from the target's master sets the detour; no FOUND within the
  timeout marks the target unreachable (``LEFT`` for now: its messages wait) and the
  driver floods again after a while;
- a healed direct link drops the detour: traffic goes back to it;
- a destination no flood reached for ``leave_after_s`` has left (:meth:`gone`); once
  the ring dropped it, :meth:`forget` clears every trace of it, and a send to it that
  fails afterwards (it was under way) leaves none.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..phoenix.ring import ChordRing
from .flood import Classification, FloodNode, Found, Probe, Send, Verdict, answer

__all__ = ["LinkTable", "Started"]


@dataclass(frozen=True)
class Started:
    """A flood the driver must time out (``flood`` id) and whose probes it sends."""

    flood: str
    target: str
    sends: list[Send]


@dataclass
class LinkTable:
    me: str
    ring: ChordRing
    down: dict[str, float] = field(default_factory=dict)  # cluster -> down since (monotonic)
    detours: dict[str, tuple[str, ...]] = field(default_factory=dict)  # dest -> hops, dest last
    unreachable: set[str] = field(default_factory=set)  # floods found no way (for now)
    floods: dict[str, str] = field(default_factory=dict)  # target -> its running flood
    flood_messages: int = 0  # PROBEs and FOUNDs this node sent

    def __post_init__(self) -> None:
        self.node = FloodNode(self.me, self.ring)
        self._answered: set[str] = set()  # floods this cluster answered as their target
        self._reach()

    def _reach(self) -> None:
        self.node.reachable = set(self.ring.clusters) - set(self.down) - {self.me}

    # ------------------------------------------------------------------ queries
    def path(self, dest: str) -> tuple[str, ...] | None:
        """The hops to ``dest`` (``dest`` last; ``(dest,)``: the direct link), or None:
        no way known now, the message waits."""
        if dest not in self.down:
            return (dest,)
        return self.detours.get(dest)

    def flooding(self, dest: str) -> bool:
        return dest in self.floods

    # ------------------------------------------------------------------ events
    def failed(self, hop: str, dest: str, now: float) -> list[Started]:
        """A send to ``hop`` (on the way to ``dest``) was not confirmed.  A send that
        was under way when ``hop`` left the ring fails after :meth:`forget`: nothing to
        do then (marking it down again would find it gone anew, even after it rejoins)."""
        if hop not in self.ring.clusters:
            return []
        started: list[Started] = []
        if hop not in self.down:
            self.down[hop] = now
            self._reach()
            for other, detour in list(self.detours.items()):
                if hop in detour[:-1]:  # a detour through it: find another
                    del self.detours[other]
                    started += self._flood(other)
            started += self._flood(hop)
        elif dest != hop and self.detours.get(dest, ())[:1] == (hop,):
            del self.detours[dest]  # raced with the detour's drop above
        if dest in self.down and dest not in self.detours:
            started += self._flood(dest)
        return started

    def again(self, dest: str) -> list[Started]:
        """Flood for ``dest`` again (no way was found, or the last flood timed out)."""
        if dest not in self.down or dest in self.detours or dest not in self.ring.clusters:
            return []
        return self._flood(dest)

    def _flood(self, target: str) -> list[Started]:
        if target in self.floods:
            return []
        flood, sends = self.node.start(target)
        self.floods[target] = flood
        self.flood_messages += len(sends)
        return [Started(flood, target, sends)]

    def probe(self, probe: Probe) -> list[Send]:
        """A probe for someone else: forward it once."""
        sends = self.node.on_probe(probe)
        self.flood_messages += len(sends)
        return sends

    def answer(self, probe: Probe) -> list[Send]:
        """A probe for this cluster: FOUND back along its path, once per flood."""
        if probe.flood in self._answered:
            return []
        self._answered.add(probe.flood)
        reply = answer(probe, "master")
        sends = [reply] if reply is not None else []
        self.flood_messages += len(sends)
        return sends

    def found(self, found: Found) -> list[Send] | Verdict:
        """A FOUND walking back: passed on, or (here, its origin) the verdict, applied."""
        result = self.node.on_found(found)
        if isinstance(result, list):
            self.flood_messages += len(result)
            return result
        if self.floods.get(result.target) == result.flood:
            del self.floods[result.target]
        if result.kind is Classification.LINK and result.target in self.down:
            hops = result.path[1:]
            if not any(h in self.down for h in hops[:-1]):
                self.detours[result.target] = hops
                self.unreachable.discard(result.target)
        return result

    def timed_out(self, flood: str, target: str) -> Verdict | None:
        """The flood's timer ran out: no way to ``target`` (unless a FOUND came first)."""
        if self.floods.get(target) != flood:
            return None
        del self.floods[target]
        if target in self.detours:
            return None
        self.unreachable.add(target)
        return FloodNode.timed_out(flood, target)

    def healed(self, dest: str) -> bool:
        """The direct link to ``dest`` answered: back to it.  True if it was down."""
        if dest not in self.down:
            return False
        del self.down[dest]
        self.detours.pop(dest, None)
        self.unreachable.discard(dest)
        self._reach()
        return True

    def gone(self, now: float, after_s: float) -> list[str]:
        """The clusters no flood reached, down for ``after_s`` or more: they left."""
        return sorted(
            c for c in self.unreachable if c in self.down and now - self.down[c] >= after_s
        )

    def forget(self, cluster: str) -> None:
        """``cluster`` left the ring (the ring object already dropped it): no link, no
        detour, no flood toward it, and no detour through it."""
        self.down.pop(cluster, None)
        self.unreachable.discard(cluster)
        self.floods.pop(cluster, None)
        self.detours.pop(cluster, None)
        for dest, detour in list(self.detours.items()):
            if cluster in detour[:-1]:
                del self.detours[dest]
        self._reach()

    def joined(self, cluster: str) -> None:
        """The ring changed (a join): the flood node's reach follows it."""
        self._reach()
