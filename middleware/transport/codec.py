"""How the layer's AMQP libraries encode and decode field values: one policy for both faces.

The policy holds for the layer's own connections only.  Importing the layer changes
nothing in pamqp, aiormq or pika; the first layer client that connects installs codec
functions there that act only inside the layer's calls (a context variable set by
:func:`layer_calls` around every public client method and by the layer's connection,
whose reader and writer tasks inherit it) and hand everything else to the library's own
code unchanged, so a plain aio-pika or pika connection in the same process encodes and
decodes byte for byte as without the layer (``tests/integration/test_codec_isolation.py``).
Inside the layer's connections it fixes four things:

* **floats go out as doubles** (``d``) and come back as floats: pamqp sends single
  precision (0.1 arrives as 0.10000000149011612), pika cannot send a float at all and
  decodes one as an integer (0.1 arrives as 0);
* **bytes and bytearray both go out** as byte arrays (``x``) on both faces (pamqp took
  only bytearray, pika only bytes);
* **text that is not UTF-8 decodes** instead of failing: a short string (a message id,
  a reply-to, a table key) another client sent as raw bytes becomes a ``str`` with the
  bytes kept as surrogate escapes (pamqp used to raise inside aiormq's frame reader, which
  closed the connection and redelivered the message to the next connection, for ever);
* **a timestamp beyond the year 9999 decodes** to its raw integer instead of raising.
  Timestamps are seconds, as AMQP says, on both faces (pamqp used to read one past 2106
  as milliseconds, pika as seconds).

One more fix, to aiormq's handshake: a broker's ``Connection.Close`` in answer to
``Connection.Open`` (a vhost that does not exist) raises aiormq's error for its reply
code, with the broker's text.

Deliveries that carry such values are dead-lettered with the reason by the consumer
(:func:`middleware.transport.delivery.unreadable`); no handler sees them.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import functools
import inspect
import struct
from collections.abc import Iterator
from typing import Any, TypeVar

import pamqp.common
import pamqp.decode
import pamqp.encode
import pika.data

__all__ = ["active", "install", "layer_calls", "layer_codec", "raw_bytes"]

_installed = False
_LAYER: contextvars.ContextVar[bool] = contextvars.ContextVar("qosmq_layer_codec", default=False)
C = TypeVar("C", bound=type)


def active() -> bool:
    """Whether the current context belongs to one of the layer's own calls."""
    return _LAYER.get()


@contextlib.contextmanager
def layer_codec() -> Iterator[None]:
    """Run the block (and the tasks it starts) with the layer's codec."""
    install()
    token = _LAYER.set(True)
    try:
        yield
    finally:
        _LAYER.reset(token)


def layer_calls(cls: C) -> C:
    """Class decorator: every public method of ``cls`` runs with the layer's codec."""
    for name, member in list(vars(cls).items()):
        if name.startswith("_") or not inspect.isfunction(member):
            continue
        setattr(cls, name, _in_layer(member))
    return cls


def _in_layer(method: Any) -> Any:
    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def run_async(*args: Any, **kwargs: Any) -> Any:
            with layer_codec():
                return await method(*args, **kwargs)

        return run_async

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        with layer_codec():
            return method(*args, **kwargs)

    return run


def raw_bytes(text: str | bytes) -> bytes:
    """The bytes a decoded short string came from (undoes the surrogate escapes)."""
    if isinstance(text, bytes):
        return text
    return text.encode("utf-8", "surrogateescape")


# ----------------------------------------------------------------- pamqp (aiormq)
_pamqp_encode_value = pamqp.encode.encode_table_value
_pamqp_short_str_orig = pamqp.decode.short_str
_pamqp_timestamp_orig = pamqp.decode.timestamp
_pamqp_field_table_orig = pamqp.decode.field_table


def _pamqp_encode(value: Any) -> bytes:
    if not _LAYER.get():
        return _pamqp_encode_value(value)
    if isinstance(value, float):
        return b"d" + pamqp.encode.double(value)
    if isinstance(value, bytes):
        return b"x" + pamqp.common.Struct.integer.pack(len(value)) + value
    return _pamqp_encode_value(value)


def _pamqp_short_str(value: bytes) -> tuple[int, str]:
    if not _LAYER.get():
        return _pamqp_short_str_orig(value)
    try:
        length = pamqp.common.Struct.byte.unpack(value[0:1])[0]
    except (struct.error, TypeError) as err:
        raise ValueError("Could not unpack short string value") from err
    return length + 1, value[1 : length + 1].decode("utf-8", "surrogateescape")


def _pamqp_timestamp(value: bytes) -> tuple[int, datetime.datetime | int]:
    if not _LAYER.get():
        return _pamqp_timestamp_orig(value)
    try:
        raw = pamqp.common.Struct.timestamp.unpack(value[0:8])[0]
    except (struct.error, TypeError) as err:
        raise ValueError("Could not unpack timestamp value") from err
    try:
        return 8, datetime.datetime.fromtimestamp(raw, tz=datetime.UTC)
    except (OverflowError, ValueError, OSError):
        return 8, raw  # beyond what a datetime holds: the raw seconds


