"""``qosmq bench phoenix --experiment chaos --seed N``: the subscribers' promises under
every fault kind, both client faces and both confirm modes at once.

Three clusters by default (A, B, C; a routing slave and a match slave each), four
subscribers homed at A, one per cell of {asyncio, sync} x {broker, e2e}, each with
filters of its own over the attributes ``x`` (0..99) and ``k`` (a short text).  Events
of two types B owns (and one C owns) are published at B and C alternately at ``rate``/s.
Then one fault per window, in an order the seed picks:

- ``router``, ``router_slave``, ``match``, ``match_slave``: that role of B SIGKILLed;
- ``freeze``: B's match master SIGSTOPped past detection (``freeze_s``), then SIGCONT;
- ``node``: a RabbitMQ node SIGKILLed and started again (needs a local cluster);
- ``silent``: the asyncio e2e subscriber stops consuming for the window, then resumes;
- ``cut``, ``blackhole``: the link from B to C (B's roles' connections to C's RabbitMQ go
  through a fault-injecting proxy, as every inter-cluster link does in a run with link
  faults) refuses and resets connections, or holds them open carrying nothing, for
  ``link_down_s``; ``cut_both``: B to C and C to B;
- ``leave``: the last cluster other than B and C (D of four, A of three) goes whole (its
  roles SIGKILLed, its links cut) and joins again ``AWAY_S`` later; a type of its arc is
  in the stream.  Copies for its own subscribers meanwhile are dead-lettered with
  ``HOME_LEFT`` (read from a queue of the harness's own): counted ``dead_lettered``.

With link faults the subscribers are homed at A and C over three clusters (two each, one
per face), over four or more every cell at C and once more at another cluster, so B's
match broker delivers copies across the faulted link, events published at B for C's type
are routed around it, and every cluster is some subscriber's home;

and in every window a subscribe and an unsubscribe are sent just after the fault.
Every subscriber counts what it receives; the harness evaluates the filters itself (its
own small evaluator, not the layer's matcher) and knows when each subscription was
confirmed and each unsubscribe sent.  Per window and subscriber: ``expected`` (events
published while a matching subscription stood), ``delivered``, ``lost``, ``duplicated``
(an e2e subscriber must see none) and ``unexpected`` (a delivery no subscription
explains: none matching stood or was being made when the event was published, nor when
its copy arrived — an event that waited in a killed router's inbox may be matched by a
subscription sent after it was published, which the subscriber asked for before the copy
came).  Events published while one of the queue's
subscriptions was being made or removed are ``uncertain``: counted neither way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import queue as queue_module
import random
import signal
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from middleware import runtime
from middleware.errors import MiddlewareError
from middleware.localcluster import FaultProxy, LocalCluster
from middleware.routing import (
    PhoenixClient,
    RoleId,
    SyncPhoenixClient,
)
from middleware.settings import Settings
from middleware.transport import (
    DEAD_LETTER_EXCHANGE,
    AsyncClient,
    BindingSpec,
    ExchangeSpec,
    ExchangeType,
    QueueKind,
    QueueSpec,
    SyncClient,
)

from .chaos_judge import (
    Condition,
    Subscriber,
    Subscription,
    problems,
    summarize,
    window_rows,
)
from .node_fault import NodeBounce
from .phoenix_deploy import CLUSTERS, Deployment
from .phoenix_recovery import _serving, _wait_all_served

log = logging.getLogger(__name__)

__all__ = ["FAULTS", "LINK_FAULTS", "problems", "run_chaos", "summarize"]

FAULTS = ("router", "router_slave", "match", "match_slave", "freeze", "node", "silent")
LINK_FAULTS = ("cut", "blackhole", "cut_both", "leave")
#: where each subscriber (CELLS' order) is homed in a run with link faults (3 clusters)
LINK_HOMES = ("C", "A", "A", "C")
LINK_DOWN_S = 3.0
#: how long the leaving cluster stays away before it joins again (past ``leave_after_s``)
AWAY_S = 6.0
CELLS = (("async", "broker"), ("async", "e2e"), ("sync", "broker"), ("sync", "e2e"))
TEXTS = ("AB", "AC", "BD", "CE")


class _SyncSide:
    """A sync subscriber: its own thread runs its SyncPhoenixClient (pika is used by one
    thread only); subscribe and unsubscribe are handed to that thread."""

    def __init__(self, settings: Settings, deployment: Deployment, sub: Subscriber) -> None:
        self.settings, self.deployment, self.sub = settings, deployment, sub
        self.todo: queue_module.Queue[Callable[[SyncPhoenixClient], None]] = queue_module.Queue()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        try:
            client = SyncPhoenixClient(
                SyncClient(settings=self.settings).connect(),
                topology=self.deployment.topology,
                cluster=self.sub.home,
            )
            while not self.stop.is_set():
                while not self.todo.empty():
                    self.todo.get()(client)
                client.run(0.05)
            client.close()
        except BaseException as exc:  # the run reports it; a sync face must not die
            log.error("sync subscriber %s died", self.sub.name, exc_info=exc)
            self.error = exc


class _Chaos:
    def __init__(
        self,
        settings: Settings,
        deployment: Deployment,
        cluster: LocalCluster | None,
        rng: random.Random,
        prefix: str,
        proxies: dict[tuple[str, str], FaultProxy] | None = None,
        leave: bool = False,
    ) -> None:
        self.settings, self.deployment, self.cluster, self.rng = settings, deployment, cluster, rng
        self.proxies = proxies or {}
        #: the ``node`` fault (the last node of the local cluster), made on first use
        self._bounce: NodeBounce | None = None
        ring = deployment.ring

        def owned(owner: str) -> list[str]:
            return [t for t in (f"chaos{i}" for i in range(10_000)) if ring.owner(t) == owner]

        #: the cluster the ``leave`` fault removes and brings back (neither publisher B
        #: nor C, whose link the other faults break): D of four, A of three
        self.leaving = next(c for c in reversed(deployment.clusters) if c not in ("B", "C"))
        self.types = [*owned("B")[:2], owned("C")[0]]
        if leave:  # a type of the leaving cluster's arc: its take-over and hand-back
            self.types.append(owned(self.leaving)[0])
        self.subs = [
            Subscriber(f, c, f"{prefix}.{f}-{c}-{home.lower()}", home)
            for (f, c), home in self.homes(deployment.clusters)
        ]
        #: every event's witness (not a row): its copy bounds when the event was matched,
        #: also where no subscriber's filter took it (see ``_raced_its_unsubscribe``)
        self.witness = Subscriber("async", "broker", f"{prefix}.witness", "B")
        #: dead letters of events (event id -> reasons), from the harness's own queue
        self.dead: dict[str, list[str]] = {}
        self.sync_sides: dict[str, _SyncSide] = {}
        self.published: dict[str, tuple[str, dict[str, Any], float]] = {}
        self.async_client: AsyncClient | None = None
        self.at_home: dict[str, PhoenixClient] = {}
        self.consumer_tags: dict[str, str] = {}

    def homes(self, clusters: Sequence[str]) -> list[tuple[tuple[str, str], str]]:
        """(cell, home) per subscriber: all at A without proxies; with link faults over
        three clusters two at A and two at C; over four or more every cell at C (across
        the faulted link B->C) and once more at another cluster, so every cluster is
        some subscriber's home."""
        if not self.proxies:
            return [(cell, "A") for cell in CELLS]
        if len(clusters) < 4:
            return list(zip(CELLS, LINK_HOMES, strict=True))
        # the last first: the leaving cluster (D of four) gets two, one per face and mode
        others = [c for c in reversed(clusters) if c != "C"]
        return [(cell, "C") for cell in CELLS] + [
            (cell, others[i % len(others)]) for i, cell in enumerate(CELLS)
        ]

    def new_conditions(self) -> tuple[str, list[Condition]]:
        event_type = self.rng.choice(self.types)
        choice = self.rng.randrange(3)
        if choice == 0:
            return event_type, [("x", "<", self.rng.randrange(20, 80))]
        if choice == 1:
            return event_type, [("k", "prefix", self.rng.choice("ABC")), ("x", ">=", 10)]
        return event_type, [("k", "=", self.rng.choice(TEXTS))]

    # --------------------------------------------------------- subscribing
    async def subscribe(self, sub: Subscriber, wait: bool = True) -> None:
        event_type, conditions = self.new_conditions()
        record = Subscription(event_type, conditions, sent=time.time())
        spec = [list(c) for c in conditions]

        def done(sid: str) -> None:
            record.confirmed = time.time()
            sub.subscriptions[sid] = record

        if sub.face == "async":
            client = self._at(sub.home)
            task = client.subscribe(
                event_type,
                spec,
                1 + self.rng.randrange(5),
                sub.queue,
                confirm=sub.confirm,
                wait_s=60,
            )
            pending = asyncio.ensure_future(task)

            def settled(t: asyncio.Future[str]) -> None:
                if t.cancelled():
                    return
                if t.exception() is not None:
                    record.refused = f"{type(t.exception()).__name__}: {t.exception()}"
                    return
                done(t.result())

            pending.add_done_callback(settled)
            sub.subscriptions[f"pending-{uuid.uuid4().hex[:6]}"] = record
            if wait:
                await pending
            return
        finished = threading.Event()

        def call(client: SyncPhoenixClient) -> None:
            try:
                done(
                    client.subscribe(event_type, spec, 3, sub.queue, confirm=sub.confirm, wait_s=60)
                )
            except MiddlewareError as exc:  # named: the harness reports it, never hangs
                record.refused = f"{type(exc).__name__}: {exc}"
            finally:
                finished.set()

        sub.subscriptions[f"pending-{uuid.uuid4().hex[:6]}"] = record
        self.sync_sides[sub.name].todo.put(call)
        if wait:
            await asyncio.to_thread(finished.wait, 90)

    async def witness_all(self) -> None:
        """The witness takes every event of every type (``x >= 0`` always holds)."""
        client = self._at(self.witness.home)
        for event_type in self.types:
            conditions: list[Condition] = [("x", ">=", 0)]
            record = Subscription(event_type, conditions, sent=time.time())
            sid = await client.subscribe(
                event_type, [list(c) for c in conditions], 1, self.witness.queue, wait_s=60
            )
            record.confirmed = time.time()
            self.witness.subscriptions[sid] = record

    async def unsubscribe(self, sub: Subscriber) -> None:
        standing = [
            (sid, s)
            for sid, s in sub.subscriptions.items()
            if not sid.startswith("pending") and s.removing is None and s.confirmed
        ]
        if len(standing) < 2:
            return  # keep at least one: every queue keeps expecting something
        sid, record = self.rng.choice(standing)
        record.removing = time.time()

        def removed(_result: object) -> None:
            record.removed = time.time()

        if sub.face == "async":
            client = self._at(sub.home)
            pending = asyncio.ensure_future(client.unsubscribe(record.event_type, sid, wait_s=60))
            pending.add_done_callback(lambda t: t.cancelled() or t.exception())
            pending.add_done_callback(
                lambda t: None if t.cancelled() or t.exception() else removed(None)
            )
            return

        def call(client: SyncPhoenixClient) -> None:
            with contextlib.suppress(MiddlewareError):  # unconfirmed: "removing" for ever
                removed(client.unsubscribe(record.event_type, sid, wait_s=60))

        self.sync_sides[sub.name].todo.put(call)

    def rejoin(self) -> None:
        """The leaving cluster comes back by the join path: links healed, roles started,
        every running router told."""
        for (a, b), proxy in self.proxies.items():
            if self.leaving in (a, b):
                proxy.heal()
        self.deployment.phoenix().join(self.leaving, timeout=120)

    async def collect_dead_letters(self) -> None:
        """The layer's dead letters, on a queue of the harness's own (bound to the
        dead-letter exchange), by the event id they carry."""
        queue = f"{self.deployment.prefix}.dead"
        client = self._client()
        await client.declare_exchange(ExchangeSpec(DEAD_LETTER_EXCHANGE, ExchangeType.FANOUT))
        await client.declare_queue(QueueSpec(queue, kind=QueueKind.CLASSIC))
        await client.bind(BindingSpec(queue, DEAD_LETTER_EXCHANGE))

        async def on_dead(delivery: Any) -> None:
            with contextlib.suppress(ValueError, TypeError, AttributeError, KeyError):
                body = json.loads(delivery.body)
                body = body.get("publish", body)  # a copy carried toward its home
                event = body.get("event", body)
                eid = str(event["attributes"]["id"])
                reason = str(delivery.headers.get("x-qosmq-reason"))
                self.dead.setdefault(eid, []).append(reason)

        await client.consume(queue, on_dead)

    def _client(self) -> AsyncClient:
        assert self.async_client is not None
        return self.async_client

    def _at(self, home: str) -> PhoenixClient:
        """The one asyncio client at ``home`` (one reply queue for its confirmations)."""
        if home not in self.at_home:
            self.at_home[home] = PhoenixClient(
                self._client(), topology=self.deployment.topology, cluster=home
            )
        return self.at_home[home]

    # ------------------------------------------------------------ consuming
    async def consume(self, sub: Subscriber) -> None:
        async def handler(event: Any, message: Any) -> None:
            sub.got.append((str(event.attributes["id"]), time.time()))

        if sub.face == "async":
            client = self._at(sub.home)
            self.consumer_tags[sub.name] = await client.consume(
                sub.queue, handler, e2e=sub.confirm == "e2e"
            )
            return
        side = self.sync_sides[sub.name]

        def consume(client: SyncPhoenixClient) -> None:
            def on_event(event: Any, message: Any) -> None:
                sub.got.append((str(event.attributes["id"]), time.time()))

            client.consume(sub.queue, on_event, e2e=sub.confirm == "e2e")

        side.todo.put(consume)

    # ------------------------------------------------------------ publishing
    async def publish(self, rate: float, seconds: float) -> None:
        sides = [
            PhoenixClient(self._client(), topology=self.deployment.topology, cluster=c)
            for c in ("B", "C")
        ]
        start, n = time.monotonic(), 0
        while time.monotonic() - start < seconds:
            event_type = self.rng.choice(self.types)
            eid = uuid.uuid4().hex[:12]
            attributes: dict[str, Any] = {
                "id": eid,
                "x": self.rng.randrange(100),
                "k": self.rng.choice(TEXTS),
            }
            self.published[eid] = (event_type, attributes, time.time())
            await sides[n % 2].publish({"event_type": event_type, "attributes": attributes})
            n += 1
            await asyncio.sleep(max(0.0, start + n / rate - time.monotonic()))

    # --------------------------------------------------------------- faults
    def fault(self, kind: str) -> Callable[[], None]:
        """What the fault does at its moment (in a thread), and the undo is scheduled."""
        phoenix = self.deployment.phoenix()
        targets = {
            "router": RoleId.router("B"),
            "router_slave": RoleId.router_slave("B", 0),
            "match": RoleId.match("B", 0),
            "match_slave": RoleId.match_slave("B", 0, 0),
            "freeze": RoleId.match("B", 0),
        }
        if kind in targets:
            _, pid = _serving(phoenix)[targets[kind]]
            if kind == "freeze":

                def freeze() -> None:
                    os.kill(pid, signal.SIGSTOP)
                    threading.Timer(2.5, lambda: os.kill(pid, signal.SIGCONT)).start()

                return freeze
            return lambda: os.kill(pid, signal.SIGKILL)
        if kind == "leave":
            gone = self.leaving
            roles = [r for r in phoenix.pids() if r.cluster == gone]
            links = [p for (a, b), p in self.proxies.items() if gone in (a, b)]

            def leave() -> None:  # the whole cluster goes: roles killed, links cut
                for role, (_, pid) in _serving(phoenix).items():
                    if role in roles:
                        os.kill(pid, signal.SIGKILL)
                for proxy in links:
                    proxy.cut()

            return leave
        if kind in LINK_FAULTS:
            pairs = [("B", "C"), ("C", "B")] if kind == "cut_both" else [("B", "C")]
            links = [self.proxies[pair] for pair in pairs]

            def heal() -> None:
                for proxy in links:
                    proxy.heal()

            def break_links() -> None:
                for proxy in links:
                    if kind == "blackhole":
                        proxy.blackhole()
                    else:
                        proxy.cut()
                threading.Timer(LINK_DOWN_S, heal).start()

            return break_links
        if kind == "node":
            assert self.cluster is not None
            if self._bounce is None:
                self._bounce = NodeBounce(self.cluster, self.cluster.layout.nodes[-1].short_name)
            return self._bounce
        return lambda: None  # "silent": done by the window itself

    def node_back(self) -> None:
        """Wait until the node the last ``node`` fault killed is started again."""
        if self._bounce is not None:
            self._bounce.back()


