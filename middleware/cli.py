"""``qosmq``: the command line (argument parsing only; each command calls its part)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from .cli_help import apply_everywhere
from .cliargs import ERROR_PREFIX, Parser, integer, path
from .errors import ConfigurationError, InvalidArgument, MiddlewareError
from .localcluster.layout import DEFAULT_BASE_PORT, MAX_NODES
from .observability import configure_logging
from .settings import Settings

__all__ = ["main", "warm"]

DESCRIPTION = """\
qosmq: qualities of service on top of RabbitMQ.

  qosmq cluster up|status|down        a local 3-node RabbitMQ cluster on 127.0.0.1
  qosmq phoenix up|status|down ...    Phoenix routing clusters (--topology phoenix.toml)
  qosmq sidecar balancer|router|...   one sidecar process (weighted dispatch, a Phoenix role)
  qosmq bench confirms|phoenix|...    benchmarks against the brokers, ratios to a raw baseline
  qosmq spark confirms|phoenix|faults the same experiments as PySpark jobs
  qosmq spool status|drain            the persistent queues' local spool
  qosmq demo                          cluster up + a short Spark run + its table

Brokers come from QOSMQ_AMQP_URLS (default: the local cluster); every setting is a
QOSMQ_* variable or a key of the --config file (docs/configuration.md).
"""

log = logging.getLogger("qosmq")
URI_HELP = (
    "a RabbitMQ node to connect to, amqp://host:port/ (repeat it, or a comma list, for "
    "a cluster); this command and what it starts use these instead of QOSMQ_AMQP_URLS"
)


def use_uris(uris: Sequence[str] | None) -> None:
    """``--uri``: the brokers for this command and every process it starts (the roles,
    sidecars and Spark's local executors read ``QOSMQ_AMQP_URLS``); checked by the
    settings model like the variable itself."""
    if uris:
        joined = ",".join(u.strip() for text in uris for u in text.split(",") if u.strip())
        os.environ["QOSMQ_AMQP_URLS"] = joined


DEFAULT_STATE_DIR = Path(os.environ.get("QOSMQ_STATE_DIR", ".qosmq"))
COMMANDS_GROUP = "qosmq.commands"  # entry points: register(subparsers) -> None
Handler = Callable[[argparse.Namespace], int]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``qosmq`` console script."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0), or bad arguments: one line said, exit 2
        return exc.code if isinstance(exc.code, int) else 2
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    with _sigterm_as_interrupt():
        return _run(args)


class _Terminated(KeyboardInterrupt):
    """SIGTERM arrived: the command ends as after Ctrl-C, its ``finally`` blocks run."""


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """While a command runs, SIGTERM (a CI job's timeout, ``timeout``, a supervisor)
    ends it the way Ctrl-C does: cleanly, so a benchmark takes down the roles and
    sidecars it started instead of leaving them running.  Further SIGTERMs are ignored
    while it cleans up (its stops are bounded: what does not stop is SIGKILLed).  A
    command that handles SIGTERM itself (a sidecar, a role) replaces this; a handler
    someone else installed is kept; the previous one comes back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is not signal.SIG_DFL:
        yield
        return

    def on_term(signum: int, frame: Any) -> None:
        # not SIG_IGN: a process the cleanup starts (a node restarted) would inherit it
        signal.signal(signal.SIGTERM, lambda *_: None)
        raise _Terminated

    signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace) -> int:
    try:
        use_uris(getattr(args, "uri", None))
        settings = Settings.load(args.config)
        configure_logging(settings.log_level, settings.log_format)
        if settings.trace_file is not None:
            from .tracing import configure_process

            configure_process(settings.trace_file)
        args.settings = settings
        result: int = args.run(args)
        return result
    except (ConfigurationError, InvalidArgument) as exc:  # bad input: usage's exit code
        print(f"{ERROR_PREFIX} {exc}", file=sys.stderr)
        return 2
    except MiddlewareError as exc:
        print(f"{ERROR_PREFIX} {exc}", file=sys.stderr)
        return 1
    except _Terminated:
        print("qosmq: terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("qosmq: interrupted", file=sys.stderr)
        return 130


def warm() -> None:
    """Build the command parser now (a zygote does, before it forks role processes:
    each then parses its arguments at once, its commands' imports made)."""
    _parser()


@functools.cache
def _parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="qosmq", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=path, help="TOML settings file (env QOSMQ_* wins)")
    parser.add_argument("--uri", action="append", help=URI_HELP)
    parser.add_argument(
        "--version", action="version", version=f"qosmq {_installed_version()}", help="print it"
    )
    sub = parser.add_subparsers(title="commands")
    _cluster_commands(sub)
    for register in _feature_commands():
        register(sub)
    _config_after_the_command(parser)
    apply_everywhere(parser)
    return parser


def _config_after_the_command(parser: argparse.ArgumentParser) -> None:
    """``--config`` also after any subcommand (``qosmq cluster status --config x.toml``):
    each command parser without one of its own gets it, not overriding the first's."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                if "--config" not in command._option_string_actions:
                    command.add_argument(
                        "--config",
                        type=path,
                        default=argparse.SUPPRESS,
                        help="TOML settings file (as before the command)",
                    )
                if "--uri" not in command._option_string_actions:
                    command.add_argument(
                        "--uri", action="append", default=argparse.SUPPRESS, help=URI_HELP
                    )
                _config_after_the_command(command)


def _installed_version() -> str:
    from . import __version__

    return __version__


def _feature_commands() -> list[Callable[[Any], None]]:
    """Commands of the library's parts (imported lazily to keep start-up fast), then
    those other installed packages contribute through the ``qosmq.commands`` entry-point
    group: the benchmarks (``qosmq bench``, ``qosmq spark``, ``qosmq demo``) come from
    ``qosmq_bench`` that way, so the library imports nothing from them."""
    from .queues.commands import register as spool
    from .sidecar.commands import register as sidecar

    plugins = [entry.load() for entry in importlib.metadata.entry_points(group=COMMANDS_GROUP)]
    return [*plugins, sidecar, spool]


# ------------------------------------------------------------------ cluster
def _cluster_commands(sub: Any) -> None:
    cluster = sub.add_parser("cluster", help="a local RabbitMQ cluster (the embedded default)")
    cmds = cluster.add_subparsers(title="cluster commands", required=True)

    def add(name: str, run: Handler, help_: str, node: bool = False) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = cmds.add_parser(name, help=help_)
        p.add_argument(
            "--state-dir",
            type=path,
            default=DEFAULT_STATE_DIR,
            help="where nodes keep data, logs and PIDs (default .qosmq)",
        )
        if node:
            p.add_argument("node", help="node: qosmq-2, its full name, or its number 2")
        p.set_defaults(run=run)
        return p

    up = add("up", _cluster_up, "start N nodes on 127.0.0.1 and join them (idempotent)")
    up.add_argument(
        "--nodes", type=integer(1, MAX_NODES), default=3, help="number of nodes (default 3)"
    )
    up.add_argument(
        "--base-port",
        type=integer(1024, 35_535),
        default=DEFAULT_BASE_PORT,
        help=f"AMQP port of node 1 (default {DEFAULT_BASE_PORT})",
    )
    status = add("status", _cluster_status, "nodes, PIDs, ports, members")
    status.add_argument("--json", action="store_true", help="print JSON")
    add("stop", _cluster_node("stop"), "stop one node gracefully", node=True)
    add("kill", _cluster_node("kill"), "SIGKILL one node (failure drill)", node=True)
    add("start", _cluster_node("start"), "start one stopped node", node=True)
    add(
        "freeze",
        _cluster_freeze,
        "SIGSTOP one node's VM, a paused VM (failure drill; says when RabbitMQ would not find it)",
        node=True,
    )
    add("thaw", _cluster_node("thaw"), "SIGCONT a frozen node", node=True)
    down = add("down", _cluster_down, "stop every node and epmd")
    down.add_argument("--purge", action="store_true", help="also delete the state directory")


def _open_cluster(args: argparse.Namespace) -> Any:
    from .localcluster import LocalCluster

    return LocalCluster.open(
        args.state_dir,
        size=getattr(args, "nodes", 3),
        base_port=getattr(args, "base_port", DEFAULT_BASE_PORT),
    )


def _cluster_up(args: argparse.Namespace) -> int:
    cluster = _open_cluster(args)
    was_running = {n["name"] for n in cluster.status()["nodes"] if n["pid"]}
    started = time.monotonic()
    status = cluster.up()
    elapsed = time.monotonic() - started
    for node in status["nodes"]:
        state = "already running" if node["name"] in was_running else "started"
        print(f"{node['name']:10} {node['amqp_url']:28} pid {node['pid']:<8} {state}")
    print(f"members: {', '.join(status['members'])}  ({elapsed:.1f} s)")
    print(f"export QOSMQ_AMQP_URLS={','.join(status['amqp_urls'])}")
    return 0


def _cluster_status(args: argparse.Namespace) -> int:
    status = _open_cluster(args).status()
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    for node in status["nodes"]:
        running = "running" if node["running"] else "stopped"
        print(f"{node['name']:10} {node['amqp_url']:28} pid {node['pid'] or '-':<8} {running}")
    print(f"members: {', '.join(status['members']) or '-'}")
    return 0


def _cluster_node(action: str) -> Handler:
    def run(args: argparse.Namespace) -> int:
        cluster = _open_cluster(args)
        getattr(cluster, action)(args.node)
        print(f"{action}: {args.node}")
        return 0

    return run


def _cluster_freeze(args: argparse.Namespace) -> int:
    cluster = _open_cluster(args)
    found = cluster.freeze_detectable(args.node)
    cluster.freeze(args.node)
    print(f"freeze: {args.node} (thaw it with: qosmq cluster thaw {args.node})")
    if not found:
        print(
            f"note: the other nodes' failure detector would not take {args.node} for failed "
            "(it froze often lately): its quorum queues keep it as leader until the thaw "
            "(docs/local-cluster.md)"
        )
    return 0


def _cluster_down(args: argparse.Namespace) -> int:
    _open_cluster(args).down(purge=args.purge)
    print("cluster down")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
