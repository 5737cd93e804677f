"""Links to another cluster's RabbitMQ, bounded: a send within a bound that tells a slow
link from a silent one (``bounded``: the link's confirm count, ``AsyncClient.confirmed``,
going up during a bound says the broker or this machine is slow, not that the link
failed), and the round trip a routing master checks a neighbour with
(``inbox_answers``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from ..errors import EntityNotFound, MiddlewareError
from ..transport import AsyncClient

__all__ = ["READ_FIRST_S", "STRETCH_MAX", "bounded", "inbox_answers"]

#: how many times its bound a send may wait in all while its destination's link keeps
#: confirming other publishes (``bounded``; a silent link fails it at one bound)
STRETCH_MAX = 10
#: once a bound passed, what is already here is read before the send is failed: a
#: process that was stopped or starved wakes with its timers due and the confirms that
#: came meanwhile still unread in its socket (a frozen match slave, resumed, took its
#: links for failed and carried copies around them: duplicates)
READ_FIRST_S = 0.05


async def bounded(
    sending: Awaitable[Any],
    bound: float | None,
    progress: Callable[[], int] | None = None,
    stretched: Callable[[], None] = lambda: None,
) -> Any:
    """``sending``'s result within ``bound`` seconds, else ``TimeoutError`` (cancelled).
    With ``progress`` (the link's confirm count) the bound passes again, up to
    ``STRETCH_MAX`` bounds in all (``stretched`` called each time), while the link
    confirmed something during the last one: the broker or this machine is slow, the
    link is not silent.  A cut or blackholed link confirms nothing and fails the send
    at its bound; a busy one no longer turns a slow confirm into a resend around it (a
    duplicate, and more load where load was the cause)."""
    if bound is None:
        return await sending
    task = asyncio.ensure_future(sending)
    for _ in range(STRETCH_MAX if progress is not None else 1):
        mark = progress() if progress is not None else 0
        done, _ = await asyncio.wait((task,), timeout=bound)
        if not done and (progress is None or progress() == mark):  # about to fail it
            done, _ = await asyncio.wait((task,), timeout=READ_FIRST_S)
        if done:
            return task.result()
        if progress is None or progress() == mark:  # nothing confirmed for a bound
            break
        stretched()
    task.cancel()
    raise TimeoutError(f"not confirmed within {bound} s")


async def inbox_answers(connect: Awaitable[AsyncClient], inbox: str, bound: float) -> bool:
    """A round trip to ``inbox`` over a link (its client from ``connect``), each step
    within ``bound``.  An inbox not declared yet answers too: the RabbitMQ behind the
    link answered, and the routing master whose inbox it is is not up yet (a deployment
    starting on a busy machine: taken for a failed link, a router up first declared
    the others gone 3 s later, for good).  A cluster whose roles died keeps its inbox
    and answers the same way: its roles' recovery is not a leave."""
    try:
        client = await asyncio.wait_for(connect, bound)
        if not client.ready:
            return False
        await asyncio.wait_for(client.queue_length(inbox), bound)
    except EntityNotFound:
        return True
    except (MiddlewareError, TimeoutError):
        return False
    return True
