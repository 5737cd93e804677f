"""Content-based subscriptions (paper 000): typed events, filters, and a sub-linear index.

A filter is a conjunction of attribute predicates (=, !=, <, <=, >, >=, in, prefix,
exists).  :class:`SubscriptionIndex`:

* a subscription with an ``=`` or ``in`` predicate is *anchored* on it: a hash
  lookup of the event's attribute values yields the candidates, and only those are
  checked in full - work proportional to the candidates, not the subscriptions;
* the others are matched with the counting algorithm: per attribute, hash indexes
  (!=, exists, prefix) and sorted threshold lists (<, <=, >, >=) yield the
  subscriptions whose predicate an event satisfies; a subscription matches when
  its count reaches its number of predicates.
"""

from __future__ import annotations

import bisect
import functools
import math
import operator
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import InvalidArgument

__all__ = ["Event", "Filter", "FilterError", "Op", "Predicate", "SubscriptionIndex"]

Scalar = str | int | float | bool
_MISSING = object()
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,127}$")


class FilterError(InvalidArgument):
    """A malformed filter or event; the message says which part and why."""


class Op(StrEnum):
    EQ = "="
    NE = "!="
    LT = "<"
    LE = "<="
    GT = ">"
    GE = ">="
    IN = "in"
    PREFIX = "prefix"
    EXISTS = "exists"


