"""One Phoenix role process (the driver): it owns the connections, serves one role at a
time and can switch to another without restarting.

A slave told to take over its master (a TAKEOVER message on its control queue) stops
consuming its own queues, and the same process starts serving the master's inbox and
control queue with the tables it already holds as a replica (read back as the first
reply of the master's R-of-N read), and drains what was dispatched to it as a slave.
The recovery issue builds elections and failure detection on this switch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from ..errors import MiddlewareError, Unroutable
from ..phoenix.ids import RoleId, RoleKind
from ..phoenix.protocol import PhoenixTopology
from ..recovery.fencing import Reign
from ..recovery.provisioner import Provisioner
from ..settings import Settings
from .beats import Beater, beat_thread
from .match_master import MatchMaster
from .match_roles import MatchSlave
from .messages import Answer, Takeover
from .peer import Role
from .router_roles import RouterMaster, RouterSlave
from .serving import Serving
from .wiring import Connections, outgoing

__all__ = ["RoleNode"]

log = logging.getLogger(__name__)


class RoleNode:
    """Runs ``role`` until ``stop``; on a take-over, the master's role in the same process."""

    def __init__(
        self,
        *,
        settings: Settings,
        topology: PhoenixTopology,
        role: RoleId,
        status_file: Path | None = None,
        provisioner: Provisioner | None = None,
    ) -> None:
        if not role.in_topology(topology):
            raise MiddlewareError(f"role {role} is not in the topology")
        self.settings, self.topology = settings, topology
        self.started_as = self.current = role
        self.status_file = status_file
        self.provisioner = provisioner  # for the masters it serves
        self.role: Role | None = None
        self.switches = 0
        self.beater: Beater | None = None  # the process's beat thread, while it runs
        #: consumes the queues of the role it serves, by tag (kept across a switch)
        self.serving = Serving()

    def build(
        self,
        role: RoleId,
        promoted_from: RoleId | None,
        connections: Connections,
        reign: Reign | None = None,
        failed_at: float | None = None,
        beater: Beater | None = None,
    ) -> Role:
        common: dict[str, Any] = {
            "beater": beater,
            "settings": self.settings,
            "topology": self.topology,
            "cluster": role.cluster,
            "connections": connections,
            "promoted_from": promoted_from,
            "reign": reign,
            "provisioner": self.provisioner,
            "failed_at": failed_at,
        }
        if role.kind is RoleKind.ROUTER:
            return RouterMaster(**common)
        if role.kind is RoleKind.ROUTER_SLAVE:
            return RouterSlave(slave=role.slave, **common)
        if role.kind is RoleKind.MATCH:
            return MatchMaster(index=role.index, **common)
        return MatchSlave(index=role.index, slave=role.slave, **common)

    async def run(self, stop: asyncio.Event) -> None:
        connections = Connections(self.settings, self.topology, self.current.cluster)
        # the process's beat thread: each role aims it while it beats (the first aim
        # starts it, once that role serves: its connection and imports do not compete
        # with the start); its connection and its lease stay when the process serves
        # another role (no thread to join and no connection to open in a switch)
        self.beater = beat_thread(
            self.settings, self.topology, self.current.cluster, connections,
            str(self.current), queues=[], body=None,
            interval_s=self.topology.heartbeat_interval_s,
        )  # fmt: skip
        promoted_from: RoleId | None = None
        reign: Reign | None = None
        failed_at: float | None = None
        reply: Takeover | None = None
        try:
            while not stop.is_set():
                role = self.role = self.build(
                    self.current, promoted_from, connections, reign, failed_at, self.beater
                )
                role.on_serving = self._write_status  # once its consumers are started
                role_stop = asyncio.Event()
                relay = asyncio.create_task(_relay(stop, role_stop))
                answer = asyncio.create_task(self._answer(role, reply)) if reply else None
                try:
                    await self.serving.run(role, role_stop)
                finally:
                    relay.cancel()
                    if answer is not None:
                        answer.cancel()
                after = role.after()
                if after is None or stop.is_set():
                    break
                log.warning("%s: serving %s from now on", self.current, after.role)
                self.current, promoted_from = after.role, after.promoted_from
                reign, failed_at, reply = after.reign, after.failed_at, after.reply
                self.switches += 1
                self.topology = after.topology
        finally:
            await asyncio.to_thread(self.beater.stop)  # its lease released: a clean stop
            await connections.close()

    async def _answer(self, role: Role, request: Takeover) -> None:
        """Tell whoever asked for the take-over that the master's role is being served."""
        await role.serving.wait()
        assert request.reply_to
        reply = Answer(request=request.request, broker=role.id.owner)
        with contextlib.suppress(Unroutable, MiddlewareError):
            client = await role.client_for(role.cluster)
            await client.publish(outgoing(reply, request.reply_to))

    def _write_status(self) -> None:
        """What this process serves now (written once it serves it), for ``phoenix status``."""
        if self.status_file is None:
            return
        reign = self.role.reign if self.role else None
        status = {
            "pid": os.getpid(),
            "started_as": self.started_as.key,
            "serves": self.current.key,
            "kind": str(self.current.kind),
            "since": time.time(),
            # a master's reign; a slave's: the one it trusted when it started serving
            "reign": {"epoch": reign.epoch, "by": reign.by} if reign else {},
            "switches": self.switches,
        }
        tmp = self.status_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(status))
        tmp.replace(self.status_file)


async def _relay(stop: asyncio.Event, role_stop: asyncio.Event) -> None:
    await stop.wait()
    role_stop.set()