def _pamqp_field_table(value: bytes) -> tuple[int, dict[str, Any]]:
    """pamqp's ``field_table`` with keys decoded like short strings (surrogate escapes)."""
    if not _LAYER.get():
        return _pamqp_field_table_orig(value)
    try:
        length = pamqp.common.Struct.integer.unpack(value[0:4])[0]
        offset, data, end = 4, {}, 4 + length
        if end > len(value):
            raise ValueError("Field table length exceeds available data")
        while offset < end:
            consumed, key = _pamqp_short_str(value[offset:])
            offset += consumed
            if offset > end:
                raise ValueError("Field table key length exceeds data")
            consumed, data[key] = pamqp.decode.embedded_value(value[offset:])
            offset += consumed
        return end, data
    except (struct.error, TypeError) as err:
        raise ValueError("Could not unpack data") from err


def _install_pamqp() -> None:
    pamqp.encode.encode_table_value = _pamqp_encode
    pamqp.decode.short_str = _pamqp_short_str
    pamqp.decode.timestamp = _pamqp_timestamp  # type: ignore[assignment]  # raw int past 9999
    pamqp.decode.field_table = _pamqp_field_table
    pamqp.decode.METHODS["shortstr"] = _pamqp_short_str
    pamqp.decode.METHODS["timestamp"] = _pamqp_timestamp
    pamqp.decode.METHODS["table"] = _pamqp_field_table
    pamqp.decode.TABLE_MAPPING[b"T"] = _pamqp_timestamp
    pamqp.decode.TABLE_MAPPING[b"F"] = _pamqp_field_table


# ------------------------------------------------------------------------- pika
_pika_encode_value = pika.data.encode_value
_pika_decode_value = pika.data.decode_value


def _pika_encode(pieces: list[bytes], value: Any) -> int:
    if not _LAYER.get():
        return int(_pika_encode_value(pieces, value))
    if isinstance(value, float):
        pieces.append(struct.pack(">cd", b"d", value))
        return 9
    if isinstance(value, bytearray):
        value = bytes(value)
    return int(_pika_encode_value(pieces, value))


def _pika_decode(encoded: bytes, offset: int) -> tuple[Any, int]:
    if not _LAYER.get():
        original: tuple[Any, int] = _pika_decode_value(encoded, offset)
        return original
    kind = encoded[offset : offset + 1]
    if kind == b"d":  # pika 1.x truncates floats to integers on decode (long(...))
        return struct.unpack_from(">d", encoded, offset + 1)[0], offset + 9
    if kind == b"f":
        return struct.unpack_from(">f", encoded, offset + 1)[0], offset + 5
    if kind == b"T":
        raw = struct.unpack_from(">Q", encoded, offset + 1)[0]
        try:
            return datetime.datetime.fromtimestamp(raw, datetime.UTC), offset + 9
        except (OverflowError, ValueError, OSError):
            return raw, offset + 9
    decoded: tuple[Any, int] = _pika_decode_value(encoded, offset)
    return decoded


def _install_pika() -> None:
    pika.data.encode_value = _pika_encode
    pika.data.decode_value = _pika_decode


# ----------------------------------------------------------------- aiormq's handshake
async def _aiormq_rpc(
    request: Any, writer: Any, frame_receiver: Any, wait_response: bool = True
) -> Any:
    """aiormq's handshake step, with the broker's Connection.Close read before the
    expected-answer check: a wrong vhost (530) or refused login then raises aiormq's
    error for that reply code with the broker's text, not ``InvalidFrameError("...got
    <Connection.Close object at 0x...>")``, which the layer could only call a lost,
    retryable connection.  Outside the layer's calls: aiormq's own step."""
    if not _LAYER.get():
        return await _aiormq_rpc_orig(request, writer, frame_receiver, wait_response)
    import aiormq.connection as connection
    import pamqp.frame
    from aiormq.exceptions import InvalidFrameError, ProbableAuthenticationError
    from pamqp.commands import Connection

    writer.write(pamqp.frame.marshal(request, 0))
    await writer.drain()
    if not wait_response:
        return None
    _, _, frame = await frame_receiver.get_frame()
    if isinstance(frame, Connection.Close):
        if frame.reply_code == 403:
            raise ProbableAuthenticationError(frame.reply_text)
        raise connection.exception_by_code(frame)
    if request.synchronous and frame.name not in request.valid_responses:
        raise InvalidFrameError(f"Expected one of {request.valid_responses!r}, got {frame.name}")
    return frame


_aiormq_rpc_orig: Any = None


def _install_aiormq() -> None:
    import aiormq.connection

    global _aiormq_rpc_orig
    _aiormq_rpc_orig = aiormq.connection.Connection._rpc
    aiormq.connection.Connection._rpc = staticmethod(_aiormq_rpc)  # type: ignore[method-assign]


def install() -> None:
    """Put the policy's codec functions in place (idempotent; they act only where
    :func:`active`); done by the first layer call, never by an import."""
    global _installed
    if not _installed:
        _install_pamqp()
        _install_pika()
        _install_aiormq()
        _installed = True
