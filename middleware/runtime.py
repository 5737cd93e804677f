"""The event loop a qosmq process runs its asyncio core on (``Settings.event_loop``).

``auto`` (the default) takes uvloop where it is installed (a dependency on Linux and
macOS) and asyncio's own loop elsewhere; ``uvloop`` insists on it (a configuration
error at start-up when it is missing); ``asyncio`` keeps the standard loop.  uvloop
runs the loop, its callbacks and the socket transports in C (libuv); a hop's CPU is
mostly aiormq's framing and pydantic, so the gain is a few per cent (docs/transport.md,
"Event loop" figures).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

from .errors import ConfigurationError

__all__ = ["EventLoopName", "loop_factory", "loop_name", "run", "uvloop_installed"]

T = TypeVar("T")
EventLoopName = Literal["auto", "asyncio", "uvloop"]


def _uvloop() -> Any:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop


def uvloop_installed() -> bool:
    return _uvloop() is not None


def loop_name(choice: EventLoopName) -> Literal["asyncio", "uvloop"]:
    """The loop ``choice`` gives on this machine."""
    if choice == "asyncio":
        return "asyncio"
    if uvloop_installed():
        return "uvloop"
    if choice == "uvloop":
        raise ConfigurationError(
            "event_loop (QOSMQ_EVENT_LOOP): 'uvloop' but uvloop is not installed; "
            "install it (pip install uvloop) or set 'auto' or 'asyncio'"
        )
    return "asyncio"


def loop_factory(choice: EventLoopName) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """A factory for ``asyncio.Runner`` (None: asyncio's default loop)."""
    if loop_name(choice) == "uvloop":
        factory: Callable[[], asyncio.AbstractEventLoop] = _uvloop().new_event_loop
        return factory
    return None


def run(main: Coroutine[Any, Any, T], *, event_loop: EventLoopName = "auto") -> T:
    """``asyncio.run(main)`` on the chosen loop."""
    try:
        factory = loop_factory(event_loop)
    except BaseException:
        main.close()  # never awaited: no "coroutine was never awaited" warning
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
