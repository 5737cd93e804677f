"""Options the CLI benchmarks (``commands.py``) and their Spark jobs both take: one
definition each, so the two cannot drift.  Light to import (every ``qosmq`` command
builds its parser)."""

from __future__ import annotations

import argparse

from middleware.cliargs import integer

__all__ = ["add_departed_masters"]


def add_departed_masters(parser: argparse.ArgumentParser) -> None:
    """``--departed-masters`` of the leave experiment (``phoenix_links.run_leave``)."""
    parser.add_argument(
        "--departed-masters",
        type=integer(1, 16),
        default=1,
        help="leave: the departed cluster's match masters (the others have 1; above 1 its "
        "successor adds the difference: the paper's capacity plan)",
    )
