"""A Phoenix deployment on this machine, as a Python API (shaped like ``LocalCluster``):
every role a process, started, stopped, killed and switched by :class:`RoleId`.

``qosmq phoenix up|down|join|status|takeover`` are thin commands over it; the bench and
the tests call it directly.  State lives in ``state_dir``: ``phoenix.json`` (process key ->
PID), one log per role and one status file per role (what the process serves now).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .. import runtime
from ..errors import EntityNotFound, MiddlewareError
from ..localcluster.manager import pid_alive, spawn_daemon
from ..phoenix.ids import RoleId
from ..phoenix.protocol import JOIN_SERVING_TIMEOUT_S, MAX_PRIORITY, PhoenixTopology
from ..phoenix.ring import ChordRing, master_index
from ..recovery.fencing import Reign
from ..routing.messages import Join, encode
from ..routing.operator import reconfigure, take_over
from ..routing.records import LatencyEntry, SubscriptionRecord
from ..routing.store import open_store, ring_owner
from ..routing.timeliness import LatencyMap
from ..routing.wiring import cluster_settings, outgoing_body, role_inbox_spec
from ..settings import Settings
from ..transport import AsyncClient
from ..transport.broker_info import BrokerInfo
from .policies import mirror_role_queues
from .processes import after_retire, reap, role_argv, terminate, wait_dead
from .zygote import Zygote

__all__ = ["DeploymentError", "PhoenixDeployment", "RoleStatus"]

log = logging.getLogger(__name__)


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
    reign: Reign | None = None  # a master's (recovery/fencing.py); None: unknown
    switches: int = 0  # role switches of the process (take-overs, steps down)


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
        #: forks replacements when set (a master's LocalProvisioner warms one)
        self.zygote: Zygote | None = None

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

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The state file is read and written under a lock: role processes replace
        slaves (``replace``) while an operator may start, stop or take the deployment down."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.state_dir / "phoenix.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    @property
    def _stopping(self) -> Path:
        return self.state_dir / "stopping"  # down under way: nothing is replaced

    def _held(self, slot: RoleId) -> Path:
        """Marks a slot its operator stopped (``stop``): not restarted by ``replace``."""
        return self.log_file(slot).with_suffix(".stopped")

    def _save(self, pids: Mapping[RoleId, int]) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({r.key: p for r, p in sorted(pids.items())}, indent=2))
        tmp.replace(self.state_file)

    def log_file(self, role: RoleId) -> Path:
        return self.state_dir / role.log_file

    def status_file(self, role: RoleId) -> Path:
        return self.log_file(role).with_suffix(".json")

    def _status_of(self, role: RoleId) -> dict[str, Any]:
        try:
            status = json.loads(self.status_file(role).read_text())
        except (OSError, ValueError):
            return {}
        return status if isinstance(status, dict) else {}

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
        self.mirror_inboxes(clusters)
        self.forget_ring_changes()
        self._stopping.unlink(missing_ok=True)
        pids: dict[RoleId, int] = {}
        with self._locked():
            for cluster in clusters:
                for role in RoleId.of_cluster(self.topology.cluster(cluster)):
                    self._held(role).unlink(missing_ok=True)
                    pids[role] = self._spawn(role)
            self._save(pids)
        try:
            self._await_serving(pids, timeout)
        except BaseException:  # not serving in time, or interrupted (Ctrl-C, SIGTERM)
            self.down()  # a failed up leaves no process behind
            raise
        return pids

    def join(self, cluster: str, *, timeout: float = JOIN_SERVING_TIMEOUT_S) -> dict[RoleId, int]:
        """Start a listed cluster's roles, then tell every running routing master, the
        joiner's own last (its hold on the arc's events runs from then: joining.py)."""
        spec = self.topology.cluster(cluster)
        pids = self.pids()
        if any(r.cluster == spec.id and pid_alive(p) for r, p in pids.items()):
            raise DeploymentError(f"{spec.id} is already running")
        self.check_reachable([spec.id])
        self.mirror_inboxes([spec.id])
        with self._locked():
            pids = self.pids()
            started = {role: self._spawn(role) for role in RoleId.of_cluster(spec)}
            pids.update(started)
            self._save(pids)
        self._serving_or_stopped(started, timeout)
        routers = [*sorted({r.cluster for r in pids} - {spec.id}), spec.id]

        async def announce() -> None:
            message = encode(Join(cluster=spec.id))
            for told in routers:
                _, conf = cluster_settings(self.settings, self.topology, told)  # its RabbitMQ
                router = RoleId.router(told)
                # the joiner's own to its control queue, where the hand-over comes: its
                # inbox may be full of the arc's events it holds until then
                own = told == spec.id
                queue = (router.control if own else router.inbox)(self.topology.prefix)
                async with AsyncClient(settings=conf) as client:
                    await client.declare_queue(role_inbox_spec(queue, self.topology, client))
                    await client.publish(outgoing_body(message, queue, priority=MAX_PRIORITY))

        runtime.run(announce(), event_loop=self.settings.event_loop)
        return started

    def forget_ring_changes(self) -> int:
        """Drop the leaves and joins the routers recorded (``up`` starts the topology's
        ring afresh, whatever an earlier run of this prefix saw); how many there were."""
        store = open_store(self.topology.state_store)
        try:
            owner = ring_owner(self.topology.prefix)
            recorded = store.load(owner, "ring")
            for cluster in recorded:
                store.delete(owner, "ring", cluster)
            for cluster in store.load(owner, "adopted"):  # the take-overs' plans with them
                store.delete(owner, "adopted", cluster)
            return len(recorded)
        finally:
            store.close()

    def down(self, *, timeout: float = 15.0) -> int:
        """SIGTERM every role (they stop consuming and close), SIGKILL what is left after
        ``timeout``; return how many processes there were."""
        with self._locked():  # from now on no role process starts a replacement
            self._stopping.touch()
            pids = self.pids()
        terminate(pids.values(), timeout)
        self.state_file.unlink(missing_ok=True)
        for slot in pids:
            self._held(slot).unlink(missing_ok=True)
        return len(pids)

    def kill(self, role: RoleId) -> int:
        """SIGKILL the process started as ``role`` (a crash: nothing is closed); its PID."""
        pid = self._pid(role)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        if not wait_dead([pid], 10.0):
            raise DeploymentError(f"{role.key} (pid {pid}) did not die")
        return pid

    def stop(self, role: RoleId, *, timeout: float = 15.0) -> int:
        """SIGTERM the process started as ``role`` and wait for it to end; its PID.  The
        role it served is not replaced by its master's provisioner (``start`` undoes it)."""
        pid = self._pid(role)
        self._held(role).touch()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        if not wait_dead([pid], timeout):
            raise DeploymentError(f"{role.key} (pid {pid}) did not stop in {timeout:.0f} s")
        return pid

    def start(self, role: RoleId, *, timeout: float = 60.0) -> int:
        """Start ``role`` again (it must be in the topology and not running); its PID,
        once it serves."""
        if not role.in_topology(self.topology):
            raise DeploymentError(f"{role} is not in the topology")
        with self._locked():
            pids = self.pids()
            if role in pids and pid_alive(pids[role]):
                raise DeploymentError(f"{role.key} is running (pid {pids[role]})")
            self._held(role).unlink(missing_ok=True)
            pids[role] = self._spawn(role)
            self._save(pids)
        self._serving_or_stopped({role: pids[role]}, timeout)
        return pids[role]

    def add(self, roles: Iterable[RoleId], *, timeout: float = 60.0) -> dict[RoleId, int]:
        """Start each of ``roles`` (match roles a take-over adds beyond the topology's
        own, ``RoleId.is_added``) in a slot of its own unless a live process serves it;
        return the new PIDs once every one serves.  ``status`` and ``down`` see them."""
        roles = list(roles)
        for role in roles:
            if not role.in_topology(self.topology):
                raise DeploymentError(f"{role} cannot run in this topology")
        with self._locked():
            if self._stopping.exists():
                raise DeploymentError("the deployment is going down: nothing added")
            pids = self.pids()
            alive = {self.serves(slot) for slot, pid in pids.items() if pid_alive(pid)}
            started = {role: self._spawn(role) for role in roles if role not in alive}
            for role in started:
                self._held(role).unlink(missing_ok=True)
            pids.update(started)
            self._save(pids)
        for pid in started.values():  # children of the process that asked: reaped there
            threading.Thread(target=reap, args=(pid,), name=f"reaper of {pid}", daemon=True).start()
        self._serving_or_stopped(started, timeout)
        return started

    def retire(self, roles: Iterable[RoleId], *, timeout: float = 15.0) -> list[int]:
        """Stop the processes started as ``roles`` (``add``'s) and forget their slots:
        SIGTERM, SIGKILL after ``timeout``; their PIDs."""
        roles = set(roles)
        with self._locked():
            pids = self.pids()
            gone = {role: pid for role, pid in pids.items() if role in roles}
            for role in gone:
                self._held(role).touch()  # not replaced meanwhile by a master that hears
        terminate(gone.values(), timeout)
        with self._locked():
            pids = after_retire(self.pids(), gone)
            self._save(pids)
            for role in gone:
                if role not in pids:
                    self._held(role).unlink(missing_ok=True)
                    self.status_file(role).unlink(missing_ok=True)
        return sorted(gone.values())

    def replace(self, role: RoleId) -> tuple[RoleId, int] | None:
        """Start a process serving ``role`` (a slave whose master hears nothing from it)
        in the slot of a dead process of its cluster, its own slot first; return the slot
        and the new PID, or None when nothing was started: a live process serves ``role``
        already (a fenced master stepped down into it), the deployment is going down, the
        operator stopped ``role`` (``stop``), or no slot of the cluster is free.

        A slot is one process's place in the state file, named after the role it was
        started as; its status file says what its process serves now.  The new process
        appends to the slot's log."""
        if not role.is_slave or not role.in_topology(self.topology):
            raise DeploymentError(f"{role} is no slave of the topology: not replaced")
        with self._locked():
            pids = self.pids()
            if self._stopping.exists() or (role in pids and self._held(role).exists()):
                return None
            alive = {slot for slot, pid in pids.items() if pid_alive(pid)}
            if any(self.serves(slot) == role for slot in alive):
                return None
            free = [
                slot
                for slot in sorted(pids, key=lambda s: (s != role, s.key))
                if slot not in alive
                and slot.cluster == role.cluster
                and not self._held(slot).exists()
            ]
            if not free:
                return None
            slot = free[0]
            pids[slot] = self._spawn(slot, role)
            self._save(pids)
            return slot, pids[slot]

    def take_over(self, slave: RoleId, *, timeout_s: float = 30.0) -> RoleId:
        """Tell a running slave to serve its master's role; return once it does (at once
        when it already does: its slaves' election may have been quicker)."""
        if self.serves(slave) == slave.master:
            return slave.master
        master = runtime.run(
            take_over(
                self.settings,
                self.topology,
                slave,
                timeout_s=timeout_s,
                served=lambda: self.serves(slave) == slave.master,
            ),
            event_loop=self.settings.event_loop,
        )
        return RoleId.from_owner(master)

    def preload(self, subscriptions: Iterable[tuple[str, str, SubscriptionRecord]]) -> int:
        """Write ``(subscription id, cluster it was made at, record)`` into the state store
        as the roles would hold them had each been subscribed (the owner's match master
        and its slaves; every routing master on the ring path its latency level), before
        ``up``: a benchmark's 200 000 subscriptions in seconds, not 200 000 round trips.
        How many were written."""
        ring = ChordRing(c.id for c in self.topology.clusters if c.joined)
        per_master: dict[RoleId, dict[str, tuple[int, dict[str, Any]]]] = defaultdict(dict)
        tables: dict[str, LatencyMap] = defaultdict(LatencyMap)
        written = 0
        for sid, at, record in subscriptions:
            et = record.event_type
            path = ring.route(at, et)
            for router in path:  # every routing master on the path saw the subscription
                tables[router].add(et, record.latency_level)
            owner = self.topology.cluster(path[-1])
            master = RoleId.match(owner.id, master_index(et, owner.match_masters))  # as routed
            per_master[master][sid] = (1, replace(record, path=path).to_document())
            written += 1
        store = open_store(self.topology.state_store)
        try:
            for spec in self.topology.clusters:
                for i in range(spec.match_masters):
                    master = RoleId.match(spec.id, i)
                    docs = per_master.get(master, {})
                    for role in [master, *master.slaves(spec)]:
                        store.snapshot(role.owner, "subscription", docs)
                entries = {
                    et: (1, LatencyEntry(total, count).to_document())
                    for et, (total, count) in tables[spec.id].entries.items()
                }
                routing = RoleId.router(spec.id)
                for role in [routing, *routing.slaves(spec)]:
                    store.snapshot(role.owner, "routing_table", entries)
        finally:
            store.close()
        return written

    def reconfigure(self, *, timeout_s: float = 30.0, **switches: object) -> list[str]:
        """Switch ``outer``/``inner``/``blind_dispatch``/``batch_max``/``batch_linger_ms``
        live on every running cluster's masters; the control queues that confirmed."""
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
        rows = []
        for role, pid in sorted(pids.items(), key=lambda item: item[0].key):
            status = self._status_of(role)
            try:
                reign: Reign | None = Reign(**status["reign"])
            except (KeyError, TypeError):
                reign = None
            rows.append(
                RoleStatus(
                    role=role,
                    pid=pid,
                    alive=pid_alive(pid),
                    serves=serves[role],
                    waiting=waiting.get(role),
                    inbox=inboxes[role],
                    reign=reign,
                    switches=int(status.get("switches", 0)),
                )
            )
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

    def mirror_inboxes(
        self,
        clusters: Iterable[str],
        *,
        version_of: Callable[[Settings], BrokerInfo] | None = None,
    ) -> list[str]:
        """Set the policy that mirrors the role queues of ``clusters`` over
        ``inbox_mirrors`` nodes of each cluster's RabbitMQ (management API); return what
        could not be done, as messages, each also logged in one line (the roles run
        without it, on one node each): a broker without classic mirroring (4.0 and
        later, read from the API's ``rabbitmq_version``; ``version_of`` replaces that
        read, for tests) gets no policy."""
        return mirror_role_queues(self.settings, self.topology, clusters, version_of)

    # --------------------------------------------------------------- internal
    def _serving_or_stopped(self, started: Mapping[RoleId, int], timeout: float) -> None:
        """``_await_serving``; when it fails, what this call started is stopped and
        forgotten before the error goes on (a failed ``join``, ``start`` or ``add`` leaves
        no process behind).  Held while it stops, so no master replaces it meanwhile."""
        try:
            self._await_serving(started, timeout)
        except BaseException:  # not serving in time, or interrupted (Ctrl-C, SIGTERM)
            with self._locked():
                for slot in started:
                    self._held(slot).touch()
                self._save(after_retire(self.pids(), started))
            terminate(started.values(), 15.0)
            for slot in started:
                self._held(slot).unlink(missing_ok=True)
            raise

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

    def _spawn(self, slot: RoleId, role: RoleId | None = None) -> int:
        """Start a process in ``slot`` serving ``role`` (the slot's own by default)."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        status = self.status_file(slot)
        status.unlink(missing_ok=True)
        argv = ["sidecar", *role_argv(role or slot)]
        argv += ["--topology", str(self.topology_file), "--status-file", str(status.resolve())]
        if self.zygote is not None:  # a warm fork: no interpreter start (zygote.py)
            pid = self.zygote.spawn(argv, self.env, self.log_file(slot))
            if pid is not None:
                return pid
        return spawn_daemon(
            [sys.executable, "-m", "middleware.cli", *argv], self.env, self.log_file(slot)
        )
