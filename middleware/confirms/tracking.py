"""End-to-end confirm logic with no I/O: tracking, receipts, batching, duplicate suppression.

Both faces (asyncio and pika) drive these same objects; only sending and
receiving differ.

* :class:`ConfirmTracker` - per published message id, which queues must answer,
  which did, when to retransmit, when to give up.
* :class:`ReceiptBatcher` - consumers' receipts grouped per publisher address,
  flushed by count or after a short linger (like ``multiple`` acks).
* :class:`DuplicateFilter` - a bounded memory of (queue, message id) already
  handled, so a retransmit is acknowledged again without running the handler.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = [
    "CONTENT_HEADER",
    "ELEMENTS_HEADER",
    "RECEIPT_HEADER",
    "RECEIPT_TYPE",
    "ConfirmTracker",
    "DuplicateFilter",
    "PendingConfirm",
    "Receipt",
    "ReceiptBatcher",
    "Resolution",
    "content_digest",
    "decode_elements",
    "decode_receipts",
    "encode_elements",
    "encode_receipts",
    "named_digest",
    "published_age",
    "wants_receipt",
]

#: Header on a data message: "send receipts to my reply_to"; its value is the publish
#: time in milliseconds since the epoch (``1`` from earlier publishers: age unknown).
RECEIPT_HEADER = "x-qosmq-receipt"
#: Header on a data message: the publisher's name for what the message says.  Two
#: messages with one id and one content name are one message to the consumer's duplicate
#: check, whatever else their bodies differ in (a Phoenix event matched by two match
#: brokers is stamped with each's name); without it the body itself is compared.
CONTENT_HEADER = "x-qosmq-content"
#: Header on a data message that carries several messages (a JSON array its consumer
#: hands over one at a time): each element's own id and content name, in order (JSON
#: ``[[id, content], ...]``), so the consumer's duplicate check takes each element as the
#: message it would be alone; the message's one receipt answers for all of them.
ELEMENTS_HEADER = "x-qosmq-elements"
#: AMQP ``type`` property of a receipt batch.
RECEIPT_TYPE = "qosmq.receipts.v1"


@dataclass(frozen=True, slots=True)
class Receipt:
    message_id: str
    queue: str
    ok: bool = True
    reason: str = ""
    #: what the handled message was (``body_digest``); kept by the consumer, never sent
    digest: bytes = b""


def body_digest(body: bytes) -> bytes:
    """Tells a resend (same id, same body: answered with the first receipt) from another
    message reusing the id (same id, other body: refused, never confirmed as handled)."""
    return hashlib.blake2b(body, digest_size=8).digest()


def content_digest(headers: Mapping[str, Any], body: bytes) -> bytes:
    """What the duplicate check compares: the ``CONTENT_HEADER`` when the publisher named
    the content (text or bytes), else the body (``body_digest``)."""
    named = headers.get(CONTENT_HEADER)
    if isinstance(named, str):
        named = named.encode()
    if isinstance(named, bytes | bytearray) and named:
        return hashlib.blake2b(b"content:" + bytes(named), digest_size=8).digest()
    return body_digest(body)


def named_digest(content: str) -> bytes:
    """``content_digest`` of a message whose publisher named its content ``content``."""
    return hashlib.blake2b(b"content:" + content.encode(), digest_size=8).digest()


def encode_elements(elements: Iterable[tuple[str, str]]) -> str:
    """The ``ELEMENTS_HEADER`` of a message carrying these ``(id, content)`` elements."""
    return json.dumps([list(e) for e in elements], separators=(",", ":"))


def decode_elements(value: Any) -> list[tuple[str, str]]:
    """The elements an ``ELEMENTS_HEADER`` names; ``ValueError`` saying what is wrong."""
    if isinstance(value, bytes | bytearray):
        value = bytes(value).decode(errors="replace")
    if not isinstance(value, str):
        raise ValueError(f"{ELEMENTS_HEADER} is not text")
    try:
        data = json.loads(value)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{ELEMENTS_HEADER} is not JSON: {exc}") from None
    if not isinstance(data, list) or not all(
        isinstance(e, list) and len(e) == 2 and all(isinstance(x, str) and x for x in e)
        for e in data
    ):
        raise ValueError(f"{ELEMENTS_HEADER} is not a list of [id, content] pairs")
    return [(e[0], e[1]) for e in data]


def wants_receipt(headers: Mapping[str, Any], reply_to: str | None, message_id: str | None) -> bool:
    """True for a message published by an e2e publisher (plain messages get none)."""
    return bool(reply_to) and bool(message_id) and bool(headers.get(RECEIPT_HEADER))


def published_age(headers: Mapping[str, Any], now: float) -> float | None:
    """Seconds since an e2e message was published (its receipt header), ``now`` being
    ``time.time()``; None when unknown (an old publisher's ``1``, a forged or
    foreign value: only ever used to bound a batch's linger)."""
    value = headers.get(RECEIPT_HEADER)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 1e12:
        return None
    age = now - value / 1000
    return age if 0 <= age < 86_400 else None


def encode_receipts(receipts: Iterable[Receipt]) -> bytes:
    """One batch: positive ids grouped per queue, negatives with their reasons."""
    ok: dict[str, list[str]] = {}
    negative: list[list[str]] = []
    for r in receipts:
        if r.ok:
            ok.setdefault(r.queue, []).append(r.message_id)
        else:
            negative.append([r.message_id, r.queue, r.reason])
    return json.dumps({"v": 1, "ok": ok, "neg": negative}, separators=(",", ":")).encode()


def decode_receipts(body: bytes) -> list[Receipt]:
    """Parse a batch; raise ``ValueError`` naming what is wrong with a malformed one."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"receipt batch is not JSON: {exc}") from None
    except RecursionError:  # json nests by recursion: a hostile batch must not escape
        raise ValueError("receipt batch nests too deep") from None
    if not isinstance(data, dict) or data.get("v") != 1:
        raise ValueError("receipt batch lacks version 1")
    ok, negative = data.get("ok", {}), data.get("neg", [])
    if not isinstance(ok, dict) or not isinstance(negative, list):
        raise ValueError("receipt batch fields 'ok'/'neg' have the wrong type")
    out: list[Receipt] = []
    for queue, ids in ok.items():
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise ValueError(f"receipt ids for queue {queue!r} are not strings")
        out.extend(Receipt(i, queue) for i in ids)
    for item in negative:
        if not (
            isinstance(item, list) and len(item) == 3 and all(isinstance(x, str) for x in item)
        ):
            raise ValueError(f"negative receipt {item!r} is not [id, queue, reason]")
        out.append(Receipt(item[0], item[1], False, item[2]))
    return out


# ---------------------------------------------------------------- publisher
@dataclass
class PendingConfirm:
    message_id: str
    expected: frozenset[str]
    sent_at: float
    deadline: float
    attempts: int = 1
    answered: set[str] = field(default_factory=set)

    @property
    def missing(self) -> frozenset[str]:
        return self.expected - self.answered


class Resolution(Enum):
    CONFIRMED = "confirmed"
    NEGATIVE = "negative"


class ConfirmTracker:
    """Which receipts each in-flight message still waits for; when to resend or give up."""

    def __init__(
        self,
        *,
        timeout: float,
        max_attempts: int,
        backoff: Callable[[int], float] = lambda _attempt: 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if timeout <= 0 or max_attempts < 1:
            raise ValueError("timeout must be > 0 and max_attempts >= 1")
        self.timeout, self.max_attempts = timeout, max_attempts
        self._backoff, self._clock = backoff, clock
        self._pending: dict[str, PendingConfirm] = {}
        self.late_receipts = 0

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, message_id: str) -> bool:
        return message_id in self._pending

    def track(self, message_id: str, expected: frozenset[str]) -> PendingConfirm:
        if not expected:
            raise ValueError("an e2e publish needs at least one expected queue")
        now = self._clock()
        pending = PendingConfirm(message_id, expected, now, now + self.timeout)
        self._pending[message_id] = pending
        return pending

    def on_receipt(self, receipt: Receipt) -> tuple[Resolution, PendingConfirm] | None:
        """Apply one receipt; return the resolution when the message is settled."""
        pending = self._pending.get(receipt.message_id)
        if pending is None or receipt.queue not in pending.expected:
            self.late_receipts += 1  # after a resend both copies answer; the second is late
            return None
        if not receipt.ok:
            del self._pending[receipt.message_id]
            return Resolution.NEGATIVE, pending
        pending.answered.add(receipt.queue)
        if pending.answered >= pending.expected:
            del self._pending[receipt.message_id]
            return Resolution.CONFIRMED, pending
        return None

    def due(self) -> tuple[list[PendingConfirm], list[PendingConfirm]]:
        """(to resend now, to fail now) among messages past their deadline."""
        now = self._clock()
        resend, failed = [], []
        for pending in [p for p in self._pending.values() if p.deadline <= now]:
            if pending.attempts < self.max_attempts:
                pending.attempts += 1
                pending.deadline = now + self.timeout + self._backoff(pending.attempts)
                resend.append(pending)
            else:
                del self._pending[pending.message_id]
                failed.append(pending)
        return resend, failed

    def discard(self, message_id: str) -> None:
        self._pending.pop(message_id, None)


# ----------------------------------------------------------------- consumer
class ReceiptLoad:
    """How many receipts per second a process sends, over windows of ``window_s``.

    Shared by every consumer of a process (:data:`PROCESS_RECEIPT_LOAD`): the CPU a
    receipt message costs is the process's, whichever consumer sends it.
    """

    def __init__(self, *, window_s: float = 0.25, clock: Callable[[], float] = time.monotonic):
        self.window_s, self._clock = window_s, clock
        self._started = clock()
        self._count = 0
        self.rate = 0.0  # receipts/s over the last full window

    def note(self, n: int = 1) -> float:
        """Count ``n`` receipts sent now; return the time (the caller's clock reading)."""
        now = self._clock()
        self._count += n
        elapsed = now - self._started
        if elapsed >= self.window_s:
            self.rate = self._count / elapsed
            self._started, self._count = now, 0
        return now


#: The receipt load of this process, shared by its consumers.
PROCESS_RECEIPT_LOAD = ReceiptLoad()


class ReceiptBatcher:
    """Receipts per publisher address, released by count or after a linger.

    The linger depends on the process's load.  While the process sends fewer than
    ``busy_rate`` receipts per second, a batch waits ``linger_s`` (a light load keeps
    a short confirm); above it, ``busy_linger_s``, so a consumer process under load
    sends one receipt message per many receipts instead of one per one or two, which
    is most of what e2e costs a client beyond the ``broker`` mode.

    Busy, a batch may also wait a fraction (``age_fraction``) of how long its first
    message had already waited since it was published (``age_s``), up to
    ``max_linger_s``: with many publishers each gets few receipts per linger, but each
    confirm then already waits long in the publishers' windows and queues, so a batch
    that waits a tenth of that longer costs a tenth more latency and collects several
    receipts instead of one.  One batcher may serve every consumer of a process (the
    asyncio face shares it per event loop): receipts for one publisher from all of
    them then leave together.
    """

    def __init__(
        self,
        *,
        max_batch: int,
        linger_s: float,
        busy_linger_s: float | None = None,
        busy_rate: float = math.inf,
        load: ReceiptLoad | None = None,
        age_fraction: float = 0.0,
        max_linger_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_batch, self.linger_s, self._clock = max_batch, linger_s, clock
        self.busy_linger_s = linger_s if busy_linger_s is None else max(busy_linger_s, linger_s)
        self.busy_rate = busy_rate
        self.age_fraction = age_fraction
        self.max_linger_s = (
            self.busy_linger_s if max_linger_s is None else max(max_linger_s, self.busy_linger_s)
        )
        self.load = load if load is not None else ReceiptLoad(clock=clock)
        self._batches: dict[str, tuple[float, list[Receipt]]] = {}  # address -> (deadline, batch)

    def __len__(self) -> int:
        return sum(len(b) for _, b in self._batches.values())

    @property
    def busy(self) -> bool:
        return self.load.rate >= self.busy_rate

    def linger(self, age_s: float | None = None) -> float:
        """How long a batch started now may wait (``age_s``: how long its first message
        had waited since it was published, when known)."""
        if not self.busy:
            return self.linger_s
        if age_s is None or not age_s > 0 or not self.age_fraction:  # NaN, negative: unknown
            return self.busy_linger_s
        return min(max(self.busy_linger_s, self.age_fraction * age_s), self.max_linger_s)

    def add(
        self, reply_to: str, receipt: Receipt, age_s: float | None = None
    ) -> list[tuple[str, list[Receipt]]]:
        """Queue a receipt; return the batches that are full."""
        now = self.load.note()
        pending = self._batches.get(reply_to)
        if pending is None:
            pending = self._batches[reply_to] = (now + self.linger(age_s), [])
        batch = pending[1]
        batch.append(receipt)
        if len(batch) >= self.max_batch:
            del self._batches[reply_to]
            return [(reply_to, batch)]
        return []

    def due(self) -> list[tuple[str, list[Receipt]]]:
        """Batches whose linger has passed."""
        now = self._clock()
        ready = [k for k, (deadline, _) in self._batches.items() if now >= deadline]
        return [(k, self._batches.pop(k)[1]) for k in ready]

    def drain(self) -> list[tuple[str, list[Receipt]]]:
        out = [(k, b) for k, (_, b) in self._batches.items()]
        self._batches.clear()
        return out


class DuplicateFilter:
    """The last ``capacity`` (queue, message id) pairs handled, with their receipt.

    The window must outlast the retransmit horizon: a resend arrives at most
    ``max_attempts x (timeout + backoff)`` after the first copy.  The default
    100 000 covers 5 s of resends at 20 000 msg/s per consumer process, for
    about 10 MB.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._seen: OrderedDict[tuple[str, str], Receipt] = OrderedDict()
        self.duplicates = 0

    def get(self, queue: str, message_id: str) -> Receipt | None:
        found = self._seen.get((queue, message_id))
        if found is not None:
            self.duplicates += 1
        return found

    def remember(self, receipt: Receipt) -> None:
        self._seen[(receipt.queue, receipt.message_id)] = receipt
        if len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
