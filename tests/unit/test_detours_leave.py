"""``detours.Detours``: a cluster no flood reached for ``leave_after_s`` is declared gone
only when a last round trip over its direct link fails too (a slow cluster on a busy
machine stays in the ring).  The links are in-memory stand-ins: what is tested is the
decision, not a broker."""

from __future__ import annotations

import asyncio
import time

from middleware.phoenix.protocol import PhoenixTopology
from middleware.phoenix.ring import ChordRing
from middleware.routing.detours import Detours

CLUSTERS = ["A", "B", "C"]


class _Link:
    """A direct link whose round trip takes ``delay_s`` (None: refused)."""

    def __init__(self, delay_s: float | None) -> None:
        self.delay_s = delay_s
        self.checks = 0

    @property
    def ready(self) -> bool:
        return self.delay_s is not None

    async def queue_length(self, _queue: str) -> int:
        self.checks += 1
        assert self.delay_s is not None
        await asyncio.sleep(self.delay_s)
        return 0


async def _watch(link: _Link) -> tuple[list[str], Detours, dict[str, int]]:
    topology = PhoenixTopology.model_validate(
        {
            "clusters": [{"id": c} for c in CLUSTERS],
            "link_timeout_s": 0.2,
            "link_retry_s": 0.05,
            "leave_after_s": 0.3,
            "neighbour_check_s": 0,
        }
    )
    declared: list[str] = []
    counts: dict[str, int] = {}

    async def client_for(_cluster: str) -> _Link:
        return link

    async def on_left(cluster: str) -> None:
        declared.append(cluster)

    async def unused(*_args: object) -> None:
        raise AssertionError("no send expected")

    def count(name: str, n: int) -> None:
        counts[name] = counts.get(name, 0) + n

    detours = Detours(
        cluster="C",
        ring=ChordRing(CLUSTERS),
        topology=topology,
        send=unused,
        tell=unused,
        client_for=client_for,  # type: ignore[arg-type]
        count=count,
        prefix="t",
        on_left=on_left,
    )
    # A's direct link failed a while ago and no flood found another way to it
    detours.table.down["A"] = time.monotonic() - 1.0
    detours.table.unreachable.add("A")
    stop = asyncio.Event()
    watching = asyncio.ensure_future(detours.watch(stop))
    await asyncio.sleep(0.6)
    stop.set()
    await watching
    return declared, detours, counts


def test_a_cluster_that_answers_the_last_check_slowly_is_not_declared_gone() -> None:
    # slower than link_timeout_s (every regular retry fails), within twice it
    link = _Link(delay_s=0.3)
    declared, detours, counts = asyncio.run(_watch(link))
    assert declared == []
    assert "A" not in detours.table.down and "A" not in detours.table.unreachable
    assert counts.get("departures_averted") == 1


def test_a_cluster_whose_link_refuses_is_declared_gone_once() -> None:
    link = _Link(delay_s=None)
    declared, _, counts = asyncio.run(_watch(link))
    assert declared == ["A"]
    assert "departures_averted" not in counts


def test_a_cluster_that_never_answers_is_declared_gone() -> None:
    link = _Link(delay_s=5.0)
    declared, _, counts = asyncio.run(_watch(link))
    assert declared == ["A"]
    assert "departures_averted" not in counts
    assert link.checks >= 2  # the regular retry, then the last check
