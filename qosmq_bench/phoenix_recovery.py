"""Phoenix recovery experiment (paper 000 §4, figure 8), on real processes and real SIGKILLs.

The paper's set-up (3 clusters, each 1 routing master + 2 routing slaves + 1 match master
+ 2 match slaves: 18 role processes); one event type owned by B, subscribed at A, events
published at A and at C alternately at a steady rate.  For each role kind, ``kills``
times: the process now serving that role of B is SIGKILLed at a random moment of a
stream, and the next kill waits until every role is served again (the dead process's
role by an elected slave, the vacated slave role by the provisioner's replacement).

Per kill, read from what the test harness itself saw (its consumer, the role processes'
status files and logs), never from the roles' counters:

- ``detection_s``: kill -> the first election (masters: a slave's "electing" line) or
  the master's replacement request for a silent slave (slaves: bounded below by the
  topology's ``replace_after_s``);
- ``recovery_s``: kill -> the role served again (status file ``since`` of the elected
  slave's process, or of the replacement);
- ``function_s``: kill -> the first delivery of an event published after the kill (the
  event path works again; for a slave that is at once);
- events ``lost`` (published, confirmed, never delivered), ``duplicates``, and
  ``delayed`` (delivered more than ``delayed_s`` after their publish).

The baseline in the same run is the event latency before each kill (``p50_before_ms``).
False suspicions are elections against a master nobody killed in the 5 s before, counted
over the whole run from every cluster's role logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from middleware import runtime
from middleware.localcluster import pid_alive
from middleware.routing import Event, PhoenixClient, PhoenixDeployment, RoleId, RoleKind
from middleware.settings import Settings
from middleware.transport import AsyncClient, Delivery

from .phoenix_deploy import Deployment, messages_of
from .stats import by_rate_and, percentile, row_percentile

__all__ = ["KINDS", "PAPER_S", "run_recovery", "summarize_recovery"]

#: the role kinds killed, as the CLI names them
KINDS = {
    "router": RoleKind.ROUTER,
    "router_slave": RoleKind.ROUTER_SLAVE,
    "match": RoleKind.MATCH,
    "match_slave": RoleKind.MATCH_SLAVE,
}
#: the paper's detection + recovery at 2 000 events/s (figure 8), seconds
PAPER_S = {"router": 30.1, "router_slave": 19.9, "match": 29.5, "match_slave": 18.8}
CLUSTER = "B"  # where roles are killed: the event type's owner
_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def _target(kind: str) -> RoleId:
    if kind == "router":
        return RoleId.router(CLUSTER)
    if kind == "router_slave":
        return RoleId.router_slave(CLUSTER, 1)
    if kind == "match":
        return RoleId.match(CLUSTER, 0)
    return RoleId.match_slave(CLUSTER, 0, 1)


def _serving(deployment: PhoenixDeployment) -> dict[RoleId, tuple[RoleId, int]]:
    """Every role served by a live process (its status file written by that process,
    once it serves): role -> (slot, pid)."""
    found = {}
    for slot, pid in deployment.pids().items():
        try:
            status = json.loads(deployment.status_file(slot).read_text())
        except (OSError, ValueError):
            continue
        if pid_alive(pid) and status.get("pid") == pid:
            found[RoleId.from_key(status["serves"])] = (slot, pid)
    return found


def _wait_all_served(deployment: PhoenixDeployment, timeout_s: float) -> None:
    every = {r for c in deployment.topology.clusters for r in RoleId.of_cluster(c)}
    deadline = time.monotonic() + timeout_s
    while not every <= set(_serving(deployment)):
        if time.monotonic() > deadline:
            missing = sorted(r.key for r in every - set(_serving(deployment)))
            raise RuntimeError(f"roles not served again in {timeout_s:.0f} s: {missing}")
        time.sleep(0.1)


def _log_lines_after(
    deployment: PhoenixDeployment, t: float, pattern: str, cluster: str | None = CLUSTER
) -> list[tuple[float, str]]:
    """(time, line) of log lines at or after ``t`` matching ``pattern``, of one cluster's
    slots (None: every cluster's)."""
    found = []
    for slot in deployment.pids():
        if cluster is not None and slot.cluster != cluster:
            continue
        try:
            text = deployment.log_file(slot).read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            stamp = _LOG_TIME.match(line)
            if not stamp or pattern not in line:
                continue
            at = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if at >= t - 0.002:  # log stamps are to the millisecond
                found.append((at, line))
    return sorted(found)


class _Stream:
    """Publishes ``rate`` events/s alternately at the ``entries`` clusters (A and C); the
    subscriber's consumer records when each event arrives (the test's own counter)."""

    def __init__(
        self,
        settings: Settings,
        deployment: Deployment,
        event_type: str,
        queue: str,
        first: int,
        entries: Sequence[str] = ("A", "C"),
        e2e: bool = False,
    ) -> None:
        self.settings, self.deployment = settings, deployment
        #: an e2e subscription's consumer: receipts, and the duplicate filter it keeps
        self.e2e = e2e
        self.event_type, self.queue = event_type, queue
        self.entries = list(entries)
        self.sent: dict[int, float] = {}  # n -> publish time
        self.got: list[tuple[int, float]] = []  # (n, arrival time), this stream's only
        self.late = 0  # deliveries of an earlier stream's events (late duplicates)
        self.next = first  # event numbers are unique over the run
        self.arrived: asyncio.Event | None = None

    async def _on_delivery(self, delivery: Delivery) -> None:
        for message in messages_of(delivery.body):  # one, or a batch (copy_batch_max)
            self._arrived(message["event"]["attributes"]["n"])

    async def _on_event(self, event: Event, message: Any) -> None:  # e2e
        self._arrived(int(event.attributes["n"]))

    def _arrived(self, n: int) -> None:
        if n not in self.sent:
            self.late += 1
            return
        self.got.append((n, time.time()))
        if self.arrived is not None:
            self.arrived.set()

    async def run(self, rate: float, seconds: float, at: float, kill: Callable[[], None]) -> float:
        """Stream for ``seconds``, calling ``kill`` (in a thread) ``at`` seconds in;
        wait for the stragglers; return the kill's wall time."""
        return (await self.run_actions(rate, seconds, [(at, kill)]))[0]

    async def run_actions(
        self, rate: float, seconds: float, actions: Sequence[tuple[float, Callable[[], None]]]
    ) -> list[float]:
        """Stream for ``seconds``, calling each action (in a thread) at its time; wait
        for the stragglers; return the actions' wall times."""
        topology = self.deployment.topology
        self.arrived = asyncio.Event()
        pending_actions = sorted(actions, key=lambda a: a[0])
        done: list[float] = []
        async with AsyncClient(settings=self.settings) as client:
            subscriber = PhoenixClient(client, topology=topology, cluster="A")
            if self.e2e:
                tag = await subscriber.consume(self.queue, self._on_event, e2e=True)
            else:
                tag = await client.consume(self.queue, self._on_delivery)
            sides = [PhoenixClient(client, topology=topology, cluster=c) for c in self.entries]
            start = time.monotonic()
            tick = 0.01
            published = 0
            pending: set[asyncio.Task[None]] = set()
            while (elapsed := time.monotonic() - start) < seconds:
                while pending_actions and elapsed >= pending_actions[0][0]:
                    _, action = pending_actions.pop(0)
                    done.append(time.time())
                    await asyncio.to_thread(action)
                # owed by the clock, not by loop turns: on a busy machine a turn takes
                # longer than its tick, and counting turns offered less than the rate
                # (254 of 400 events on one CPU)
                owed = int(rate * (time.monotonic() - start)) - published
                for _ in range(owed):
                    published += 1
                    n = self.next
                    self.next += 1
                    self.sent[n] = time.time()
                    side = sides[n % len(sides)]
                    event = {"event_type": self.event_type, "attributes": {"n": n}}
                    task = asyncio.create_task(side.publish(event))
                    pending.add(task)
                    task.add_done_callback(pending.discard)
                await asyncio.sleep(tick)
            if pending:
                await asyncio.gather(*pending)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and len({n for n, _ in self.got}) < len(self.sent):
                self.arrived.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        self.arrived.wait(), max(0.0, deadline - time.monotonic())
                    )
            await asyncio.sleep(1.0)  # late duplicates show here
            await client.cancel(tag)
            if self.e2e:
                await subscriber.close()  # its receipts consumer first, then the connection
            return done