async def _run(
    chaos: _Chaos, faults: Sequence[str], rate: float, window_s: float
) -> list[dict[str, Any]]:
    chaos.async_client = await AsyncClient(settings=chaos.settings).connect()
    await chaos.collect_dead_letters()
    # the sync subscribers connect to the node the ``node`` fault kills (the last one),
    # their queues live on the first: the node loss tests their failover, not the loss
    # of a classic queue with its node
    urls = tuple(chaos.settings.amqp_urls)
    sync_settings = chaos.settings.model_copy(update={"amqp_urls": (urls[-1], *urls[:-1])})
    for sub in chaos.subs:  # sync ones need their thread first
        if sub.face == "sync":
            await chaos._client().declare_queue(QueueSpec(sub.queue, kind=QueueKind.CLASSIC))
            side = chaos.sync_sides[sub.name] = _SyncSide(sync_settings, chaos.deployment, sub)
            side.start()
    for sub in chaos.subs:
        for _ in range(2):
            await chaos.subscribe(sub)
    await chaos.witness_all()
    for sub in (*chaos.subs, chaos.witness):
        await chaos.consume(sub)
    await chaos.publish(rate, 3.0)  # a warm-up window, counted as "none"
    bounds = [("none", 0.0, time.time())]
    for kind in faults:
        await asyncio.to_thread(chaos.node_back)
        await asyncio.to_thread(_wait_all_served, chaos.deployment.phoenix(), 180)
        begin = time.time()
        act = chaos.fault(kind)

        async def during(
            kind: str = kind, act: Callable[[], None] = act, silent: Subscriber = chaos.subs[1]
        ) -> None:  # ``silent``: the asyncio e2e subscriber
            await asyncio.sleep(1.0)
            if kind == "silent":
                await chaos._client().cancel(chaos.consumer_tags[silent.name])
            else:
                await asyncio.to_thread(act)
            sub = chaos.rng.choice(chaos.subs)
            await chaos.subscribe(sub, wait=False)  # in flight during the fault
            await chaos.unsubscribe(chaos.rng.choice(chaos.subs))
            if kind == "silent":
                await asyncio.sleep(window_s - 3.0)
                await chaos.consume(silent)
            if kind == "leave":
                await asyncio.sleep(AWAY_S)
                await asyncio.to_thread(chaos.rejoin)

        doing = asyncio.create_task(during())
        # a leave's window goes on past the rejoin: the hand-back under traffic too
        await chaos.publish(rate, window_s + (AWAY_S + 4.0 if kind == "leave" else 0.0))
        await doing
        bounds.append((kind, begin, time.time()))
    await asyncio.to_thread(chaos.node_back)
    # the stragglers: every expected event may still arrive (a silent subscriber's backlog)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        rows = [r for kind, b, e in bounds for r in window_rows(chaos, kind, b, e)]
        if not any(r["lost"] for r in rows):
            break
        await asyncio.sleep(1.0)
    await asyncio.sleep(2.0)  # late duplicates show here
    for side in chaos.sync_sides.values():
        side.stop.set()
        await asyncio.to_thread(side.thread.join, 10)
    await chaos._client().close()
    rows = [r for kind, b, e in bounds for r in window_rows(chaos, kind, b, e)]
    for sub in chaos.subs:
        for record in sub.subscriptions.values():
            if record.refused:
                window = next((k for k, b, e in bounds if b <= record.sent < e), "?")
                rows.append(
                    {"fault": window, "subscriber": sub.name, "unconfirmed": record.refused}
                )
    for side in chaos.sync_sides.values():
        if side.error is not None:
            rows.append(
                {
                    "fault": "sync face",
                    "subscriber": side.sub.name,
                    "error": f"{type(side.error).__name__}: {side.error}",
                }
            )
    return rows


