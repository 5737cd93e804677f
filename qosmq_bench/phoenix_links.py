"""Phoenix link failures (issue #24, ``qosmq bench phoenix --experiment link``), on real
processes and real link faults.

Three clusters (A, B, C; a routing master and a match master each) on the given
RabbitMQ; every directed link between two clusters goes through a fault-injecting TCP
proxy of the bench's (``[[link]]`` in the topology).  One event type whose owner X is A's
direct ring neighbour; events published at A at a steady rate; the subscriber homed at
the third cluster Y.  Per cut, at a random moment of a stream, the link A<->X is cut
(connections reset, new ones refused) or blackholed (connections stay open and carry
nothing: only the missing confirm tells), and healed ``down_s`` later.

Per cut, from what the harness itself saw (its consumer's arrivals, the clock of the
fault) and the routers' logs (when each step happened, flood messages per node):

- ``detect_s``: fault -> A's router logs the failed link (its flood starts);
- ``reroute_s``: fault -> A's router logs the detour its flood found;
- ``function_s``: fault -> the first arrival of an event published after the fault (the
  target the issue sets: <= 1 s median);
- ``back_s``: heal -> A's router logs the direct link answering again;
- ``flood_messages``: PROBEs and FOUNDs sent by all routers for the floods since the fault;
- events ``lost`` (published, confirmed, never delivered) and ``duplicates``;
- the baseline in the same run: event latency before the fault (``p50_direct_ms``)
  against latency over the detour (``p50_detour_ms``).
"""

from __future__ import annotations

import contextlib
import random
import re
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from middleware import runtime
from middleware.localcluster import FaultProxy
from middleware.routing import ChordRing, RoleId, SubscriptionRecord
from middleware.settings import Settings

from .phoenix_deploy import Deployment
from .phoenix_recovery import _drop, _log_lines_after, _Stream, _subscribe
from .stats import by_rate_and, percentile, row_percentile

__all__ = ["FAULTS", "run_leave", "run_links", "summarize_leave", "summarize_links"]

FAULTS = ("cut", "blackhole")
CLUSTERS = ("A", "B", "C")
_FLOOD = re.compile(r"flood (\S+): (\d+) message")


def _proxied_port(url: str) -> int:
    port = urllib.parse.urlsplit(url).port
    return 5672 if port is None else port


@dataclass
class _World:
    """A 3-cluster deployment with a proxy per directed link, and the stream's type:
    one whose owner ``x`` is A's direct ring neighbour; ``y`` is the third cluster."""

    deployment: Deployment
    proxies: dict[tuple[str, str], FaultProxy]
    event_type: str
    x: str
    y: str
    queue: str


@contextlib.contextmanager
def _world(
    settings: Settings,
    directory: Path,
    prefix: str,
    fields: Mapping[str, float] | None,
    owner_masters: int = 1,
) -> Iterator[_World]:
    """``owner_masters``: the match masters of X (the others have one each)."""
    port = _proxied_port(settings.amqp_urls[0])
    proxies = {(a, b): FaultProxy(port) for a in CLUSTERS for b in CLUSTERS if a != b}
    try:
        ring = ChordRing(CLUSTERS)
        event_type = next(
            t for t in (f"{prefix}-{i}" for i in range(10_000)) if len(ring.route("A", t)) == 2
        )
        x = ring.owner(event_type)
        y = next(c for c in CLUSTERS if c not in ("A", x))
        deployment = Deployment(
            directory / prefix,
            prefix=prefix,
            amqp_urls=settings.amqp_urls,
            routing_slaves=0,
            match_slaves=0,
            links={pair: proxy.url for pair, proxy in proxies.items()},
            fields=fields,
            match_masters={x: owner_masters},
        )
        yield _World(deployment, proxies, event_type, x, y, f"{prefix}.sub")
    finally:
        for proxy in proxies.values():
            proxy.close()


