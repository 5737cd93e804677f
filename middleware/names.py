"""Names the broker can carry (queues, topics), checked before anything is declared:
pure, shared by the command line and the library API."""

from __future__ import annotations

from .errors import InvalidArgument

__all__ = ["check_name"]


def check_name(text: object, where: str, most_bytes: int = 255) -> str:
    """``text`` if the broker can carry it as a name (a queue, a topic): a string, not
    blank, without control characters, valid UTF-8 of at most ``most_bytes`` bytes (AMQP
    names end at 255; the layer adds suffixes to some); else :class:`InvalidArgument`
    saying why."""
    if not isinstance(text, str):
        raise InvalidArgument(f"{where} must be a string, got {type(text).__name__}")
    if not text.strip():
        raise InvalidArgument(f"{where} is empty")
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise InvalidArgument(f"{where} {text!r} has control characters")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidArgument(f"{where} {text!r} is not valid UTF-8 text ({exc.reason})") from None
    if size > most_bytes:
        raise InvalidArgument(f"{where} is {size} bytes long (at most {most_bytes} in UTF-8)")
    return text
