"""A lost socket under aiormq's reader: one line (or nothing), never its traceback."""

from __future__ import annotations

import logging

import pytest

from middleware.transport import quiet


class _Reset(Exception):
    pass


def _reader_error(cause: BaseException) -> BaseException:
    try:
        try:
            raise cause
        except BaseException as inner:
            raise _Reset("Server connection reset") from inner
    except _Reset as outer:
        return outer


def _emit(
    caplog: pytest.LogCaptureFixture, level: int, exc: BaseException
) -> list[logging.LogRecord]:
    quiet.install()
    caplog.clear()
    with caplog.at_level(level, logger="aiormq.connection"):
        logging.getLogger("aiormq.connection").warning(
            "Cancelling cause reader exited abnormally", exc_info=exc
        )
    return caplog.records


def test_a_lost_socket_is_one_debug_line_without_traceback(caplog) -> None:
    records = _emit(caplog, logging.DEBUG, _reader_error(ConnectionResetError(104, "reset")))
    assert [r.levelno for r in records] == [logging.DEBUG]
    assert records[0].exc_info is None
    assert "reader exited abnormally" in records[0].getMessage()
    assert "Server connection reset" in records[0].getMessage()


def test_a_lost_socket_is_not_printed_where_debug_is_off(caplog) -> None:
    assert _emit(caplog, logging.WARNING, _reader_error(ConnectionResetError())) == []
    assert _emit(caplog, logging.WARNING, _reader_error(EOFError())) == []


def test_any_other_cause_keeps_its_warning_and_traceback(caplog) -> None:
    records = _emit(caplog, logging.WARNING, _reader_error(ValueError("malformed frame")))
    assert [r.levelno for r in records] == [logging.WARNING]
    assert records[0].exc_info is not None


def test_the_filter_is_put_on_once() -> None:
    quiet.install()
    quiet.install()
    filters = logging.getLogger("aiormq.connection").filters
    assert sum(isinstance(f, type(quiet._FILTER)) for f in filters) == 1


def test_is_lost_socket_walks_the_chain_and_stops_on_cycles() -> None:
    a, b = ValueError("a"), ValueError("b")
    a.__context__, b.__context__ = b, a
    assert not quiet.is_lost_socket(a)
    assert quiet.is_lost_socket(_reader_error(TimeoutError()))
    assert not quiet.is_lost_socket(None)
