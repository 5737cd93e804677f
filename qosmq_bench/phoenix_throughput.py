"""``qosmq bench phoenix --experiment throughput``: where each event's cost goes.

The paper's topology (three clusters, each a routing master with two routing slaves and
a match master with two match slaves: 18 role processes; the subscriptions preloaded as
in the timeliness runs), one mechanism (``both`` by default), the rate raised in steps
until the deployment falls behind.  First the idle cost: ``idle_s`` with no events at
all (beats, leases, neighbour checks, snapshots).  Then per step (a warm-up, then
``duration_s`` measured, Poisson arrivals from the clients at A and C):

- events/s offered and delivered, mean/p50/p99 response (publish -> first delivery);
- the CPU of every process: the role processes summed by kind, the RabbitMQ nodes, the
  client; their sum per delivered event (ms of CPU over every process); the machine's
  busy %; the most-waiting process of each kind's run delay (ready but no core);
- the AMQP messages per event into each kind of queue, from the brokers' own per-queue
  ``publish`` counters (management API; read after its statistics interval, so the
  figures are the brokers', not the roles'): the routers' inboxes (client -> router and
  router -> router), the routing slaves' (replication), the match masters' (router ->
  match), the match slaves' (match -> slave: dispatched events and replication), every
  role's control queue (beats, acks, snapshots), the subscribers' queues (deliveries)
  and the rest (process, lease and reply queues); the control and "other" counts include
  the idle traffic of the step's wall time (``idle`` gives its rate);
- what limited the step: a process kind near a whole core, the cores, or nothing
  (``none``: waiting — windows and round trips — set the pace).

Not every event matches a subscription (about one match per event on average, so about
four in ten match none): a step is ``behind`` when the share of its events delivered in
the step and its drain falls under 95 % of the best share of the steps before it, or the
p99 passed ``behind_p99_s``; the steps stop after the first one behind (``keep_going``
runs them all).  The CPU is given per published event (everything the machine spent,
idle cost included), per delivered event, and above the idle cost (what an event adds).
"""

from __future__ import annotations

import os
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from middleware import runtime
from middleware.routing import RoleId, RoleKind
from middleware.settings import Settings
from middleware.transport import management_get, vhost_path

from .confirms import _brokers
from .cpu import CpuMeter, limit, role_kind
from .options import MECHANISMS
from .phoenix_deploy import CLIENTS, Deployment, Workload, wait_ready
from .phoenix_deploy import subscriber_queue as subscriber_queue_of
from .phoenix_timeliness import measure, warm_up

__all__ = ["HOPS", "hop_of", "per_second", "run_throughput", "summarize_throughput"]

#: the kinds of queue an event's messages go into (``hop_of``)
HOPS = (
    "router",
    "router_slave",
    "match",
    "match_slave",
    "control",
    "subscriber",
    "other",
)
_HOP_OF_KIND = {
    RoleKind.ROUTER: "router",
    RoleKind.ROUTER_SLAVE: "router_slave",
    RoleKind.MATCH: "match",
    RoleKind.MATCH_SLAVE: "match_slave",
}
#: the management API refreshes its counters this often (RabbitMQ's default
#: ``collect_statistics_interval``, 5 s), plus a margin
STATS_EVERY_S = 5.5


def per_second(counted: float, wall_s: float) -> float:
    """A rate from two counter reads, the first ``STATS_EVERY_S`` after the phase before
    ended, the second ``STATS_EVERY_S`` after the measured ``wall_s``: each read shows the
    counters as of their last refresh, so the first covers from up to one refresh interval
    before the phase and the second up to ``STATS_EVERY_S`` after it, ``wall_s +
    STATS_EVERY_S`` on average (give or take one interval).  Divided by ``wall_s`` alone,
    a 5 s idle phase read 217 control messages a second where a 90 s one read 115."""
    return counted / (wall_s + STATS_EVERY_S)


def hop_of(deployment: Deployment) -> Callable[[str], str | None]:
    """Queue name -> its hop (HOPS), None for a queue not of this deployment."""
    known: dict[str, str] = {}
    prefix = deployment.prefix
    for cluster in deployment.topology.clusters:
        for role in RoleId.of_cluster(cluster):
            known[role.inbox(prefix)] = _HOP_OF_KIND[role.kind]
            known[role.control(prefix)] = "control"
        known[subscriber_queue_of(prefix, cluster.id)] = "subscriber"

    def hop(name: str) -> str | None:
        if name in known:
            return known[name]
        return "other" if name.startswith(f"{prefix}.") else None

    return hop


