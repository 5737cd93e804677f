"""Random ids (``random_hex``) without a system call each."""

from __future__ import annotations

import os
import threading

__all__ = ["random_hex"]


class _RandomPool:
    """Random bytes as ``uuid.uuid4`` draws them (``os.urandom``), but 4 KiB per system
    call instead of one call per id: an id is made per event and per AMQP message on
    every hot path (the client, the routers), where the call showed in the profile.
    A forked child (the role zygote's) draws a pool of its own."""

    SIZE = 4096

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._lock = threading.Lock()  # (a beat thread makes ids too)
        self._pool, self._at = b"", 0

    def hex(self, nbytes: int) -> str:
        with self._lock:
            at = self._at
            if at + nbytes > len(self._pool):
                self._pool, at = os.urandom(self.SIZE), 0
            self._at = at + nbytes
            return self._pool[at : at + nbytes].hex()


_POOL = _RandomPool()
os.register_at_fork(after_in_child=_POOL.reset)  # never the parent's ids again


def random_hex(nbytes: int = 16) -> str:
    """``2 * nbytes`` random hex digits (``uuid.uuid4().hex`` has 32, 122 of its bits
    random); unique as random ids are, at a fraction of the cost."""
    return _POOL.hex(nbytes)
