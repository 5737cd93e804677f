"""How the layer's AMQP libraries encode and decode field values: one policy for both faces.

Installed once when :mod:`middleware.transport` is imported; it changes pamqp's (aiormq's)
and pika's table codecs for the whole process, in four ways, each a fix:

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

import datetime
import struct
from typing import Any

import pamqp.common
import pamqp.decode
import pamqp.encode
import pika.data

__all__ = ["install", "raw_bytes"]

_installed = False


def raw_bytes(text: str | bytes) -> bytes:
    """The bytes a decoded short string came from (undoes the surrogate escapes)."""
    if isinstance(text, bytes):
        return text
    return text.encode("utf-8", "surrogateescape")


# ----------------------------------------------------------------- pamqp (aiormq)
_pamqp_encode_value = pamqp.encode.encode_table_value


def _pamqp_encode(value: Any) -> bytes:
    if isinstance(value, float):
        return b"d" + pamqp.encode.double(value)
    if isinstance(value, bytes):
        return b"x" + pamqp.common.Struct.integer.pack(len(value)) + value
    return _pamqp_encode_value(value)


def _pamqp_short_str(value: bytes) -> tuple[int, str]:
    try:
        length = pamqp.common.Struct.byte.unpack(value[0:1])[0]
    except (struct.error, TypeError) as err:
        raise ValueError("Could not unpack short string value") from err
    return length + 1, value[1 : length + 1].decode("utf-8", "surrogateescape")


def _pamqp_timestamp(value: bytes) -> tuple[int, datetime.datetime | int]:
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
    if isinstance(value, float):
        pieces.append(struct.pack(">cd", b"d", value))
        return 9
    if isinstance(value, bytearray):
        value = bytes(value)
    return int(_pika_encode_value(pieces, value))


def _pika_decode(encoded: bytes, offset: int) -> tuple[Any, int]:
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
    retryable connection."""
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


def _install_aiormq() -> None:
    import aiormq.connection

    aiormq.connection.Connection._rpc = staticmethod(_aiormq_rpc)  # type: ignore[method-assign]


def install() -> None:
    """Apply the policy (idempotent)."""
    global _installed
    if not _installed:
        _install_pamqp()
        _install_pika()
        _install_aiormq()
        _installed = True
