"""Where routing roles persist their state (paper 000: match masters persist routing
tables, advertisements and subscriptions, periodically and on change).

One interface, two implementations that pass one contract test suite:
:class:`MongoStateStore` (pymongo; production points it at a real MongoDB by URL)
and :class:`SQLiteStateStore` (the embedded default for one host).  Documents are
keyed by (owner, kind, key); ``owner`` is the role (e.g. ``clusterA/match-1``),
``kind`` one of :data:`KINDS`; each carries a version so a recovering role can keep
the newest copy.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_random

from ..errors import ConfigurationError

__all__ = [
    "KINDS",
    "MongoStateStore",
    "SQLiteStateStore",
    "StateStore",
    "handback_key",
    "hold_key",
    "open_store",
    "ring_owner",
]

KINDS = ("routing_table", "advertisement", "subscription", "ring", "adopted")
Document = dict[str, Any]


def ring_owner(prefix: str) -> str:
    """Whose ``ring`` documents hold a deployment's leaves and joins (one per cluster)."""
    return f"{prefix}.ring"


def hold_key(cluster: str) -> str:
    """The ``ring`` document of ``cluster``'s join hold (``joining.JoinHold``): "holding"
    from its router's start, "released" once the hand-over is routed (cluster ids have
    no "/", so it is no cluster's own)."""
    return f"{cluster}/join"


def handback_key(joiner: str) -> str:
    """The ``ring`` document of the previous owner's hand-back of ``joiner``'s arc
    (``handback.OpenRound`` while it is open)."""
    return f"{joiner}/handback"


class StateStore(Protocol):
    def save(self, owner: str, kind: str, key: str, document: Document, version: int) -> None:
        """Insert or replace one document (a newer version wins; an older one is ignored)."""

    def delete(self, owner: str, kind: str, key: str) -> None: ...

    def load(self, owner: str, kind: str) -> dict[str, tuple[int, Document]]:
        """Every document of ``owner`` and ``kind``: key -> (version, document)."""

    def fingerprint(self, owner: str, kind: str) -> tuple[int, int, int]:
        """(how many documents ``owner`` has of ``kind``, the sum and the largest of their
        versions), without reading the documents: a save of a newer version, a new key,
        a delete or a snapshot that changes the set changes it (versions only grow), so a
        read compared with it later knows whether it is still current."""

    def snapshot(
        self, owner: str, kind: str, documents: Mapping[str, tuple[int, Document]]
    ) -> None:
        """Replace everything of ``owner`` and ``kind`` (the periodic persistence)."""

    def close(self) -> None: ...


def _check(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown state kind {kind!r}; one of {', '.join(KINDS)}")


def _locked(exc: BaseException) -> bool:
    return isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc)


class SQLiteStateStore:
    """The embedded default: one SQLite file (WAL), safe across threads."""

    def __init__(self, path: Path | str) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(
            str(path), check_same_thread=False, isolation_level=None, timeout=30
        )
        # Switching a new file to WAL takes an exclusive lock and SQLite does not always wait
        # for it (busy handler skipped): the roles of `phoenix up` start together on one file,
        # and one of 12 processes opening a fresh file at once failed with "database is
        # locked" in 3 of 10 trials.  Set-up is idempotent, so it is retried.
        for attempt in Retrying(
            retry=retry_if_exception(_locked),
            wait=wait_random(0.02, 0.2),
            stop=stop_after_delay(30),
            reraise=True,
        ):
            with attempt:
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute(
                    "CREATE TABLE IF NOT EXISTS state (owner TEXT, kind TEXT, key TEXT,"
                    " version INTEGER, doc TEXT, PRIMARY KEY (owner, kind, key))"
                )

    def save(self, owner: str, kind: str, key: str, document: Document, version: int) -> None:
        _check(kind)
        with self._lock:
            self._db.execute(
                "INSERT INTO state VALUES (?, ?, ?, ?, ?) ON CONFLICT (owner, kind, key) DO "
                "UPDATE SET version = excluded.version, doc = excluded.doc "
                "WHERE excluded.version >= state.version",
                (owner, kind, key, version, json.dumps(document)),
            )

    def delete(self, owner: str, kind: str, key: str) -> None:
        _check(kind)
        with self._lock:
            self._db.execute(
                "DELETE FROM state WHERE owner = ? AND kind = ? AND key = ?", (owner, kind, key)
            )

    def load(self, owner: str, kind: str) -> dict[str, tuple[int, Document]]:
        _check(kind)
        with self._lock:
            rows = self._db.execute(
                "SELECT key, version, doc FROM state WHERE owner = ? AND kind = ?", (owner, kind)
            ).fetchall()
        return {key: (version, json.loads(doc)) for key, version, doc in rows}

    def fingerprint(self, owner: str, kind: str) -> tuple[int, int, int]:
        _check(kind)
        with self._lock:
            n, total, top = self._db.execute(
                "SELECT count(*), coalesce(sum(version), 0), coalesce(max(version), 0) "
                "FROM state WHERE owner = ? AND kind = ?",
                (owner, kind),
            ).fetchone()
        return int(n), int(total), int(top)

    def snapshot(
        self, owner: str, kind: str, documents: Mapping[str, tuple[int, Document]]
    ) -> None:
        _check(kind)
        rows = [(owner, kind, k, v, json.dumps(d)) for k, (v, d) in documents.items()]
        with self._lock:
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM state WHERE owner = ? AND kind = ?", (owner, kind))
            self._db.executemany("INSERT INTO state VALUES (?, ?, ?, ?, ?)", rows)
            self._db.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._db.close()


