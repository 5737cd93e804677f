"""``qosmq spool status|drain``: the operator's view of the persistent queues' local spool."""

from __future__ import annotations

import argparse
import json
from typing import Any

from .. import runtime
from ..cliargs import path

__all__ = ["register"]


def register(sub: Any) -> None:
    spool = sub.add_parser("spool", help="the local spool of the persistent-queue API")
    spool_cmds = spool.add_subparsers(title="spool commands", required=True)
    for name, help_ in (
        ("status", "messages waiting, per queue"),
        ("drain", "send the spool to the broker now"),
    ):
        p = spool_cmds.add_parser(name, help=help_)
        p.add_argument("--path", type=path, help="spool file (default: settings)")
        p.set_defaults(run=_run_spool, action=name)


def _run_spool(args: argparse.Namespace) -> int:
    from ..transport import AsyncClient
    from .aio import AsyncQueues
    from .spool import Spool

    settings = args.settings
    spool = Spool.open_existing(args.path or settings.queues.spool_path)  # never creates one
    if args.action == "status":
        print(json.dumps(spool.stats(), indent=2))
        return 0

    async def drain() -> int:
        queues = AsyncQueues(AsyncClient(settings=settings), spool=spool)
        await queues.client.connect()
        report = await queues.recover()
        await queues.client.close()
        print(json.dumps({"replayed": report.replayed, "remaining": report.remaining}))
        return 0 if report.remaining == 0 else 1

    return runtime.run(drain(), event_loop=settings.event_loop)
