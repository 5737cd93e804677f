"""``qosmq sidecar router|matcher`` and ``qosmq phoenix up|down``: Phoenix roles as processes."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

from .. import runtime
from ..cliargs import ERROR_PREFIX, integer, number, path

__all__ = ["register"]


def register(roles: Any, sub: Any) -> None:
    for name, run in (("router", _run_router), ("matcher", _run_matcher)):
        p = roles.add_parser(name, help=f"a Phoenix {name} role")
        p.add_argument("--cluster", required=True, help="the cluster id this role belongs to")
        p.add_argument(
            "--role",
            choices=("master", "slave"),
            default="master",
            help="start as the master or as a slave",
        )
        p.add_argument(
            "--topology", type=path, required=True, help="the Phoenix topology file (TOML)"
        )
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
        p.add_argument(
            "--topology", type=path, required=True, help="the Phoenix topology file (TOML)"
        )
        p.add_argument(
            "--state-dir",
            type=path,
            default=Path(".qosmq"),
            help="where the deployment keeps its PIDs, status files and logs",
        )
        if name == "join":
            p.add_argument("--cluster", required=True, help="the id of the cluster that joins")
        if name == "takeover":
            p.add_argument("--role", required=True, help="the slave's key, as status shows it")
            p.add_argument(
                "--timeout", type=number(0, 3600, above=True), default=30.0, help="seconds to wait"
            )
        if name == "configure":
            for switch in ("outer", "inner"):
                p.add_argument(
                    f"--{switch}",
                    choices=("on", "off"),
                    help=f"turn the {switch} timeliness mechanism on or off, live "
                    "(default: unchanged)",
                )
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
                "--batch-linger-ms",
                type=number(0, 1000),
                help="how long a batch between roles may wait for more, at the lowest "
                "priority (none at the top one; 0: to the end of the loop turn)",
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

    if settings.profile_dir is None:
        runtime.run(main(), event_loop=settings.event_loop)
        return 0
    import cProfile  # performance work only: the whole process under the profiler
    import time

    # the main thread's CPU time, not the wall clock: on a busy machine a function's
    # wall time is mostly the wait for a core
    profile = cProfile.Profile(time.thread_time)
    try:
        profile.runcall(runtime.run, main(), event_loop=settings.event_loop)
    finally:  # also when the role ends in an error: the profile shows up to it
        Path(settings.profile_dir).mkdir(parents=True, exist_ok=True)
        profile.dump_stats(Path(settings.profile_dir) / f"{os.getpid()}.prof")
    return 0


def _run_role(args: argparse.Namespace, role: Any) -> int:
    from ..phoenix.protocol import PhoenixTopology
    from ..routing.node import RoleNode

    topology = PhoenixTopology.load(args.topology)
    topology.cluster(args.cluster)
    provisioner = None
    if args.status_file is not None:  # started by a deployment: replace slaves in it
        from .deployment import PhoenixDeployment
        from .processes import LocalProvisioner

        deployment = PhoenixDeployment(
            args.topology, Path(args.status_file).parent, settings=args.settings
        )
        provisioner = LocalProvisioner(deployment)
    node = RoleNode(
        settings=args.settings,
        topology=topology,
        role=role,
        status_file=args.status_file,
        provisioner=provisioner,
    )
    return _serve(node, args.settings)


def _run_router(args: argparse.Namespace) -> int:
    from ..phoenix.ids import RoleId

    if args.role == "slave":
        return _run_role(args, RoleId.router_slave(args.cluster, args.slave))
    return _run_role(args, RoleId.router(args.cluster))


def _run_matcher(args: argparse.Namespace) -> int:
    from ..phoenix.ids import RoleId

    if args.role == "slave":
        return _run_role(args, RoleId.match_slave(args.cluster, args.index, args.slave))
    return _run_role(args, RoleId.match(args.cluster, args.index))


def _deployment(args: argparse.Namespace) -> Any:
    from .deployment import PhoenixDeployment

    return PhoenixDeployment(
        args.topology, args.state_dir, settings=args.settings, env=dict(os.environ)
    )


def _started(deployment: Any, pids: dict[Any, int]) -> None:
    for role, pid in pids.items():
        print(f"{role.key:24} pid {pid}  log {deployment.log_file(role)}")


def _up(args: argparse.Namespace) -> int:
    from .deployment import DeploymentError

    deployment = _deployment(args)
    try:
        _started(deployment, deployment.up())
    except DeploymentError as exc:
        print(f"{ERROR_PREFIX} {exc}", file=sys.stderr)
        return 1 if "already" in str(exc) else 2
    return 0


def _join(args: argparse.Namespace) -> int:
    """Start the cluster's roles, then tell every routing master that it joined."""
    from .deployment import DeploymentError

    deployment = _deployment(args)
    joiner = deployment.topology.cluster(args.cluster)
    try:
        _started(deployment, deployment.join(joiner.id))
    except DeploymentError as exc:
        print(f"{ERROR_PREFIX} {exc}", file=sys.stderr)
        return 1 if "already" in str(exc) else 2
    print(f"{joiner.id} joined the ring of {', '.join(deployment.running_clusters())}")
    return 0


