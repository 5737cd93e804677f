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


def test_an_unset_global_provider_is_asked_for_at_most_once_per_recheck(monkeypatch) -> None:
    import middleware.tracing as tracing

    asked: list[object] = []
    provider: list[object] = [tracing.trace.ProxyTracerProvider()]

    def get_tracer_provider() -> object:
        asked.append(provider[0])
        return provider[0]

    monkeypatch.setattr(tracing.trace, "get_tracer_provider", get_tracer_provider)
    monkeypatch.setattr(tracing, "_global_set", False)
    monkeypatch.setattr(tracing, "_unset_until", 0.0)
    clock = [100.0]
    monkeypatch.setattr(tracing.time, "monotonic", lambda: clock[0])
    assert not any(tracing.active() for _ in range(1000))
    assert len(asked) == 1  # not on every publish and delivery
    provider[0] = object()  # the application sets its provider
    clock[0] += tracing.RECHECK_S / 2
    assert not tracing.active() and len(asked) == 1
    clock[0] += tracing.RECHECK_S
    assert tracing.active() and tracing.active()  # seen within RECHECK_S, then kept
    assert len(asked) == 2