def _wait_back(deployment: Deployment, x: str, since: float, timeout_s: float) -> float | None:
    """When A's router logged the direct link to ``x`` answering again (None: not yet)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = _log_lines_after(deployment.phoenix(), since, f"A -> {x}: direct link", "A")
        if lines:
            return lines[0][0]
        time.sleep(0.1)
    return None


def _one_cut(
    settings: Settings,
    deployment: Deployment,
    proxies: dict[tuple[str, str], FaultProxy],
    fault: str,
    rate: float,
    *,
    seconds: float,
    down_s: float,
    rng: random.Random,
    event_type: str,
    x: str,
    queue: str,
    first: int,
) -> dict[str, Any]:
    stream = _Stream(settings, deployment, event_type, queue, first, entries=("A",))
    pair = (proxies["A", x], proxies[x, "A"])

    def break_link() -> None:
        for proxy in pair:
            if fault == "cut":
                proxy.cut()
            else:
                proxy.blackhole()

    def heal() -> None:
        for proxy in pair:
            proxy.heal()

    at = rng.uniform(1.0, max(1.0, seconds - down_s - 1.0))
    fault_at, heal_at = runtime.run(
        stream.run_actions(rate, seconds, [(at, break_link), (at + down_s, heal)]),
        event_loop=settings.event_loop,
    )
    back = _wait_back(deployment, x, heal_at, 60.0)
    phoenix = deployment.phoenix()
    detected = _log_lines_after(phoenix, fault_at, f"A -> {x}: link failed", "A")
    detour = _log_lines_after(phoenix, fault_at, f"A -> {x}: detour over", "A")
    floods = _log_lines_after(phoenix, fault_at, "flood A#", None)
    flood_ids = set()
    messages = 0
    for _, line in floods:
        found = _FLOOD.search(line)
        if found:
            flood_ids.add(found.group(1))
            messages += int(found.group(2))
    arrivals: dict[int, float] = {}
    for n, t in stream.got:
        arrivals.setdefault(n, t)
    after = [t for n, t in stream.got if stream.sent[n] >= fault_at]
    direct = [
        (arrivals[n] - stream.sent[n]) * 1000 for n in arrivals if stream.sent[n] < fault_at - 0.2
    ]
    detoured_since = detour[0][0] if detour else heal_at
    over_detour = [
        (arrivals[n] - stream.sent[n]) * 1000
        for n in arrivals
        if detoured_since + 0.2 <= stream.sent[n] < heal_at - 0.1
    ]
    return {
        "fault": fault,
        "rate": rate,
        "detour": detour[0][1].rsplit("detour over ", 1)[1].split(",")[0] if detour else None,
        "fault_at": fault_at,
        "detect_s": round(detected[0][0] - fault_at, 3) if detected else None,
        "reroute_s": round(detour[0][0] - fault_at, 3) if detour else None,
        "function_s": round(min(after) - fault_at, 3) if after else None,
        "back_s": round(back - heal_at, 3) if back is not None else None,
        "floods": len(flood_ids),
        "flood_messages": messages,
        "events": len(stream.sent),
        "lost": len(set(stream.sent) - set(arrivals)),
        "duplicates": len(stream.got) - len(arrivals) + stream.late,
        "p50_direct_ms": round(percentile(direct, 50), 1) if direct else None,
        "p50_detour_ms": round(percentile(over_detour, 50), 1) if over_detour else None,
    }


def run_links(
    settings: Settings,
    *,
    directory: Path,
    faults: Sequence[str],
    rates: Sequence[float],
    cuts: int,
    seconds: float = 6.0,
    down_s: float = 2.5,
    seed: int = 1,
    report: Callable[[dict[str, Any]], None] | None = None,
    fields: Mapping[str, float] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every fault at every rate, ``cuts`` times; the per-cut rows and the run.
    ``fields``: topology fields to set (``link_timeout_s``, ``link_retry_s``, ...)."""
    prefix = f"bench-link-{int(time.time())}"
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    with _world(settings, directory, prefix, fields) as world:
        x, y = world.x, world.y
        with world.deployment.running():
            runtime.run(_subscribe(settings, world.deployment, world.event_type, world.queue, y))
            for rate in rates:
                for fault in faults:
                    for _ in range(cuts):
                        row = _one_cut(
                            settings,
                            world.deployment,
                            world.proxies,
                            fault,
                            rate,
                            seconds=seconds,
                            down_s=down_s,
                            rng=rng,
                            event_type=world.event_type,
                            x=x,
                            queue=world.queue,
                            first=sum(r["events"] for r in rows),
                        )
                        rows.append(row)
                        if report is not None:
                            report(row)
            runtime.run(_drop(settings, world.queue))
    run = {
        "link": f"A <-> {x}",
        "detour_via": y,
        "subscriber_home": y,
        "down_s": down_s,
        "topology": dict(fields or {}),
        "directory": str(directory / prefix),
    }
    return rows, run


