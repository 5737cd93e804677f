"""Quiet beats (``quiet_beat_interval_s``, docs/phoenix-recovery.md): a master whose
inbox took nothing for ``QUIET_AFTER_S`` beats at the quiet interval and its slaves with
it, each beat saying so, so nobody is suspected for the longer gaps; a master frozen
while quiet is still found (after the quiet interval plus the detection timeout) and
its successor carries every event after; once events come, the beats are back at the
usual pace.

Real role processes, a real SIGSTOP by PID, and counters that are not the code's: the
broker's count of what was published into the slave's control queue (the management
API's) and the events the test's own subscriber queue got."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.parse
from pathlib import Path

import pytest

from middleware.localcluster.manager import pid_alive
from middleware.phoenix.ids import RoleId
from middleware.routing.client import PhoenixClient
from middleware.routing.peer import QUIET_AFTER_S
from middleware.transport import AsyncClient
from middleware.transport.management import management_get
from tests.integration.phoenix_support import eventually
from tests.integration.test_phoenix_recovery import _deployment, _subscribe

pytestmark = [pytest.mark.rabbit, pytest.mark.slow, pytest.mark.chaos]

MASTER = RoleId.match("B", 0)
QUIET_S = 2.0
WINDOW_S = 30.0  # the management API's counters are up to 5 s old at each end


def _published(settings, queue: str) -> int:
    path = f"/api/queues/%2F/{urllib.parse.quote(queue, safe='')}"
    info = management_get(settings, path)
    return int((info.get("message_stats") or {}).get("publish", 0))


def _beats_in_window(settings, queue: str, meanwhile=None) -> int:
    """What the broker counted into ``queue`` over ``WINDOW_S`` (``meanwhile`` runs in
    the window)."""
    before = _published(settings, queue)
    started = time.monotonic()
    if meanwhile is not None:
        meanwhile(WINDOW_S)
    time.sleep(max(0.0, WINDOW_S - (time.monotonic() - started)))
    return _published(settings, queue) - before


async def _collect(settings, queue: str, published: int) -> set[int]:
    """The event numbers the test's subscriber queue got (until all ``published`` came,
    or for 30 s)."""
    got: set[int] = set()
    async with AsyncClient(settings=settings) as client:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(got) < published:
            while (d := await client.get(queue)) is not None:
                got.add(json.loads(d.body)["event"]["attributes"]["n"])
            await asyncio.sleep(0.1)
    return got


def test_a_quiet_master_beats_slowly_is_still_found_when_frozen_and_loses_nothing(
    settings, brokers, tmp_path: Path, name: str
) -> None:
    fields = {"quiet_beat_interval_s": QUIET_S}
    event_type, topology, deployment = _deployment(
        settings, brokers, tmp_path, name, {"A": {}, "B": {"match_slaves": 1}}, fields
    )
    slave0 = MASTER.slaves(topology.cluster("B"))[0]
    queue = f"{name}.sub"
    slave_control = slave0.control(topology.prefix)
    pids = deployment.up()

    async def publish_for(seconds: float, first: int) -> int:
        async with AsyncClient(settings=settings) as client:
            at_a = PhoenixClient(client, topology=topology, cluster="A")
            n, start = first, time.monotonic()
            while time.monotonic() - start < seconds:
                await at_a.publish({"event_type": event_type, "attributes": {"n": n}})
                n += 1
                await asyncio.sleep(0.02)
            return n

    try:
        asyncio.run(_subscribe(settings, topology, event_type, queue))
        published = asyncio.run(publish_for(1.0, 0))
        time.sleep(QUIET_AFTER_S + QUIET_S)  # quiet from here on
        quiet = _beats_in_window(settings, slave_control)
        assert deployment.serves(slave0) == slave0, "a quiet master was taken for failed"
        sent: list[int] = []
        busy = _beats_in_window(
            settings, slave_control, lambda s: sent.append(asyncio.run(publish_for(s, published)))
        )
        published = sent[0]
        time.sleep(QUIET_AFTER_S + QUIET_S)  # quiet again
        os.kill(pids[MASTER], signal.SIGSTOP)
        frozen = time.monotonic()
        eventually(lambda: deployment.serves(slave0) == MASTER, "the successor", 15, 0.02)
        found = time.monotonic() - frozen
        published = asyncio.run(publish_for(2.0, published))
        got = asyncio.run(_collect(settings, queue, published))
    finally:
        if pid_alive(pids[MASTER]):
            os.kill(pids[MASTER], signal.SIGCONT)
        deployment.down()
    print(
        f"\nbeats into {slave_control} over {WINDOW_S:.0f} s: quiet {quiet}, busy {busy}; "
        f"a master frozen while quiet replaced after {found:.2f} s; "
        f"{published} published, {len(got)} got"
    )
    # at the usual 0.2 s a window holds about 150 beats; quiet, about 15 (the counters'
    # age at either end may add a few of the other pace: 22 in 20 s once on a loaded CI)
    assert quiet <= 45, f"{quiet} beats in {WINDOW_S} s while quiet"
    assert busy >= 75, f"only {busy} beats in {WINDOW_S} s while events came"
    # found after the quiet interval plus the detection timeout at most, and an election
    assert found < QUIET_S + 1.0 + 3.0, f"a frozen quiet master found after {found:.2f} s"
    missing = sorted(set(range(published)) - set(got))
    assert not missing, f"{len(missing)} events lost: {missing[:20]}"


LONG_QUIET_S = 8.0  # a pace that, kept after the quiet spell, would excuse 7.8 s more


def test_a_master_that_freezes_as_its_quiet_spell_ends_is_found_at_the_usual_pace(
    settings, brokers, tmp_path: Path, name: str
) -> None:
    """An event reaches a quiet master 0.7 s after its first quiet beat (which said the
    next comes 8 s later); the master freezes 0.3 s after the event.  Its beat thread,
    woken by the delivery, beat at the usual pace before the freeze, so its slave judges
    the silence by the usual rule: a successor in about the detection timeout, not the
    8 s the quiet beat announced.  Every event reaches the test's subscriber."""
    fields = {"quiet_beat_interval_s": LONG_QUIET_S}
    event_type, topology, deployment = _deployment(
        settings, brokers, tmp_path, name, {"A": {}, "B": {"match_slaves": 1}}, fields
    )
    slave0 = MASTER.slaves(topology.cluster("B"))[0]
    queue = f"{name}.sub"
    pids = deployment.up()

    async def publish(numbers: range, gap_s: float = 0.02) -> None:
        async with AsyncClient(settings=settings) as client:
            at_a = PhoenixClient(client, topology=topology, cluster="A")
            for n in numbers:
                await at_a.publish({"event_type": event_type, "attributes": {"n": n}})
                await asyncio.sleep(gap_s)

    try:
        asyncio.run(_subscribe(settings, topology, event_type, queue))
        asyncio.run(publish(range(50)))
        # the master's first quiet beat comes QUIET_AFTER_S after its last delivery
        time.sleep(QUIET_AFTER_S + 0.7)
        asyncio.run(publish(range(50, 51), 0.3))  # one event, 0.3 s for its delivery
        os.kill(pids[MASTER], signal.SIGSTOP)
        frozen = time.monotonic()
        eventually(lambda: deployment.serves(slave0) == MASTER, "the successor", 20, 0.02)
        found = time.monotonic() - frozen
        asyncio.run(publish(range(51, 100)))
        got = asyncio.run(_collect(settings, queue, 100))
    finally:
        if pid_alive(pids[MASTER]):
            os.kill(pids[MASTER], signal.SIGCONT)
        deployment.down()
    print(f"\na master frozen as its quiet spell ended replaced after {found:.2f} s")
    # the usual rule: about 1 s of silence and an election; the quiet beat's pace would
    # have held the slave back until about 8 s after the freeze
    assert found < 4.0, f"the frozen master was found after {found:.2f} s"
    missing = sorted(set(range(100)) - got)
    assert not missing, f"{len(missing)} events lost: {missing[:20]}"