class Event(BaseModel):
    """A typed attribute map of one event type."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    event_type: str = Field(pattern=_NAME.pattern)
    attributes: dict[str, Scalar] = Field(default_factory=dict)

    @field_validator("attributes")
    @classmethod
    def _names(cls, value: dict[str, Scalar]) -> dict[str, Scalar]:
        low, high = INT64  # every hop parses every event: common values checked inline
        for name, v in value.items():
            if not _NAME.match(name):
                raise ValueError(f"attribute name {name!r} is not an identifier")
            kind = type(v)
            common = kind is str or (kind is int and low <= v <= high)  # type: ignore[operator]
            common = common or (kind is float and math.isfinite(v))  # type: ignore[arg-type]
            if not common and (problem := _number_problem(v)):
                raise ValueError(f"attribute {name}: {problem}")
        return value

    @classmethod
    def parse(cls, data: Any) -> Event:
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise FilterError(f"malformed event: {exc.errors(include_url=False)}") from None


INT64 = (-(2**63), 2**63 - 1)


def _number_problem(value: Any) -> str | None:
    """Why a number cannot be held (stored as BSON/SQLite, compared as a double), or None."""
    if isinstance(value, int) and not INT64[0] <= value <= INT64[1]:
        return f"integer {value} is beyond 64 bits"
    if isinstance(value, float) and not math.isfinite(value):
        return f"{value} is not a finite number"
    return None


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "b"
    if isinstance(value, int | float):
        return "n"
    return "s"


def _key(value: Scalar) -> tuple[str, Scalar]:
    if type(value) is str:  # the common kind first: every event's attributes come here
        return ("s", value)
    kind = _kind(value)
    return (kind, float(value) if kind == "n" else value)


@dataclass(frozen=True, slots=True)
class Predicate:
    attribute: str
    op: Op
    value: Scalar | tuple[Scalar, ...] | None = None

    def __post_init__(self) -> None:
        if not _NAME.match(self.attribute):
            raise FilterError(f"attribute {self.attribute!r} is not an identifier")
        v = self.value
        for member in v if isinstance(v, tuple) else (v,):
            if problem := _number_problem(member):
                raise FilterError(f"{self.attribute} {self.op}: {problem}")
        match self.op:
            case Op.EXISTS:
                if v is not None:
                    raise FilterError(f"{self.attribute} exists: takes no value")
            case Op.IN:
                if not isinstance(v, tuple) or not v or not all(isinstance(x, Scalar) for x in v):
                    raise FilterError(f"{self.attribute} in: needs a non-empty list of scalars")
            case Op.PREFIX:
                if not isinstance(v, str):
                    raise FilterError(f"{self.attribute} prefix: needs a string")
            case Op.LT | Op.LE | Op.GT | Op.GE:
                if isinstance(v, bool) or not isinstance(v, int | float | str):
                    raise FilterError(f"{self.attribute} {self.op}: needs a number or a string")
            case _:
                if not isinstance(v, Scalar):
                    raise FilterError(f"{self.attribute} {self.op}: needs a scalar value")

    def matches(self, attributes: Mapping[str, Scalar]) -> bool:
        if self.attribute not in attributes:
            return False
        x = attributes[self.attribute]
        v = self.value
        match self.op:
            case Op.EXISTS:
                return True
            case Op.EQ:
                return _key(x) == _key(v)  # type: ignore[arg-type]
            case Op.NE:
                return _key(x) != _key(v)  # type: ignore[arg-type]
            case Op.IN:
                return _key(x) in {_key(m) for m in v}  # type: ignore[union-attr]
            case Op.PREFIX:
                return isinstance(x, str) and x.startswith(v)  # type: ignore[arg-type]
        if _kind(x) != _kind(v):
            return False
        a, b = _key(x)[1], _key(v)[1]  # type: ignore[arg-type]
        return {Op.LT: a < b, Op.LE: a <= b, Op.GT: a > b, Op.GE: a >= b}[self.op]  # type: ignore[operator]


_ORDER = {Op.LT: operator.lt, Op.LE: operator.le, Op.GT: operator.gt, Op.GE: operator.ge}


def _compile(p: Predicate) -> Callable[[Scalar], bool]:
    """``p`` as a test of a present attribute value, same results as ``p.matches``;
    the value's normal form is worked out once, not per event (the index's hot path).
    Subscriptions share tests: one per (operator, typed value)."""
    v = p.value
    typed = tuple((type(m), m) for m in v) if isinstance(v, tuple) else (type(v), v)
    return _compiled(p.op, typed)


@functools.lru_cache(maxsize=1 << 16)
def _compiled(op: Op, typed: Any) -> Callable[[Scalar], bool]:
    v = tuple(m for _, m in typed) if op is Op.IN else typed[1]
    if op is Op.EXISTS:
        return lambda x: True
    if op is Op.PREFIX:
        return lambda x: isinstance(x, str) and x.startswith(v)
    if op is Op.IN:
        members = frozenset(_key(m) for m in v)
        return lambda x: _key(x) in members
    kind, target = _key(v)  # type: ignore[arg-type]  # a scalar for every other operator
    if op in (Op.EQ, Op.NE):
        wanted = op is Op.EQ
        if kind == "n":
            return lambda x: (
                (x == target and isinstance(x, int | float) and not isinstance(x, bool)) is wanted
            )
        if kind == "b":
            return lambda x: (x is target) is wanted
        return lambda x: (x == target and isinstance(x, str)) is wanted
    compare = _ORDER[op]
    if kind == "n":
        return lambda x: (
            isinstance(x, int | float) and not isinstance(x, bool) and compare(x, target)
        )
    return lambda x: isinstance(x, str) and compare(x, target)


@dataclass(frozen=True, slots=True)
class Filter:
    """A conjunction of predicates; no predicates matches every event of the type."""

    predicates: tuple[Predicate, ...] = ()

    def matches(self, attributes: Mapping[str, Scalar]) -> bool:
        return all(p.matches(attributes) for p in self.predicates)

    @classmethod
    def parse(cls, spec: Iterable[Sequence[Any]] | None) -> Filter:
        """From ``[(attribute, op, value?), ...]``, e.g. ``[("price", "<", 10)]``."""
        if spec is not None and (
            isinstance(spec, str | bytes | Mapping) or not isinstance(spec, Iterable)
        ):
            raise FilterError(f"a filter is a list of (attribute, op[, value]), not {spec!r:.80}")
        predicates = []
        for item in spec or ():
            if not isinstance(item, Sequence) or isinstance(item, str) or not 2 <= len(item) <= 3:
                raise FilterError(f"predicate {item!r} is not (attribute, op[, value])")
            try:
                op = Op(item[1])
            except ValueError:
                raise FilterError(
                    f"unknown operator {item[1]!r}; use one of {', '.join(o.value for o in Op)}"
                ) from None
            value = item[2] if len(item) == 3 else None
            if op is Op.IN and isinstance(value, list | tuple | set | frozenset):
                value = tuple(value)
            predicates.append(Predicate(str(item[0]), op, value))
        return cls(tuple(predicates))

    def spec(self) -> list[list[Any]]:
        """The JSON form :meth:`parse` reads: ``[[attribute, op, value?], ...]``."""
        return [
            [
                p.attribute,
                p.op.value,
                *(
                    []
                    if p.value is None
                    else [list(p.value) if isinstance(p.value, tuple) else p.value]
                ),
            ]
            for p in self.predicates
        ]


class SubscriptionIndex:
    """Subscriptions of one event type, matched by counting satisfied predicates."""

    def __init__(self) -> None:
        self.filters: dict[str, Filter] = {}
        self.work = 0  # candidates checked + range postings counted: the cost of matching
        self._match_all: set[str] = set()
        self._anchored: dict[tuple[str, Any], set[str]] = defaultdict(set)
        # sid -> the anchored subscription's other predicates, compiled: (attribute, test)
        self._residual: dict[str, tuple[tuple[str, Callable[[Scalar], bool]], ...]] = {}
        self._eq: dict[tuple[str, Any], set[str]] = defaultdict(set)
        self._ne_all: dict[str, Counter[str]] = defaultdict(Counter)
        self._ne: dict[tuple[str, Any], Counter[str]] = defaultdict(Counter)
        self._exists: dict[str, Counter[str]] = defaultdict(Counter)
        self._prefix: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
        self._prefix_lengths: dict[str, Counter[int]] = defaultdict(Counter)
        # (attribute, op, kind) -> sorted [(threshold, sid)]
        self._ranges: dict[tuple[str, Op, str], list[tuple[Any, str]]] = defaultdict(list)

    def __len__(self) -> int:
        return len(self.filters)

    def add(self, sid: str, flt: Filter) -> None:
        if sid in self.filters:
            self.remove(sid)
        self.filters[sid] = flt
        anchor = _anchor(flt)
        if anchor is not None:
            self._index(sid, anchor, +1, self._anchored)
            self._residual[sid] = tuple(
                (p.attribute, _compile(p)) for p in flt.predicates if p is not anchor
            )
        elif not flt.predicates:
            self._match_all.add(sid)
        else:
            for p in flt.predicates:
                self._index(sid, p, +1, self._eq)

    def remove(self, sid: str) -> None:
        flt = self.filters.pop(sid)
        self._match_all.discard(sid)
        anchor = _anchor(flt)
        if anchor is not None:
            self._index(sid, anchor, -1, self._anchored)
            del self._residual[sid]
        else:
            for p in flt.predicates:
                self._index(sid, p, -1, self._eq)

    def match(self, attributes: Mapping[str, Scalar]) -> set[str]:
        found = set(self._match_all)
        keys = [(name, value, _key(value)) for name, value in attributes.items()]
        for name, _, key in keys:
            candidates = self._anchored.get((name, key), ())
            self.work += len(candidates)
            for sid in candidates:  # the anchor holds (same key): test the rest
                if sid in found:
                    continue
                for attribute, test in self._residual[sid]:
                    x = attributes.get(attribute, _MISSING)
                    if x is _MISSING or not test(x):  # type: ignore[arg-type]
                        break
                else:
                    found.add(sid)
        return found | self._count(keys)

    def _count(self, keys: list[tuple[str, Scalar, tuple[str, Scalar]]]) -> set[str]:
        counts: Counter[str] = Counter()
        for name, value, key in keys:
            counts.update(self._eq.get((name, key), ()))
            if name in self._exists:
                counts.update(self._exists[name])
            if name in self._ne_all:
                counts.update(self._ne_all[name])
                counts.subtract(self._ne.get((name, key), Counter()))
            if isinstance(value, str) and name in self._prefix_lengths:
                for length in self._prefix_lengths[name]:
                    if length <= len(value):
                        counts.update(self._prefix.get((name, value[:length]), ()))
            self._count_ranges(name, key, counts)
        return {sid for sid, c in counts.items() if c and c == len(self.filters[sid].predicates)}

    def _count_ranges(self, name: str, key: tuple[str, Any], counts: Counter[str]) -> None:
        kind, x = key
        for op in (Op.LT, Op.LE, Op.GT, Op.GE):
            entries = self._ranges.get((name, op, kind))
            if not entries:
                continue
            if op is Op.LT:  # x < t: thresholds above x
                hits = entries[bisect.bisect_right(entries, (x, "\uffff")) :]
            elif op is Op.LE:  # x <= t
                hits = entries[bisect.bisect_left(entries, (x, "")) :]
            elif op is Op.GT:  # x > t: thresholds below x
                hits = entries[: bisect.bisect_left(entries, (x, ""))]
            else:  # x >= t
                hits = entries[: bisect.bisect_right(entries, (x, "\uffff"))]
            self.work += len(hits)
            counts.update(sid for _, sid in hits)

    def _index(
        self, sid: str, p: Predicate, sign: int, eq: dict[tuple[str, Any], set[str]]
    ) -> None:
        a, v = p.attribute, p.value
        match p.op:
            case Op.EQ:
                _toggle(eq[(a, _key(v))], sid, sign)  # type: ignore[arg-type]
            case Op.IN:
                for member in {_key(m) for m in v}:  # type: ignore[union-attr]
                    _toggle(eq[(a, member)], sid, sign)
            case Op.NE:
                self._ne_all[a][sid] += sign
                self._ne[(a, _key(v))][sid] += sign  # type: ignore[arg-type]
                _prune(self._ne_all[a], sid)
                _prune(self._ne[(a, _key(v))], sid)  # type: ignore[arg-type]
            case Op.EXISTS:
                self._exists[a][sid] += sign
                _prune(self._exists[a], sid)
            case Op.PREFIX:
                self._prefix[(a, v)][sid] += sign  # type: ignore[index]
                self._prefix_lengths[a][len(v)] += sign  # type: ignore[arg-type]
                _prune(self._prefix[(a, v)], sid)  # type: ignore[index]
                _prune(self._prefix_lengths[a], len(v))  # type: ignore[arg-type]
            case _:
                kind, t = _key(v)  # type: ignore[arg-type]
                entries = self._ranges[(a, p.op, kind)]
                if sign > 0:
                    bisect.insort(entries, (t, sid))
                else:
                    entries.remove((t, sid))


def _anchor(flt: Filter) -> Predicate | None:
    """The predicate a subscription is found by: its first = (else its first in)."""
    for op in (Op.EQ, Op.IN):
        for p in flt.predicates:
            if p.op is op:
                return p
    return None


def _toggle(members: set[str], sid: str, sign: int) -> None:
    if sign > 0:
        members.add(sid)
    else:
        members.discard(sid)


def _prune(counter: Counter[Any], key: Any) -> None:
    if counter[key] <= 0:
        del counter[key]