class MongoStateStore:
    """MongoDB through pymongo: one collection per kind (no dots in names)."""

    BATCH = 5000  # documents per bulk write of a snapshot

    def __init__(
        self, url: str, *, database: str = "qosmq_phoenix", timeout_ms: int = 5000
    ) -> None:
        try:
            from pymongo import MongoClient
        except ImportError as err:
            raise ConfigurationError(
                "the Mongo state store needs pymongo: pip install 'qosmq[mongo]'"
            ) from err
        self._client: Any = MongoClient(url, serverSelectionTimeoutMS=timeout_ms)
        self._db = self._client[database]

    def _collection(self, kind: str) -> Any:
        _check(kind)
        return self._db[f"state_{kind}"]

    def save(self, owner: str, kind: str, key: str, document: Document, version: int) -> None:
        """One conditional upsert: it matches only an older (or equal) version, so a newer
        stored copy makes the upsert's insert collide with its ``_id`` and nothing changes."""
        from pymongo.errors import DuplicateKeyError

        _id = f"{owner}|{key}"
        with contextlib.suppress(DuplicateKeyError):  # a newer version is stored: it wins
            self._collection(kind).replace_one(
                {"_id": _id, "version": {"$lte": version}},
                {"_id": _id, "owner": owner, "key": key, "version": version, "doc": document},
                upsert=True,
            )

    def delete(self, owner: str, kind: str, key: str) -> None:
        self._collection(kind).delete_one({"_id": f"{owner}|{key}"})

    def load(self, owner: str, kind: str) -> dict[str, tuple[int, Document]]:
        return {
            d["key"]: (d["version"], d["doc"])
            for d in self._collection(kind).find({"owner": owner})
        }

    def fingerprint(self, owner: str, kind: str) -> tuple[int, int, int]:
        """The versions only (a projection: the documents stay in the server)."""
        versions = [
            int(d["version"])
            for d in self._collection(kind).find(
                {"owner": owner}, projection={"version": True, "_id": False}
            )
        ]
        return len(versions), sum(versions), max(versions, default=0)

    def snapshot(
        self, owner: str, kind: str, documents: Mapping[str, tuple[int, Document]]
    ) -> None:
        """Upsert every document tagged with a new generation, then delete the owner's
        documents of older generations: a crash between the two leaves the old extra keys
        beside a complete new copy (versions decide on load), never an empty table."""
        from pymongo import ReplaceOne

        collection = self._collection(kind)
        generation = uuid.uuid4().hex
        writes = [
            ReplaceOne(
                {"_id": f"{owner}|{k}"},
                {
                    "_id": f"{owner}|{k}",
                    "owner": owner,
                    "key": k,
                    "version": v,
                    "doc": d,
                    "generation": generation,
                },
                upsert=True,
            )
            for k, (v, d) in documents.items()
        ]
        for i in range(0, len(writes), self.BATCH):
            collection.bulk_write(writes[i : i + self.BATCH], ordered=False)
        older = [{"generation": {"$exists": False}}, {"generation": {"$ne": generation}}]
        collection.delete_many({"owner": owner, "$or": older})

    def close(self) -> None:
        self._client.close()


def open_store(url: str) -> StateStore:
    """``mongodb://…`` -> MongoDB; ``sqlite:///path`` or a plain path -> SQLite."""
    if url.startswith(("mongodb://", "mongodb+srv://")):
        return MongoStateStore(url)
    return SQLiteStateStore(url.removeprefix("sqlite://"))
