"""How the chaos experiment judges a window (``phoenix_chaos.py``): each subscriber's
subscriptions with when they stood, the harness's own filter evaluation, and per
window and subscriber what was expected, delivered, lost, duplicated, dead-lettered,
unexpected or uncertain (a subscription changing, or an event that raced its
unsubscribe), with the ids the report names."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from middleware.routing import HOME_LEFT, MAYBE_DELIVERED

if TYPE_CHECKING:
    from .phoenix_chaos import _Chaos

__all__ = [
    "Condition",
    "Subscriber",
    "Subscription",
    "holds",
    "problems",
    "summarize",
    "window_rows",
]

Condition = tuple[str, str, Any]


def holds(conditions: Sequence[Condition], attributes: dict[str, Any]) -> bool:
    """The harness's own evaluation of a filter (a conjunction), for what it uses."""
    for name, op, value in conditions:
        got = attributes.get(name)
        if op == "<" and not got < value:
            return False
        if op == ">=" and not got >= value:
            return False
        if op == "=" and got != value:
            return False
        if op == "prefix" and not str(got).startswith(value):
            return False
    return True


@dataclass
class Subscription:
    event_type: str
    conditions: list[Condition]
    sent: float  # the subscribe went out
    confirmed: float | None = None  # it was confirmed (None: never)
    removing: float | None = None  # the unsubscribe went out
    removed: float | None = None  # it was confirmed
    refused: str = ""  # a subscribe that was not confirmed: the named error

    def standing(self, t: float) -> bool:
        return (
            self.confirmed is not None
            and self.confirmed <= t
            and (self.removing is None or t < self.removing)
        )

    def changing(self, t: float) -> bool:
        making = self.sent <= t and (self.confirmed is None or t < self.confirmed)
        unmaking = (
            self.removing is not None
            and self.removing <= t
            and (self.removed is None or t < self.removed)
        )
        return making or unmaking


@dataclass
class Subscriber:
    face: str
    confirm: str
    queue: str
    home: str = "A"
    subscriptions: dict[str, Subscription] = field(default_factory=dict)
    got: list[tuple[str, float]] = field(default_factory=list)  # (event id, arrival)

    @property
    def name(self) -> str:
        return f"{self.face}-{self.confirm}@{self.home}"


def _removed_after(sub: Subscriber, eid: str, chaos: _Chaos) -> float | None:
    """Seconds from a lost event's publish to the unsubscribe of a matching subscription
    sent next (None: none was), for the report."""
    event_type, attributes, at = chaos.published[eid]
    later = [
        s.removing - at
        for s in sub.subscriptions.values()
        if s.event_type == event_type
        and holds(s.conditions, attributes)
        and s.removing is not None
        and s.removing >= at
    ]
    return round(min(later), 3) if later else None


def _changes_of(
    sub: Subscriber, eid: str, chaos: _Chaos, begin: float
) -> list[tuple[bool, float | None, float | None, float | None, float | None]]:
    """The queue's subscriptions of a delivered event's type, for the report: whether
    each matches it, and when it was sent, confirmed, removed (sent) and removal
    confirmed, in seconds into the window (None: never)."""
    event_type, attributes, _ = chaos.published[eid]

    def at(t: float | None) -> float | None:
        return None if t is None else round(t - begin, 3)

    return [
        (
            holds(s.conditions, attributes),
            at(s.sent),
            at(s.confirmed),
            at(s.removing),
            at(s.removed),
        )
        for s in sub.subscriptions.values()
        if s.event_type == event_type
    ]


def _standing_for(sub: Subscriber, eid: str, chaos: _Chaos) -> int:
    event_type, attributes, at = chaos.published[eid]
    return sum(
        s.event_type == event_type and holds(s.conditions, attributes) and s.standing(at)
        for s in sub.subscriptions.values()
    )


def _raced_its_unsubscribe(
    matching: list[Subscription], at: float, matched_by: float | None
) -> bool:
    """An event that entered at one cluster while its subscriber's unsubscribe entered at
    another has no order with it: the owner may match it after the removal (the promise
    is for events matched before it).  Said only where the copies tell: every matching
    subscription's unsubscribe was sent after the publish, and the event's first copy to
    any subscriber (so its matching, which came before) arrived after that send.  A copy
    elsewhere before the unsubscribe was even sent proves it was matched in time: lost.
    The witness (a subscriber of every event, homed at B) gives every event a copy, so an
    event no other filter took is judged by evidence too, never by a guess."""
    standing = [s for s in matching if s.standing(at)]
    if not standing or matched_by is None:
        return False
    sends = [s.removing for s in standing]
    return all(t is not None and t >= at for t in sends) and matched_by >= min(
        t for t in sends if t is not None
    )


