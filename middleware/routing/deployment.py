"""A Phoenix deployment on this machine, as a Python API (shaped like ``LocalCluster``):
every role a process, started, stopped, killed and switched by :class:`RoleId`.

``qosmq phoenix up|down|join|status|takeover`` are thin commands over it; the bench and
the tests call it directly.  State lives in ``state_dir``: ``phoenix.json`` (process key ->
PID), one log per role and one status file per role (what the process serves now).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .. import runtime
from ..errors import EntityNotFound, MiddlewareError
from ..localcluster.manager import pid_alive, spawn_daemon
from ..settings import Settings
from ..transport import AsyncClient, OutgoingMessage
from .ids import RoleId, RoleKind
from .messages import Join, encode
from .node import take_over
from .protocol import MAX_PRIORITY, PhoenixTopology
from .roles import cluster_settings, inbox_spec, reconfigure

__all__ = ["DeploymentError", "PhoenixDeployment", "RoleStatus"]


class DeploymentError(MiddlewareError):
    """The deployment cannot do what was asked (already up, a cluster unreachable, ...)."""


@dataclass(frozen=True)
class RoleStatus:
    role: RoleId  # what the process was started as
    pid: int
    alive: bool
    serves: RoleId  # what it serves now (differs after a take-over)
    waiting: int | None  # AMQP messages in the inbox of what it serves; None: unknown
    inbox: str


class PhoenixDeployment:
    """The role processes of a topology, on this machine."""

    def __init__(
        self,
        topology_file: Path | str,
        state_dir: Path | str = ".qosmq",
        *,
        settings: Settings | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.topology_file = Path(topology_file).resolve()
        self.topology = PhoenixTopology.load(self.topology_file)
        self.state_dir = Path(state_dir)
        self.settings = settings or Settings.load()
        #: the roles' environment (their settings come from it, as any process's)
        self.env = dict(os.environ if env is None else env)

    # ------------------------------------------------------------------ state
    @property
    def state_file(self) -> Path:
        return self.state_dir / "phoenix.json"

    def pids(self) -> dict[RoleId, int]:
        """The processes ``up``/``join``/``start`` recorded, by the role they started as."""
        if not self.state_file.exists():
            return {}
        saved: dict[str, int] = json.loads(self.state_file.read_text())
        return {RoleId.from_key(key): pid for key, pid in saved.items()}

    def _save(self, pids: Mapping[RoleId, int]) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({r.key: p for r, p in sorted(pids.items())}, indent=2))
        tmp.replace(self.state_file)

    def log_file(self, role: RoleId) -> Path:
        return self.state_dir / role.log_file

    def status_file(self, role: RoleId) -> Path:
        return self.log_file(role).with_suffix(".json")

    def serves(self, role: RoleId) -> RoleId:
        """What the process started as ``role`` serves now (its status file), else ``role``."""
        try:
            return RoleId.from_key(json.loads(self.status_file(role).read_text())["serves"])
        except (OSError, ValueError, KeyError, TypeError):
            return role

    def running_clusters(self) -> list[str]:
        pids = self.pids()
        if not pids:
            return [c.id for c in self.topology.clusters if c.joined]
        return sorted({r.cluster for r in pids})

    # -------------------------------------------------------------- lifecycle
    def up(self, *, timeout: float = 60.0) -> dict[RoleId, int]:
        """Start every role of the joined clusters (after one connection to each
        cluster's RabbitMQ and vhost, so a wrong URL or vhost is named here); return once
        every one serves (its consumers started), or raise naming the ones that do not."""
        if any(pid_alive(p) for p in self.pids().values()):
            raise DeploymentError("already up (down first)")
        clusters = [c.id for c in self.topology.clusters if c.joined]
        self.check_reachable(clusters)
        pids: dict[RoleId, int] = {}
        for cluster in clusters:
            for role in RoleId.of_cluster(self.topology.cluster(cluster)):
                pids[role] = self._spawn(role)
        self._save(pids)
        self._await_serving(pids, timeout)
        return pids

    def join(self, cluster: str, *, timeout: float = 60.0) -> dict[RoleId, int]:
        """Start a listed cluster's roles, then tell every running routing master."""
        spec = self.topology.cluster(cluster)
        pids = self.pids()
        if any(r.cluster == spec.id and pid_alive(p) for r, p in pids.items()):
            raise DeploymentError(f"{spec.id} is already running")
        self.check_reachable([spec.id])
        started = {role: self._spawn(role) for role in RoleId.of_cluster(spec)}
        pids.update(started)
        self._save(pids)
        self._await_serving(started, timeout)
        others = sorted({r.cluster for r in pids} - {spec.id})

        async def announce() -> None:
            message = encode(Join(cluster=spec.id))
            for other in others:
                _, conf = cluster_settings(self.settings, self.topology, other)  # its RabbitMQ
                async with AsyncClient(settings=conf) as client:
                    inbox = RoleId.router(other).inbox(self.topology.prefix)
                    await client.declare_queue(inbox_spec(inbox))
                    await client.publish(OutgoingMessage(message, "", inbox, priority=MAX_PRIORITY))

        runtime.run(announce(), event_loop=self.settings.event_loop)
        return started

    def down(self, *, timeout: float = 15.0) -> int:
        """SIGTERM every role (they stop consuming and close), SIGKILL what is left after
        ``timeout``; return how many processes there were."""
        pids = self.pids()
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        if not _wait_dead(pids.values(), timeout):
            for pid in pids.values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            _wait_dead(pids.values(), 5.0)
        self.state_file.unlink(missing_ok=True)
        return len(pids)

    def kill(self, role: RoleId) -> int:
        """SIGKILL the process started as ``role`` (a crash: nothing is closed); its PID."""
        pid = self._pid(role)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        if not _wait_dead([pid], 10.0):
            raise DeploymentError(f"{role.key} (pid {pid}) did not die")
        return pid

    def stop(self, role: RoleId, *, timeout: float = 15.0) -> int:
        """SIGTERM the process started as ``role`` and wait for it to end; its PID."""
        pid = self._pid(role)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        if not _wait_dead([pid], timeout):
            raise DeploymentError(f"{role.key} (pid {pid}) did not stop in {timeout:.0f} s")
        return pid

    def start(self, role: RoleId, *, timeout: float = 60.0) -> int:
        """Start ``role`` again (it must be in the topology and not running); its PID,
        once it serves."""
        if not role.in_topology(self.topology):
            raise DeploymentError(f"{role} is not in the topology")
        pids = self.pids()
        if role in pids and pid_alive(pids[role]):
            raise DeploymentError(f"{role.key} is running (pid {pids[role]})")
        pids[role] = self._spawn(role)
        self._save(pids)
        self._await_serving({role: pids[role]}, timeout)
        return pids[role]

    def take_over(self, slave: RoleId, *, timeout_s: float = 30.0) -> RoleId:
        """Tell a running slave to serve its master's role; return once it does (at once
        when it already does: its slaves' election may have been quicker)."""
        if self.serves(slave) == slave.master:
            return slave.master
        master = runtime.run(
            take_over(self.settings, self.topology, slave, timeout_s=timeout_s),
            event_loop=self.settings.event_loop,
        )
        return RoleId.from_owner(master)

    def reconfigure(self, *, timeout_s: float = 30.0, **switches: object) -> list[str]:
        """Switch ``outer``/``inner``/``blind_dispatch``/``batch_max`` live on every
        running cluster's masters; the control queues that confirmed."""
        return runtime.run(
            reconfigure(
                self.settings,
                self.topology,
                self.running_clusters(),
                timeout_s=timeout_s,
                **switches,  # type: ignore[arg-type]
            ),
            event_loop=self.settings.event_loop,
        )

    def status(self) -> tuple[list[RoleStatus], list[str]]:
        """Every recorded role: process alive, what it serves, its inbox backlog; and the
        clusters whose RabbitMQ could not be asked (as messages)."""
        pids = self.pids()
        serves = {role: self.serves(role) for role in pids}
        inboxes = {role: serves[role].inbox(self.topology.prefix) for role in pids}

        async def backlogs() -> tuple[dict[RoleId, int | None], list[str]]:
            found: dict[RoleId, int | None] = {}
            problems: list[str] = []
            for cluster in sorted({r.cluster for r in pids}):
                _, conf = cluster_settings(self.settings, self.topology, cluster)
                try:
                    async with AsyncClient(settings=conf) as client:
                        for role in sorted(r for r in pids if r.cluster == cluster):
                            try:
                                found[role] = await client.queue_length(inboxes[role])
                            except EntityNotFound:
                                found[role] = None
                except MiddlewareError as exc:
                    problems.append(f"cluster {cluster!r}: {exc}")
            return found, problems

        waiting, problems = (
            runtime.run(backlogs(), event_loop=self.settings.event_loop) if pids else ({}, [])
        )
        rows = [
            RoleStatus(
                role=role,
                pid=pid,
                alive=pid_alive(pid),
                serves=serves[role],
                waiting=waiting.get(role),
                inbox=inboxes[role],
            )
            for role, pid in sorted(pids.items(), key=lambda item: item[0].key)
        ]
        return rows, problems

    def check_reachable(self, clusters: Iterable[str]) -> None:
        """Connect once to each cluster's RabbitMQ and vhost; ``DeploymentError`` naming
        the cluster, its URLs and vhost when one refuses or does not answer."""

        async def check() -> None:
            seen: set[str] = set()
            for cluster in clusters:
                key, conf = cluster_settings(self.settings, self.topology, cluster)
                if key in seen:
                    continue
                seen.add(key)
                try:
                    async with AsyncClient(settings=conf):  # one try per node
                        pass
                except MiddlewareError as exc:
                    raise DeploymentError(
                        f"cluster {cluster!r} (amqp_urls {','.join(conf.amqp_urls)}, "
                        f"vhost {conf.vhost!r}): {exc}"
                    ) from None

        runtime.run(check(), event_loop=self.settings.event_loop)

    # --------------------------------------------------------------- internal
    def _await_serving(self, pids: Mapping[RoleId, int], timeout: float) -> None:
        """Until every process in ``pids`` wrote its status file (it serves)."""
        deadline = time.monotonic() + timeout
        waiting = dict(pids)
        while waiting:
            waiting = {r: p for r, p in waiting.items() if not self.status_file(r).exists()}
            dead = sorted(r.key for r, p in waiting.items() if not pid_alive(p))
            if dead:
                raise DeploymentError(
                    f"role(s) {', '.join(dead)} ended before serving; see "
                    + ", ".join(str(self.log_file(RoleId.from_key(k))) for k in dead)
                )
            if waiting and time.monotonic() > deadline:
                raise DeploymentError(
                    f"role(s) {', '.join(sorted(r.key for r in waiting))} not serving "
                    f"after {timeout:.0f} s"
                )
            if waiting:
                time.sleep(0.05)

    def _pid(self, role: RoleId) -> int:
        pids = self.pids()
        if role not in pids:
            raise DeploymentError(f"{role.key} was not started by this deployment")
        return pids[role]

    def _spawn(self, role: RoleId) -> int:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        status = self.status_file(role)
        status.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "middleware.cli", "sidecar", *_role_argv(role)]
        argv += ["--topology", str(self.topology_file), "--status-file", str(status.resolve())]
        return spawn_daemon(argv, self.env, self.log_file(role))


def _role_argv(role: RoleId) -> list[str]:
    """The ``qosmq sidecar`` arguments that run ``role``."""
    argv = ["router" if role.kind in (RoleKind.ROUTER, RoleKind.ROUTER_SLAVE) else "matcher"]
    argv += ["--cluster", role.cluster]
    if role.kind in (RoleKind.MATCH, RoleKind.MATCH_SLAVE):
        argv += ["--index", str(role.index)]
    if role.is_slave:
        argv += ["--role", "slave", "--slave", str(role.slave)]
    return argv


def _wait_dead(pids: Iterable[int], timeout: float) -> bool:
    pids = list(pids)
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        with contextlib.suppress(ChildProcessError):
            os.waitpid(-1, os.WNOHANG)  # our own children (a role started here) are reaped
        time.sleep(0.05)
    return True