def summarize_links(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median and p99 per fault and rate; totals of events, losses, duplicates."""
    out = []
    for rate, fault, mine in by_rate_and(rows, "fault", FAULTS):
        out.append(
            {
                "fault": fault,
                "rate": rate,
                "cuts": len(mine),
                "detect_p50_s": row_percentile(mine, "detect_s", 50),
                "reroute_p50_s": row_percentile(mine, "reroute_s", 50),
                "function_p50_s": row_percentile(mine, "function_s", 50),
                "function_p99_s": row_percentile(mine, "function_s", 99),
                "back_p50_s": row_percentile(mine, "back_s", 50),
                "flood_messages_p50": row_percentile(mine, "flood_messages", 50),
                "p50_direct_ms": row_percentile(mine, "p50_direct_ms", 50),
                "p50_detour_ms": row_percentile(mine, "p50_detour_ms", 50),
                "events": sum(r["events"] for r in mine),
                "lost": sum(r["lost"] for r in mine),
                "duplicates": sum(r["duplicates"] for r in mine),
            }
        )
    return out


# ---------------------------------------------------------------------- cluster leave
_TOOK_OVER = re.compile(r"took over the arc of (\S+): (\d+) subscriptions restored in ([\d.]+) s")
_ADDED = re.compile(
    r"added (\d+) match roles for \S+ arc \((\d+) masters, as it had\) in ([\d.]+) s"
)


def _leave_docs(
    ring: Any, owner: str, home: str, count: int, prefix: str
) -> Iterator[tuple[str, str, SubscriptionRecord]]:
    """``count`` subscriptions on 30 event types ``owner`` owns, made at ``home``."""
    types = [t for t in (f"leave-ev{i}" for i in range(10_000)) if ring.owner(t) == owner][:30]
    rng = random.Random(7)
    for i in range(count):
        yield (
            f"s{i}",
            home,
            SubscriptionRecord(
                event_type=types[i % len(types)],
                filter=[["symbol", "=", f"S{rng.randrange(1000)}"]],
                queue=f"{prefix}.unused",
                latency_level=1 + i % 5,
                home=home,
            ),
        )


def _one_leave(
    settings: Settings,
    directory: Path,
    run_index: int,
    *,
    rate: float,
    subscriptions: int,
    seconds: float,
    fields: Mapping[str, float] | None,
    departed_masters: int = 1,
) -> dict[str, Any]:
    prefix = f"bench-leave-{int(time.time())}-{run_index}"
    with _world(settings, directory, prefix, fields, departed_masters) as world:
        deployment, x, y, queue = world.deployment, world.x, world.y, world.queue
        ring = deployment.ring
        preloaded = deployment.preload(_leave_docs(ring, x, y, subscriptions, prefix))
        with deployment.running():
            runtime.run(_subscribe(settings, deployment, world.event_type, queue, y))
            stream = _Stream(settings, deployment, world.event_type, queue, 0, entries=("A",))
            phoenix = deployment.phoenix()

            def remove() -> None:
                for role in RoleId.of_cluster(deployment.topology.cluster(x)):
                    phoenix.kill(role)
                for (a, b), proxy in world.proxies.items():
                    if x in (a, b):
                        proxy.cut()

            (removed_at,) = runtime.run(
                stream.run_actions(rate, seconds, [(1.5, remove)]),
                event_loop=settings.event_loop,
            )
            left = _log_lines_after(phoenix, removed_at, f"{x} left the ring", None)
            took = _log_lines_after(phoenix, removed_at, f"took over the arc of {x}", None)
            added = _log_lines_after(phoenix, removed_at, f"match roles for {x}'s arc", None)
            runtime.run(_drop(settings, queue))
    arrivals: dict[int, float] = {}
    for n, t in stream.got:
        arrivals.setdefault(n, t)
    after = [n for n in stream.sent if stream.sent[n] >= removed_at]
    before = [n for n in stream.sent if stream.sent[n] < removed_at]
    restored = restore_s = None
    if took:
        found = _TOOK_OVER.search(took[0][1])
        if found:
            restored, restore_s = int(found.group(2)), float(found.group(3))
    first_after = min((arrivals[n] for n in after if n in arrivals), default=None)
    grown = _ADDED.search(added[0][1]) if added else None
    return {
        "subscriptions": preloaded,
        "rate": rate,
        "departed": x,
        "successor": ring.successors(x, 1)[0],
        "departed_masters": departed_masters,
        # the capacity plan: match roles the successor added, and how long it took
        "added_roles": int(grown.group(1)) if grown else 0,
        "provision_s": float(grown.group(3)) if grown else None,
        "detect_s": round(left[0][0] - removed_at, 3) if left else None,
        "restore_s": restore_s,
        "restored": restored,
        "restored_per_s": round(restored / restore_s) if restored and restore_s else None,
        "function_s": round(first_after - removed_at, 3) if first_after else None,
        "events": len(stream.sent),
        "lost_after": sum(1 for n in after if n not in arrivals),
        "lost_in_departed": sum(1 for n in before if n not in arrivals),
        "duplicates": len(stream.got) - len(arrivals) + stream.late,
    }


def run_leave(
    settings: Settings,
    *,
    directory: Path,
    runs: int,
    rate: float,
    subscriptions: int,
    seconds: float = 10.0,
    report: Callable[[dict[str, Any]], None] | None = None,
    fields: Mapping[str, float] | None = None,
    departed_masters: int = 1,
) -> list[dict[str, Any]]:
    """``runs`` removals of the cluster that owns the stream's type, each on a fresh
    deployment holding ``subscriptions`` subscriptions in the departed cluster's arc;
    ``departed_masters``: its match masters (the successor has one: above one, the
    successor adds the difference, the paper's capacity plan)."""
    rows = []
    for i in range(runs):
        row = _one_leave(
            settings,
            directory,
            i,
            rate=rate,
            subscriptions=subscriptions,
            seconds=seconds,
            fields=fields,
            departed_masters=departed_masters,
        )
        rows.append(row)
        if report is not None:
            report(row)
    return rows


def summarize_leave(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {
        "runs": len(rows),
        "subscriptions": rows[0]["subscriptions"] if rows else 0,
        "departed_masters": rows[0].get("departed_masters", 1) if rows else 1,
        "provision_p50_s": row_percentile(rows, "provision_s", 50),
        "detect_p50_s": row_percentile(rows, "detect_s", 50),
        "restore_p50_s": row_percentile(rows, "restore_s", 50),
        "function_p50_s": row_percentile(rows, "function_s", 50),
        "function_p99_s": row_percentile(rows, "function_s", 99),
        "restored_per_s_p50": row_percentile(rows, "restored_per_s", 50),
        "events": sum(r["events"] for r in rows),
        "lost_after": sum(r["lost_after"] for r in rows),
        "lost_in_departed": sum(r["lost_in_departed"] for r in rows),
        "duplicates": sum(r["duplicates"] for r in rows),
    }
