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

import json
import sqlite3
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

__all__ = ["KINDS", "MongoStateStore", "SQLiteStateStore", "StateStore", "open_store"]

KINDS = ("routing_table", "advertisement", "subscription")
Document = dict[str, Any]


class StateStore(Protocol):
    def save(self, owner: str, kind: str, key: str, document: Document, version: int) -> None:
        """Insert or replace one document (a newer version wins; an older one is ignored)."""

    def delete(self, owner: str, kind: str, key: str) -> None: ...

    def load(self, owner: str, kind: str) -> dict[str, tuple[int, Document]]:
        """Every document of ``owner`` and ``kind``: key -> (version, document)."""

    def snapshot(
        self, owner: str, kind: str, documents: Mapping[str, tuple[int, Document]]
    ) -> None:
        """Replace everything of ``owner`` and ``kind`` (the periodic persistence)."""

    def close(self) -> None: ...


def _check(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown state kind {kind!r}; one of {', '.join(KINDS)}")


class SQLiteStateStore:
    """The embedded default: one SQLite file (WAL), safe across threads."""

    def __init__(self, path: Path | str) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS state (owner TEXT, kind TEXT, key TEXT, version INTEGER,"
            " doc TEXT, PRIMARY KEY (owner, kind, key))"
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

    def __init__(
        self, url: str, *, database: str = "qosmq_phoenix", timeout_ms: int = 5000
    ) -> None:
        from pymongo import MongoClient

        self._client: Any = MongoClient(url, serverSelectionTimeoutMS=timeout_ms)
        self._db = self._client[database]

    def _collection(self, kind: str) -> Any:
        _check(kind)
        return self._db[f"state_{kind}"]

    def save(self, owner: str, kind: str, key: str, document: Document, version: int) -> None:
        collection = self._collection(kind)
        current = collection.find_one({"_id": f"{owner}|{key}"})
        if current is not None and current["version"] > version:
            return
        collection.replace_one(
            {"_id": f"{owner}|{key}"},
            {
                "_id": f"{owner}|{key}",
                "owner": owner,
                "key": key,
                "version": version,
                "doc": document,
            },
            upsert=True,
        )

    def delete(self, owner: str, kind: str, key: str) -> None:
        self._collection(kind).delete_one({"_id": f"{owner}|{key}"})

    def load(self, owner: str, kind: str) -> dict[str, tuple[int, Document]]:
        return {
            d["key"]: (d["version"], d["doc"])
            for d in self._collection(kind).find({"owner": owner})
        }

    def snapshot(
        self, owner: str, kind: str, documents: Mapping[str, tuple[int, Document]]
    ) -> None:
        collection = self._collection(kind)
        collection.delete_many({"owner": owner})
        if documents:
            collection.insert_many(
                [
                    {"_id": f"{owner}|{k}", "owner": owner, "key": k, "version": v, "doc": d}
                    for k, (v, d) in documents.items()
                ]
            )

    def close(self) -> None:
        self._client.close()


def open_store(url: str) -> StateStore:
    """``mongodb://…`` -> MongoDB; ``sqlite:///path`` or a plain path -> SQLite."""
    if url.startswith(("mongodb://", "mongodb+srv://")):
        return MongoStateStore(url)
    return SQLiteStateStore(url.removeprefix("sqlite://"))
