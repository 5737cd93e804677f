"""``qosmq bench balance --phases``: weighted dispatch under the faults users meet.

Every algorithm runs in a lane of its own at the same time (a replicated topic each, its
own sidecar and publisher), so they meet the same machine and the same faults.  One
consumer *process* per replica index consumes that replica of every lane at
``service_rate`` messages/s each (prefetch 1, so waiting messages stay in the broker,
where the sidecar sees them).  Phases of ``phase_s`` each:

- ``steady``: nothing wrong;
- ``slow``: replica 0's consumer process serves at a quarter of its rate (SIGUSR1);
- ``kill``: replica 1's consumer process SIGKILLed, started again 12 s later;
- ``delete``: replica 2's queue deleted in every lane, declared again at the phase's end.

Per lane and phase: the latency (publish to handled) p50/p99 of the messages published
in the phase, errors callers saw, and for the faulted replica the seconds from the fault
until its share of the lane's messages fell below half and below a tenth of its steady
share.  Every count is the benchmark's own: what each publisher sent, what each consumer
process wrote down.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from middleware.balancer import BalancedPublisher, BalancerSidecar, declare_replicated_topic
from middleware.settings import Settings
from middleware.transport import AsyncClient, Delivery, QueueKind, QueueSpec

from .stats import percentile

__all__ = ["PHASES", "run_balance_faults"]

PHASES = ("steady", "slow", "kill", "delete")
FAULTED = {"slow": 0, "kill": 1, "delete": 2}  # the replica each fault hits
RESTART_AFTER_S = 12.0


async def _consume(settings: Settings, queues: list[str], service_s: float, out: Path) -> None:
    """One consumer process: every queue in ``queues``, one message at a time each."""
    slow = [False]
    asyncio.get_running_loop().add_signal_handler(
        signal.SIGUSR1, lambda: slow.__setitem__(0, not slow[0])
    )
    client = await AsyncClient(settings=settings).connect()
    with out.open("a", buffering=1) as fh:

        async def handle(d: Delivery) -> None:
            await asyncio.sleep(service_s * (4 if slow[0] else 1))
            fh.write(f"{d.message_id} {time.time():.6f}\n")

        for queue in queues:
            await client.consume(queue, handle, prefetch=1)
        await asyncio.get_running_loop().create_future()  # until killed


def _spawn(
    settings: Settings, queues: list[str], service_s: float, out: Path
) -> subprocess.Popen[bytes]:
    env = {**os.environ, "QOSMQ_AMQP_URLS": ",".join(settings.amqp_urls)}
    return subprocess.Popen(
        [sys.executable, "-m", "qosmq_bench.balance_faults", str(service_s), str(out), *queues],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=(out.with_suffix(".log")).open("ab"),
    )


class _Lane:
    def __init__(self, settings: Settings, algorithm: str, replicas: int, seed: int) -> None:
        self.settings, self.algorithm = settings, algorithm
        self.topic = f"qosmq.bench.faults.{algorithm}.{uuid.uuid4().hex[:6]}"
        self.replicas, self.seed = replicas, seed
        #: message id -> (sent wall time, replica index or None, error kind or None)
        self.sent: dict[str, tuple[float, int | None, str | None]] = {}

    async def publish(self, rate: float, stop: asyncio.Event, go: asyncio.Event) -> None:
        client = await AsyncClient(settings=self.settings).connect()
        publisher = await BalancedPublisher(
            client,
            topic=self.topic,
            replicas=self.replicas,
            algorithm=self.algorithm,
            rng=random.Random(self.seed),
            recheck_s=0.5,
        ).start()
        rng = random.Random(self.seed)
        tasks: set[asyncio.Task[None]] = set()

        async def one(mid: str) -> None:
            at = time.time()
            try:
                queue = await publisher.publish(b"x" * 256, message_id=mid)
                self.sent[mid] = (at, int(queue.rsplit(".r", 1)[1]), None)
            except Exception as exc:  # counted: a caller would have seen it
                self.sent[mid] = (at, None, type(exc).__name__)

        next_at = time.monotonic()
        while not stop.is_set():
            next_at += rng.expovariate(rate)  # Poisson arrivals on the clock, not per sleep
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            if not go.is_set():  # paused between phases, while the replicas drain
                await go.wait()
                next_at = time.monotonic()
            if stop.is_set():
                break
            task = asyncio.create_task(one(f"{self.algorithm}-{uuid.uuid4().hex[:12]}"))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks)
        await publisher.close()
        await client.close()


async def run_balance_faults(
    settings: Settings,
    algorithms: list[str],
    *,
    rate: float = 90.0,
    service_rate: float = 50.0,
    replicas: int = 3,
    phase_s: float = 30.0,
    work_dir: Path,
    kind: QueueKind = QueueKind.QUORUM,
    progress: Any = lambda _line: None,
) -> list[dict[str, Any]]:
    """Run the phases once over one lane per algorithm; a row per (algorithm, phase)."""
    await asyncio.to_thread(work_dir.mkdir, parents=True, exist_ok=True)
    lanes = [_Lane(settings, a, replicas, seed) for seed, a in enumerate(algorithms, 1)]
    for lane in lanes:
        await declare_replicated_topic(settings, lane.topic, replicas, kind=kind)
    outs = [work_dir / f"consumer-{i}.txt" for i in range(replicas)]
    queues = [[f"{lane.topic}.r{i}" for lane in lanes] for i in range(replicas)]
    consumers = [_spawn(settings, queues[i], 1 / service_rate, outs[i]) for i in range(replicas)]
    stop, stop_publishing, go = asyncio.Event(), asyncio.Event(), asyncio.Event()
    go.set()
    sidecars = [
        asyncio.create_task(
            BalancerSidecar(
                settings=settings,
                topic=lane.topic,
                replicas=replicas,
                sample_interval=0.25,
                report_interval=1.0,
            ).run(stop=stop)
        )
        for lane in lanes
    ]
    await asyncio.sleep(3.0)  # consumers subscribed, first reports out
    publishers = [asyncio.create_task(lane.publish(rate, stop_publishing, go)) for lane in lanes]
    starts: dict[str, float] = {}
    ends: dict[str, float] = {}
    admin = await AsyncClient(settings=settings).connect()
    try:
        for phase in PHASES:
            go.set()
            starts[phase] = time.time()
            progress(f"phase {phase} ({phase_s:.0f} s)")
            if phase == "slow":
                consumers[0].send_signal(signal.SIGUSR1)
            elif phase == "kill":
                consumers[1].kill()
            elif phase == "delete":
                for lane in lanes:
                    await admin.delete_queue(f"{lane.topic}.r2")
            waited = 0.0
            while waited < phase_s:
                await asyncio.sleep(0.5)
                waited += 0.5
                if (
                    phase == "kill"
                    and consumers[1].poll() is not None
                    and waited >= RESTART_AFTER_S
                ):
                    consumers[1] = _spawn(settings, queues[1], 1 / service_rate, outs[1])
            if phase == "slow":
                consumers[0].send_signal(signal.SIGUSR1)
            elif phase == "delete":
                for lane in lanes:
                    await admin.declare_queue(QueueSpec(f"{lane.topic}.r2", kind=kind))
            go.clear()  # each phase starts from drained replicas: no backlog carried over
            ends[phase] = time.time()
            await _drained(admin, [f"{lane.topic}.r{i}" for lane in lanes for i in range(replicas)])
        starts["end"] = time.time()
        stop_publishing.set()
        go.set()
        await asyncio.gather(*publishers)
        await asyncio.sleep(10.0)  # the backlog drains
    finally:
        stop.set()
        for task in sidecars:
            with contextlib.suppress(Exception):
                await task
        for proc in consumers:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(10)
        for lane in lanes:
            for i in range(replicas):
                with contextlib.suppress(Exception):
                    await admin.delete_queue(f"{lane.topic}.r{i}")
        await admin.close()
    handled = _handled(outs)
    return [row for lane in lanes for row in _rows(lane, handled, starts, ends, replicas)]


async def _drained(admin: AsyncClient, queues: list[str], within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        lengths = []
        for queue in queues:
            with contextlib.suppress(Exception):
                lengths.append(await admin.queue_length(queue))
        if not any(lengths):
            return
        await asyncio.sleep(0.5)


def _handled(outs: list[Path]) -> dict[str, float]:
    first: dict[str, float] = {}
    for out in outs:
        if out.exists():
            for line in out.read_text().splitlines():
                mid, _, at = line.partition(" ")
                first.setdefault(mid, float(at))
    return first


def _rows(
    lane: _Lane,
    handled: dict[str, float],
    starts: dict[str, float],
    ends: dict[str, float],
    replicas: int,
) -> list[dict[str, Any]]:
    steady = _shares(lane, starts["steady"], ends["steady"], replicas)
    rows = []
    for phase in PHASES:
        begin, end = starts[phase], ends[phase]
        mine = {m: s for m, s in lane.sent.items() if begin <= s[0] < end}
        latencies = sorted(handled[m] - s[0] for m, s in mine.items() if m in handled and not s[2])
        errors = Counter(s[2] for s in mine.values() if s[2])
        lost = [m for m, s in mine.items() if not s[2] and m not in handled]
        row: dict[str, Any] = {
            "algorithm": lane.algorithm,
            "phase": phase,
            "published": len(mine),
            "p50_s": round(percentile(latencies, 50), 3) if latencies else None,
            "p99_s": round(percentile(latencies, 99), 3) if latencies else None,
            "errors": dict(errors),
            "lost": len(lost),
        }
        if phase in FAULTED:
            replica = FAULTED[phase]
            row["to_half_s"], row["to_tenth_s"] = _drop_times(
                lane, begin, end, replica, steady[replica]
            )
        rows.append(row)
    return rows


def _shares(lane: _Lane, begin: float, end: float, replicas: int) -> list[float]:
    counts = Counter(s[1] for s in lane.sent.values() if begin <= s[0] < end and s[1] is not None)
    total = sum(counts.values()) or 1
    return [counts[i] / total for i in range(replicas)]


def _drop_times(
    lane: _Lane, begin: float, end: float, replica: int, base: float
) -> tuple[float | None, float | None]:
    """Seconds from ``begin`` until the replica's share of one-second bins first fell
    below half, and below a tenth, of ``base``."""
    bins: dict[int, Counter[int | None]] = defaultdict(Counter)
    for at, index, _ in lane.sent.values():
        if begin <= at < end:
            bins[int(at - begin)][index] += 1
    found: list[float | None] = [None, None]
    for second in sorted(bins):
        counts = bins[second]
        share = counts[replica] / max(1, sum(counts.values()))
        for k, fraction in enumerate((0.5, 0.1)):
            if found[k] is None and share < fraction * base:
                found[k] = float(second + 1)
    return found[0], found[1]


if __name__ == "__main__":  # a consumer process: service_s, out file, queues
    asyncio.run(_consume(Settings.load(), sys.argv[3:], float(sys.argv[1]), Path(sys.argv[2])))
