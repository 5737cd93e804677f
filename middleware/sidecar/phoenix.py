"""``qosmq sidecar router|matcher`` and ``qosmq phoenix up|down``: Phoenix roles as processes."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from .. import runtime
from ..cliargs import integer, number, path
from ..localcluster.manager import pid_alive, spawn_daemon

__all__ = ["register"]


def register(roles: Any, sub: Any) -> None:
    for name, run in (("router", _run_router), ("matcher", _run_matcher)):
        p = roles.add_parser(name, help=f"a Phoenix {name} role")
        p.add_argument("--cluster", required=True)
        p.add_argument("--role", choices=("master", "slave"), default="master")
        p.add_argument("--topology", type=path, required=True)
        p.add_argument("--index", type=integer(0, 63), default=0, help="match master number")
        p.add_argument(
            "--slave", type=integer(0, 63), default=0, help="slave number (--role slave)"
        )
        p.add_argument(
            "--status-file", type=path, help="where the process writes the role it serves now"
        )
        p.set_defaults(run=run)
    phoenix = sub.add_parser("phoenix", help="a local Phoenix deployment")
    cmds = phoenix.add_subparsers(title="phoenix commands", required=True)
    for name, run, help_ in (
        ("up", _up, "start every role of the joined clusters"),
        ("down", _down, "stop every role"),
        ("join", _join, "start a listed cluster and join it to the ring"),
        ("configure", _configure, "switch outer/inner (and batching) of running roles live"),
        ("status", _status, "every role: process alive, inbox backlog (exit 1 if one is down)"),
        (
            "takeover",
            _takeover,
            "tell a slave to serve its master's role (e.g. B/matcher-0-slave-0)",
        ),
    ):
        p = cmds.add_parser(name, help=help_)
        p.add_argument("--topology", type=path, required=True)
        p.add_argument("--state-dir", type=path, default=Path(".qosmq"))
        if name == "join":
            p.add_argument("--cluster", required=True)
        if name == "takeover":
            p.add_argument("--role", required=True, help="the slave's key, as status shows it")
            p.add_argument(
                "--timeout", type=number(0, 3600, above=True), default=30.0, help="seconds to wait"
            )
        if name == "configure":
            for switch in ("outer", "inner"):
                p.add_argument(f"--{switch}", choices=("on", "off"))
            p.add_argument(
                "--blind-dispatch",
                choices=("round_robin", "master"),
                help="match masters with inner off: round robin over master and slaves, "
                "or the master matches every event",
            )
            p.add_argument(
                "--batch-max",
                type=integer(1, 10_000),
                help="messages per batch between roles (1: no batching)",
            )
            p.add_argument(
                "--timeout", type=number(0, 3600, above=True), default=30.0, help="seconds to wait"
            )
        p.set_defaults(run=run)


def _serve(role: Any, settings: Any) -> int:
    if settings.metrics_port is not None:
        from ..observability import start_metrics_server

        port = start_metrics_server(host=settings.metrics_host, port=settings.metrics_port)
        print(f"metrics: http://{settings.metrics_host}:{port}/metrics", file=sys.stderr)

    print(f"event loop: {runtime.loop_name(settings.event_loop)}", file=sys.stderr)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await role.run(stop)

    runtime.run(main(), event_loop=settings.event_loop)
    return 0


def _run_role(args: argparse.Namespace, role: Any) -> int:
    from ..routing.node import RoleNode
    from ..routing.protocol import PhoenixTopology

    topology = PhoenixTopology.load(args.topology)
    topology.cluster(args.cluster)
    node = RoleNode(
        settings=args.settings, topology=topology, role=role, status_file=args.status_file
    )
    return _serve(node, args.settings)


def _run_router(args: argparse.Namespace) -> int:
    from ..routing.ids import RoleId

    if args.role == "slave":
        return _run_role(args, RoleId.router_slave(args.cluster, args.slave))
    return _run_role(args, RoleId.router(args.cluster))


def _run_matcher(args: argparse.Namespace) -> int:
    from ..routing.ids import RoleId

    if args.role == "slave":
        return _run_role(args, RoleId.match_slave(args.cluster, args.index, args.slave))
    return _run_role(args, RoleId.match(args.cluster, args.index))


def _up(args: argparse.Namespace) -> int:
    from ..routing.protocol import PhoenixTopology

    topology = PhoenixTopology.load(args.topology)
    state = args.state_dir / "phoenix.json"
    if state.exists() and any(pid_alive(p) for p in json.loads(state.read_text()).values()):
        print("phoenix: already up (qosmq phoenix down first)", file=sys.stderr)
        return 1
    problem = _unreachable(args.settings, topology, [c.id for c in topology.clusters if c.joined])
    if problem:
        print(f"phoenix: {problem}", file=sys.stderr)
        return 2
    args.state_dir.mkdir(parents=True, exist_ok=True)
    pids: dict[str, int] = {}
    for cluster in topology.clusters:
        if cluster.joined:
            pids.update(_start_cluster(args, cluster))
    state.write_text(json.dumps(pids, indent=2))
    return 0


def _unreachable(settings: Any, topology: Any, clusters: list[str]) -> str | None:
    """Connect once to each cluster's RabbitMQ and vhost before any role starts: a wrong
    URL, vhost or credential is named here, not found later in a role's log."""
    from ..errors import MiddlewareError
    from ..routing.roles import cluster_settings
    from ..transport import AsyncClient

    async def check() -> str | None:
        seen: set[str] = set()
        for cluster in clusters:
            key, conf = cluster_settings(settings, topology, cluster)
            if key in seen:
                continue
            seen.add(key)
            try:
                async with AsyncClient(settings=conf):  # one try per node
                    pass
            except MiddlewareError as exc:
                return (
                    f"cluster {cluster!r} (amqp_urls {','.join(conf.amqp_urls)}, "
                    f"vhost {conf.vhost!r}): {exc}"
                )
        return None

    return runtime.run(check(), event_loop=settings.event_loop)