def _one_kill(
    settings: Settings,
    deployment: Deployment,
    kind: str,
    rate: float,
    *,
    seconds: float,
    rng: random.Random,
    event_type: str,
    queue: str,
    delayed_s: float,
    first: int,
    e2e: bool = False,
) -> dict[str, Any]:
    phoenix = deployment.phoenix()
    _wait_all_served(phoenix, 120)
    target = _target(kind)
    slot, pid = _serving(phoenix)[target]
    stream = _Stream(settings, deployment, event_type, queue, first, e2e=e2e)

    def kill() -> None:
        os.kill(pid, signal.SIGKILL)

    at = rng.uniform(1.0, max(1.0, seconds - 2.0))
    killed_at = runtime.run(stream.run(rate, seconds, at, kill), event_loop=settings.event_loop)
    _wait_all_served(phoenix, 120)
    serving = _serving(phoenix)
    new_slot = serving[target][0]
    since = json.loads(phoenix.status_file(new_slot).read_text())["since"]
    master = not target.is_slave
    # a master's death: its lease came back (beats.py), or its beats stopped
    needles = [
        f"lease of {target} ",
        f"no beat from {target} " if master else f"{target} silent for",
    ]
    detection = sorted(line for n in needles for line in _log_lines_after(phoenix, killed_at, n))
    got = stream.got
    arrivals: dict[int, float] = {}
    for n, t in got:
        arrivals.setdefault(n, t)
    after = [t for n, t in got if stream.sent[n] >= killed_at]
    before = [
        (arrivals[n] - stream.sent[n]) * 1000 for n in arrivals if stream.sent[n] < killed_at - 0.2
    ]
    latencies = [arrivals[n] - stream.sent[n] for n in arrivals]
    return {
        "kind": kind,
        "rate": rate,
        "killed": f"{target.key} (pid {pid}, slot {slot.key})",
        "target": str(target),
        "killed_at": killed_at,
        "served_by": new_slot.key,
        "detection_s": round(detection[0][0] - killed_at, 3) if detection else None,
        "recovery_s": round(since - killed_at, 3),
        "function_s": round(min(after) - killed_at, 3) if after else None,
        "events": len(stream.sent),
        "lost": len(set(stream.sent) - set(arrivals)),
        "duplicates": len(got) - len(arrivals) + stream.late,
        "delayed": sum(1 for x in latencies if x > delayed_s),
        "p50_before_ms": round(percentile(before, 50), 1) if before else None,
        "max_latency_s": round(max(latencies), 3) if latencies else None,
    }


