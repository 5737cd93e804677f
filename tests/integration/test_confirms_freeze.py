"""E2e confirms with the publisher or the consumer frozen (SIGSTOP), on both faces.

A process that stops running for a while (a VM pause, a long GC, a laptop lid, SIGSTOP)
keeps its connections: nothing fails over, the broker holds what it gave it, and its
timers are all overdue when it runs again.  The promises:

- a publisher frozen for longer than its whole receipt budget (``receipt_timeout`` times
  ``max_attempts``) confirms every message once it runs again: the receipts that
  arrived meanwhile count, no message is failed for the pause;
- a consumer frozen for longer than ``receipt_timeout`` but within the budget makes the
  publisher resend (the broker counts more publishes than messages) and every message
  is still confirmed and handled once;
- a consumer frozen past the budget gets its messages a named ``ReceiptTimeout`` and
  nothing else: each of them is still handled, once, after it runs again.

Publisher and consumer are processes of their own (``tests/e2e_processes.py``);
the test counts what each handled from its own file and the publishes from the broker
(its firehose tracer).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pika
import pytest

from middleware.localcluster.manager import LocalCluster
from middleware.settings import Settings
from middleware.transport import QueueKind, QueueSpec, SyncClient
from middleware.transport.management import management_get, vhost_path
from tests.processes import spawn_ready, stop

pytestmark = [pytest.mark.rabbit, pytest.mark.chaos]

COUNT, RATE = 300, 50.0
MODULE = "tests.e2e_processes"

#: (who is frozen, seconds, receipt_timeout, max_attempts)
CASES = {
    "publisher past its budget": ("publisher", 5.0, 1.0, 3),
    "consumer within the budget": ("consumer", 2.5, 1.5, 4),
    "consumer past the budget": ("consumer", 5.0, 1.0, 3),
}


def _handled(path: Path) -> Counter[str]:
    return (
        Counter(line.split()[1] for line in path.read_text().splitlines())
        if path.exists()
        else Counter()
    )


@contextlib.contextmanager
def _broker_publishes(
    settings: Settings, cluster: LocalCluster | None, queue: str
) -> Iterator[Callable[[], int]]:
    """The broker's own count of publishes routed to ``queue``, by its firehose tracer
    (``rabbitmqctl trace_on`` on every node; a tap queue on ``amq.rabbitmq.trace``,
    read with plain pika).  Without a local cluster to run ``rabbitmqctl`` on, the
    management API's statistics, which lag (over a minute on a busy CI runner)."""
    if cluster is None:
        path = f"/api/queues/{vhost_path(settings)}/{queue}"

        def from_statistics() -> int:
            time.sleep(10)  # the statistics come every 5 s
            stats: dict[str, Any] = management_get(settings, path).get("message_stats") or {}
            return int(stats.get("publish", 0))

        yield from_statistics
        return
    tap = f"{queue}.tap"
    names = [node.short_name for node in cluster.layout.nodes]

    def on_every_node(*args: str) -> None:
        with ThreadPoolExecutor(len(names)) as pool:
            list(pool.map(lambda node: cluster.ctl(node, *args, "-p", settings.vhost), names))

    params = pika.URLParameters(settings.amqp_urls[0])
    params.credentials = pika.PlainCredentials(
        settings.username, settings.password.get_secret_value()
    )
    params.virtual_host = settings.vhost
    connection = pika.BlockingConnection(params)
    channel = connection.channel()
    channel.queue_declare(tap, exclusive=True)
    channel.queue_bind(tap, "amq.rabbitmq.trace", "publish.#")
    on_every_node("trace_on")

    def from_tracer() -> int:
        on_every_node("trace_off")
        count = 0
        while True:
            method, props, _ = channel.basic_get(tap, auto_ack=True)
            if method is None:
                return count
            count += list((props.headers or {}).get("routing_keys") or []) == [queue]

    try:
        yield from_tracer
    finally:
        with contextlib.suppress(Exception):
            on_every_node("trace_off")
        with contextlib.suppress(Exception):
            connection.close()


@pytest.mark.parametrize("face", ["async", "sync"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_frozen_e2e_process_loses_nothing_and_handles_nothing_twice(
    case: str, face: str, settings: Settings, brokers: Any, name: str, tmp_path: Path
) -> None:
    frozen, freeze_s, receipt_timeout, attempts = CASES[case]
    env = {
        **os.environ,
        "QOSMQ_AMQP_URLS": ",".join(brokers.urls),
        "QOSMQ_CONFIRMS__RECEIPT_TIMEOUT": str(receipt_timeout),
        "QOSMQ_CONFIRMS__MAX_ATTEMPTS": str(attempts),
    }
    with SyncClient(settings=settings) as admin:
        admin.declare_queue(QueueSpec(name, kind=QueueKind.CLASSIC))
    handled_file, published_file = tmp_path / "handled", tmp_path / "published"
    tap = contextlib.ExitStack()
    broker_publishes: Callable[[], int] = lambda: -1  # noqa: E731
    if frozen == "consumer":  # the broker counts the resends
        broker_publishes = tap.enter_context(_broker_publishes(settings, brokers.cluster, name))
    consumer = spawn_ready(MODULE, "consumer", face, name, str(handled_file), env=env)
    publisher = None
    try:
        args = (face, name, str(published_file), str(COUNT), str(RATE))
        publisher = spawn_ready(MODULE, "publisher", *args, env=env)
        time.sleep(1.5)  # a part of the stream confirmed before the freeze
        target = publisher if frozen == "publisher" else consumer
        os.kill(target.pid, signal.SIGSTOP)
        time.sleep(freeze_s)
        os.kill(target.pid, signal.SIGCONT)
        assert publisher.wait(120) == 0
        deadline = time.monotonic() + 30
        while len(_handled(handled_file)) < COUNT and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(receipt_timeout)  # a late duplicate would show by now
    finally:
        for proc in (publisher, consumer):
            if proc is not None:
                stop(proc)
        with tap:
            publishes = broker_publishes()
    rows = [json.loads(line) for line in published_file.read_text().splitlines()]
    assert rows[-1] == ["done"]
    confirmed = {row[1] for row in rows if row[0] == "ok"}
    failed = {row[1]: row[2] for row in rows if row[0] == "err"}
    handled = _handled(handled_file)
    assert len(confirmed) + len(failed) == COUNT
    assert confirmed <= set(handled), "a confirmed message was never handled"
    assert set(handled) == {f"m{i}" for i in range(COUNT)}, "a message was never handled"
    assert max(handled.values()) == 1, "a handler ran twice for one message"
    if case == "consumer past the budget":
        assert failed, "the freeze outlasted the budget: some publishes must have failed"
        assert all(error.startswith("ReceiptTimeout(") for error in failed.values()), failed
    else:
        assert failed == {}
    if frozen == "consumer":
        # the freeze outlasted a receipt timeout: the publisher resent, the broker saw it
        assert publishes > COUNT, f"the broker counted {publishes} publishes"
    with SyncClient(settings=settings) as admin:
        admin.delete_queue(name)