def _role_argv(role: Any) -> list[str]:
    """The ``qosmq sidecar`` arguments that run ``role`` (a RoleId)."""
    from ..routing.ids import RoleKind

    argv = ["router" if role.kind in (RoleKind.ROUTER, RoleKind.ROUTER_SLAVE) else "matcher"]
    argv += ["--cluster", role.cluster]
    if role.kind in (RoleKind.MATCH, RoleKind.MATCH_SLAVE):
        argv += ["--index", str(role.index)]
    if role.is_slave:
        argv += ["--role", "slave", "--slave", str(role.slave)]
    return argv


def _start_cluster(args: argparse.Namespace, cluster: Any) -> dict[str, int]:
    from ..routing.ids import RoleId

    base = [sys.executable, "-m", "middleware.cli", "sidecar"]
    pids = {}
    for role in RoleId.of_cluster(cluster):
        key = role.key
        log = args.state_dir / role.log_file
        status = (args.state_dir / role.log_file).with_suffix(".json")
        status.unlink(missing_ok=True)
        argv = [*_role_argv(role), "--topology", str(args.topology.resolve())]
        argv += ["--status-file", str(status.resolve())]
        pids[key] = spawn_daemon([*base, *argv], dict(os.environ), log)
        print(f"{key:24} pid {pids[key]}  log {log}")
    return pids


def _join(args: argparse.Namespace) -> int:
    """Start the cluster's roles, then tell every routing master that it joined."""
    from ..routing.ids import RoleId
    from ..routing.protocol import Kind, PhoenixMessage, PhoenixTopology
    from ..routing.roles import cluster_settings, inbox_spec
    from ..transport import AsyncClient, OutgoingMessage

    topology = PhoenixTopology.load(args.topology)
    joiner = topology.cluster(args.cluster)
    state = args.state_dir / "phoenix.json"
    pids = json.loads(state.read_text()) if state.exists() else {}
    if any(key.startswith(f"{joiner.id}/") and pid_alive(pid) for key, pid in pids.items()):
        print(f"phoenix: {joiner.id} is already running", file=sys.stderr)
        return 1
    problem = _unreachable(args.settings, topology, [joiner.id])
    if problem:
        print(f"phoenix: {problem}", file=sys.stderr)
        return 2
    pids.update(_start_cluster(args, joiner))
    state.write_text(json.dumps(pids, indent=2))
    running = {key.split("/")[0] for key in pids}

    async def announce() -> None:
        message = PhoenixMessage(kind=Kind.JOIN, event_type="-", cluster=joiner.id)
        for cluster in sorted(running - {joiner.id}):
            _, settings = cluster_settings(args.settings, topology, cluster)  # its own RabbitMQ
            async with AsyncClient(settings=settings) as client:
                inbox = RoleId.router(cluster).inbox(topology.prefix)
                await client.declare_queue(inbox_spec(inbox))
                await client.publish(
                    OutgoingMessage(message.model_dump_json().encode(), "", inbox, priority=9)
                )

    runtime.run(announce(), event_loop=args.settings.event_loop)
    print(f"{joiner.id} joined the ring of {', '.join(sorted(running))}")
    return 0


def _configure(args: argparse.Namespace) -> int:
    """Every running cluster's masters switch live; the topology file stays as it is."""
    from ..errors import MiddlewareError
    from ..routing.protocol import PhoenixTopology
    from ..routing.roles import reconfigure

    asked = (args.outer, args.inner, args.blind_dispatch, args.batch_max)
    if all(a is None for a in asked):
        print(
            "phoenix configure: give --outer on|off, --inner on|off, "
            "--blind-dispatch round_robin|master and/or --batch-max N",
            file=sys.stderr,
        )
        return 2
    topology = PhoenixTopology.load(args.topology)
    state = args.state_dir / "phoenix.json"
    running = (
        sorted({key.split("/")[0] for key in json.loads(state.read_text())})
        if (state.exists())
        else [c.id for c in topology.clusters if c.joined]
    )
    try:
        confirmed = runtime.run(
            reconfigure(
                args.settings,
                topology,
                running,
                outer=None if args.outer is None else args.outer == "on",
                inner=None if args.inner is None else args.inner == "on",
                blind_dispatch=args.blind_dispatch,
                batch_max=args.batch_max,
                timeout_s=args.timeout,
            ),
            event_loop=args.settings.event_loop,
        )
    except MiddlewareError as exc:
        print(f"phoenix configure: {exc}", file=sys.stderr)
        return 1
    print(f"configured live ({len(confirmed)} masters): {', '.join(confirmed)}")
    return 0


