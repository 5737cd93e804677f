"""Options the CLI benchmarks (``commands.py``) and their Spark jobs both take: one
definition each, so the two cannot drift.  Light to import (every ``qosmq`` command
builds its parser)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from middleware.cliargs import integer, names, number, numbers

__all__ = [
    "LINK_FAULTS",
    "MECHANISMS",
    "ROLE_KINDS",
    "add_departed_masters",
    "fault_arguments",
    "steal_arguments",
    "timeliness_arguments",
]

#: name -> the live switches (``qosmq phoenix configure``); with ``inner`` off the match
#: masters take turns over themselves and their slaves (the paper's base system)
MECHANISMS: dict[str, dict[str, Any]] = {
    "none": {"outer": False, "inner": False, "blind_dispatch": "round_robin"},
    "inner": {"outer": False, "inner": True},
    "outer": {"outer": True, "inner": False, "blind_dispatch": "round_robin"},
    "both": {"outer": True, "inner": True},
    # not paper mechanisms, to measure one thing in the same run: "none" with the match
    # masters matching every event themselves (no slaves), and "none" with every role
    # message in an AMQP message of its own (batch_max = 1)
    "none-master": {"outer": False, "inner": False, "blind_dispatch": "master"},
    "none-unbatched": {
        "outer": False,
        "inner": False,
        "blind_dispatch": "round_robin",
        "batch_max": 1,
    },
}


#: the role kinds the recovery experiment kills, the link faults the links experiment injects
ROLE_KINDS = ("router", "router_slave", "match", "match_slave")
LINK_FAULTS = ("cut", "blackhole")


def fault_arguments(
    parser: argparse.ArgumentParser, *, kinds: Sequence[str], faults_help: str
) -> None:
    """``--kinds`` (recovery: the role kinds killed) and ``--faults`` (links: the link
    faults injected), the same for ``qosmq bench phoenix`` and the Spark fault job."""
    parser.add_argument(
        "--kinds",
        type=names(ROLE_KINDS),
        default=",".join(kinds),
        help="recovery: the role kinds killed",
    )
    parser.add_argument(
        "--faults", type=names(LINK_FAULTS), default=",".join(LINK_FAULTS), help=faults_help
    )


def add_departed_masters(parser: argparse.ArgumentParser) -> None:
    """``--departed-masters`` of the leave experiment (``phoenix_links.run_leave``)."""
    parser.add_argument(
        "--departed-masters",
        type=integer(1, 16),
        default=1,
        help="leave: the departed cluster's match masters (the others have 1; above 1 its "
        "successor adds the difference: the paper's capacity plan)",
    )


def timeliness_arguments(
    p: argparse.ArgumentParser,
    *,
    repeats: int | None,
    repeats_help: str = "mechanism passes (rotated)",
) -> None:
    """The cell arguments the bench command and the Spark job share: rates, mechanisms,
    duration, repeats, warm-up and the steal rule."""
    p.add_argument(
        "--rates",
        type=numbers(0, 1e6, above=True),
        help="events/s, comma list (default rate: 100,200,400; subscriptions: 200)",
    )
    p.add_argument(
        "--mechanisms",
        type=names(MECHANISMS),
        default="none,inner,outer,both",
        help="the timeliness mechanisms compared (comma list)",
    )
    p.add_argument(
        "--duration", type=number(0, 86_400, above=True), default=10.0, help="seconds per cell"
    )
    p.add_argument("--repeats", type=integer(1, 10_000), default=repeats, help=repeats_help)
    p.add_argument(
        "--warmup", type=number(0, 3600), default=3.0, help="unmeasured seconds per cell"
    )
    p.add_argument(
        "--inbox-mirrors",
        type=integer(0, 16),
        default=0,
        help="RabbitMQ nodes holding each role queue (0: no mirroring policy)",
    )
    p.add_argument(
        "--role-queues",
        choices=("classic", "quorum"),
        default="classic",
        help="the role inboxes' queue type (quorum: replicated by RabbitMQ, no broker "
        "priorities on 3.x)",
    )
    steal_arguments(p)


def steal_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-steal",
        type=number(-100, 100),
        default=5.0,
        help="re-measure a cell during which the hypervisor took more than this %% of the "
        "CPU (steal); the disturbed cell is kept in the results as discarded (< 0: off)",
    )
    p.add_argument(
        "--steal-retries", type=integer(0, 100), default=2, help="re-measurements per cell at most"
    )
