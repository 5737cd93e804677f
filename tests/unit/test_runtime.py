"""The event loop a process runs on (``Settings.event_loop``, ``middleware.runtime``)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from middleware import runtime
from middleware.errors import ConfigurationError
from middleware.settings import Settings


async def _loop_module() -> str:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__


def test_auto_runs_on_uvloop_where_installed() -> None:
    pytest.importorskip("uvloop")  # a dependency on Linux: installed with qosmq
    assert runtime.loop_name("auto") == "uvloop"
    assert runtime.run(_loop_module()).startswith("uvloop")
    assert runtime.run(_loop_module(), event_loop="uvloop").startswith("uvloop")


def test_asyncio_keeps_the_standard_loop() -> None:
    assert runtime.loop_name("asyncio") == "asyncio"
    assert runtime.run(_loop_module(), event_loop="asyncio").startswith("asyncio")


def test_a_missing_uvloop_falls_back_under_auto_and_fails_when_asked_for(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop -> ImportError
    assert runtime.loop_name("auto") == "asyncio"
    assert runtime.run(_loop_module()).startswith("asyncio")
    with pytest.raises(ConfigurationError, match="uvloop is not installed"):
        runtime.run(_loop_module(), event_loop="uvloop")
    # and at start-up, naming the field and its variable
    monkeypatch.setenv("QOSMQ_EVENT_LOOP", "uvloop")
    with pytest.raises(ConfigurationError, match=r"event_loop.*QOSMQ_EVENT_LOOP"):
        Settings.load()


def test_a_bad_event_loop_fails_at_start_up_naming_the_field(monkeypatch) -> None:
    monkeypatch.setenv("QOSMQ_EVENT_LOOP", "trio")
    with pytest.raises(ConfigurationError, match="event_loop"):
        Settings.load()
