"""The local spool: a durable FIFO where accepted messages wait while no broker is reachable.

SQLite in WAL mode (the paper's second storage option).  ``synchronous=NORMAL``
(the default here) survives the process being killed at any instant: a commit
is in the WAL before ``append`` returns; ``FULL`` also survives power loss at
the cost of an fsync per commit.  Entries leave only through ``delete``, which
the drain calls after the broker confirmed them, so a crash mid-drain resends
at most the unconfirmed window (consumers drop those duplicates by id).
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Gauge

from ..errors import InvalidArgument, PublishError, UnknownName

__all__ = ["Spool", "SpoolEntry", "SpoolFull"]

DEPTH = Gauge("qosmq_spool_messages", "messages waiting in the spool", ["path"])
OLDEST_AGE = Gauge(
    "qosmq_spool_oldest_age_seconds",
    "how long the oldest message in the spool has waited (0: empty)",
    ["path"],
)
APPENDED = Counter("qosmq_spool_appended_total", "messages accepted into the spool", ["path"])
DRAINED = Counter(
    "qosmq_spool_drained_total",
    "messages that left the spool, confirmed by the broker (rate(): the drain rate)",
    ["path"],
)


class SpoolFull(PublishError):
    """The spool reached its size limit (internal; the queue API raises a typed error)."""


@dataclass(frozen=True, slots=True)
class SpoolEntry:
    queue: str
    message_id: str
    body: bytes
    headers: Mapping[str, Any] = field(default_factory=dict)
    seq: int = 0


class Spool:
    """A FIFO of :class:`SpoolEntry` in one SQLite file, safe across threads."""

    def __init__(
        self, path: Path | str, *, max_messages: int = 1_000_000, synchronous: str = "NORMAL"
    ) -> None:
        if synchronous not in ("NORMAL", "FULL"):
            raise ValueError("synchronous must be NORMAL or FULL")
        self.path = Path(path)
        self.max_messages = max_messages
        self._lock = threading.Lock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        except (OSError, sqlite3.Error) as exc:
            raise InvalidArgument(
                f"cannot open the spool {self.path} ({exc}): queues.spool_path must name a "
                "file in a folder this process can write"
            ) from None
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"PRAGMA synchronous={synchronous}")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS spool (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
                "queue TEXT NOT NULL, message_id TEXT NOT NULL, body BLOB NOT NULL, "
                "headers TEXT NOT NULL, added_at REAL)"
            )
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(spool)")}
            if "added_at" not in columns:  # a spool written before entries had a time
                self._db.execute("ALTER TABLE spool ADD COLUMN added_at REAL")
            self._count = self._db.execute("SELECT COUNT(*) FROM spool").fetchone()[0]
        except sqlite3.DatabaseError as exc:
            self._db.close()
            raise InvalidArgument(
                f"{self.path} is not a qosmq spool ({exc}): give the SQLite file that "
                "queues.spool_path names"
            ) from None
        self._opened_at = time.time()  # the age of entries written without a time
        self._label = str(self.path)
        DEPTH.labels(self._label).set_function(lambda: self._count)
        OLDEST_AGE.labels(self._label).set_function(self.oldest_age_s)

    @classmethod
    def open_existing(cls, path: Path | str) -> Spool:
        """Open a spool that must already exist (operator commands never create one)."""
        if not Path(path).is_file():
            raise UnknownName(f"no spool at {path}: give the file that queues.spool_path names")
        return cls(path)

    def __len__(self) -> int:
        return int(self._count)

    def append(self, entries: Iterable[SpoolEntry]) -> list[int]:
        """Append in one transaction; return the sequence numbers.  Raises SpoolFull."""
        now = time.time()
        rows = [(e.queue, e.message_id, e.body, json.dumps(dict(e.headers)), now) for e in entries]
        with self._lock:
            if self._count + len(rows) > self.max_messages:
                raise SpoolFull(f"spool {self.path} holds {self._count} of {self.max_messages}")
            self._db.execute("BEGIN")
            try:
                seqs = [
                    self._db.execute(
                        "INSERT INTO spool (queue, message_id, body, headers, added_at) "
                        "VALUES (?, ?, ?, ?, ?)",
                        row,
                    ).lastrowid
                    or 0
                    for row in rows
                ]
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._count += len(rows)
            APPENDED.labels(self._label).inc(len(rows))
            return seqs

    def peek(self, limit: int, *, after: int = 0) -> list[SpoolEntry]:
        """The oldest ``limit`` entries with ``seq > after``, in order."""
        with self._lock:
            rows = self._db.execute(
                "SELECT seq, queue, message_id, body, headers FROM spool WHERE seq > ? "
                "ORDER BY seq LIMIT ?",
                (after, limit),
            ).fetchall()
        return [SpoolEntry(q, m, bytes(b), json.loads(h), s) for s, q, m, b, h in rows]

    def delete(self, seqs: Iterable[int]) -> None:
        ids = [(s,) for s in seqs]
        if not ids:
            return
        with self._lock:
            self._db.execute("BEGIN")
            self._db.executemany("DELETE FROM spool WHERE seq = ?", ids)
            self._db.execute("COMMIT")
            before = self._count
            self._count = self._db.execute("SELECT COUNT(*) FROM spool").fetchone()[0]
        DRAINED.labels(self._label).inc(max(0, before - self._count))

    def oldest_age_s(self) -> float:
        """Seconds the oldest entry has waited (0 when empty or closed)."""
        try:
            with self._lock:
                row = self._db.execute("SELECT added_at FROM spool ORDER BY seq LIMIT 1").fetchone()
        except sqlite3.ProgrammingError:  # closed
            return 0.0
        if row is None:
            return 0.0
        added = row[0] if row[0] is not None else self._opened_at
        return max(0.0, time.time() - added)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            count, size, oldest = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(LENGTH(body)), 0), MIN(seq) FROM spool"
            ).fetchone()
            queues = dict(
                self._db.execute("SELECT queue, COUNT(*) FROM spool GROUP BY queue").fetchall()
            )
        return {
            "path": str(self.path),
            "messages": count,
            "bytes": size,
            "oldest_seq": oldest,
            "oldest_age_s": round(self.oldest_age_s(), 3),
            "queues": queues,
            "max_messages": self.max_messages,
        }

    def close(self) -> None:
        with self._lock:
            self._db.close()
        for gauge in (DEPTH, OLDEST_AGE):
            with contextlib.suppress(KeyError):
                gauge.remove(self._label)
