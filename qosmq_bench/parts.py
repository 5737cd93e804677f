"""One benchmark cell run by several processes (the Spark jobs' ``--tasks-per-cell``):
which part a process is, how the parts meet, and how far apart their clocks are.

The parts meet through a :class:`Coordinator`: Spark's ``BarrierTaskContext`` (its
``barrier()`` and ``allGather()``), or threads in the tests.  A latency measured from a
publish in one process to a handle in another is read on two wall clocks: part 0
answers clock requests over the cell's brokers (:func:`serve_clock`) and every other
part estimates its offset from it as Cristian's algorithm does
(:func:`measure_clock_offset`: the request with the shortest round trip, the offset
known to within half of it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from middleware.transport import REPLY_TO, AsyncClient, Delivery, OutgoingMessage

__all__ = ["Coordinator", "Part", "measure_clock_offset", "serve_clock"]


class Coordinator(Protocol):
    """What the parts of one cell share (Spark's ``BarrierTaskContext`` has both)."""

    def barrier(self) -> None: ...

    def allGather(self, message: str = "") -> list[str]: ...


@dataclass(frozen=True)
class Part:
    """Part ``index`` of ``count`` processes running one cell named ``run_id``."""

    index: int
    count: int
    run_id: str
    coordinator: Coordinator

    def mine(self, k: int) -> bool:
        """Whether client number ``k`` (producer or consumer) runs in this part."""
        return k % self.count == self.index

    async def barrier(self) -> None:
        await asyncio.to_thread(self.coordinator.barrier)

    async def gather(self, value: Any) -> list[Any]:
        """Every part's ``value`` (JSON), in part order; every part must call it."""
        answers = await asyncio.to_thread(self.coordinator.allGather, json.dumps(value))
        return [json.loads(a) for a in answers]


async def serve_clock(client: AsyncClient, queue: str) -> Callable[[], Any]:
    """Answer clock requests on ``queue`` (declared by the caller) with this process's
    ``time.time()``; return what stops answering."""

    async def answer(delivery: Delivery) -> None:
        if delivery.reply_to:
            body = json.dumps(time.time()).encode()
            reply = OutgoingMessage(body, "", delivery.reply_to, mandatory=False)
            await client.publish(reply, confirm=False)

    tag = await client.consume(queue, answer)

    async def stop() -> None:
        await client.cancel(tag)

    return stop


async def measure_clock_offset(
    client: AsyncClient, queue: str, *, samples: int = 12, timeout_s: float = 5.0
) -> tuple[float, float] | None:
    """(offset, error) in seconds of the clock answering on ``queue`` minus this one's:
    of ``samples`` requests the one with the shortest round trip ``rtt``, taken as
    answered half-way (offset within ``rtt / 2``, the error); None without an answer."""
    answers: asyncio.Queue[tuple[float, float]] = asyncio.Queue()

    def on_reply(delivery: Delivery) -> None:
        with contextlib.suppress(ValueError, TypeError):  # not a clock answer
            answers.put_nowait((float(json.loads(delivery.body)), time.time()))

    await client.listen_replies(on_reply)
    best: tuple[float, float] | None = None
    for _ in range(samples):
        sent = time.time()
        request = OutgoingMessage(b"", "", queue, mandatory=False, reply_to=REPLY_TO)
        await client.publish(request, confirm=False)
        try:
            theirs, back = await asyncio.wait_for(answers.get(), timeout_s)
        except TimeoutError:
            continue
        rtt = back - sent
        offset = theirs - (sent + back) / 2
        if best is None or rtt / 2 < best[1]:
            best = (offset, rtt / 2)
    return best
