"""Start, stop, kill and inspect a local RabbitMQ cluster as plain processes.

Every process is tracked by PID in ``<state-dir>/cluster.json``; nothing is
found by name, and ``down`` leaves no process behind (epmd included).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pika
import pika.exceptions

from ..errors import MiddlewareError
from ..transport.management import get_json
from .layout import DEFAULT_BASE_PORT, RABBITMQ_BIN, ClusterLayout, NodeLayout

__all__ = [
    "ClusterError",
    "LocalCluster",
    "NodeExited",
    "RabbitMQMissing",
    "lost_boot_race",
    "pid_alive",
    "spawn_daemon",
]

log = logging.getLogger(__name__)
START_TIMEOUT = 90.0
#: starts of one node that may end in RabbitMQ 3.10's feature-flag boot race
BOOT_RACE_ATTEMPTS = 3
BOOT_RACE_DELAY_S = 2.0  # before starting it again: its peers wait for it meanwhile
STOP_TIMEOUT = 60.0
#: how soon the other nodes must take a frozen node for failed (``freeze_detectable``):
#: RabbitMQ's failure detector polls every 5 s
FREEZE_FOUND_S = 5.0


class ClusterError(MiddlewareError):
    """The local cluster could not be started, stopped or inspected."""


class RabbitMQMissing(ClusterError):
    """rabbitmq-server is not installed where the layer looks for it."""


class NodeExited(ClusterError):
    """A node's rabbitmq-server exited before it accepted AMQP."""


def pid_alive(pid: int | None) -> bool:
    """True if ``pid`` is a live (not zombie) process."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _reap() -> None:
    """Collect exited children (node wrappers we started) so they do not linger as zombies."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


