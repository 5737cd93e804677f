"""Phoenix e2e subscribers frozen (SIGSTOP) or killed under a stream, on both faces.

Two subscriber processes (``tests/phoenix_subscriber_process.py``: the asyncio
``PhoenixClient`` and the pika ``SyncPhoenixClient``), each on an e2e subscription of
its own at A to events B matches, are frozen for 8 s while events go on at 50/s, then
run again.  The freeze outlasts ``e2e_hold_s`` (2 s): the match master stops waiting
for their receipts, counts their copies once their RabbitMQ holds them (the subscriber
*lags*, one probe copy a second waits for a receipt again) and goes on; the copies wait
in their queues.  Once they run again each handler gets every event, once, and a
receipt in time ends the lag (docs/phoenix.md, "What a subscriber can count on").  The
test counts from each process's own file.

The same subscribers SIGKILLed instead, and new processes started 3 s later: every event
is handled; what a killed process handled but had not acked yet goes to the new one,
whose duplicate filter is new, so at most its prefetch may be handled twice.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from middleware.routing.client import PhoenixClient
from middleware.transport import AsyncClient
from tests.integration.phoenix_support import event, owned_by, running
from tests.processes import spawn_ready, stop

pytestmark = [pytest.mark.rabbit, pytest.mark.chaos, pytest.mark.slow]

FACES = ("async", "sync")
RATE, SECONDS, FREEZE_AT = 50, 12.0, 3.0
FAULTS = {"frozen": signal.SIGSTOP, "killed": signal.SIGKILL}
FAULT_S = {"frozen": 8.0, "killed": 3.0}  # frozen for, or dead for until a new process
PREFETCH = 128  # the subscriber's (Settings.prefetch)


def _spawn(face: str, topology: Path, queue: str, out: Path, urls: str) -> subprocess.Popen[str]:
    env = {**os.environ, "QOSMQ_AMQP_URLS": urls}
    args = (face, str(topology), "A", queue, str(out))
    return spawn_ready("tests.phoenix_subscriber_process", *args, env=env)


def _handled(path: Path) -> list[int]:
    return [int(n) for n in path.read_text().split()] if path.exists() else []


@pytest.mark.parametrize("fault", ["frozen", "killed"])
def test_e2e_subscribers_frozen_or_killed_miss_nothing(
    fault: str, settings: Any, brokers: Any, tmp_path: Path, name: str
) -> None:
    urls = ",".join(brokers.urls)
    event_type = owned_by(["A", "B"], "B", "frozen")
    clusters: dict[str, dict[str, object]] = {
        c: {"routing_slaves": 1, "match_slaves": 1} for c in "AB"
    }
    files = {face: tmp_path / f"{face}.handled" for face in FACES}
    procs: dict[str, subprocess.Popen[str]] = {}
    with running(tmp_path, name, settings, urls, clusters) as deployed:

        async def scenario() -> int:
            async with AsyncClient(settings=settings) as client:
                at_a = PhoenixClient(client, topology=deployed.topology, cluster="A")
                for face in FACES:
                    queue = f"{name}.{face}"
                    await at_a.subscribe(event_type, [("n", ">=", -1)], 1, queue, confirm="e2e")
                    procs[face] = _spawn(face, deployed.topology_file, queue, files[face], urls)
                deadline = time.monotonic() + 60  # both paths live end to end
                while time.monotonic() < deadline:
                    await at_a.publish(event(event_type, n=-1))
                    await asyncio.sleep(0.5)
                    if all(-1 in _handled(files[face]) for face in FACES):
                        break
                assert all(-1 in _handled(files[face]) for face in FACES), "no probe handled"
                published, start, frozen, frozen_at = 0, time.monotonic(), False, 0.0
                while (now := time.monotonic() - start) < SECONDS:
                    if not frozen and now >= FREEZE_AT:
                        for proc in procs.values():
                            os.kill(proc.pid, FAULTS[fault])
                        frozen, frozen_at = True, now
                    if frozen and frozen_at and now >= frozen_at + FAULT_S[fault]:
                        if fault == "frozen":
                            for proc in procs.values():
                                os.kill(proc.pid, signal.SIGCONT)
                        else:  # a new process, as a supervisor would start
                            spawned = [
                                asyncio.to_thread(
                                    _spawn, f, deployed.topology_file, f"{name}.{f}", files[f], urls
                                )
                                for f in FACES
                            ]
                            for proc in procs.values():
                                proc.wait(10)
                                if proc.stdout is not None:
                                    proc.stdout.close()
                            procs.update(zip(FACES, await asyncio.gather(*spawned), strict=True))
                        frozen_at = 0.0
                    await at_a.publish(event(event_type, n=published))
                    published += 1
                    await asyncio.sleep(1 / RATE)
                if frozen_at:
                    for proc in procs.values():
                        os.kill(proc.pid, signal.SIGCONT)
                wanted = set(range(published))
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and not all(  # noqa: ASYNC110
                    wanted <= set(_handled(files[face])) for face in FACES
                ):
                    await asyncio.sleep(0.2)
                await asyncio.sleep(3.0)  # copies sent again would be handled by now
                await at_a.close()
            return published

        try:
            published = asyncio.run(scenario())
        finally:
            for proc in procs.values():
                stop(proc)
    for face in FACES:
        handled = [n for n in _handled(files[face]) if n >= 0]
        missing = sorted(set(range(published)) - set(handled))
        assert not missing, f"{face}: {len(missing)} of {published} never handled: {missing[:20]}"
        twice = sorted({n for n in handled if handled.count(n) > 1})
        print(f"\n{fault} {face}: {published} events, {len(twice)} handled twice")
        if fault == "frozen":
            assert not twice, f"{face}: {len(twice)} handled twice: {twice[:20]}"
        else:
            # what the killed process handled but had not acked yet goes to the new one
            # (its duplicate filter died with it): at most its prefetch
            assert len(twice) <= PREFETCH, f"{face}: {len(twice)} handled twice"