def _inbox_of(topology: Any, key: str) -> str:
    """The inbox of a role as ``phoenix up`` names it (``B/matcher-0-slave-1``)."""
    from ..routing.ids import RoleId

    return RoleId.from_key(key).inbox(topology.prefix)


def _serves(state_dir: Path, key: str) -> str:
    """The role a process serves now (its status file), else the one it was started as."""
    from ..routing.ids import RoleId

    status = (state_dir / RoleId.from_key(key).log_file).with_suffix(".json")
    try:
        return str(json.loads(status.read_text())["serves"])
    except (OSError, ValueError, KeyError, TypeError):
        return key


def _takeover(args: argparse.Namespace) -> int:
    """Tell a running slave to serve its master's role (the master's inbox and control
    queue, with the tables the slave holds); the same process goes on as the master."""
    from ..errors import MiddlewareError
    from ..routing.ids import RoleId
    from ..routing.node import take_over
    from ..routing.protocol import PhoenixTopology

    topology = PhoenixTopology.load(args.topology)
    try:
        slave = RoleId.from_key(args.role)
    except ValueError as exc:
        print(f"phoenix takeover: --role {exc} (e.g. B/matcher-0-slave-0)", file=sys.stderr)
        return 2
    try:
        master = runtime.run(
            take_over(args.settings, topology, slave, timeout_s=args.timeout),
            event_loop=args.settings.event_loop,
        )
    except MiddlewareError as exc:
        print(f"phoenix takeover: {exc}", file=sys.stderr)
        return 1
    print(f"{slave.key} now serves {RoleId.from_owner(master).key}")
    return 0


def _status(args: argparse.Namespace) -> int:
    """One line per role: process alive or not, its inbox and the events waiting there."""
    from ..errors import EntityNotFound, MiddlewareError
    from ..routing.protocol import PhoenixTopology
    from ..routing.roles import cluster_settings
    from ..transport import AsyncClient

    topology = PhoenixTopology.load(args.topology)
    state = args.state_dir / "phoenix.json"
    if not state.exists():
        print("phoenix: nothing running (no phoenix.json)", file=sys.stderr)
        return 1
    pids: dict[str, int] = json.loads(state.read_text())
    serves = {key: _serves(args.state_dir, key) for key in pids}
    inboxes = {key: _inbox_of(topology, serves[key]) for key in pids}

    async def backlogs() -> tuple[dict[str, int | None], list[str]]:
        found: dict[str, int | None] = {}
        problems: list[str] = []
        for cluster in sorted({key.split("/")[0] for key in pids}):
            _, conf = cluster_settings(args.settings, topology, cluster)
            try:
                async with AsyncClient(settings=conf) as client:
                    for key in sorted(k for k in pids if k.startswith(f"{cluster}/")):
                        try:
                            found[key] = await client.queue_length(inboxes[key])
                        except EntityNotFound:
                            found[key] = None
            except MiddlewareError as exc:
                problems.append(f"cluster {cluster!r}: {exc}")
        return found, problems

    waiting, problems = runtime.run(backlogs(), event_loop=args.settings.event_loop)
    down = [key for key, pid in pids.items() if not pid_alive(pid)]
    print(f"{'role':28} {'pid':>8}  {'process':8} {'serves':28} {'waiting':>8}  inbox")
    for key in sorted(pids):
        depth = waiting.get(key)
        shown = "-" if depth is None else str(depth)
        alive = "down" if key in down else "running"
        print(f"{key:28} {pids[key]:>8}  {alive:8} {serves[key]:28} {shown:>8}  {inboxes[key]}")
    for problem in problems:
        print(f"phoenix: {problem}", file=sys.stderr)
    if down:
        print(f"phoenix: {len(down)} role(s) down: {', '.join(sorted(down))}", file=sys.stderr)
    return 1 if down or problems else 0


def _down(args: argparse.Namespace) -> int:
    state = args.state_dir / "phoenix.json"
    if not state.exists():
        print("phoenix: nothing running")
        return 0
    pids = json.loads(state.read_text())
    for pid in pids.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    while any(pid_alive(p) for p in pids.values()) and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(-1, os.WNOHANG)
        time.sleep(0.1)
    for pid in pids.values():
        if pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    state.unlink()
    print(f"phoenix down ({len(pids)} processes)")
    return 0
