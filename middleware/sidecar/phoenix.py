"""``qosmq sidecar router|matcher`` and ``qosmq phoenix up|down``: Phoenix roles as processes."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
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
        p.set_defaults(run=run)
    phoenix = sub.add_parser("phoenix", help="a local Phoenix deployment")
    cmds = phoenix.add_subparsers(title="phoenix commands", required=True)
    for name, run, help_ in (
        ("up", _up, "start every role of the joined clusters"),
        ("down", _down, "stop every role"),
        ("join", _join, "start a listed cluster and join it to the ring"),
        ("configure", _configure, "switch outer/inner (and batching) of running roles live"),
        ("status", _status, "every role: process alive, inbox backlog (exit 1 if one is down)"),
    ):
        p = cmds.add_parser(name, help=help_)
        p.add_argument("--topology", type=path, required=True)
        p.add_argument("--state-dir", type=path, default=Path(".qosmq"))
        if name == "join":
            p.add_argument("--cluster", required=True)
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


def _role_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from ..routing.protocol import PhoenixTopology

    topology = PhoenixTopology.load(args.topology)
    topology.cluster(args.cluster)
    return {"settings": args.settings, "topology": topology, "cluster": args.cluster}


def _run_router(args: argparse.Namespace) -> int:
    from ..routing.roles import RouterMaster, RouterSlave

    if args.role == "slave":
        return _serve(RouterSlave(slave=args.slave, **_role_kwargs(args)), args.settings)
    return _serve(RouterMaster(**_role_kwargs(args)), args.settings)


def _run_matcher(args: argparse.Namespace) -> int:
    from ..routing.roles import MatchMaster, MatchSlave

    if args.role == "slave":
        return _serve(
            MatchSlave(index=args.index, slave=args.slave, **_role_kwargs(args)), args.settings
        )
    return _serve(MatchMaster(index=args.index, **_role_kwargs(args)), args.settings)


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


def _start_cluster(args: argparse.Namespace, cluster: Any) -> dict[str, int]:
    base = [sys.executable, "-m", "middleware.cli", "sidecar"]
    roles = [("router", ["router", "--cluster", cluster.id])]
    roles += [
        (
            f"router-slave-{j}",
            ["router", "--cluster", cluster.id, "--role", "slave", "--slave", str(j)],
        )
        for j in range(cluster.routing_slaves)
    ]
    roles += [
        (f"matcher-{i}", ["matcher", "--cluster", cluster.id, "--index", str(i)])
        for i in range(cluster.match_masters)
    ]
    roles += [
        (
            f"matcher-{i}-slave-{j}",
            [
                "matcher",
                "--cluster",
                cluster.id,
                "--index",
                str(i),
                "--role",
                "slave",
                "--slave",
                str(j),
            ],
        )
        for i in range(cluster.match_masters)
        for j in range(cluster.match_slaves)
    ]
    pids = {}
    for name, argv in roles:
        key = f"{cluster.id}/{name}"
        log = args.state_dir / f"phoenix-{cluster.id}-{name}.log"
        pids[key] = spawn_daemon(
            [*base, *argv, "--topology", str(args.topology.resolve())], dict(os.environ), log
        )
        print(f"{key:24} pid {pids[key]}  log {log}")
    return pids


def _join(args: argparse.Namespace) -> int:
    """Start the cluster's roles, then tell every routing master that it joined."""
    from ..routing.protocol import Kind, PhoenixMessage, PhoenixTopology, router_inbox
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
                inbox = router_inbox(topology, cluster)
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
    from ..routing.protocol import match_inbox, router_inbox, router_slave_inbox

    cluster, role = key.split("/", 1)
    if role == "router":
        return router_inbox(topology, cluster)
    if found := re.fullmatch(r"router-slave-(\d+)", role):
        return router_slave_inbox(topology, cluster, int(found[1]))
    if found := re.fullmatch(r"matcher-(\d+)(?:-slave-(\d+))?", role):
        slave = None if found[2] is None else int(found[2])
        return match_inbox(topology, cluster, int(found[1]), slave)
    raise ValueError(f"unknown role {key!r} in phoenix.json")


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
    inboxes = {key: _inbox_of(topology, key) for key in pids}

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
    print(f"{'role':28} {'pid':>8}  {'process':8} {'waiting':>8}  inbox")
    for key in sorted(pids):
        depth = waiting.get(key)
        shown = "-" if depth is None else str(depth)
        alive = "down" if key in down else "running"
        print(f"{key:28} {pids[key]:>8}  {alive:8} {shown:>8}  {inboxes[key]}")
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
