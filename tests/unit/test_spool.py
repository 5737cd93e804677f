"""The spool's accept times: kept per entry, and a spool written before they existed opens."""

from __future__ import annotations

import sqlite3
import time

from middleware.queues.spool import Spool, SpoolEntry


def test_a_spool_without_accept_times_opens_and_ages_from_its_opening(tmp_path) -> None:
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.execute(
        "CREATE TABLE spool (seq INTEGER PRIMARY KEY AUTOINCREMENT, queue TEXT NOT NULL, "
        "message_id TEXT NOT NULL, body BLOB NOT NULL, headers TEXT NOT NULL)"
    )
    db.execute(
        "INSERT INTO spool (queue, message_id, body, headers) VALUES ('q', 'a', x'00', '{}')"
    )
    db.commit()
    db.close()
    spool = Spool(path)
    try:
        assert len(spool) == 1
        time.sleep(0.05)
        assert 0.05 <= spool.oldest_age_s() < 5
        spool.append([SpoolEntry("q", "b", b"1")])
        assert [e.message_id for e in spool.peek(10)] == ["a", "b"]
        spool.delete([e.seq for e in spool.peek(1)])  # the old entry leaves
        assert spool.oldest_age_s() < 1 and spool.stats()["messages"] == 1
        spool.delete([e.seq for e in spool.peek(1)])
        assert spool.oldest_age_s() == 0
    finally:
        spool.close()
    assert spool.oldest_age_s() == 0  # closed: no error from a scrape
