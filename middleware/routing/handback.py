"""A previous owner handing a joiner's arc back, without I/O (joining.py: the joiner's side).

:class:`HandBack` is the previous owner's routing master: it asks each of its match
masters to hand the arc over (a ``Send`` of HANDOVER to each), counts their answers
within a bound (``After``, keyed by request: then :meth:`HandBack.expired`), tells the
joiner's router how many (a ``Send`` of HANDED_OVER whose outcome comes back as
:meth:`HandBack.sent`; tried again after ``retry_s``, ``After`` keyed by ``("tell",
request)``, until ``handover_wait_s`` has passed: the link to a rejoining cluster may
still be connecting), then retires the match masters a take-over of the arc had added
(:class:`Retire`).  What each master sends is ``joining.handover_plan``'s choice.

A round outlives the router that started it: the driver records it when it starts and
when it ends (:class:`HandedBack`), and a router elected or restarted while one is open
starts it again (``resumed``).  The masters answer a second HANDOVER with what is left
to send (nothing, if they had the first), and their first answers went to the dead
router, so a resumed round's count would be short: the joiner hears that the hand-over
is under way until the masters all answered, then one last such word, and lets its
events go a bound after it (joining.JoinHold), once what the masters sent is routed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..phoenix.effects import After, Box, Send
from ..phoenix.ids import RoleId
from .messages import HandedOver, Handover

__all__ = ["HandBack", "HandBackEffect", "HandedBack", "NotHandedOver", "OpenRound", "Retire"]


@dataclass(frozen=True, slots=True)
class NotHandedOver:
    """The masters did not all answer within the bound (``told``: False) or the count
    could not be told (``told``: True, ``error`` why); what was sent stays sent."""

    cluster: str
    count: int
    told: bool
    error: str = ""


@dataclass(frozen=True, slots=True)
class Retire:
    """The hand-over is done (``moved`` subscriptions): stop ``masters`` (owner names),
    the ones a take-over of ``cluster``'s arc had added, with their slaves."""

    cluster: str
    masters: tuple[str, ...]
    moved: int


@dataclass(frozen=True, slots=True)
class OpenRound:
    """What a router records of a round it starts (``store.handback_key`` of the joiner),
    for a router elected before it ends to start it again."""

    by: str  # the previous owner: this router's cluster
    arc: tuple[int, int]
    masters: tuple[str, ...]
    retiring: tuple[str, ...]

    def to_document(self) -> dict[str, object]:
        arc = [str(self.arc[0]), str(self.arc[1])]  # 160-bit: as text, for every store
        return {"state": "handing", "by": self.by, "arc": arc, "masters": list(self.masters),
                "retiring": list(self.retiring)}  # fmt: skip

    @classmethod
    def from_document(cls, doc: Any) -> OpenRound | None:
        """The open round a record names (None: it ended); ``ValueError`` naming what is
        wrong with a record no version wrote."""
        if not isinstance(doc, dict) or doc.get("state") != "handing":
            return None
        try:
            start, end = (int(x) for x in doc["arc"])
            masters, retiring = tuple(map(str, doc["masters"])), tuple(map(str, doc["retiring"]))
            return cls(str(doc["by"]), (start, end), masters, retiring)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"hand-back record {doc!r}: {exc!r}") from exc


@dataclass(frozen=True, slots=True)
class HandedBack:
    """The round for ``cluster`` ended (told, or given up): its record is closed."""

    cluster: str


HandBackEffect = Send | After | NotHandedOver | Retire | HandedBack


@dataclass
class _Round:
    cluster: str
    waiting: set[str]
    retiring: tuple[str, ...]
    count: int = 0
    tell_until: float | None = None  # set once the count is being told
    resumed: bool = False  # started again by a router elected meanwhile


