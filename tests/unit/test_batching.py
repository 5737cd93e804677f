"""Adaptive batching of role-to-role messages (the logic; over RabbitMQ: the priorities
test of Phoenix)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from middleware.errors import DeadLetter, Unroutable
from middleware.phoenix.protocol import MAX_PRIORITY
from middleware.routing.batching import Batcher, PriorityGate, encode, linger_for, split
from middleware.routing.linkbound import STRETCH_MAX, bounded
from middleware.routing.messages import Publish, parse


def _body(n: int, event_type: str = "quotes") -> bytes:
    message = Publish(
        event_type=event_type,
        event={"event_type": event_type, "attributes": {"n": n}},
    )
    return message.model_dump_json().encode()


class _Recorder:
    """Stands in for the publish of one AMQP message: records what would leave."""

    def __init__(self, fail: BaseException | None = None, delay: float = 0.0) -> None:
        self.published: list[tuple[str, str, bytes, int]] = []
        self.fail, self.delay = fail, delay

    async def __call__(self, cluster: str, queue: str, body: bytes, priority: int) -> None:
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail is not None:
            raise self.fail
        self.published.append((cluster, queue, body, priority))


def test_a_lone_message_leaves_alone_as_the_plain_object() -> None:
    async def run() -> _Recorder:
        publish = _Recorder()
        await Batcher(publish, max_messages=32).send("A", "inbox", _body(1), 0)
        return publish

    publish = asyncio.run(run())
    assert publish.published == [("A", "inbox", _body(1), 0)]
    assert split(publish.published[0][2]) == ([parse(_body(1))], [])


def test_sends_of_one_loop_turn_share_an_amqp_message_per_inbox_at_the_top_priority() -> None:
    async def run() -> tuple[_Recorder, Batcher]:
        publish = _Recorder()
        batcher = Batcher(publish, max_messages=32)
        sends = [batcher.send("A", "inbox", _body(i), 0) for i in range(5)]
        sends += [batcher.send("A", "inbox", _body(i), 7) for i in range(5, 8)]  # urgent
        sends += [batcher.send("A", "inbox", _body(8), 3)]
        sends += [batcher.send("B", "inbox", _body(9), 0)]
        await asyncio.gather(*sends)
        return publish, batcher

    publish, batcher = asyncio.run(run())
    by_key = {(c, q): (body, p) for c, q, body, p in publish.published}
    assert len(publish.published) == 2
    body, priority = by_key["A", "inbox"]
    assert priority == 7  # the urgent ones do not wait behind the bulk ones in the broker
    together, _ = split(body)
    assert [m.event.attributes["n"] for m in together if m.event] == list(range(9))
    body, priority = by_key["B", "inbox"]
    assert priority == 0 and json.loads(body)["event"]["attributes"] == {"n": 9}
    assert (batcher.sent, batcher.batches) == (10, 2)


def test_a_full_batch_leaves_at_once_and_the_next_one_opens() -> None:
    async def run() -> _Recorder:
        publish = _Recorder()
        batcher = Batcher(publish, max_messages=4)
        await asyncio.gather(*(batcher.send("A", "q", _body(i), 0) for i in range(10)))
        return publish

    sizes = [len(split(body)[0]) for _, _, body, _ in asyncio.run(run()).published]
    assert sizes == [4, 4, 2]


def test_max_bytes_closes_a_batch() -> None:
    async def run() -> _Recorder:
        publish = _Recorder()
        batcher = Batcher(publish, max_messages=100, max_bytes=3 * len(_body(0)))
        await asyncio.gather(*(batcher.send("A", "q", _body(0), 0) for i in range(7)))
        return publish

    assert [len(split(b)[0]) for _, _, b, _ in asyncio.run(run()).published] == [3, 3, 1]


def test_one_message_per_amqp_message_when_batching_is_off() -> None:
    async def run() -> _Recorder:
        publish = _Recorder()
        batcher = Batcher(publish, max_messages=1)
        await asyncio.gather(*(batcher.send("A", "q", _body(i), 0) for i in range(3)))
        return publish

    assert [body for _, _, body, _ in asyncio.run(run()).published] == [_body(i) for i in range(3)]


def test_the_linger_is_whole_at_priority_0_and_nothing_at_the_top() -> None:
    assert linger_for(0, 0.005) == 0.005
    assert linger_for(MAX_PRIORITY, 0.005) == 0.0
    assert 0 < linger_for(4, 0.005) < linger_for(3, 0.005) < 0.005
    assert linger_for(0, 0.0) == 0.0


class _Timed(_Recorder):
    """Records when (loop time) each AMQP message left."""

    def __init__(self) -> None:
        super().__init__()
        self.at: list[float] = []

    async def __call__(self, cluster: str, queue: str, body: bytes, priority: int) -> None:
        self.at.append(asyncio.get_running_loop().time())
        await super().__call__(cluster, queue, body, priority)


# a linger far above a loop turn, so that the claims do not hang on the machine's pace
LINGER_S = 0.4


def test_a_lingering_batch_gathers_the_sends_of_later_loop_turns() -> None:
    async def run() -> tuple[_Timed, float]:
        publish = _Timed()
        batcher = Batcher(publish, max_messages=32, linger_s=LINGER_S)
        start = asyncio.get_running_loop().time()
        sends = []
        for i in range(4):  # one send per loop turn, a few ms apart
            sends.append(asyncio.create_task(batcher.send("A", "q", _body(i), 0)))
            await asyncio.sleep(0.005)
        await asyncio.gather(*sends)
        return publish, start

    publish, start = asyncio.run(run())
    assert len(publish.published) == 1
    assert len(split(publish.published[0][2])[0]) == 4
    assert publish.at[0] - start >= LINGER_S * 0.9  # it waited for more


def test_the_top_priority_does_not_linger_and_takes_a_lingering_batch_with_it() -> None:
    async def run() -> tuple[_Timed, float]:
        publish = _Timed()
        batcher = Batcher(publish, max_messages=32, linger_s=LINGER_S)
        start = asyncio.get_running_loop().time()
        bulk = asyncio.create_task(batcher.send("A", "q", _body(0), 0))
        await asyncio.sleep(0.005)
        await batcher.send("A", "q", _body(1), MAX_PRIORITY)  # an urgent one joins
        await bulk
        await batcher.send("B", "q", _body(2), MAX_PRIORITY)  # and one alone
        return publish, start

    publish, start = asyncio.run(run())
    assert [len(split(body)[0]) for _, _, body, _ in publish.published] == [2, 1]
    assert [p for *_, p in publish.published] == [MAX_PRIORITY, MAX_PRIORITY]
    assert publish.at[-1] - start < LINGER_S / 2  # neither waited out the linger


def test_sends_sparser_than_the_linger_leave_without_waiting() -> None:
    """At a light load (the gaps between sends to an inbox longer than the linger) a
    message leaves at the end of its loop turn: the linger would only add its wait."""

    async def run() -> list[float]:
        publish = _Timed()
        batcher = Batcher(publish, max_messages=32, linger_s=0.15)
        waits = []
        for i in range(4):
            sent = asyncio.get_running_loop().time()
            await batcher.send("A", "q", _body(i), 0)
            waits.append(publish.at[-1] - sent)
            await asyncio.sleep(0.3)
        return waits

    waits = asyncio.run(run())
    assert waits[0] >= 0.15 * 0.9  # nothing known of the inbox yet: it lingers
    assert all(w < 0.075 for w in waits[2:]), waits  # the gaps (0.3 s) are known now


def test_a_full_batch_does_not_linger() -> None:
    async def run() -> tuple[_Timed, float]:
        publish = _Timed()
        batcher = Batcher(publish, max_messages=3, linger_s=LINGER_S)
        start = asyncio.get_running_loop().time()
        await asyncio.gather(*(batcher.send("A", "q", _body(i), 0) for i in range(3)))
        return publish, start

    publish, start = asyncio.run(run())
    assert len(publish.published) == 1 and publish.at[0] - start < LINGER_S / 2


def test_a_sender_of_a_lingering_batch_that_is_cancelled_leaves_the_others_theirs() -> None:
    async def run() -> tuple[_Recorder, list[object]]:
        publish = _Recorder()
        batcher = Batcher(publish, max_messages=32, linger_s=0.05)
        tasks = [asyncio.create_task(batcher.send("A", "q", _body(i), 0)) for i in range(3)]
        await asyncio.sleep(0.01)
        tasks[0].cancel()
        return publish, await asyncio.gather(*tasks, return_exceptions=True)

    publish, results = asyncio.run(run())
    assert isinstance(results[0], asyncio.CancelledError) and results[1:] == [None, None]
    assert len(split(publish.published[0][2])[0]) == 3


def test_every_sender_of_a_batch_hears_that_its_publish_failed() -> None:
    async def run() -> list[object]:
        batcher = Batcher(_Recorder(fail=Unroutable("no inbox")), max_messages=32)
        sends = [batcher.send("A", "q", _body(i), 0) for i in range(3)]
        return await asyncio.gather(*sends, return_exceptions=True)

    assert all(isinstance(r, Unroutable) for r in asyncio.run(run()))


def test_a_cancelled_sender_does_not_cancel_the_others_publish() -> None:
    async def run() -> tuple[_Recorder, list[object]]:
        publish = _Recorder(delay=0.05)
        batcher = Batcher(publish, max_messages=32)
        tasks = [asyncio.create_task(batcher.send("A", "q", _body(i), 0)) for i in range(3)]
        await asyncio.sleep(0.01)
        tasks[0].cancel()
        return publish, await asyncio.gather(*tasks, return_exceptions=True)

    publish, results = asyncio.run(run())
    assert isinstance(results[0], asyncio.CancelledError)
    assert results[1:] == [None, None]
    assert len(split(publish.published[0][2])[0]) == 3  # all three left together


def test_a_bound_fails_every_sender_of_a_batch_not_published_within_it() -> None:
    async def run() -> tuple[_Recorder, list[object], float, list[object]]:
        publish = _Recorder(delay=0.2)  # a confirm that comes late
        batcher = Batcher(publish, max_messages=32)
        loop = asyncio.get_running_loop()
        began = loop.time()
        sends = [batcher.send("A", "q", _body(0), 0, bound=0.05)]  # the earliest bound
        sends += [batcher.send("A", "q", _body(i), 0, bound=1.0) for i in (1, 2)]
        sends.append(batcher.send("A", "q", _body(3), 0))  # no bound of its own
        results = await asyncio.gather(*sends, return_exceptions=True)
        waited = loop.time() - began
        later = await asyncio.gather(batcher.send("A", "q", _body(4), 0, bound=1.0))
        await asyncio.sleep(0.25)  # the late publish was not cancelled: it went on
        return publish, results, waited, later

    publish, results, waited, later = asyncio.run(run())
    assert all(isinstance(r, TimeoutError) for r in results)
    assert waited < 0.15  # at the earliest bound, not the publish's 0.2 s
    assert later == [None]  # the next batch is a new one, published within its bound
    assert [len(split(p[2])[0]) for p in publish.published] == [4, 1]


class _Link:
    """A destination link's confirm count, going up every ``every`` seconds while it
    carries traffic (None: silent, as a cut or blackholed link)."""

    def __init__(self, every: float | None) -> None:
        self.confirmed, self.every = 0, every

    async def run(self) -> None:
        while self.every is not None:
            await asyncio.sleep(self.every)
            self.confirmed += 1

    def progress(self, _cluster: str = "") -> int:
        return self.confirmed


def _timed(link: _Link, send: object) -> tuple[object, float]:
    async def run() -> tuple[object, float]:
        ticking = asyncio.create_task(link.run())
        loop = asyncio.get_running_loop()
        began = loop.time()
        try:
            result: object = await send()  # type: ignore[operator]
        except TimeoutError as exc:
            result = exc
        ticking.cancel()
        return result, loop.time() - began

    return asyncio.run(run())


def test_a_bound_stretches_while_the_link_confirms_others() -> None:
    """A busy broker or machine: the confirm comes after 2.5 bounds, and the link
    confirmed other publishes meanwhile: the send is not failed (it would be carried
    around the link and arrive twice)."""
    link = _Link(every=0.01)
    result, took = _timed(link, lambda: bounded(asyncio.sleep(0.25, "ok"), 0.1, link.progress))
    assert result == "ok" and took >= 0.25


def test_a_silent_link_fails_a_send_at_its_bound() -> None:
    link = _Link(every=None)
    result, took = _timed(link, lambda: bounded(asyncio.sleep(5, "ok"), 0.1, link.progress))
    assert isinstance(result, TimeoutError) and took < 0.2


@pytest.mark.parametrize("linked", [True, False])
def test_a_confirm_that_came_while_the_process_did_not_run_is_read_before_the_bound_fails(
    linked: bool,
) -> None:
    """The process is stopped (SIGSTOP) or starved past the bound while the confirm
    comes: it wakes with the bound's timer due and the confirm still to be read (a few
    loop turns away here, as the socket read, the frame parse and the publish's own
    coroutine are): the send is not failed (it would be carried around a working link
    and arrive twice)."""
    link = _Link(every=None)  # nothing else confirmed on the link meanwhile

    async def send() -> object:
        loop = asyncio.get_running_loop()
        confirm: asyncio.Future[str] = loop.create_future()

        def read(turns: int) -> None:
            if turns:
                loop.call_soon(read, turns - 1)
            else:
                confirm.set_result("ok")

        def stopped() -> None:
            time.sleep(0.15)  # the whole loop: the bound passes meanwhile
            read(5)

        loop.call_later(0.01, stopped)
        return await bounded(confirm, 0.1, link.progress if linked else None)

    result, _ = _timed(link, send)
    assert result == "ok"


def test_a_stretched_bound_ends_at_its_cap() -> None:
    """The link confirms others forever, never this one: STRETCH_MAX bounds in all."""
    link = _Link(every=0.01)
    result, took = _timed(link, lambda: bounded(asyncio.sleep(5, "ok"), 0.05, link.progress))
    assert isinstance(result, TimeoutError)
    assert STRETCH_MAX * 0.05 <= took < STRETCH_MAX * 0.05 + 0.2


@pytest.mark.parametrize("every", [0.01, None])
def test_a_batch_bound_stretches_only_while_the_link_confirms_others(
    every: float | None,
) -> None:
    link = _Link(every)
    batcher = Batcher(_Recorder(delay=0.25), max_messages=32, progress=link.progress)

    async def send() -> list[object]:
        sends = [batcher.send("A", "q", _body(i), 0, bound=0.1) for i in range(3)]
        return await asyncio.gather(*sends, return_exceptions=True)

    results, took = _timed(link, send)
    if every is None:  # silent: every sender hears it at the bound
        assert isinstance(results, list) and all(isinstance(r, TimeoutError) for r in results)
        assert took < 0.2 and batcher.stretched == 0
    else:
        assert results == [None, None, None] and took >= 0.25
        assert batcher.stretched >= 2


def test_a_batch_published_within_its_bound_leaves_no_timer_behind() -> None:
    async def run() -> tuple[list[object], int]:
        batcher = Batcher(_Recorder(), max_messages=32)
        sends = (batcher.send("A", "q", _body(i), 0, bound=5.0) for i in range(3))
        results = await asyncio.gather(*sends)
        scheduled = asyncio.get_running_loop()._scheduled  # type: ignore[attr-defined]
        return results, len([h for h in scheduled if not h.cancelled()])

    results, timers = asyncio.run(run())
    assert results == [None, None, None]
    assert timers == 0  # its expiry was cancelled with the publish


def test_split_keeps_the_good_elements_and_names_each_bad_one() -> None:
    bad = {"kind": "publish"}  # no event_type
    body = b"[" + _body(1) + b"," + json.dumps(bad).encode() + b"," + _body(2) + b"]"
    good, malformed = split(body)
    assert [m.event.attributes["n"] for m in good if m.event] == [1, 2]
    assert len(malformed) == 1
    raw, why = malformed[0]
    assert json.loads(raw) == bad and "event_type" in why and "batch" in why


def test_split_of_a_body_that_is_not_json() -> None:
    good, malformed = split(b"[1, 2")
    assert (
        good == [] and malformed[0][0] == b"[1, 2" and "malformed Phoenix batch" in malformed[0][1]
    )
    with pytest.raises(DeadLetter, match="malformed Phoenix message"):
        split(b'{"kind": "nope"}')


def test_encode_is_the_object_alone_and_an_array_for_several() -> None:
    assert encode([_body(1)]) == _body(1)
    assert json.loads(encode([_body(1), _body(2)]))[1]["event"]["attributes"] == {"n": 2}


def test_the_gate_lets_the_most_urgent_waiting_message_in_next() -> None:
    async def run() -> list[str]:
        gate = PriorityGate(2)
        order: list[str] = []
        release = asyncio.Event()

        async def work(name: str, priority: int) -> None:
            async with gate.slot(priority):
                order.append(name)
                await release.wait()

        tasks = [asyncio.create_task(work(f"bulk{i}", 1)) for i in range(5)]
        await asyncio.sleep(0)
        tasks += [asyncio.create_task(work(f"urgent{i}", 9)) for i in range(2)]
        await asyncio.sleep(0)
        assert (gate.free, gate.waiting) == (0, 5)  # two at work, five waiting
        release.set()
        await asyncio.gather(*tasks)
        assert (gate.free, gate.waiting) == (2, 0)
        return order

    assert asyncio.run(run()) == ["bulk0", "bulk1", "urgent0", "urgent1", "bulk2", "bulk3", "bulk4"]


def test_a_waiter_cancelled_gives_its_place_up_and_loses_no_slot() -> None:
    async def run() -> int:
        gate = PriorityGate(1)
        await gate.acquire(0)
        waiter = asyncio.create_task(gate.acquire(5))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        gate.release()
        # given the slot and cancelled before it ran: the slot is passed on
        await gate.acquire(0)
        second = asyncio.create_task(gate.acquire(5))
        await asyncio.sleep(0)
        gate.release()  # the slot goes to ``second`` ...
        second.cancel()  # ... which is cancelled before it resumes
        with pytest.raises(asyncio.CancelledError):
            await second
        return gate.free

    assert asyncio.run(run()) == 1


def test_the_gaps_kept_per_inbox_stay_bounded() -> None:
    from middleware.routing import batching

    async def run() -> Batcher:
        batcher = Batcher(_Recorder(), max_messages=32, linger_s=1e-6)
        for i in range(batching.MAX_INBOXES_TRACKED + 10):  # one-off reply addresses
            await batcher.send("A", f"reply-{i}", _body(i), 0)
        await batcher.send("A", "control", _body(0), MAX_PRIORITY)  # not tracked
        return batcher

    batcher = asyncio.run(run())
    assert len(batcher._gaps) <= batching.MAX_INBOXES_TRACKED
    assert ("A", "control") not in batcher._gaps


def test_publish_many_gets_each_batch_with_its_tags_and_every_sender_its_result() -> None:
    """``publish_many``: the batch as bodies with the tags they were sent with, and what
    it returns is each sender's result (an e2e batch's outcome for each copy)."""
    batches: list[tuple[str, list[bytes], list[object]]] = []

    async def publish_many(cluster: str, queue: str, bodies: list[bytes], tags: list, p: int):
        batches.append((queue, bodies, tags))
        return f"{queue}:{len(bodies)}"

    async def run() -> list[object]:
        batcher = Batcher(max_messages=3, publish_many=publish_many)
        sends = [batcher.send("A", "q", _body(i), 0, tag=i) for i in range(4)]
        return await asyncio.gather(*sends, batcher.send("A", "r", _body(9), 0, tag="r"))

    results = asyncio.run(run())
    assert results == ["q:3", "q:3", "q:3", "q:1", "r:1"]
    assert sorted((q, tags) for q, _, tags in batches if q == "q") == [("q", [0, 1, 2]), ("q", [3])]
    assert [(q, tags) for q, _, tags in batches if q == "r"] == [("r", ["r"])]


def test_a_batcher_takes_one_way_to_publish() -> None:
    with pytest.raises(ValueError, match="publish or publish_many"):
        Batcher(max_messages=2)