def _configure(args: argparse.Namespace) -> int:
    """Every running cluster's masters switch live; the topology file stays as it is."""
    from ..errors import MiddlewareError

    asked = {
        "outer": None if args.outer is None else args.outer == "on",
        "inner": None if args.inner is None else args.inner == "on",
        "blind_dispatch": args.blind_dispatch,
        "batch_max": args.batch_max,
        "batch_linger_ms": args.batch_linger_ms,
    }
    if all(a is None for a in asked.values()):
        print(
            f"{ERROR_PREFIX} give --outer on|off, --inner on|off, "
            "--blind-dispatch round_robin|master, --batch-max N and/or --batch-linger-ms MS",
            file=sys.stderr,
        )
        return 2
    try:
        confirmed = _deployment(args).reconfigure(timeout_s=args.timeout, **asked)
    except MiddlewareError as exc:
        print(f"{ERROR_PREFIX} {exc}", file=sys.stderr)
        return 1
    print(f"configured live ({len(confirmed)} masters): {', '.join(confirmed)}")
    return 0


def _takeover(args: argparse.Namespace) -> int:
    """Tell a running slave to serve its master's role (the master's inbox and control
    queue, with the tables the slave holds); the same process goes on as the master."""
    from ..errors import MiddlewareError
    from ..phoenix.ids import RoleId

    try:
        slave = RoleId.from_key(args.role)
    except ValueError as exc:
        print(f"{ERROR_PREFIX} --role {exc} (e.g. B/matcher-0-slave-0)", file=sys.stderr)
        return 2
    try:
        master = _deployment(args).take_over(slave, timeout_s=args.timeout)
    except MiddlewareError as exc:
        print(f"{ERROR_PREFIX} {exc}", file=sys.stderr)
        return 1
    print(f"{slave.key} now serves {master.key}")
    return 0


def _reign(reign: Any) -> str:
    """A master's reign as ``status`` shows it: ``0`` as started, ``2:slave-1`` the
    second election's winner, which was slave 1."""
    return str(reign.epoch) if reign.slave is None else f"{reign.epoch}:slave-{reign.slave}"


def _status(args: argparse.Namespace) -> int:
    """One line per role slot: process alive or not, what it serves, its inbox backlog,
    a master's reign (elections won since start) and the process's role switches."""
    deployment = _deployment(args)
    if not deployment.state_file.exists():
        print("phoenix: nothing running (no phoenix.json)", file=sys.stderr)
        return 1
    rows, problems = deployment.status()
    down = [row.role.key for row in rows if not row.alive]
    print(
        f"{'role':28} {'pid':>8}  {'process':8} {'serves':28} {'waiting':>8}  "
        f"{'reign':10} {'switches':>8}  inbox"
    )
    for row in rows:
        shown = "-" if row.waiting is None else str(row.waiting)
        alive = "running" if row.alive else "down"
        reign = "-" if row.reign is None or row.serves.is_slave else _reign(row.reign)
        print(
            f"{row.role.key:28} {row.pid:>8}  {alive:8} {row.serves.key:28} {shown:>8}  "
            f"{reign:10} {row.switches:>8}  {row.inbox}"
        )
    for problem in problems:
        print(f"phoenix: {problem}", file=sys.stderr)
    if down:
        print(f"phoenix: {len(down)} role(s) down: {', '.join(sorted(down))}", file=sys.stderr)
    return 1 if down or problems else 0


def _down(args: argparse.Namespace) -> int:
    deployment = _deployment(args)
    if not deployment.state_file.exists():
        print("phoenix: nothing running")
        return 0
    print(f"phoenix down ({deployment.down()} processes)")
    return 0
