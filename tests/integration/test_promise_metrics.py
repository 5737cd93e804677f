"""The confirm promises' metrics, on both faces against the real brokers: each publish
counted once by how it ended, its confirm time observed, refusals and silent queues by
queue, resends, duplicates answered without the handler, and the scrape that shows them.

The counts are process-wide (Prometheus' registry), so each check reads a delta, and
what the test itself saw (confirms returned, errors raised, handler runs) is the
independent count the metrics must equal."""

from __future__ import annotations

import time
import urllib.request
from collections import Counter

import pytest
from prometheus_client import REGISTRY

from middleware.errors import NegativeReceipt, ReceiptTimeout, Reject
from middleware.observability import start_metrics_server
from middleware.transport import BindingSpec, Delivery, QueueKind, QueueSpec
from tests.integration.test_confirms import E2E, _declare_async, _declare_sync, _fanout, _fast

pytestmark = pytest.mark.rabbit


def _value(series: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(series, labels) or 0.0


def _snapshot(queues: list[str]) -> dict[str, float]:
    out = {
        f"confirms.{o}": _value("qosmq_confirms_total", mode="e2e", outcome=o)
        for o in ("confirmed", "negative", "receipt_timeout")
    }
    out["seconds.count"] = _value("qosmq_confirm_seconds_count", mode="e2e")
    out["resends"] = _value("qosmq_e2e_resends_total", mode="e2e")
    for q in queues:
        out[f"negative.{q}"] = _value("qosmq_e2e_negative_receipts_total", queue=q)
        out[f"timeouts.{q}"] = _value("qosmq_e2e_receipt_timeouts_total", queue=q)
        out[f"dups.{q}"] = _value("qosmq_e2e_duplicates_suppressed_total", queue=q)
        for action in ("ack", "reject", "dead-letter"):
            out[f"settled.{q}.{action}"] = _value("qosmq_e2e_settled_total", queue=q, action=action)
    return out


@pytest.mark.parametrize("face", ["async", "sync"])
def test_every_e2e_outcome_is_counted_once_where_it_happened(face, settings, name) -> None:
    ok, picky, silent = f"{name}.ok", f"{name}.picky", f"{name}.silent"
    e2e = E2E(face, _fast(settings), _fanout(name, [ok, picky]))
    runs: Counter[str] = Counter()

    def handler(d: Delivery) -> None:
        runs[d.queue] += 1
        if d.queue == picky and d.text() == "bad":
            raise Reject("not this one")

    before = _snapshot([ok, picky, silent])
    confirmed = negative = timed_out = 0
    try:
        e2e.consume([ok, picky], handler)
        for i in range(5):
            e2e.publish(f"m{i}".encode(), exchange=name)
            confirmed += 1
        e2e.publish(b"again", exchange=name, message_id=f"{name}-dup")
        e2e.publish(b"again", exchange=name, message_id=f"{name}-dup")  # answered, not run
        confirmed += 2
        with pytest.raises(NegativeReceipt):
            e2e.publish(b"bad", exchange=name)
        negative += 1
        for spec in (QueueSpec(silent, kind=QueueKind.CLASSIC), BindingSpec(silent, name)):
            if face == "async":
                e2e.loop.run(_declare_async(e2e.pub_client, spec))
            else:
                _declare_sync(e2e.pub_client, spec)
        with pytest.raises(ReceiptTimeout):
            e2e.publish(b"late", exchange=name)
        timed_out += 1
        time.sleep(0.3)  # the consumers' settle counts of the last copies
    finally:
        e2e.close()
    after = _snapshot([ok, picky, silent])
    delta = {k: after[k] - before[k] for k in after}
    assert delta["confirms.confirmed"] == confirmed == delta["seconds.count"]
    assert delta["confirms.negative"] == negative == delta[f"negative.{picky}"]
    assert delta["confirms.receipt_timeout"] == timed_out == delta[f"timeouts.{silent}"]
    assert delta["resends"] >= 1  # max_attempts 2: the silent queue's message went twice
    # the same id again, and each resend of "late" (which both queues had handled)
    assert delta[f"dups.{ok}"] == delta[f"dups.{picky}"] == 1 + delta["resends"]
    # each handler run settled once: ack, or the rejection
    assert delta[f"settled.{picky}.reject"] + delta[f"settled.{picky}.dead-letter"] == 1
    handled = {
        q: sum(delta[f"settled.{q}.{a}"] for a in ("ack", "reject", "dead-letter"))
        for q in (ok, picky)
    }
    assert handled == {ok: runs[ok], picky: runs[picky]}, (handled, runs)


def test_the_scrape_shows_the_promise_series(settings, name) -> None:
    e2e = E2E("async", _fast(settings), _fanout(name, [f"{name}.q"]))
    try:
        e2e.consume([f"{name}.q"], lambda d: None)
        e2e.publish(b"x", exchange=name)
    finally:
        e2e.close()
    port = start_metrics_server(port=0)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for series in (
        'qosmq_confirm_seconds_bucket{le="0.1",mode="e2e"}',
        'qosmq_confirms_total{mode="e2e",outcome="confirmed"}',
        f'qosmq_e2e_settled_total{{action="ack",queue="{name}.q"}}',
    ):
        assert series in text, series