def _published(settings: Settings, hop: Callable[[str], str | None]) -> Counter[str]:
    """Messages published into each hop's queues so far (the brokers' counters)."""
    path = f"/api/queues/{vhost_path(settings)}?columns=name,message_stats.publish"
    counts: Counter[str] = Counter()
    for queue in management_get(settings, path, timeout=10.0):
        kind = hop(str(queue.get("name", "")))
        if kind is not None:
            counts[kind] += int((queue.get("message_stats") or {}).get("publish", 0))
    return counts


def _processes(deployment: Deployment) -> dict[str, int]:
    return {"client": os.getpid(), **deployment.processes(), **_brokers()}


def _cpu_by_group(processes: Mapping[str, float | None]) -> dict[str, float]:
    """% of one core, summed per role kind, over the brokers, and the client."""
    out: dict[str, float] = defaultdict(float)
    for name, pct in processes.items():
        if pct is None:
            continue
        group = "brokers" if name.startswith("broker-") else role_kind(name)
        out[group] += pct
    return {k: round(v, 1) for k, v in out.items()}


def _idle(settings: Settings, deployment: Deployment, idle_s: float) -> dict[str, Any]:
    hop = hop_of(deployment)
    time.sleep(STATS_EVERY_S)
    before = _published(settings, hop)
    started = time.monotonic()
    with CpuMeter(_processes(deployment)) as meter:
        time.sleep(idle_s)
    wall = time.monotonic() - started
    time.sleep(STATS_EVERY_S)
    messages = _published(settings, hop) - before
    cpu = _cpu_by_group(meter.result["processes"])
    return {
        "seconds": round(wall, 1),
        "cpu_pct": cpu,
        "roles_pct": round(sum(v for k, v in cpu.items() if k not in ("brokers", "client")), 1),
        "machine_pct": meter.result["machine_pct"],
        "messages_per_s": {k: round(per_second(v, wall), 1) for k, v in sorted(messages.items())},
    }


def _step(
    settings: Settings,
    deployment: Deployment,
    workload: Workload,
    *,
    rate: float,
    duration_s: float,
    warmup_s: float,
    batch_max: int,
    behind_p99_s: float,
    best_share: float,
    idle_cpu_pct: float,
) -> dict[str, Any]:
    loop = settings.event_loop
    hop = hop_of(deployment)
    warm_up(settings, deployment, workload, rate, warmup_s, batch_max)
    time.sleep(STATS_EVERY_S)  # the counters include the warm-up's last messages
    before = _published(settings, hop)
    started = time.monotonic()
    with CpuMeter(_processes(deployment)) as meter:
        row = runtime.run(
            measure(
                settings,
                deployment,
                workload,
                rate=rate,
                duration_s=duration_s,
                batch_max=batch_max,
                count_lost=True,
            ),
            event_loop=loop,
        )
    wall = time.monotonic() - started
    time.sleep(STATS_EVERY_S)
    messages = _published(settings, hop) - before
    processes = meter.result["processes"]
    cpu = _cpu_by_group(processes)
    total_s = sum(pct for pct in processes.values() if pct is not None) / 100 * wall
    delivered = row["delivered_events"]
    kinds = {k: v for k, v in _busiest(processes).items() if k != "client"}
    brokers = [p for n, p in processes.items() if n.startswith("broker-") and p is not None]
    if brokers:
        kinds["a broker"] = max(brokers)
    waiting = _busiest(meter.result["waiting"])
    p99 = row.get("p99_ms")
    share = delivered / max(1, row["events"])
    behind = share < 0.95 * best_share or (p99 is not None and p99 > 1000 * behind_p99_s)
    events = max(1, row["events"])
    return {
        "rate": rate,
        "offered_per_s": row["offered_per_s"],
        "delivered_per_s": round(row["offered_per_s"] * share, 1),
        "events": row["events"],
        "delivered": delivered,
        "mean_ms": row["mean_ms"],
        "p50_ms": row["p50_ms"],
        "p99_ms": p99,
        "wall_s": round(wall, 1),
        "cpu_pct": cpu,
        "machine_pct": meter.result["machine_pct"],
        "steal_pct": meter.result["steal_pct"],
        "delivered_share": round(share, 3),
        "cpu_ms_per_event": round(1000 * total_s / events, 3),
        "cpu_ms_per_delivered_event": round(1000 * total_s / delivered, 3) if delivered else None,
        "cpu_ms_per_event_above_idle": round(
            1000 * max(0.0, total_s - idle_cpu_pct / 100 * wall) / events, 3
        ),
        "cpu_ms_per_event_by_group": {k: round(10 * v * wall / events, 3) for k, v in cpu.items()},
        "waiting_pct": waiting,
        "messages_per_event": {
            k: round(messages[k] / max(1, row["events"]), 2) for k in HOPS if messages[k]
        },
        "limit": limit(cpu.get("client"), meter.result["machine_pct"], kinds),
        "behind": behind,
        **{k: row[k] for k in ("copies_owed", "lost", "duplicates", "unexpected") if k in row},
    }


