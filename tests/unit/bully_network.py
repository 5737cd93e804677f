"""The bully election among one master's slaves run over an in-memory network: every
message delivered to live slaves, time moving past the timeouts (the real ``Bully``
machines; used by ``test_election`` and ``test_phoenix_network``)."""

from __future__ import annotations

from middleware.phoenix.ids import RoleId
from middleware.recovery import Become, Bully, BullyState, Send


def drive(machines: dict[RoleId, Bully], suspect: list[RoleId], dead: set[RoleId]) -> list[RoleId]:
    """Deliver every effect (to live slaves only) until quiet; time moves past timeouts."""
    now, winners = 0.0, []
    queue: list[tuple[RoleId, Send | Become, RoleId]] = []
    for role in suspect:
        queue += [(role, e, role) for e in machines[role].master_suspected(now)]
    for _ in range(100):
        while queue:
            sender, effect, _ = queue.pop(0)
            if isinstance(effect, Become):
                winners.append(sender)
                continue
            if effect.to in dead:
                continue
            target = machines[effect.to]
            handle = {
                "election": target.on_election,
                "answer": target.on_answer,
                "coordinator": target.on_coordinator,
            }[effect.what]
            queue += [(effect.to, e, effect.to) for e in handle(sender, now)]
        now += 0.05
        for role, machine in machines.items():
            if role not in dead:
                queue += [(role, e, role) for e in machine.tick(now)]
        if not queue and all(
            m.state in (BullyState.IDLE, BullyState.WON)
            for r, m in machines.items()
            if r not in dead
        ):
            break
    return winners