def window_rows(chaos: _Chaos, kind: str, begin: float, end: float) -> list[dict[str, Any]]:
    rows = []
    first_copy: dict[str, float] = {}  # an event's first copy to any subscriber
    for other in (*chaos.subs, chaos.witness):
        for eid, t in other.got:
            if t < first_copy.get(eid, float("inf")):
                first_copy[eid] = t
    for sub in chaos.subs:
        arrivals = Counter(eid for eid, _ in sub.got)
        expected, uncertain = set(), set()
        for eid, (event_type, attributes, at) in chaos.published.items():
            if not begin <= at < end:
                continue
            matching = [
                s
                for s in sub.subscriptions.values()
                if s.event_type == event_type and holds(s.conditions, attributes)
            ]
            raced = not arrivals[eid] and _raced_its_unsubscribe(matching, at, first_copy.get(eid))
            if raced or any(s.changing(at) for s in matching):
                uncertain.add(eid)
            elif any(s.standing(at) for s in matching):
                expected.add(eid)
        delivered = {eid for eid in expected if arrivals[eid]}
        named = f"{sub.queue} (cluster {sub.home})"

        def home_left(eid: str, named: str = named, surely: bool = False) -> bool:
            return any(
                HOME_LEFT in why and named in why and not (surely and MAYBE_DELIVERED in why)
                for why in chaos.dead.get(eid, ())
            )

        # a copy for a subscriber whose home left the ring: dead-lettered with the reason
        dead_lettered = {eid for eid in expected - delivered if home_left(eid)}
        # ... and one that the reason does not say may have reached it, which did
        dead_but_delivered = [
            eid
            for eid in arrivals
            if eid in chaos.published
            and begin <= chaos.published[eid][2] < end
            and home_left(eid, surely=True)
        ]
        first_arrival: dict[str, float] = {}
        for eid, t in sub.got:
            first_arrival.setdefault(eid, t)

        def asked_by_then(
            eid: str, sub: Subscriber = sub, first_arrival: dict[str, float] = first_arrival
        ) -> bool:
            """A matching subscription was being made or stood when the copy arrived: an
            event that waited (a killed router's inbox) may meet a subscription sent after
            it was published; a subscriber asked for that one before it came."""
            event_type, attributes, _ = chaos.published[eid]
            at = first_arrival[eid]
            return any(
                s.event_type == event_type
                and holds(s.conditions, attributes)
                and (s.standing(at) or s.changing(at))
                for s in sub.subscriptions.values()
            )

        unexpected = [
            eid
            for eid in arrivals
            if eid in chaos.published
            and begin <= chaos.published[eid][2] < end
            and eid not in expected
            and eid not in uncertain
            and not asked_by_then(eid)
        ]
        rows.append(
            {
                "fault": kind,
                "subscriber": sub.name,
                "expected": len(expected),
                "delivered": len(delivered),
                "lost": len(expected - delivered - dead_lettered),
                "lost_ids": [
                    (
                        eid,
                        chaos.published[eid][0],
                        round(chaos.published[eid][2] - begin, 3),
                        _removed_after(sub, eid, chaos),
                        # its first copy to any subscriber, s after the publish (None:
                        # none), and how many of this one's subscriptions stood for it
                        None
                        if eid not in first_copy
                        else round(first_copy[eid] - chaos.published[eid][2], 3),
                        _standing_for(sub, eid, chaos),
                        # the event's dead letters, whatever their reason (first two)
                        [why[:160] for why in chaos.dead.get(eid, ())][:2],
                    )
                    for eid in sorted(expected - delivered - dead_lettered)[:50]
                ],
                "dead_lettered": len(dead_lettered),
                "dead_but_delivered": len(dead_but_delivered),
                "dead_but_delivered_ids": dead_but_delivered[:20],
                "duplicated": sum(
                    n - 1
                    for eid, n in arrivals.items()
                    if n > 1 and eid in chaos.published and begin <= chaos.published[eid][2] < end
                ),
                "unexpected": len(unexpected),
                # (id, type, s into the window published, s after it arrived, the
                # queue's subscriptions of that type: (matches, sent, confirmed, removing,
                # removed), s into the window; None: never)
                "unexpected_ids": [
                    (
                        eid,
                        chaos.published[eid][0],
                        round(chaos.published[eid][2] - begin, 3),
                        round(first_arrival[eid] - chaos.published[eid][2], 3),
                        _changes_of(sub, eid, chaos, begin),
                    )
                    for eid in unexpected[:10]
                ],
                "uncertain": len(uncertain),
            }
        )
    return rows


def summarize(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    head = (
        "| window | subscriber | expected | delivered | dead-lettered | lost | duplicated "
        "| unexpected | uncertain |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r or "unconfirmed" in r:
            what = f"error: {r['error']}" if "error" in r else f"unconfirmed: {r['unconfirmed']}"
            lines.append(f"| {r['fault']} | {r['subscriber']} | {what} ||||||")
            continue
        lines.append(
            f"| {r['fault']} | {r['subscriber']} | {r['expected']} | {r['delivered']} | "
            f"{r['dead_lettered']} | {r['lost']} | {r['duplicated']} | {r['unexpected']} | "
            f"{r['uncertain']} |"
        )
    return "\n".join(lines)


def problems(rows: list[dict[str, Any]]) -> list[str]:
    """What breaks a promise: a loss, an e2e duplicate, an unexpected delivery, an error."""
    out = []
    for r in rows:
        if "error" in r:
            out.append(f"{r['subscriber']}: {r['error']}")
            continue
        if "unconfirmed" in r:  # named, not lost: said, and its events are "uncertain"
            continue
        where = f"{r['fault']} window, {r['subscriber']}"
        if r["lost"]:
            # (id, type, seconds into the window, next unsubscribe after, first copy
            # elsewhere, subscriptions standing, dead letters): enough to find the event
            # in the role logs of a run that failed once
            out.append(f"{where}: {r['lost']} of {r['expected']} lost: {r['lost_ids'][:5]}")
        if r["unexpected"]:
            out.append(f"{where}: {r['unexpected']} unexpected: {r['unexpected_ids'][:5]}")
        if r["dead_but_delivered"]:
            out.append(
                f"{where}: {r['dead_but_delivered']} dead-lettered as if its home had left, "
                "yet delivered"
            )
        if r["duplicated"] and r["subscriber"].endswith("e2e"):
            out.append(f"{where}: {r['duplicated']} duplicates to an e2e subscriber")
    return out