def run_chaos(
    settings: Settings,
    *,
    directory: Path,
    seed: int,
    faults: Sequence[str] = FAULTS,
    rate: float = 100.0,
    window_s: float = 8.0,
    cluster: LocalCluster | None = None,
    routing_slaves: int = 1,
    match_slaves: int = 1,
    clusters: Sequence[str] = CLUSTERS,
    fields: Mapping[str, float] | None = None,
) -> list[dict[str, Any]]:
    """One chaos run: the faults in the seed's order; a row per (window, subscriber).
    ``fields``: topology fields to set (``copy_batch_max``)."""
    rng = random.Random(seed)
    kinds = [f for f in faults if f != "node" or cluster is not None]
    rng.shuffle(kinds)
    prefix = f"bench-chaos-{seed}-{int(time.time())}"
    proxies: dict[tuple[str, str], FaultProxy] = {}
    if any(k in LINK_FAULTS for k in kinds):  # every inter-cluster link through a proxy
        port = urllib.parse.urlsplit(settings.amqp_urls[0]).port or 5672
        proxies = {(a, b): FaultProxy(port) for a in clusters for b in clusters if a != b}
    try:
        deployment = Deployment(
            directory / prefix,
            prefix=prefix,
            amqp_urls=settings.amqp_urls,
            routing_slaves=routing_slaves,
            match_slaves=match_slaves,
            links={pair: proxy.url for pair, proxy in proxies.items()},
            clusters=clusters,
            fields=fields,
        )
        with deployment.running():
            _wait_all_served(deployment.phoenix(), 180)
            chaos = _Chaos(
                settings, deployment, cluster, rng, prefix, proxies, leave="leave" in kinds
            )
            rows = runtime.run(_run(chaos, kinds, rate, window_s), event_loop=settings.event_loop)
            with contextlib.suppress(Exception):
                queues = [s.queue for s in chaos.subs] + [f"{prefix}.dead"]
                runtime.run(_drop_queues(settings, queues))
    finally:
        for proxy in proxies.values():
            proxy.close()
    return rows


async def _drop_queues(settings: Settings, queues: list[str]) -> None:
    async with AsyncClient(settings=settings) as client:
        for name in queues:
            await client.delete_queue(name)


if __name__ == "__main__":  # pragma: no cover - a quick manual run
    import sys

    out = run_chaos(Settings.load(), directory=Path(sys.argv[1]), seed=int(sys.argv[2]))
    print(summarize(out))
    print(json.dumps(problems(out), indent=2))
