"""One contract, both faces: what a client does against a real broker, and what the test
doubles of ``middleware.testing`` do the same way (the tests on ``contract_face``)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pika
import pytest
from prometheus_client import REGISTRY

from middleware.errors import (
    BrokerUnreachable,
    DeadLetter,
    EntityNotFound,
    NotConnected,
    PreconditionFailed,
    Reject,
    Unroutable,
)
from middleware.settings import Settings
from middleware.transport import (
    DEAD_LETTER_QUEUE,
    AsyncClient,
    BindingSpec,
    ExchangeSpec,
    ExchangeType,
    OutgoingMessage,
    QueueKind,
    QueueSpec,
    SyncClient,
)
from middleware.transport.delivery import Action
from middleware.transport.management import management_get
from tests.conftest import Face
from tests.raw_pika import drained

pytestmark = pytest.mark.rabbit


def test_publish_consume_roundtrip(contract_face, name) -> None:
    face = contract_face
    face.call("declare_exchange", ExchangeSpec(name, ExchangeType.DIRECT))
    face.call("declare_queue", QueueSpec(name))
    face.call("bind", BindingSpec(name, name, "k"))
    got: list[bytes] = []
    face.consume(name, lambda d: got.append(d.body))
    for i in range(50):
        face.call("publish", OutgoingMessage(f"m{i}".encode(), name, "k"))
    face.pump(10, until=lambda: len(got) >= 50)
    assert sorted(got) == sorted(f"m{i}".encode() for i in range(50))
    face.call("delete_queue", name)


def test_a_queue_its_own_client_deleted_ends_that_clients_consumers(contract_face, name) -> None:
    """A client that deletes a queue it consumes stops its consumers of it first: they
    are not subscribed again when the queue is declared later (no loop polling for a
    queue that is gone), and the message published after that waits in the new queue.
    Counted by another client (a raw pika connection on the real broker)."""
    face = contract_face
    face.call("declare_queue", QueueSpec(name))
    got: list[bytes] = []
    face.consume(name, lambda d: got.append(d.body))
    face.call("publish", OutgoingMessage(b"before", "", name))
    face.pump(10, until=lambda: got == [b"before"])
    face.call("delete_queue", name)
    face.call("declare_queue", QueueSpec(name))
    face.call("publish", OutgoingMessage(b"after", "", name))
    face.pump(2)  # a re-subscribe (0.1 s, then backing off) would have taken it by now
    assert got == [b"before"]
    if face.double:
        waiting, consumers = face.call("queue_length", name), 0
    else:
        connection = pika.BlockingConnection(pika.URLParameters(face.settings.amqp_urls[0]))
        try:
            ok = connection.channel().queue_declare(name, passive=True).method
            waiting, consumers = ok.message_count, ok.consumer_count
        finally:
            connection.close()
    assert (waiting, consumers) == (1, 0)
    face.call("delete_queue", name)


def test_every_message_property_arrives(contract_face, name) -> None:
    face = contract_face
    """What a publisher sets is what the consumer (and basic.get) reads, on both faces."""
    face.call("declare_queue", QueueSpec(name, kind=QueueKind.CLASSIC, max_priority=9))
    sent = OutgoingMessage(
        b'{"n": 1}',
        "",
        name,
        message_id="m-1",
        headers={"tenant": "t1", "n": 3},
        persistent=True,
        priority=7,
        reply_to="replies",
        correlation_id="c-1",
        expiration_ms=60_000,
        content_type="application/json",
        timestamp=1_763_840_000.9,  # AMQP carries whole seconds
    )
    face.call("publish", sent)
    face.call("publish", sent)
    got = [face.call("get", name)]
    face.consume(name, got.append)
    face.pump(10, until=lambda: len(got) >= 2)
    assert len(got) == 2
    for delivery in got:
        assert delivery is not None
        assert (delivery.body, delivery.queue, delivery.routing_key) == (sent.body, name, name)
        assert delivery.message_id == "m-1"
        assert delivery.headers == {"tenant": "t1", "n": 3}
        assert delivery.persistent
        assert delivery.priority == 7
        assert (delivery.reply_to, delivery.correlation_id) == ("replies", "c-1")
        assert delivery.content_type == "application/json"
        assert delivery.timestamp == 1_763_840_000.0
    face.call("delete_queue", name)


def test_unroutable_and_missing_exchange_are_named_errors(contract_face, name) -> None:
    face = contract_face
    face.call("declare_exchange", ExchangeSpec(name, ExchangeType.DIRECT))
    with pytest.raises(Unroutable):
        face.call("publish", OutgoingMessage(b"x", name, "nobody-bound"))
    with pytest.raises(EntityNotFound):
        face.call("publish", OutgoingMessage(b"x", name + "-missing", "k"))
    # the client recovers its channel: the next publish works
    face.call(
        "declare_queue", QueueSpec(name, kind=QueueKind.CLASSIC, durable=False, auto_delete=False)
    )
    face.call("publish", OutgoingMessage(b"ok", "", name))
    assert face.call("queue_length", name) == 1
    face.call("delete_queue", name)


def test_redeclare_with_other_arguments_is_precondition_failed(contract_face, name) -> None:
    face = contract_face
    face.call("declare_queue", QueueSpec(name))
    with pytest.raises(PreconditionFailed):
        face.call("declare_queue", QueueSpec(name, kind=QueueKind.CLASSIC))
    with pytest.raises(EntityNotFound):
        face.call("queue_length", name + "-missing")
    face.call("delete_queue", name)


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_queue_lengths_and_consumer_checks_open_no_channel_each(kind, name, settings) -> None:
    """Roles and sidecars read a queue length every second and look at each consumer's
    queue every ``consumer_check_s``: on one probe channel per connection (a refused
    read closes it, the next opens another), not a channel opened and closed per read,
    which the broker pays for.  Counted by the broker's own channel churn (its
    statistics lag by up to the collection interval, 5 s)."""
    face = Face(kind, settings.model_copy(update={"consumer_check_s": 0.5}))
    face.call("connect")
    consumed = f"{name}-consumed"
    try:
        face.call("declare_queue", QueueSpec(name))
        face.call("declare_queue", QueueSpec(consumed))
        face.consume(consumed, lambda delivery: None)
        assert face.call("queue_length", name) == 0  # the probe is open from here
        face.pump(STATS_S)  # what earlier tests opened is counted by now (I/O served)
        before = _channels_created(settings)
        for _ in range(20):
            assert face.call("queue_length", name) == 0
        with pytest.raises(EntityNotFound):
            face.call("queue_length", name + "-missing")
        face.call("publish", OutgoingMessage(b"x", "", name))
        assert face.call("queue_length", name) == 1  # read again after the refusal
        face.pump(STATS_S)  # the watchdog looks at the consumer's queue 12 times
        # 22 reads and 12 looks opened 34 channels before the probe channel
        assert _channels_created(settings) - before <= 3
    finally:
        for queue in (name, consumed):
            face.call("delete_queue", queue)
        face.close()


#: the broker's statistics lag by up to its collection interval (5 s)
STATS_S = 6.0


def _channels_created(settings: Settings) -> int:
    overview = management_get(settings, "/api/overview", timeout=10)
    return int(overview["churn_rates"]["channel_created"])


def test_many_refused_passive_declares_at_once_keep_the_connection(settings, name) -> None:
    """Each look at a queue that does not exist is refused on a channel of its own
    (the broker closes it).  Many at once on one connection, round after round (past
    the short-lived channels' 1 024 numbers): every look answers, none loses the
    connection.  Until 2026-12-07 the second round of 30 lost it every time
    ("CHANNEL_ERROR - second 'channel.open' seen"): aiormq freed a refused channel's
    number before answering the broker's close, and dropped that answer when its write
    queue was full, so a channel opened under the number was refused with the whole
    connection (a Phoenix match master's failover in a fresh-clone run)."""

    async def looks() -> None:
        async with AsyncClient(settings=settings) as client:
            for r in range(20):
                names = [f"{name}.none.{r}.{i}" for i in range(60)]
                answers = await asyncio.gather(
                    *map(client.queue_gone, names), return_exceptions=True
                )
                wrong = [repr(a)[:200] for a in answers if a is not True]
                assert not wrong, f"round {r}: {len(wrong)} looks failed: {wrong[:2]}"

    asyncio.run(looks())


def test_a_publish_to_an_exchange_that_does_not_exist_fails_only_itself(settings, name) -> None:
    """Publishes to an exchange that does not exist, each with publishes to a queue in
    flight on the same client at once: the broker closes the shared confirm channel at
    the first refused frame and drops what follows on it.  Each bad publish hears
    ``EntityNotFound``; each good one is confirmed, and the queue holds every one of
    them once.  Until 2026-12-07 every good publish then in flight failed with the bad
    one's 404 (20 of 20 rounds), as if its own queue were gone."""
    rounds, bad_per_round = 20, 10

    async def publishes() -> tuple[list[str], list[str], int]:
        bad_answers: list[str] = []
        good_answers: list[str] = []
        async with AsyncClient(settings=settings) as client:
            await client.declare_queue(QueueSpec(name))

            async def one(body: bytes, exchange: str, into: list[str]) -> None:
                try:
                    await client.publish(OutgoingMessage(body, exchange, name))
                    into.append("confirmed")
                except Exception as exc:
                    into.append(type(exc).__name__)

            for r in range(rounds):
                await asyncio.gather(
                    *(one(b"bad", f"{name}.nope", bad_answers) for _ in range(bad_per_round)),
                    one(b"good %d" % r, "", good_answers),
                )
            held = await client.queue_length(name)
            await client.delete_queue(name)
        return bad_answers, good_answers, held

    bad, good, held = asyncio.run(publishes())
    assert set(bad) == {"EntityNotFound"}, sorted(set(bad))
    assert good == ["confirmed"] * rounds, good
    assert held == rounds


def test_handler_failures_dead_letter_with_reason(contract_face, name) -> None:
    face = contract_face
    face.call("declare_queue", QueueSpec(name))
    seen: list[str] = []

    def handler(d):
        seen.append(d.text())
        if d.text() == "poison":
            raise ValueError("cannot parse")
        if d.text() == "refuse":
            raise DeadLetter("schema v1 not accepted")
        if d.text() == "reject":
            raise Reject("no DLX: dropped by choice")

    face.consume(name, handler)
    before = _drain_dead_letters(face, name)
    for body in (b"poison", b"refuse", b"reject", b"fine"):
        face.call("publish", OutgoingMessage(body, "", name))
    face.pump(10, until=lambda: len(seen) >= 4)
    time.sleep(0.5)
    dead = _drain_dead_letters(face, name)
    assert before == {}
    assert set(dead) == {"poison", "refuse"}
    assert "ValueError: cannot parse" in dead["poison"]
    assert dead["refuse"] == "schema v1 not accepted"
    assert face.call("queue_length", name) == 0
    face.call("delete_queue", name)


def _drain_dead_letters(face, queue: str) -> dict[str, str]:
    out = {}
    face.call("declare_queue", QueueSpec(DEAD_LETTER_QUEUE))
    while (d := face.call("get", DEAD_LETTER_QUEUE)) is not None:
        if d.headers.get("x-qosmq-queue") == queue:
            out[d.text()] = d.headers["x-qosmq-reason"]
    return out


def test_unreachable_cluster_fails_fast_and_clearly() -> None:
    settings = Settings.load(amqp_urls="amqp://127.0.0.1:1/,amqp://127.0.0.1:2/", connect_timeout=1)
    started = time.monotonic()
    with pytest.raises(BrokerUnreachable, match=r"127\.0\.0\.1:1.*127\.0\.0\.1:2"):
        SyncClient(settings=settings).connect()
    import asyncio

    with pytest.raises(BrokerUnreachable, match="cluster status"):
        asyncio.run(AsyncClient(settings=settings).connect())
    assert time.monotonic() - started < 10


def test_failed_connects_leave_no_connection_to_close_later() -> None:
    """A connect that fails is closed at once, on its loop: left to aio-pika's ``__del__``,
    its close() coroutine is made wherever the garbage collector runs and, off the loop,
    never awaited (seen in CI while a proxy refused every link)."""
    import asyncio
    import gc

    import aio_pika

    settings = Settings.load(amqp_urls="amqp://127.0.0.1:1/", connect_timeout=1)

    async def fail_to_connect() -> None:
        for _ in range(3):
            with pytest.raises(BrokerUnreachable):
                await AsyncClient(settings=settings).connect()

    def unclosed() -> set[int]:  # type(), not isinstance(): a dead weakref proxy raises
        return {
            id(o)
            for o in gc.get_objects()
            if issubclass(type(o), aio_pika.Connection) and not o.is_closed
        }

    gc.disable()  # nothing collected before the count below
    try:
        before = unclosed()  # whatever other tests hold open
        asyncio.run(fail_to_connect())
        left = unclosed() - before
    finally:
        gc.enable()
    assert left == set()


def test_use_before_connect_is_named() -> None:
    with pytest.raises(NotConnected, match="connect"):
        SyncClient(settings=Settings.load()).publish(OutgoingMessage(b"x"))


def test_cli_bad_settings_exit_with_the_field(tmp_path) -> None:
    env = {"QOSMQ_PREFETCH": "-3", "PATH": "/usr/bin:/bin"}
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "middleware.cli", "cluster", "status", "--state-dir", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2  # bad input: usage exit code
    assert "prefetch" in proc.stderr and "QOSMQ_PREFETCH" in proc.stderr
    assert time.monotonic() - started < 15


@pytest.mark.parametrize(
    ("coalesce", "event_loop"), [(True, "asyncio"), (False, "asyncio"), (True, "uvloop")]
)
def test_coalesced_writes_lose_nothing_and_share_socket_writes(
    settings, name, coalesce, event_loop
) -> None:
    """A burst of confirmed publishes, consumed and acked on the same connection: every
    message arrives once and the queue ends empty (every ack reached the broker), whether
    the frames of a loop turn share a socket write (default) or each has its own, on
    asyncio's loop and on uvloop's."""
    import asyncio

    from middleware import runtime

    async def main() -> tuple[list[bytes], int, tuple[int, int] | None]:
        custom = settings.model_copy(update={"coalesce_writes": coalesce})
        async with AsyncClient(settings=custom) as client:
            await client.declare_queue(QueueSpec(name, kind=QueueKind.CLASSIC))
            got: list[bytes] = []
            done = asyncio.Event()

            async def handle(delivery) -> None:
                got.append(delivery.body)
                if len(got) == 400:
                    done.set()

            await client.consume(name, handle, prefetch=64)
            await asyncio.gather(
                *(client.publish(OutgoingMessage(f"m{i}".encode(), "", name)) for i in range(400))
            )
            await asyncio.wait_for(done.wait(), 30)
            await asyncio.sleep(0.5)  # the last acks leave
            writes = client.socket_writes
        # closed: a delivery whose ack never reached the broker is ready again now
        async with AsyncClient(settings=settings) as checker:
            left = await checker.queue_length(name)
            await checker.delete_queue(name)
        return got, left, writes

    got, left, writes = runtime.run(main(), event_loop=event_loop)
    assert sorted(got) == sorted(f"m{i}".encode() for i in range(400))
    assert left == 0
    if coalesce:
        assert writes is not None
        frames, socket_writes = writes
        assert frames > 800  # 400 publishes and 400 acks at least
        assert socket_writes < frames  # some turns wrote several frames at once
    else:
        assert writes is None


def _bench(settings: Settings, clients: list[str], *, messages: int, repeats: int) -> list:
    """``qosmq bench transport``'s cells for ``clients``, 64-byte messages, no printing."""
    from qosmq_bench.transport import run_transport

    return run_transport(
        settings,
        clients=clients,
        messages=messages,
        size=64,
        repeats=repeats,
        report=lambda row: None,
    )


def test_transport_bench_runs_every_client_and_reports_its_cost(settings) -> None:
    """``qosmq bench transport``: each client moves every message through the real broker,
    in the order rotated per pass; the layer reports frames per socket write."""
    rows = _bench(settings, ["raw", "layer", "layer-per-frame"], messages=200, repeats=2)
    assert [r["client"] for r in rows] == [
        "raw",
        "layer",
        "layer-per-frame",
        "layer",
        "layer-per-frame",
        "raw",
    ]
    for row in rows:
        assert row["per_s"] > 0 and row["cpu_us_per_message"] > 0
        assert (row["frames_per_write"] is not None) == (row["client"] == "layer")
    assert all(r["frames_per_write"] >= 1 for r in rows if r["client"] == "layer")


def test_transport_bench_runs_a_client_on_the_loop_it_names(settings) -> None:
    """``NAME@LOOP`` cells run on that loop (and say so); bare names on the settings'."""
    custom = settings.model_copy(update={"event_loop": "asyncio"})
    rows = _bench(custom, ["raw@uvloop", "layer@uvloop", "layer"], messages=200, repeats=1)
    assert [(r["client"], r["event_loop"]) for r in rows] == [
        ("raw@uvloop", "uvloop"),
        ("layer@uvloop", "uvloop"),
        ("layer", "asyncio"),
    ]
    assert all(r["messages"] == 200 and r["per_s"] > 0 for r in rows)
    assert rows[1]["frames_per_write"] is not None  # the coalescing writer on uvloop
    with pytest.raises(ValueError, match="event loop must be one of"):
        _bench(custom, ["layer@trio"], messages=1, repeats=1)


def test_transport_bench_measures_the_sync_face_against_raw_pika(settings) -> None:
    """The sync cells publish confirmed one by one and get every message back (a cell that
    misses one raises); they run no event loop, so a loop in their name is refused."""
    rows = _bench(settings, ["raw-pika", "layer-sync"], messages=300, repeats=1)
    assert [(r["client"], r["event_loop"]) for r in rows] == [
        ("raw-pika", None),
        ("layer-sync", None),
    ]
    assert all(
        r["messages"] == 300 and r["per_s"] > 0 and r["cpu_us_per_message"] > 0 for r in rows
    )
    assert all(r["frames_per_write"] is None for r in rows)
    with pytest.raises(ValueError, match="runs no event loop"):
        _bench(settings, ["layer-sync@uvloop"], messages=1, repeats=1)


def test_short_operations_leave_nothing_behind(settings, name) -> None:
    """Queue lengths, gets, declares and deletes each run on a channel of their own (a
    refused one closes only it). Roles and sidecars read queue lengths every second for
    as long as they run, so each such channel must leave nothing behind: with aio-pika's
    channels on aiormq 7, each one left three futures on the connection for good
    (600 after these 200 operations; sidecars grew ~4 kB/s)."""
    import asyncio
    import gc

    async def main() -> tuple[int, int]:
        def futures() -> int:
            gc.collect()
            # type(), not isinstance(): a dead weakref.proxy raises on __class__
            return sum(issubclass(type(o), asyncio.Future) for o in gc.get_objects())

        async with AsyncClient(settings=settings) as client:
            await client.declare_queue(QueueSpec(name, kind=QueueKind.CLASSIC))
            await client.queue_length(name)
            before = futures()
            for _ in range(50):
                await client.queue_length(name)
                assert await client.get(name) is None
                await client.declare_queue(QueueSpec(f"{name}-x", kind=QueueKind.CLASSIC))
                await client.delete_queue(f"{name}-x")
            after = futures()
            await client.delete_queue(name)
            return before, after

    before, after = asyncio.run(main())
    assert after - before < 20, f"{after - before} futures left by 200 operations"


def test_a_settle_on_a_dead_channel_is_requeue_and_the_face_goes_on(face, name) -> None:
    """The broker closes a consumer's channel while its handler runs (an ack with a tag it
    never gave, 406): the settle meets a dead channel. Both faces (one logic in
    ``transport.consuming``) report REQUEUE to the hook, raise nothing into their loop,
    keep their connection, and subscribe the consumer again, so the requeued message is
    handled again and every message ends acked once."""
    face.call("declare_queue", QueueSpec(name))
    settled: list[tuple[bytes, Action]] = []
    handled: list[bytes] = []
    tag = f"{name}-consumer"
    client = face.client
    connection = client._live.connection
    for i in range(3):
        face.call("publish", OutgoingMessage(f"m{i}".encode(), "", name))

    if face.kind == "async":

        async def handler(delivery) -> None:
            handled.append(delivery.body)
            if len(handled) == 1:
                channel = await client._live.consumer_channels[tag].get_underlay_channel()
                await channel.basic_ack(10**6)  # the broker closes the channel: 406
                while not channel.is_closed:  # noqa: ASYNC110 (aiormq has no event)
                    await asyncio.sleep(0.01)

        async def hook(delivery, outcome) -> None:
            settled.append((delivery.body, outcome.action))

        face.loop.run(client.consume(name, handler, prefetch=1, tag=tag, on_settled=hook))
    else:

        def handler(delivery) -> None:
            handled.append(delivery.body)
            if len(handled) == 1:
                channel = client._live.consumer_channels[tag]
                channel.basic_ack(10**6)
                deadline = time.monotonic() + 5
                while channel.is_open and time.monotonic() < deadline:
                    channel.connection.sleep(0.01)

        client.consume(
            name,
            handler,
            prefetch=1,
            tag=tag,
            on_settled=lambda d, o: settled.append((d.body, o.action)),
        )
    acked = lambda: sorted(b for b, a in settled if a is Action.ACK)  # noqa: E731
    face.pump(15, until=lambda: len(acked()) >= 3)
    assert settled[0] == (b"m0", Action.REQUEUE)
    assert acked() == [b"m0", b"m1", b"m2"]  # the requeued one handled again, none twice
    assert handled.count(b"m0") == 2
    assert client._live.connection is connection  # the face kept its connection
    face.call("delete_queue", name)


def test_a_sync_run_wakes_once_per_step_it_was_given(settings) -> None:
    """``run(step_s=...)``: a thread that only publishes (the Phoenix beats) wakes once
    per its own interval, not every 0.1 s; without it, every 0.1 s as before."""
    looks: list[float] = []

    def until() -> bool:
        looks.append(time.monotonic())
        return False

    with SyncClient(settings=settings) as client:
        client.run(1.0, until=until, step_s=0.5)
        slow = len(looks)
        looks.clear()
        client.run(1.0, until=until)
        default = len(looks)
    assert slow <= 4, f"asked {slow} times in 1 s with 0.5 s steps"
    assert default >= 8, f"asked {default} times in 1 s with the default 0.1 s steps"


def test_a_connected_client_used_as_a_context_keeps_its_one_connection(settings) -> None:
    """``with SyncClient(...).connect() as c`` and ``async with await c.connect()``: the
    context does not open a second connection (the first was left open, unclosed)."""
    client = SyncClient(settings=settings).connect()
    live = client._live
    with client as same:
        assert same is client and client._live is live
    assert client._live is None

    async def aio() -> None:
        client = await AsyncClient(settings=settings).connect()
        live = client._live
        async with client as same:
            assert same is client and client._live is live
        assert not client.ready

    asyncio.run(aio())


@pytest.mark.parametrize("room", [True, False], ids=["room-made", "still-full"])
@pytest.mark.parametrize("kind", ["async", "sync"])
def test_a_refused_unconfirmed_publish_waiting_to_go_again_is_not_dropped_by_close(
    kind, room, settings, name
) -> None:
    """A queue full under ``reject-publish`` nacks an unconfirmed publish; the client
    sends it again after its retry pause (``watch.py``).  Closed during that pause,
    before: the close dropped the resend and said nothing (the message lost).  Now the
    close lets the watched channel settle first, up to ``close_grace``: with room made
    meanwhile the message is in the queue; still full, the close ends at ``close_grace``
    and the message is counted and logged as given up.  Read by a raw pika connection."""
    pause = 2.0  # the resends go at 2.0, 4.0, ... s; the close runs from 0.5 to 3.5 s
    patient = settings.model_copy(
        update={
            "retry": settings.retry.model_copy(
                update={"initial_delay": pause, "max_delay": pause, "jitter": 0.0}
            ),
            "close_grace": 3.0,
        }
    )
    face = Face(kind, patient)
    face.call("connect")
    face.call(
        "declare_queue",
        QueueSpec(
            name,
            kind=QueueKind.CLASSIC,
            max_length=1,
            arguments={"x-overflow": "reject-publish"},
        ),
    )
    url = settings.amqp_urls[0]
    closed = False
    try:
        face.call("publish", OutgoingMessage(b"a", "", name, message_id="a"))  # confirmed
        face.call("publish", OutgoingMessage(b"b", "", name, message_id="b"), confirm=False)
        time.sleep(0.5)  # the nack is back; the resend waits for its pause
        if kind == "sync":
            face.client.poll()  # reads the nack (the asyncio core read it meanwhile)
        if room:
            assert [p.message_id for p, _ in drained(url, name)] == ["a"]
        given_up = REGISTRY.get_sample_value("qosmq_unconfirmed_given_up_total") or 0.0
        started = time.monotonic()
        face.close()
        closed, took = True, time.monotonic() - started
        given_up = (REGISTRY.get_sample_value("qosmq_unconfirmed_given_up_total") or 0) - given_up
        left = [p.message_id for p, _ in drained(url, name)]
    finally:
        if not closed:
            face.close()
        with SyncClient(settings=settings) as admin:
            admin.delete_queue(name)
    print(
        f"\n{kind}, room {room}: close took {took:.2f} s, queue holds {left}, given up {given_up}"
    )
    if room:
        assert left == ["b"], "the refused publish was dropped by the close"
        assert given_up == 0
    else:
        assert left == ["a"]
        assert given_up == 1, "a publish the close gave up on was not counted"
        assert took < patient.close_grace + 2.0, f"close took {took:.1f} s"
