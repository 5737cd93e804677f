"""Phoenix messages (middleware/routing/messages.py): one model per kind, parsed and
encoded in one place; what does not fit its kind is refused with the reason."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from middleware.errors import DeadLetter
from middleware.phoenix.ids import RoleId
from middleware.phoenix.protocol import Kind, PhoenixTopology
from middleware.routing.batching import encode as batch
from middleware.routing.batching import split
from middleware.routing.messages import (
    Ack,
    Advertise,
    Answer,
    Beat,
    Configure,
    Confirmation,
    Copy,
    Fence,
    Found,
    HandedOver,
    Handover,
    Heartbeat,
    Join,
    Leave,
    Matched,
    Probe,
    Publish,
    Read,
    Recover,
    Recovered,
    Replicate,
    Retire,
    Snapshot,
    Subscribe,
    Takeover,
    Unsubscribe,
    Unsubscribed,
    Vote,
    encode,
    heartbeat_value,
    parse,
)
from middleware.routing.wiring import outgoing

ONE_OF_EACH = [
    Advertise(event_type="quotes"),
    Subscribe(event_type="quotes", subscription_id="s1", queue="q", filter=[["p", "<", 1]]),
    Unsubscribe(event_type="quotes", subscription_id="s1", home="A", hops=["A"]),
    Unsubscribed(event_type="quotes", latency_level=2),
    Publish(event_type="quotes", event={"event_type": "quotes", "attributes": {"p": 1}}),
    Heartbeat(broker="B/match-0/slave-1", predicted_t=0.1, queue=3, service_rate=100),
    Join(cluster="D"),
    Handover(cluster="D", arc=(1, 2**63)),
    Replicate(state_kind="subscription", key="s1", version=4, table={"queue": "q"}),
    Ack(broker="B/router-slave-0", version=4, key="s1"),
    Read(request="r1", state_kind="routing_table", reply_to="px.B.router.control"),
    Snapshot(request="r1", state_kind="routing_table", broker="B/router-slave-0", last=True),
    Configure(switches={"outer": False}, request="r2", reply_to="px.configure.r2"),
    Takeover(master="B/match-0", request="r3", reply_to="px.takeover.r3"),
    Answer(request="r3", broker="B/match-0"),
    Confirmation(subscription_id="s1", event_type="quotes", broker="B/match-0"),
    Beat(broker="B/match-0", epoch=1, by=-2, reply_to="phoenix.process.x"),
    *(
        Vote(kind=k, broker="B/match-0/slave-1")
        for k in ("election", "election_answer", "coordinator")
    ),
    Fence(broker="B/match-0/slave-0", epoch=2, by=-1),
    Probe(flood="A#1", origin="A", target="C", path=["A", "B"], ttl=3),
    Found(flood="A#1", origin="A", target="C", path=["A", "B"], by="master", at=1),
    Publish(
        event_type="quotes",
        event={"event_type": "quotes", "attributes": {}},
        id="e1",
        via=["B", "C"],
    ),
    Leave(cluster="B", by="A"),
    Recover(cluster="B", arc=(1, 2), masters=2, request="r4", reply_to="px.process.y"),
    Recovered(request="r4", broker="C/match-0", restored=3),
    Retire(broker="B/match-0", slave="B/match-0/slave-1", epoch=2, by=-1),
    Matched(by="C", ids=["e1", "e2"]),
    HandedOver(cluster="D", by="A", count=3),
    Copy(
        event_type="quotes",
        home="A",
        queue="q",
        confirm="e2e",
        copy_id="e1:q",
        publish=Publish(event_type="quotes", event={"event_type": "quotes", "attributes": {}}),
        unreachable=True,
    ),
]


def test_every_kind_has_a_model_and_round_trips() -> None:
    assert {m.kind for m in ONE_OF_EACH} == set(Kind)
    for message in ONE_OF_EACH:
        assert parse(encode(message)) == message
        assert type(parse(encode(message))) is type(message)


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ({"kind": "subscribe", "event_type": "x", "queue": "q"}, "subscription_id"),
        ({"kind": "publish", "event_type": "x"}, "event"),
        (
            {
                "kind": "heartbeat",
                "broker": "B/match-0/slave-0",
                "predicted_t": 0,
                "queue": -1,
                "service_rate": 1,
            },
            "queue",
        ),
        (
            {"kind": "replicate", "state_kind": "s", "key": "k", "version": 0, "table": {}},
            "version",
        ),
        ({"kind": "takeover"}, "master"),
        ({"kind": "join", "cluster": "D", "event_type": "-"}, "event_type"),  # not its field
        ({"kind": "nope"}, "kind"),
        ({"kind": "matched", "by": "C", "ids": [""]}, "ids"),
        ({"kind": "matched", "by": "a b", "ids": ["e1"]}, "by"),
        (
            {
                "kind": "confirmation",
                "subscription_id": "s",
                "event_type": "x",
                "broker": "b",
                "outcome": {"evil": 1},
            },
            "unknown outcome",
        ),
        (
            {"kind": "publish", "event_type": "x", "event": {"event_type": "x"}, "via": ["a b"]},
            "via",
        ),
        (
            {"kind": "probe", "flood": "f", "origin": "A", "target": "B", "path": [], "ttl": 1},
            "path",
        ),
        (
            {"kind": "found", "flood": "f", "origin": "A", "target": "B", "path": ["A"], "by": "x"},
            "by",
        ),
        (
            {"kind": "found", "flood": "f", "origin": "A", "target": "B", "path": ["A"]}
            | {"by": "master", "at": 3},
            "at must index",
        ),
        (
            {"kind": "probe", "flood": "f", "origin": "A", "target": "B", "path": ["C"], "ttl": 1},
            "starts at its origin",
        ),
    ],
)
def test_a_message_that_does_not_fit_its_kind_is_refused_with_why(body, why) -> None:
    with pytest.raises(DeadLetter, match=why):
        parse(json.dumps(body).encode())


def test_a_heartbeat_refuses_what_json_cannot_carry_and_values_are_made_finite() -> None:
    with pytest.raises(DeadLetter):
        parse(
            b'{"kind": "heartbeat", "broker": "b", "predicted_t": NaN, "queue": 0, '
            b'"service_rate": 0}'
        )
    assert heartbeat_value(math.inf) == 1e9 and heartbeat_value(math.nan) == 0.0
    assert heartbeat_value(-3.0) == 0.0 and heartbeat_value(2.5) == 2.5


def test_a_batch_keeps_the_good_messages_and_names_the_bad_one() -> None:
    good = [encode(ONE_OF_EACH[4]), encode(ONE_OF_EACH[0])]
    messages, bad = split(batch([good[0], b'{"kind": "publish"}', good[1]]))
    assert messages == [ONE_OF_EACH[4], ONE_OF_EACH[0]]
    assert len(bad) == 1 and "malformed Phoenix message in a batch" in bad[0][1]


def test_roles_dispatch_by_kind_and_dead_letter_a_kind_not_theirs() -> None:
    """The handler tables: a routing master takes routed kinds in its inbox and replica
    answers on its control queue; a heartbeat in its inbox, or a take-over told to a
    master, is dead-lettered with the reason."""
    from middleware.routing.match_roles import MatchSlave
    from middleware.routing.router_roles import RouterMaster
    from middleware.settings import Settings

    topology = PhoenixTopology.model_validate(
        {
            "clusters": [{"id": "B", "routing_slaves": 1, "match_slaves": 1}],
            "state_store": ":memory:",
        }
    )

    async def scenario() -> None:
        router = RouterMaster(settings=Settings.load(), topology=topology, cluster="B")
        assert set(router.inbox_handlers) == {
            Join,
            Copy,
            Advertise,
            Subscribe,
            Unsubscribe,
            Unsubscribed,
            Publish,
        }
        assert {Ack, Snapshot, Takeover, Beat, Fence} <= set(router.control_handlers)
        # beats from role ids its topology does not give it as slaves are dead-lettered
        for stranger in ("B/router-slave-7", "A/router-slave-0", "B/match-0/slave-0", "x"):
            with pytest.raises(DeadLetter, match="not a slave of B/router"):
                await router.control(Beat(broker=stranger, version=3))
        # a fence no slave can have sent (epoch 0, or the master as started) changes nothing
        with pytest.raises(DeadLetter, match="not for B/router"):
            await router.control(Fence(broker="B/router-slave-0", epoch=0, by=0))
        assert router.switch_to is None
        with pytest.raises(DeadLetter, match="heartbeat is not for a RouterMaster's inbox"):
            await router.handle(ONE_OF_EACH[5])
        with pytest.raises(DeadLetter, match="not its slave"):
            await router.control(Takeover(master="B/router"))
        slave = MatchSlave(
            settings=Settings.load(), topology=topology, cluster="B", index=0, slave=0
        )
        assert set(slave.inbox_handlers) == {Replicate, Read, Publish}
        assert {Takeover, Beat, Vote} <= set(slave.control_handlers)
        with pytest.raises(DeadLetter, match="not its slave"):  # another master's
            await slave.control(Takeover(master=RoleId.router("B").owner))
        router.store.close()

    asyncio.run(scenario())


def test_phoenix_messages_are_persistent_and_expiring_signals_are_not() -> None:
    """What a durable queue holds survives its node's restart (RabbitMQ keeps only
    persistent messages across one); a signal that expires would be stale after it."""
    event = {"event_type": "t", "attributes": {"n": 1}}
    message = Publish(event_type="t", event=event, broker="b")
    assert outgoing(message, "q").delivery_mode == 2
    assert outgoing(message, "q", priority=3).persistent
    assert not outgoing(message, "q", expiration_ms=500).persistent
    assert not outgoing(message, "q", persistent=False).persistent