def _busiest(processes: Mapping[str, float | None]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, pct in processes.items():
        if pct is None or name.startswith("broker-"):
            continue
        kind = role_kind(name)
        out[kind] = max(out.get(kind, 0.0), pct)
    return out


def run_throughput(
    settings: Settings,
    *,
    directory: Path,
    subscriptions: int,
    rates: Sequence[float],
    mechanism: str = "both",
    duration_s: float = 10.0,
    warmup_s: float = 3.0,
    idle_s: float = 20.0,
    behind_p99_s: float = 5.0,
    keep_going: bool = False,
    linger_ms: float | None = None,
    report: Callable[[dict[str, Any]], None] = print,
    topology_fields: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The idle cost, then a row per rate step (see the module's text); ``linger_ms``:
    the topology's ``batch_linger_ms`` (None: its default); ``topology_fields``: more
    topology fields (``copy_batch_max``, ``persistent``, and the detection's
    ``heartbeat_interval_s``, ``heartbeat_misses``, ``slave_beat_interval_s``,
    ``neighbour_check_s``, which set what the idle deployment costs)."""
    fields: dict[str, Any] = dict(topology_fields or {})
    if linger_ms is not None:
        fields["batch_linger_ms"] = linger_ms
    workload = Workload(subscriptions)
    deployment = Deployment(
        directory / f"throughput-{subscriptions}",
        prefix=f"bench-thr-{os.getpid()}",
        amqp_urls=settings.amqp_urls,
        fields=fields,
    )
    loaded = deployment.preload(workload.subscription_docs(deployment.prefix))
    steps: list[dict[str, Any]] = []
    with deployment.running():
        ready_s = runtime.run(
            wait_ready(settings, deployment, workload), event_loop=settings.event_loop
        )
        switches = {"batch_max": deployment.topology.batch_max, **MECHANISMS[mechanism]}
        deployment.phoenix().reconfigure(**switches)
        idle = _idle(settings, deployment, idle_s)
        report({"idle": idle})
        idle_cpu = sum(idle["cpu_pct"].values())
        best_share = 0.0
        for rate in rates:
            step = _step(
                settings,
                deployment,
                workload,
                rate=rate,
                duration_s=duration_s,
                warmup_s=warmup_s,
                batch_max=switches["batch_max"],
                behind_p99_s=behind_p99_s,
                best_share=best_share,
                idle_cpu_pct=idle_cpu,
            )
            best_share = max(best_share, step["delivered_share"])
            steps.append(step)
            report(step)
            if step["behind"] and not keep_going:
                break
    return {
        "subscriptions": subscriptions,
        "loaded": loaded,
        "mechanism": mechanism,
        "batch_linger_ms": deployment.topology.batch_linger_ms,
        "copy_batch_max": deployment.topology.copy_batch_max,
        "persistent": deployment.topology.persistent,
        "detection": {
            key: getattr(deployment.topology, key)
            for key in (
                "heartbeat_interval_s",
                "heartbeat_misses",
                "slave_beat_interval_s",
                "quiet_beat_interval_s",
                "neighbour_check_s",
                "leases",
            )
        },
        "ready_s": round(ready_s, 1),
        "clients_at": list(CLIENTS),
        "idle": idle,
        "steps": steps,
    }


def summarize_throughput(result: Mapping[str, Any]) -> str:
    """The steps as a Markdown table, the idle cost above it."""
    idle = result["idle"]
    beats = ", ".join(f"{k} {v}" for k, v in result.get("detection", {}).items())
    lines = [
        f"idle: roles {idle['roles_pct']} % of one core, brokers "
        f"{idle['cpu_pct'].get('brokers')} %, messages/s {idle['messages_per_s']}"
        + (f" ({beats})" if beats else ""),
        "",
        "| offered/s | delivered/s | mean ms | p99 ms | machine % | CPU ms/event | "
        "above idle | by group (ms/event) | messages/event | copies owed / lost / dup "
        "| limit |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in result["steps"]:
        groups = ", ".join(f"{k} {v}" for k, v in sorted(s["cpu_ms_per_event_by_group"].items()))
        hops = ", ".join(f"{k} {v}" for k, v in s["messages_per_event"].items())
        lines.append(
            f"| {s['offered_per_s']} | {s['delivered_per_s']} | {s['mean_ms']} | {s['p99_ms']} "
            f"| {s['machine_pct']} | {s['cpu_ms_per_event']} | {s['cpu_ms_per_event_above_idle']} "
            f"| {groups} | {hops} "
            f"| {s.get('copies_owed')} / {s.get('lost')} / {s.get('duplicates')} "
            f"| {s['limit']}{' (behind)' if s['behind'] else ''} |"
        )
    return "\n".join(lines)
