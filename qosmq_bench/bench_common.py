"""What the ``qosmq bench`` commands share: live progress lines, a run's provenance,
the check that a broker answers before a benchmark starts anything."""

from __future__ import annotations

import argparse
import platform
import socket
import sys
import time
from typing import Any

from middleware import __version__, runtime
from middleware.cliargs import number
from middleware.errors import InvalidArgument
from middleware.settings import Settings

__all__ = ["brokers_answer", "live_arguments", "progress", "provenance"]


def live_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--interval",
        type=number(0, 3600, above=True),
        default=1.0,
        help="seconds between the live progress lines inside a cell (stderr)",
    )
    p.add_argument("--quiet", action="store_true", help="no live progress lines")


def progress(args: argparse.Namespace) -> Any:
    """Where a benchmark's live lines go: stderr, or nowhere with ``--quiet``."""
    if args.quiet:
        return None
    return lambda line: print(line, file=sys.stderr, flush=True)


def provenance(settings: Settings) -> dict[str, Any]:
    return {
        "version": __version__,
        "event_loop": runtime.loop_name(settings.event_loop),
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def brokers_answer(settings: Settings) -> None:
    """Connect once (one try per node): a benchmark that cannot reach a broker says so
    in one line before it preloads or starts anything."""
    from middleware.errors import MiddlewareError
    from middleware.transport import AsyncClient

    async def check() -> None:
        async with AsyncClient(settings=settings):
            pass

    try:
        runtime.run(check(), event_loop=settings.event_loop)
    except MiddlewareError as exc:
        raise InvalidArgument(
            f"no RabbitMQ answers at {','.join(settings.amqp_urls)} ({exc}); start one "
            "(qosmq cluster up) or name yours (--uri or QOSMQ_AMQP_URLS)"
        ) from None
