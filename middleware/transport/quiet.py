"""A lost connection is one line in the log, not aiormq's traceback.

When a node dies under an ``AsyncClient``, aiormq's frame reader ends with the socket's
error and aiormq logs it as a WARNING *with its traceback* ("Cancelling cause reader
exited abnormally", twice per connection).  Without a logging configuration Python's
last-resort handler prints both tracebacks to stderr, for a loss the layer expects and
handles: it says so itself in one line ("connection to … lost (…); failing over") and
fails over.  This filter, put on aiormq's connection logger when a client opens its
first connection (never at import), turns that record into a DEBUG line without the
traceback when the reader's error is a lost socket (an ``OSError`` or an end of stream
anywhere in its chain of causes).  Any other cause, a malformed frame for one, keeps its
WARNING and its traceback.
"""

from __future__ import annotations

import asyncio
import logging

__all__ = ["install", "is_lost_socket"]

_LOGGER = "aiormq.connection"


def is_lost_socket(exc: BaseException | None) -> bool:
    """``exc``, or an exception it was raised from, says the socket went away."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (OSError, EOFError, asyncio.IncompleteReadError)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class _LostSocketOneLine(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING and record.exc_info:
            exc = record.exc_info[1]
            if is_lost_socket(exc):
                if not logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
                    return False  # handlers without a level of their own would print it
                record.msg = f"{record.getMessage()}: {exc}"
                record.args = None
                record.exc_info = None
                record.exc_text = None
                record.levelno = logging.DEBUG
                record.levelname = logging.getLevelName(logging.DEBUG)
        return True


_FILTER = _LostSocketOneLine()


def install() -> None:
    """Put the filter on aiormq's connection logger (once; ``addFilter`` keeps one copy)."""
    logging.getLogger(_LOGGER).addFilter(_FILTER)
