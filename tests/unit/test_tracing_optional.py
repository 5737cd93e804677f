"""Without OpenTelemetry installed, tracing is off and every hook does nothing."""

from __future__ import annotations

import importlib
import sys

from middleware.transport.delivery import Delivery
from middleware.transport.message import OutgoingMessage


def test_without_the_package_every_hook_is_a_no_op(monkeypatch) -> None:
    import middleware.tracing as tracing

    for name in ("opentelemetry", "opentelemetry.context", "opentelemetry.propagate"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    bare = importlib.reload(tracing)
    try:
        assert not bare.active()
        message = OutgoingMessage(b"x", "", "q", headers={"a": 1})
        with bare.publish(message) as sent:
            assert sent is message
        delivery = Delivery(b"x", "q", headers={"traceparent": "garbage"})
        with bare.process(delivery):
            pass
        bare.receipt(delivery, True)
        assert bare.injected({"a": 1}) == {"a": 1}
        with bare.resumed({"traceparent": "00-x"}, "q"):
            pass
    finally:
        monkeypatch.undo()
        importlib.reload(tracing)