class LocalCluster:
    """A local RabbitMQ cluster described by a :class:`ClusterLayout`."""

    def __init__(self, layout: ClusterLayout) -> None:
        self.layout = layout
        self._state_lock = threading.Lock()  # nodes start (and restart) on threads
        self._output_from: dict[str, int] = {}  # node -> offset of its latest start's output

    # ----------------------------------------------------------------- state
    @classmethod
    def open(
        cls, state_dir: Path | str, *, size: int = 3, base_port: int = DEFAULT_BASE_PORT
    ) -> LocalCluster:
        """The cluster in ``state_dir``: its recorded layout if there is one, else a new one."""
        state_dir = Path(state_dir).resolve()
        state_file = state_dir / "cluster.json"
        if state_file.is_file():
            saved = json.loads(state_file.read_text())
            size, base_port = saved["size"], saved["base_port"]
        return cls(ClusterLayout(state_dir=state_dir, size=size, base_port=base_port))

    def _load(self) -> dict[str, Any]:
        if self.layout.state_file.is_file():
            data: dict[str, Any] = json.loads(self.layout.state_file.read_text())
            return data
        return {"size": self.layout.size, "base_port": self.layout.base_port, "pids": {}}

    def _save(self, state: dict[str, Any]) -> None:
        tmp = self.layout.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.layout.state_file)

    def _pids(self, node: NodeLayout) -> dict[str, int]:
        pids: dict[str, int] = self._load()["pids"].get(node.short_name, {})
        return pids

    def beam_pid(self, node: NodeLayout) -> int | None:
        """The node's running beam: as recorded, or (a start that failed before it was
        recorded, e.g. a peer crashed) the one the node's own PID file names."""
        pid = self._pids(node).get("beam")
        return pid if pid_alive(pid) else _beam_of(node)

    @property
    def epmd_pid(self) -> int | None:
        pid = self._load().get("epmd")
        return pid if pid_alive(pid) else None

    # ------------------------------------------------------------- lifecycle
    def up(self, *, timeout: float = START_TIMEOUT) -> dict[str, Any]:
        """Start every node that is not running, join them, return :meth:`status`."""
        _check_installed()
        self._prepare_dirs()
        self._ensure_epmd()
        down = [n for n in self.layout.nodes if self.beam_pid(n) is None]
        fresh = [n for n in down if not (n.directory / "mnesia").exists()]
        started = time.monotonic()
        if fresh and len(fresh) == len(self.layout.nodes):
            # A new cluster: the first node forms it, the others join it at first boot.
            self._start_nodes(fresh[:1], timeout)
            self._start_nodes(fresh[1:], timeout)
        else:
            # Restarting nodes with data: they wait for their peers, so start them together.
            self._start_nodes(down, timeout)
        self._await_members(timeout)
        if down:
            log.info("cluster up in %.1f s", time.monotonic() - started)
        return self.status()

    def start(self, name: str, *, timeout: float = START_TIMEOUT) -> None:
        """Start one stopped node (it rejoins the cluster from its data directory)."""
        _check_installed()
        node = self.layout.find(name)
        if self.beam_pid(node) is not None:
            return
        self._ensure_epmd()
        self._start_nodes([node], timeout)

    def stop(self, name: str, *, timeout: float = STOP_TIMEOUT) -> None:
        """Stop one node gracefully (SIGTERM, then SIGKILL after ``timeout``)."""
        self._terminate([self.layout.find(name)], timeout)

    def kill(self, name: str) -> None:
        """SIGKILL one node: the failure drill for a crashed broker."""
        node = self.layout.find(name)
        pids = self._pids(node)
        for key in ("beam", "wrapper"):
            with contextlib.suppress(ProcessLookupError, TypeError):
                if pid_alive(pids.get(key)):
                    os.kill(pids[key], signal.SIGKILL)
        self._wait_dead([pids.get("beam")], 10.0)
        _reap()

    def freeze(self, name: str) -> None:
        """SIGSTOP one node's Erlang VM: a node that stops running without closing a
        socket (a VM paused, a host swapping).  :meth:`thaw` lets it go on."""
        pid = self.beam_pid(self.layout.find(name))
        if pid is None:
            raise ClusterError(f"node {name} is not running")
        os.kill(pid, signal.SIGSTOP)

    def thaw(self, name: str) -> None:
        """SIGCONT a node :meth:`freeze` stopped (a node not frozen is left as it is)."""
        pid = self.beam_pid(self.layout.find(name))
        if pid is not None:
            os.kill(pid, signal.SIGCONT)

    def freeze_detectable(self, name: str, within_s: float = FREEZE_FOUND_S) -> bool:
        """Whether every other running node's failure detector would take a freeze of
        ``name`` for a failure within ``within_s``.  Quorum queues elect a new leader only
        when it does.  RabbitMQ's detector (aten) judges a node's silence against the
        gaps between its last (up to) 1 000 heartbeats.  The node counts as down once 99 %
        of those gaps, times 1.5, are shorter than the silence.  So a node whose earlier
        freezes are more than 1 % of its heartbeat history is never found frozen:
        after 3 freezes of 20 s, not until it has sent 300 heartbeats since it joined
        (one every 0.1 s while it runs)."""
        target = self.layout.find(name)
        silence_us = int(within_s * 1_000_000)
        expr = (
            f"D = element(2, sys:get_state(aten_sink)), case maps:find('{target.node_name}', D)"
            " of error -> none; {ok, S} -> L = [X || X <- array:to_list(element(3, S)),"
            f" X =/= undefined], {{length(L), length([X || X <- L, X * 1.5 > {silence_us}]),"
            " application:get_env(aten, detection_threshold, 0.99)} end."
        )
        for node in self.layout.nodes:
            if node.node_name == target.node_name or not pid_alive(self.beam_pid(node)):
                continue
            answer = "".join(self.ctl(node.short_name, "eval", expr, timeout=15).split())
            if answer == "none":
                return False  # not watched yet (a node that just came back)
            heard, long_gaps, threshold = answer.strip("{}").split(",")
            if int(heard) < 2 or (int(heard) - int(long_gaps)) / int(heard) < float(threshold):
                return False
        return True

    def await_freeze_detectable(
        self, name: str, within_s: float = FREEZE_FOUND_S, timeout: float = 240.0
    ) -> float:
        """Wait until :meth:`freeze_detectable` (a node frozen a few times in its first
        minutes is not found frozen until it has run a while longer); the seconds waited.
        Past ``timeout``: :class:`ClusterError`."""
        started = time.monotonic()
        while not self.freeze_detectable(name, within_s):
            if time.monotonic() - started > timeout:
                raise ClusterError(
                    f"a freeze of {name} would not be found by the other nodes' failure "
                    f"detector within {within_s:.0f} s, after waiting {timeout:.0f} s"
                )
            time.sleep(2.0)
        waited = time.monotonic() - started
        if waited > 0.5:
            log.info("waited %.0f s until a freeze of %s would be found", waited, name)
        return waited

    def down(self, *, purge: bool = False, timeout: float = STOP_TIMEOUT) -> None:
        """Stop every node and epmd by PID; with ``purge`` also delete the state directory."""
        self._terminate(list(self.layout.nodes), timeout)
        epmd = self.epmd_pid
        if epmd is not None:
            os.kill(epmd, signal.SIGTERM)
            self._wait_dead([epmd], 5.0)
        _reap()
        if self.layout.state_dir.exists():
            state = self._load()
            state["pids"], state["epmd"] = {}, None
            self._save(state)
        if purge:
            shutil.rmtree(self.layout.state_dir, ignore_errors=True)

    # ---------------------------------------------------------------- status
    def status(self) -> dict[str, Any]:
        """Nodes, PIDs, ports, whether each runs, and the members the cluster reports."""
        nodes = []
        for node in self.layout.nodes:
            pid = self.beam_pid(node)
            nodes.append(
                {
                    "name": node.short_name,
                    "node": node.node_name,
                    "pid": pid,
                    "running": pid is not None and _amqp_handshake(node.amqp_port, 2.0),
                    "amqp_url": node.amqp_url,
                    "amqp_port": node.amqp_port,
                    "management_port": node.management_port,
                    "prometheus_port": node.prometheus_port,
                }
            )
        return {
            "state_dir": str(self.layout.state_dir),
            "epmd_pid": self.epmd_pid,
            "nodes": nodes,
            "members": sorted(self.running_members()),
            "amqp_urls": [n.amqp_url for n in self.layout.nodes],
        }

    def ctl(self, name: str, *args: str, timeout: float = 60.0) -> str:
        """Run ``rabbitmqctl`` against one node (by any of its names); its output.  A
        failure raises :class:`ClusterError` with what the tool printed."""
        node = self.layout.find(name)
        argv = [str(RABBITMQ_BIN / "rabbitmqctl"), "-n", node.node_name, *args]
        env = {**os.environ, **self.layout.base_env()}
        try:
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise ClusterError(f"rabbitmqctl {' '.join(args)} took over {timeout:.0f} s") from exc
        if done.returncode != 0:
            raise ClusterError(f"rabbitmqctl {' '.join(args)}: {done.stderr.strip()[-500:]}")
        return done.stdout

    def running_members(self) -> set[str]:
        """Running cluster members as seen by the first node that answers its management API."""
        for node in self.layout.nodes:
            if self.beam_pid(node) is None:
                continue
            try:
                listed = _management_get(node.management_port, "/api/nodes")
            except OSError:
                continue
            return {n["name"] for n in listed if n.get("running")}
        return set()

    # -------------------------------------------------------------- internal
    def _prepare_dirs(self) -> None:
        self.layout.state_dir.mkdir(parents=True, exist_ok=True)
        cookie = self.layout.cookie_file
        if not cookie.exists():
            cookie.write_text(base64.b32encode(secrets.token_bytes(20)).decode().rstrip("="))
            cookie.chmod(0o400)
        for node in self.layout.nodes:
            (node.directory / "log").mkdir(parents=True, exist_ok=True)
            node.config_file.write_text(self.layout.rabbitmq_conf(node))
            node.advanced_config_file.write_text(self.layout.advanced_config())
            (node.directory / "enabled_plugins").write_text(self.layout.enabled_plugins())
        if not self.layout.state_file.exists():
            self._save(self._load())

    def _ensure_epmd(self) -> None:
        if self.epmd_pid is not None:
            return
        epmd = shutil.which("epmd") or "/usr/lib/erlang/bin/epmd"
        pid = spawn_daemon(
            [epmd, "-port", str(self.layout.epmd_port), "-address", "127.0.0.1"],
            dict(os.environ),
            self.layout.state_dir / "epmd.log",
        )
        state = self._load()
        state["epmd"] = pid
        self._save(state)

    def _start_nodes(self, nodes: list[NodeLayout], timeout: float) -> None:
        if not nodes:
            return
        for node in nodes:
            for port in (
                node.amqp_port,
                node.management_port,
                node.prometheus_port,
                node.dist_port,
            ):
                if _port_in_use(port):
                    raise ClusterError(
                        f"port {port} (for {node.node_name}) is already in use on 127.0.0.1: "
                        "another RabbitMQ (a system service?) or another cluster holds it; "
                        "stop it, or pick other ports with --base-port"
                    )
        with ThreadPoolExecutor(max_workers=len(nodes)) as pool:
            for node in nodes:
                self._spawn(node)
            beams = list(pool.map(lambda n: self._await_started(n, timeout), nodes))
        with self._state_lock:
            state = self._load()
            for node, beam in zip(nodes, beams, strict=True):
                state["pids"][node.short_name]["beam"] = beam
            self._save(state)

    def _spawn(self, node: NodeLayout) -> None:
        """Start the node's rabbitmq-server, recorded at once (a ``down`` finds it), and
        note where this start's output begins in the node's (appended) log."""
        node.pid_file.unlink(missing_ok=True)
        start_of_output = node.log_file.stat().st_size if node.log_file.exists() else 0
        env = {**os.environ, **self.layout.node_env(node)}
        pid = spawn_daemon([str(RABBITMQ_BIN / "rabbitmq-server")], env, node.log_file)
        with self._state_lock:
            state = self._load()
            state["pids"][node.short_name] = {"wrapper": pid}
            self._save(state)
        log.info("starting %s (AMQP 127.0.0.1:%d)", node.node_name, node.amqp_port)
        self._output_from[node.short_name] = start_of_output

    def _await_started(self, node: NodeLayout, timeout: float) -> int:
        """:meth:`_await_node`, starting a node again when it lost RabbitMQ 3.10's boot race:
        nodes restarted together from their data can crash syncing feature flags with a
        peer that is itself still booting (``incompatible_feature_flags``); started again
        a moment later, while the peers wait for it, it boots."""
        for attempt in range(1, BOOT_RACE_ATTEMPTS + 1):
            try:
                return self._await_node(node, timeout)
            except NodeExited:
                output = _output_since(node, self._output_from.get(node.short_name, 0))
                if attempt == BOOT_RACE_ATTEMPTS or not lost_boot_race(output):
                    raise
                log.warning(
                    "%s lost the feature-flag boot race with its peers; starting it again",
                    node.node_name,
                )
                time.sleep(BOOT_RACE_DELAY_S)
                self._spawn(node)
        raise AssertionError("unreachable")  # pragma: no cover

    def _await_node(self, node: NodeLayout, timeout: float) -> int:
        """Wait for the node's PID file and a full AMQP handshake on its port."""
        wrapper = self._pids(node).get("wrapper")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            _reap()
            if not pid_alive(wrapper):
                raise NodeExited(f"{node.node_name} exited during start-up:\n{_tail(node)}")
            if node.pid_file.is_file() and _amqp_handshake(node.amqp_port, 2.0):
                return int(node.pid_file.read_text().strip())
            time.sleep(0.25)
        raise ClusterError(
            f"{node.node_name} did not accept AMQP within {timeout:.0f} s:\n{_tail(node)}"
        )

    def _await_members(self, timeout: float) -> None:
        expected = {n.node_name for n in self.layout.nodes if self.beam_pid(n)}
        deadline = time.monotonic() + timeout
        members: set[str] = set()
        while time.monotonic() < deadline:
            members = self.running_members()
            if expected <= members:
                return
            time.sleep(0.5)
        raise ClusterError(
            f"nodes did not join one cluster: expected {sorted(expected)}, "
            f"members {sorted(members)}"
        )

    def _terminate(self, nodes: list[NodeLayout], timeout: float) -> None:
        beams = [self.beam_pid(n) for n in nodes]
        for pid in beams:
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        if not self._wait_dead(beams, timeout):
            for pid in beams:
                if pid_alive(pid):
                    log.warning("node pid %s ignored SIGTERM for %.0f s; killing", pid, timeout)
                    with contextlib.suppress(ProcessLookupError, TypeError):
                        os.kill(pid, signal.SIGKILL)  # type: ignore[arg-type]
            self._wait_dead(beams, 10.0)
        for node in nodes:
            wrapper = self._pids(node).get("wrapper")
            if pid_alive(wrapper):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(wrapper, signal.SIGKILL)  # type: ignore[arg-type]
        _reap()

    @staticmethod
    def _wait_dead(pids: Iterable[int | None], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            _reap()
            if not any(pid_alive(p) for p in pids):
                return True
            time.sleep(0.1)
        return False


def _beam_of(node: NodeLayout) -> int | None:
    """The PID in the node's PID file if that process is this node's beam (its
    environment names this PID file: a stale file's PID reused by another process is not
    taken)."""
    try:
        pid = int(node.pid_file.read_text().strip())
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    mine = f"RABBITMQ_PID_FILE={node.pid_file}".encode() in environ
    return pid if mine and pid_alive(pid) else None


def spawn_daemon(argv: list[str], env: dict[str, str], log_path: Path) -> int:
    """Start a daemon in its own session, output to ``log_path``; return its PID.

    posix_spawn rather than Popen: these processes outlive the caller by design,
    and are tracked (and reaped) by PID, not by a Popen object.
    """
    actions = [
        (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
        (os.POSIX_SPAWN_OPEN, 1, str(log_path), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644),
        (os.POSIX_SPAWN_DUP2, 1, 2),
    ]
    return os.posix_spawn(argv[0], argv, env, file_actions=actions, setsid=True)


def _port_in_use(port: int) -> bool:
    """Whether something listens on ``port``.  A port in the kernel's ephemeral range
    that nothing listens on may still take the connection: the kernel can pick that
    very port as the probe's own, and the socket connects to itself (Linux's TCP
    self-connect; a unit test's cluster at base port 31000 was refused once for its
    Erlang port 51000): not in use."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        if probe.connect_ex(("127.0.0.1", port)) != 0:
            return False
        return bool(probe.getsockname()[1] != port)


def _check_installed() -> None:
    if not (RABBITMQ_BIN / "rabbitmq-server").is_file():
        raise RabbitMQMissing(
            f"rabbitmq-server is not installed (looked in {RABBITMQ_BIN}). "
            "Install it with: sudo apt-get install -y rabbitmq-server "
            "(or run `make setup`, which does it), or set QOSMQ_RABBITMQ_BIN to its bin folder."
        )


def _amqp_handshake(port: int, timeout: float) -> bool:
    """True once a full AMQP handshake (connection.open) succeeds on 127.0.0.1:port."""
    params = pika.ConnectionParameters(
        host="127.0.0.1",
        port=port,
        socket_timeout=timeout,
        blocked_connection_timeout=timeout,
        connection_attempts=1,
        stack_timeout=timeout,
    )
    with _quiet_pika():  # a refused probe is expected while a node boots
        try:
            pika.BlockingConnection(params).close()
        except (pika.exceptions.AMQPError, OSError):
            return False
    return True


_quiet = {"depth": 0, "level": logging.NOTSET}
_quiet_lock = threading.Lock()


@contextlib.contextmanager
def _quiet_pika() -> Iterator[None]:
    """Silence pika's own error logs while any thread probes (probes run in parallel)."""
    pika_log = logging.getLogger("pika")
    with _quiet_lock:
        if _quiet["depth"] == 0:
            _quiet["level"] = pika_log.level
            pika_log.setLevel(logging.CRITICAL)
        _quiet["depth"] += 1
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet["depth"] -= 1
            if _quiet["depth"] == 0:
                pika_log.setLevel(_quiet["level"])


def _management_get(port: int, path: str) -> Any:
    return get_json(f"http://127.0.0.1:{port}{path}", username="guest", password="guest")


def lost_boot_race(output: str) -> bool:
    """Whether a node's start-up output ends in the feature-flag boot race (a peer still
    booting answers a feature-flag sync with an error), not in a lasting fault."""
    return "incompatible_feature_flags" in output


def _output_since(node: NodeLayout, offset: int) -> str:
    try:
        with node.log_file.open("rb") as fh:
            fh.seek(offset)
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


def _tail(node: NodeLayout, lines: int = 15) -> str:
    try:
        return "\n".join(node.log_file.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