def _until_warm(phoenix: PhoenixDeployment, timeout_s: float = 60.0) -> None:
    """Before the first kill: every master's provisioner is warm (its log says "zygote
    ready"), as in a deployment that has run for a while; a fresh one replaces its first
    dead slave with a plain process start, which is what a cold start measures, not
    recovery.  Goes on after ``timeout_s`` (a deployment without zygotes)."""
    masters = [slot for slot in phoenix.pids() if not slot.is_slave]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        cold = []
        for slot in masters:
            try:
                text = phoenix.log_file(slot).read_text(errors="replace")
            except OSError:
                text = ""
            if "zygote ready" not in text:
                cold.append(slot)
        if not cold:
            return
        time.sleep(0.2)


def run_recovery(
    settings: Settings,
    *,
    directory: Path,
    kinds: Sequence[str],
    rates: Sequence[float],
    kills: int,
    seconds: float = 5.0,
    seed: int = 1,
    delayed_s: float = 0.5,
    report: Callable[[dict[str, Any]], None] | None = None,
    fields: Mapping[str, float] | None = None,
    confirm: str = "broker",
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every kind at every rate, ``kills`` times; the per-kill rows and the run's
    false-suspicion count (elections and fences no kill explains).  ``fields``: topology
    fields to set (``heartbeat_interval_s``, ``heartbeat_misses``, ``replace_after_s``);
    ``confirm``: the subscription's (``e2e``: the Phoenix client's e2e consumer, whose
    duplicate filter the duplicates count then checks)."""
    prefix = f"bench-recovery-{int(time.time())}"
    deployment = Deployment(
        directory / prefix, prefix=prefix, amqp_urls=settings.amqp_urls, fields=fields
    )
    event_type = next(
        f"recovery{i}" for i in range(10_000) if deployment.ring.owner(f"recovery{i}") == CLUSTER
    )
    queue = f"{prefix}.sub"
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    with deployment.running():
        runtime.run(_subscribe(settings, deployment, event_type, queue, confirm=confirm))
        _until_warm(deployment.phoenix())
        started = time.time()
        for rate in rates:
            for kind in kinds:
                for _ in range(kills):
                    row = _one_kill(
                        settings,
                        deployment,
                        kind,
                        rate,
                        seconds=seconds,
                        rng=rng,
                        event_type=event_type,
                        queue=queue,
                        delayed_s=delayed_s,
                        first=sum(r["events"] for r in rows),
                        e2e=confirm == "e2e",
                    )
                    rows.append(row)
                    if report is not None:
                        report(row)
        phoenix = deployment.phoenix()
        elections = _log_lines_after(phoenix, started, ": electing", cluster=None)
        master_kills = [r for r in rows if r["kind"] in ("router", "match")]

        def explained(at: float, line: str) -> bool:
            """Within 5 s after a kill of the master the line names."""
            return any(
                (f"no beat from {r['target']} " in line or f"lease of {r['target']} " in line)
                and 0 <= at - r["killed_at"] <= 5.0
                for r in master_kills
            )

        false = [line for at, line in elections if not explained(at, line)]
        stepped_down = len(_log_lines_after(phoenix, started, "stepping down to", cluster=None))
        # a SIGKILL leaves no second process: a retirement here is a wrong one
        retired = len(_log_lines_after(phoenix, started, ": retired by ", cluster=None))
        runtime.run(_drop(settings, queue))
    run = {
        "topology": dict(fields or {}),
        "elections_logged": len(elections),
        "master_kills": len(master_kills),
        "false_suspicions": len(false),
        "false_suspicion_lines": false[:20],
        "stepped_down": stepped_down,
        "retired": retired,
        "directory": str(directory / prefix),
    }
    return rows, run


async def _subscribe(
    settings: Settings,
    deployment: Deployment,
    event_type: str,
    queue: str,
    home: str = "A",
    confirm: str = "broker",
) -> None:
    """Subscribe at ``home``; wait until an event published at A reaches the queue."""
    async with AsyncClient(settings=settings) as client:
        at_home = PhoenixClient(client, topology=deployment.topology, cluster=home)
        at_a = PhoenixClient(client, topology=deployment.topology, cluster="A")
        await at_home.subscribe(event_type, None, 1, queue, confirm=confirm)
        deadline = time.monotonic() + 60
        while await client.queue_length(queue) == 0:
            if time.monotonic() > deadline:
                raise RuntimeError("no probe event reached the subscriber in 60 s")
            await at_a.publish({"event_type": event_type, "attributes": {"n": -1}})
            await asyncio.sleep(0.3)
        while await client.get(queue) is not None:
            pass


async def _drop(settings: Settings, queue: str) -> None:
    async with AsyncClient(settings=settings) as client:
        await client.delete_queue(queue)


def summarize_recovery(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median and p99 of detection and recovery per kind and rate, totals of events."""
    out = []
    for rate, kind, mine in by_rate_and(rows, "kind", KINDS):
        out.append(
            {
                "kind": kind,
                "rate": rate,
                "kills": len(mine),
                "detection_p50_s": row_percentile(mine, "detection_s", 50),
                "detection_p99_s": row_percentile(mine, "detection_s", 99),
                "recovery_p50_s": row_percentile(mine, "recovery_s", 50),
                "recovery_p99_s": row_percentile(mine, "recovery_s", 99),
                "function_p50_s": row_percentile(mine, "function_s", 50),
                "function_p99_s": row_percentile(mine, "function_s", 99),
                "events": sum(r["events"] for r in mine),
                "lost": sum(r["lost"] for r in mine),
                "duplicates": sum(r["duplicates"] for r in mine),
                "delayed": sum(r["delayed"] for r in mine),
                "paper_s": PAPER_S[kind],
            }
        )
    return out
