"""One contract for both state stores: SQLite (embedded) and MongoDB via pymongo.

MongoDB is a real wire-protocol server here: ``nx-27017`` (MongoDB protocol on
SQLite), started on a free loopback port and stopped by PID; production points
the store at a real MongoDB by URL.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from middleware.routing.store import MongoStateStore, SQLiteStateStore, StateStore, open_store


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def mongo_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    exe = shutil.which("nx-27017") or str(Path(sys.executable).with_name("nx-27017"))
    if not Path(exe).exists():
        pytest.skip("nx-27017 is not installed (pip install 'qosmq[test]')")
    port = _free_port()
    db = tmp_path_factory.mktemp("mongo") / "state.db"
    proc = subprocess.Popen(
        [exe, "--db", str(db), "--host", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("nx-27017 did not start")
        time.sleep(0.1)
    from pymongo import MongoClient

    client: MongoClient = MongoClient(
        f"mongodb://127.0.0.1:{port}/", serverSelectionTimeoutMS=10_000
    )
    client.admin.command("ping")  # a real wire-protocol handshake
    client.close()
    try:
        yield f"mongodb://127.0.0.1:{port}/"
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(params=["sqlite", "mongo"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StateStore]:
    if request.param == "sqlite":
        s: StateStore = SQLiteStateStore(tmp_path / "state.sqlite3")
    else:
        s = MongoStateStore(
            request.getfixturevalue("mongo_url"),
            database=f"t{os.getpid()}{abs(hash(request.node.name)) % 10**8}",
        )
    yield s
    s.close()


def test_save_load_delete(store: StateStore) -> None:
    store.save("A/match-1", "subscription", "s1", {"filter": [["price", "<", 10]]}, 1)
    store.save("A/match-1", "subscription", "s2", {"filter": []}, 1)
    store.save("B/match-1", "subscription", "s1", {"other": True}, 1)
    assert store.load("A/match-1", "subscription") == {
        "s1": (1, {"filter": [["price", "<", 10]]}),
        "s2": (1, {"filter": []}),
    }
    store.delete("A/match-1", "subscription", "s2")
    assert set(store.load("A/match-1", "subscription")) == {"s1"}
    assert store.load("A/match-1", "advertisement") == {}


def test_newer_version_wins(store: StateStore) -> None:
    store.save("A/r", "routing_table", "quotes", {"match": "m1"}, 5)
    store.save("A/r", "routing_table", "quotes", {"match": "m0"}, 4)  # stale replica write
    store.save("A/r", "routing_table", "trades", {"match": "m2"}, 1)
    store.save("A/r", "routing_table", "trades", {"match": "m3"}, 2)
    assert store.load("A/r", "routing_table") == {
        "quotes": (5, {"match": "m1"}),
        "trades": (2, {"match": "m3"}),
    }


def test_a_fingerprint_changes_with_every_change_of_an_owners_documents(
    store: StateStore,
) -> None:
    """What a read kept ahead of a leave is checked with: every change shows, another
    owner's or kind's does not, and a snapshot of the same documents changes nothing."""
    assert store.fingerprint("A/m", "subscription") == (0, 0, 0)
    seen = []
    for change in (
        lambda: store.save("A/m", "subscription", "s1", {"x": 1}, 1),
        lambda: store.save("A/m", "subscription", "s2", {"x": 2}, 2),
        lambda: store.save("A/m", "subscription", "s1", {"_deleted": True}, 3),  # tombstone
        lambda: store.delete("A/m", "subscription", "s2"),
    ):
        change()
        seen.append(store.fingerprint("A/m", "subscription"))
    assert seen == [(1, 1, 1), (2, 3, 2), (2, 5, 3), (1, 3, 3)]
    before = store.fingerprint("A/m", "subscription")
    store.save("B/m", "subscription", "s9", {"x": 9}, 7)
    store.save("A/m", "advertisement", "t", {"x": 9}, 8)
    store.save("A/m", "subscription", "s1", {"x": 0}, 1)  # an older version: ignored
    store.snapshot("A/m", "subscription", store.load("A/m", "subscription"))
    assert store.fingerprint("A/m", "subscription") == before


def test_snapshot_replaces_one_owner_and_kind(store: StateStore) -> None:
    store.save("A/m", "advertisement", "old", {"x": 1}, 1)
    store.save("B/m", "advertisement", "keep", {"x": 2}, 1)
    store.snapshot("A/m", "advertisement", {"new1": (3, {"y": 1}), "new2": (3, {"y": 2})})
    assert set(store.load("A/m", "advertisement")) == {"new1", "new2"}
    assert store.load("B/m", "advertisement") == {"keep": (1, {"x": 2})}
    store.snapshot("A/m", "advertisement", {})
    assert store.load("A/m", "advertisement") == {}


def test_snapshot_is_authoritative_and_takes_many_documents(store: StateStore) -> None:
    store.save("A/m", "subscription", "s1", {"stale": True}, 9)
    documents = {f"s{i}": (3, {"i": i}) for i in range(12_000)}  # more than one bulk write
    store.snapshot("A/m", "subscription", documents)
    assert store.load("A/m", "subscription") == documents


def test_a_mongo_snapshot_cut_short_keeps_a_complete_copy(mongo_url: str) -> None:
    """The process dies between writing the new copy and deleting the old one."""

    class Dies(RuntimeError):
        pass

    class DyingStore(MongoStateStore):
        def _collection(self, kind: str) -> Any:
            collection = super()._collection(kind)

            class Cut:
                def __getattr__(self, name: str) -> Any:
                    return getattr(collection, name)

                def delete_many(self, *args: Any, **kwargs: Any) -> None:
                    raise Dies("killed mid-snapshot")

            return Cut()

    database, owner = f"cut{os.getpid()}", f"cut{os.getpid()}/m"
    store = MongoStateStore(mongo_url, database=database)
    store.save(owner, "subscription", "gone", {"old": True}, 1)
    store.save(owner, "subscription", "s1", {"v": 1}, 1)
    store.close()
    dying = DyingStore(mongo_url, database=database)
    with pytest.raises(Dies):
        dying.snapshot(owner, "subscription", {"s1": (2, {"v": 2}), "s2": (2, {"v": 2})})
    dying.close()
    store = MongoStateStore(mongo_url, database=database)
    assert store.load(owner, "subscription") == {
        "gone": (1, {"old": True}),  # left behind, not lost
        "s1": (2, {"v": 2}),
        "s2": (2, {"v": 2}),
    }
    store.close()


def test_unknown_kind_is_refused(store: StateStore) -> None:
    with pytest.raises(ValueError, match="unknown state kind"):
        store.save("A", "nonsense", "k", {}, 1)


def test_state_survives_reopening_the_sqlite_file(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite3"
    first = open_store(str(path))
    first.save("A/m", "subscription", "s1", {"f": 1}, 1)
    first.close()
    again = open_store(f"sqlite://{path}")
    assert again.load("A/m", "subscription") == {"s1": (1, {"f": 1})}
    again.close()


def test_many_roles_opening_a_fresh_sqlite_file_at_once_all_start(tmp_path: Path) -> None:
    """`phoenix up` starts every role together on one new state file; switching it to WAL
    takes an exclusive lock that SQLite does not always wait for, and a router crashed at
    start with "database is locked" (a CI run). 16 connections open a fresh file at the
    same moment, 500 times (the old code failed about 1 time in 75)."""
    import threading

    failures: list[str] = []
    for trial in range(500):
        path = tmp_path / f"s{trial}.sqlite3"
        barrier = threading.Barrier(16)

        def open_one(path: Path = path, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            try:
                store = SQLiteStateStore(path)
                store.save("A/router", "routing_table", "t", {"n": 1}, 1)
                store.close()
            except Exception as exc:
                failures.append(f"{type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=open_one) for _ in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert failures == []
