"""OpenTelemetry tracing of the layer's traffic: an optional extra (``qosmq[tracing]``).

When ``opentelemetry-api`` is installed and the process has set a tracer provider (the
SDK's, configured by the service; or one given to :func:`use`), every publish of either
client is a PRODUCER span ``<exchange> publish`` whose context travels in the message's
headers (W3C
``traceparent``/``tracestate``), every delivery a handler runs is a CONSUMER span ``<queue>
process`` under the context the message carried (the handler, the settle and the settle
hook inside it), and each e2e receipt a consumer owes is a ``<queue> receipt`` span under
that: one e2e publish yields publish -> process (per consumer) -> receipt.  A message the
spool held is published at its drain under the context it was accepted in.  Attributes
follow the messaging semantic conventions (``messaging.system = rabbitmq``,
``messaging.operation.type``, ``messaging.destination.name``, ``messaging.message.id``,
``messaging.rabbitmq.destination.routing_key``).

Without the package, or before a provider is set, each hook is one check and does
nothing.  A ``traceparent`` that does not parse (another client's, or garbage) is ignored:
the delivery is processed in a trace of its own, and one log line per queue says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the transport imports this module: no import back at run time
    from .transport.delivery import Delivery
    from .transport.message import OutgoingMessage

try:
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace

    _INSTALLED = True
except ImportError:  # pragma: no cover - the extra is installed in the tests
    _INSTALLED = False

__all__ = [
    "TRACE_HEADERS",
    "active",
    "configure_process",
    "injected",
    "process",
    "publish",
    "receipt",
    "resumed",
    "span",
    "use",
]

log = logging.getLogger(__name__)
TRACE_HEADERS = ("traceparent", "tracestate")
_warned: set[str] = set()
_provider: Any = None  # the layer's own tracer provider (``use``), else the global one
_global_set = False  # the process's global tracer provider was found set (``active``)
_unset_until = 0.0  # (monotonic) found unset: not asked again before this
#: how long ``active`` trusts that no global provider is set before it asks again
RECHECK_S = 1.0


def use(provider: Any) -> None:
    """Trace the layer's traffic with ``provider`` (an SDK ``TracerProvider``) instead of
    the process's global one; ``None``: back to the global one."""
    global _provider
    _provider = provider


def active() -> bool:
    """Tracing is on: the package is there and a tracer provider was given (``use``) or
    set for the process.  A process's global provider is set once and never unset, so
    once found it is not asked for again, and while none is set it is asked at most once
    every ``RECHECK_S`` (asking reads the environment: 1-2 % of a Phoenix role's CPU
    when it was asked on every publish and delivery)."""
    global _global_set, _unset_until
    if not _INSTALLED:
        return False
    if _provider is not None or _global_set:
        return True
    now = time.monotonic()
    if now < _unset_until:
        return False
    _global_set = not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    _unset_until = now + RECHECK_S
    return _global_set


def _tracer() -> Any:
    return (_provider or trace.get_tracer_provider()).get_tracer("qosmq")


def _attributes(operation: str, destination: str, message_id: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "messaging.system": "rabbitmq",
        "messaging.operation.type": operation,
        "messaging.destination.name": destination,
    }
    if message_id:
        out["messaging.message.id"] = message_id
    return out


@contextlib.contextmanager
def publish(message: OutgoingMessage) -> Iterator[OutgoingMessage]:
    """A PRODUCER span around a publish; yields the message carrying its context."""
    if not active():
        yield message
        return
    destination = message.exchange or "amq.default"
    attributes = _attributes("send", destination, message.message_id)
    attributes["messaging.rabbitmq.destination.routing_key"] = message.routing_key
    attributes["messaging.message.body.size"] = len(message.body)
    with _tracer().start_as_current_span(
        f"{destination} publish", kind=trace.SpanKind.PRODUCER, attributes=attributes
    ):
        headers = {k: v for k, v in message.headers.items() if k not in TRACE_HEADERS}
        propagate.inject(headers)
        yield dataclasses.replace(message, headers=headers)


def _carried(headers: Mapping[str, Any], where: str) -> Any:
    """The context ``headers`` carry (None: none, or one that did not parse)."""
    raw = headers.get("traceparent")
    if raw is None:
        return None
    carrier = {k: v for k in TRACE_HEADERS if isinstance(v := headers.get(k), str)}
    extracted = propagate.extract(carrier)
    if trace.get_current_span(extracted).get_span_context().is_valid:
        return extracted
    if where not in _warned:
        _warned.add(where)
        log.warning(
            "ignoring a traceparent that does not parse on %s (%r): such deliveries are "
            "traced on their own",
            where,
            str(raw)[:80],
        )
    return None


@contextlib.contextmanager
def process(delivery: Delivery) -> Iterator[None]:
    """A CONSUMER span around a delivery's handling (handler, settle, settle hook)."""
    if not active():
        yield
        return
    parent = _carried(delivery.headers, delivery.queue)
    attributes = _attributes("process", delivery.queue, delivery.message_id)
    attributes["messaging.rabbitmq.destination.routing_key"] = delivery.routing_key
    with _tracer().start_as_current_span(
        f"{delivery.queue} process",
        context=parent,
        kind=trace.SpanKind.CONSUMER,
        attributes=attributes,
    ):
        yield


@contextlib.contextmanager
def span(name: str, attributes: Mapping[str, Any]) -> Iterator[None]:
    """An INTERNAL span around a step of the layer's own (a Phoenix match's delivery)."""
    if not active():
        yield
        return
    with _tracer().start_as_current_span(name, attributes=dict(attributes)):
        yield


def receipt(delivery: Delivery, ok: bool) -> None:
    """The e2e receipt a consumer owes for ``delivery`` (a span under its process span)."""
    if not active():
        return
    attributes = _attributes("settle", delivery.queue, delivery.message_id)
    attributes["qosmq.receipt.ok"] = ok
    with _tracer().start_as_current_span(f"{delivery.queue} receipt", attributes=attributes):
        pass


def injected(headers: Mapping[str, Any]) -> dict[str, Any]:
    """``headers`` with the current context added (a message accepted now, sent later)."""
    out = dict(headers)
    if active():
        propagate.inject(out)
    return out


@contextlib.contextmanager
def resumed(headers: Mapping[str, Any], where: str) -> Iterator[None]:
    """Run the block in the context ``headers`` carry (a spooled message's drain)."""
    parent = _carried(headers, where) if active() else None
    if parent is None:
        yield
        return
    token = otel_context.attach(parent)
    try:
        yield
    finally:
        otel_context.detach(token)


def configure_process(trace_file: Any) -> bool:
    """For the layer's own processes: every span appended as a JSON line to
    ``trace_file`` (the SDK's console exporter on that file).  False, with one log line,
    when the SDK is not installed."""
    if trace_file is None:
        return False
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
    except ImportError:
        log.warning("trace_file %s ignored: opentelemetry-sdk is not installed", trace_file)
        return False
    out = open(trace_file, "a", buffering=1)  # noqa: SIM115 - lives as long as the process
    exporter = ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(indent=None) + "\n")
    provider = TracerProvider(resource=Resource.create({"service.name": "qosmq"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    use(provider)
    return True
