"""``qosmq sidecar balancer``: the load-report sidecar of one replicated topic."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from typing import Any

from .. import runtime
from ..balancer import BalancerSidecar, declare_replicated_topic
from ..balancer.reports import TOPIC_MAX_BYTES
from ..cli_help import renamed
from ..cliargs import broker_name, integer, number
from ..observability import start_metrics_server

__all__ = ["register"]


def register(sub: Any) -> None:
    sidecar = sub.add_parser("sidecar", help="long-running sidecar processes")
    roles = sidecar.add_subparsers(title="sidecars", required=True)
    bal = roles.add_parser("balancer", help="sample a replicated topic and publish load reports")
    bal.add_argument(
        "--topic",
        required=True,
        type=broker_name(TOPIC_MAX_BYTES),  # replicas <topic>.r<i>; the reports name it
        help="the topic whose replicas this sidecar measures",
    )
    bal.add_argument(
        "--replicas", type=integer(1, 64), default=2, help="queue replicas of the topic"
    )
    bal.add_argument(
        "--sample-interval",
        type=number(0, 3600, above=True),
        default=0.5,
        help="seconds between samples of the replicas' load (the paper's I1)",
    )
    bal.add_argument(
        "--report-interval",
        type=number(0, 3600, above=True),
        default=2.0,
        help="seconds between load reports to the publishers (the paper's I2)",
    )
    bal.add_argument(
        "--declare",
        action="store_true",
        help="declare the replica queues first (leaders spread over nodes)",
    )
    renamed(bal, "--i1", "--sample-interval")
    renamed(bal, "--i2", "--report-interval")
    bal.set_defaults(run=_run_balancer)
    from .phoenix import register as phoenix

    phoenix(roles, sub)


def _run_balancer(args: argparse.Namespace) -> int:
    settings = args.settings
    if settings.metrics_port is not None:
        port = start_metrics_server(host=settings.metrics_host, port=settings.metrics_port)
        print(f"metrics: http://{settings.metrics_host}:{port}/metrics", file=sys.stderr)

    async def main() -> None:
        if args.declare:
            names = await declare_replicated_topic(settings, args.topic, args.replicas)
            print(f"replicas: {', '.join(names)}", file=sys.stderr)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        sidecar = BalancerSidecar(
            settings=settings,
            topic=args.topic,
            replicas=args.replicas,
            sample_interval=args.sample_interval,
            report_interval=args.report_interval,
        )
        await sidecar.run(stop=stop)

    runtime.run(main(), event_loop=settings.event_loop)
    return 0