@dataclass
class HandBack:
    """A previous owner's routing master handing a joiner's arc back.

    ``answer_s``: how long its match masters may take to answer (``read_timeout_s``);
    ``tell_s``: how long the count is tried on the joiner (``handover_wait_s``, the
    joiner's own hold; a quarter of it: how often the joiner hears, until they all
    answered, that the hand-over is under way); ``retry_s``: between tries;
    ``cluster``: the router's own; ``reply_to``: where its match masters answer (its
    process queue)."""

    answer_s: float
    tell_s: float
    retry_s: float = 0.1
    cluster: str = ""
    reply_to: str | None = None
    rounds: dict[str, _Round] = field(default_factory=dict)

    def start(
        self,
        request: str,
        cluster: str,
        arc: tuple[int, int],
        masters: Iterable[str],
        retiring: Iterable[str] = (),
        *,
        resumed: bool = False,
    ) -> list[HandBackEffect]:
        """``cluster`` joined with ``arc``, which was this router's: every one of
        ``masters`` hands it over; ``retiring`` are stopped once that is done;
        ``resumed``: a round its predecessor started and did not end."""
        asked = tuple(masters)
        self.rounds[request] = _Round(cluster, set(asked), tuple(retiring), resumed=resumed)
        give = Handover(cluster=cluster, arc=arc, request=request, reply_to=self.reply_to)
        # each answers how many it sent; priority 0: behind the arc's events routed here
        # before the join (matched here with the subscriptions still held); none come
        # after it (forwarded to the joiner from now)
        effects: list[HandBackEffect] = [
            Send(RoleId.from_owner(owner), give, box=Box.INBOX, priority=0) for owner in asked
        ]
        return [*effects, After(self.answer_s, request), *self._under_way(request)]

    def answered(self, request: str, master: str, count: int, now: float) -> list[HandBackEffect]:
        """``master`` sent ``count``; the last answer starts telling the joiner."""
        held = self.rounds.get(request)
        if held is None or held.tell_until is not None or master not in held.waiting:
            return []  # late, or twice
        held.waiting.discard(master)
        held.count += count
        if held.waiting:
            return []
        held.tell_until = now + self.tell_s
        return [self._tell(request, held)]

    def expired(self, key: str | tuple[str, str]) -> list[HandBackEffect]:
        """A timer: the masters' bound passed (``key``: the request): if some never
        answered, the round ends here and the masters a take-over added stay (nothing of
        theirs is lost); or (``("tell", request)``) the count is to be told again; or
        (``("note", request)``) the joiner is to hear again that it is under way."""
        if isinstance(key, tuple):
            kind, request = key
            held = self.rounds.get(request)
            if held is None:
                return []
            if kind == "note":
                return [] if held.tell_until is not None else self._under_way(request)
            return [self._tell(request, held)]
        held = self.rounds.get(key)
        if held is None or held.tell_until is not None:
            return []
        del self.rounds[key]
        return [NotHandedOver(held.cluster, held.count, told=False), HandedBack(held.cluster)]

    def sent(self, request: str, error: str | None, now: float) -> list[HandBackEffect]:
        """How telling the count ended (``error``: None once told)."""
        return self.told(request) if error is None else self.tell_failed(request, error, now)

    def told(self, request: str) -> list[HandBackEffect]:
        held = self.rounds.pop(request, None)
        return [] if held is None else [*self._retire(held), HandedBack(held.cluster)]

    def tell_failed(self, request: str, error: str, now: float) -> list[HandBackEffect]:
        """Telling failed: again after ``retry_s`` until ``tell_s`` has passed."""
        held = self.rounds.get(request)
        if held is None or held.tell_until is None:
            return []
        if now < held.tell_until:
            return [After(self.retry_s, ("tell", request))]
        del self.rounds[request]
        return [
            NotHandedOver(held.cluster, held.count, told=True, error=error),
            *self._retire(held),
            HandedBack(held.cluster),
        ]

    def _under_way(self, request: str) -> list[HandBackEffect]:
        """A ``handed_over`` without a count to the joiner's routing master (one bounded
        try: the next one follows), and the next in a quarter of its bound."""
        held, every = self.rounds[request], self.tell_s / 4
        if every <= 0:
            return []  # the joiner does not hold
        note = HandedOver(cluster=held.cluster, by=self.cluster, count=None)
        return [
            Send(RoleId.router(held.cluster), note, bound_s=every, missed="handover_notes_missed"),
            After(every, ("note", request)),
        ]

    def _tell(self, request: str, held: _Round) -> Send:
        """HANDED_OVER (the count; a resumed round's last word has none) to the joiner's
        routing master; its outcome comes back as :meth:`sent`."""
        count = None if held.resumed else held.count
        done = HandedOver(cluster=held.cluster, by=self.cluster, count=count)
        return Send(RoleId.router(held.cluster), done, priority=0, then=request)

    @staticmethod
    def _retire(held: _Round) -> list[HandBackEffect]:
        return [Retire(held.cluster, held.retiring, held.count)] if held.retiring else []
