"""One thread at a time on a ``SyncClient``'s connection (a part of it, ``sync.py``).

pika's ``BlockingConnection`` is not thread-safe: two threads publishing on one at once
interleave their frames (the broker closes the connection: "UNEXPECTED_FRAME"), take each
other's confirms and lose unconfirmed publishes silently.  A service's threads that share
one client (a threaded web server's request handlers, a worker pool) take turns instead:
every public call of the client runs in a turn, one thread's at a time, and a thread may
take turns inside its own (a handler that publishes from inside ``run``).

Turns go in the order threads asked for them.  A thread that ``run``s consumers holds
its turn for one step at a time, and a step waits for I/O up to 0.1 s; a thread that
wants a turn meanwhile ends that wait at once (pika's thread-safe callback, as ``wake``
does) and goes before the runner's next step, so its call waits for what is under way,
not for the step's timer.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

C = TypeVar("C", bound=type)

#: every ``Turns`` alive, reset in a forked child (``_after_fork``)
_ALIVE: weakref.WeakSet[Turns] = weakref.WeakSet()
_HOOKED: list[bool] = []  # the fork hook is registered at the first ``Turns``, not at import


def _after_fork() -> None:
    for turns in list(_ALIVE):
        turns.forked()


class Turns:
    """A reentrant turn on one connection, handed over in the order threads asked for it;
    a thread that has to wait ends the holder's wait for I/O (``interrupt``)."""

    def __init__(
        self, interrupt: Callable[[], None], forked: Callable[[], None] | None = None
    ) -> None:
        self._interrupt = interrupt
        self._on_fork = forked
        self._cond = threading.Condition(threading.Lock())
        self._holder: int | None = None
        self._depth = 0  # the holder's turns inside its turn
        self._queue: deque[int] = deque()  # threads waiting, in the order they asked
        if not _HOOKED:
            os.register_at_fork(after_in_child=_after_fork)
            _HOOKED.append(True)
        _ALIVE.add(self)

    def forked(self) -> None:
        """In a forked child: the parent's other threads are not here, so their turns
        (held or asked for) are gone; then ``forked`` as given (the client lets go of
        the parent's connection)."""
        self._cond = threading.Condition(threading.Lock())
        if self._holder != threading.get_ident():  # the forking thread keeps its own
            self._holder, self._depth = None, 0
        self._queue = deque()
        if self._on_fork is not None:
            self._on_fork()

    def turn(self) -> Turns:
        """``with turns.turn():`` (the turns are their own context manager)."""
        return self

    def __enter__(self) -> None:
        self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> None:
        me = threading.get_ident()
        with self._cond:
            if self._holder == me:
                self._depth += 1
                return
            if self._holder is None and not self._queue:
                self._holder, self._depth = me, 1
                return
            self._queue.append(me)
        try:
            self._interrupt()
            with self._cond:
                while self._holder is not None or self._queue[0] != me:
                    self._cond.wait()
                self._queue.popleft()
                self._holder, self._depth = me, 1
        except BaseException:  # interrupted while waiting (^C): the others go on
            with self._cond:
                if self._holder != me:
                    self._queue.remove(me)
                    self._cond.notify_all()
            raise

    def wanted(self) -> bool:
        """Whether a thread is waiting for a turn."""
        return bool(self._queue)

    def release(self) -> None:
        with self._cond:
            self._depth -= 1
            if not self._depth:
                self._holder = None
                self._cond.notify_all()


def in_turns(*, except_: tuple[str, ...]) -> Callable[[C], C]:
    """Class decorator: every public method of the class, but those named, runs in a
    turn of the instance's ``_turns``."""

    def decorate(cls: C) -> C:
        for name, member in list(vars(cls).items()):
            if name.startswith("_") or name in except_ or not inspect.isfunction(member):
                continue
            setattr(cls, name, _in_turn(member))
        return cls

    return decorate


def _in_turn(method: Any) -> Any:
    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._turns:
            return method(self, *args, **kwargs)

    return run
