"""``replicas.ReplicaLog``: W-of-N writes and R-of-N reads with read repair, without a
broker and without patching; the orderings (acks late, lost or repeated, reads meeting
writes still in flight) by hypothesis."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from middleware.errors import DeadLetter
from middleware.phoenix.ids import RoleId
from middleware.routing.messages import Ack, Read, Replicate, Snapshot
from middleware.routing.replicas import (
    TOMBSTONE,
    GaveUp,
    Persist,
    ReplicaLog,
    Send,
    Written,
    live,
)

SLAVES = [RoleId.router_slave("B", j) for j in range(2)]


def _log(slaves: list[RoleId] = SLAVES, **kwargs: Any) -> ReplicaLog:
    return ReplicaLog(
        owner="B/router",
        kind="routing_table",
        replicas=slaves,
        n=len(slaves) + 1,
        reply_to="proc",
        **kwargs,
    )


def test_a_write_is_persisted_replicated_and_written_at_w_of_n() -> None:
    log = _log()
    assert (log.quorum.replicas, log.quorum.write, log.quorum.read) == (3, 2, 2)
    version, effects = log.write("quotes", {"level_sum": 1, "count": 1})
    assert version == 1
    assert effects[0] == Persist("quotes", 1, {"level_sum": 1, "count": 1})
    sends = [e for e in effects if isinstance(e, Send)]
    assert [e.to for e in sends] == SLAVES
    assert all(isinstance(e.message, Replicate) and e.message.version == 1 for e in sends)
    assert all(e.message.reply_to == "proc" for e in sends)
    assert not any(isinstance(e, Written) for e in effects)  # the master alone is 1 of W = 2
    assert log.on_ack(Ack(broker=SLAVES[1].owner, version=1)) == [Written(1)]
    assert log.on_ack(Ack(broker=SLAVES[0].owner, version=1)) == []  # late: written once
    assert not log.pending


def test_a_single_replica_set_is_written_at_once() -> None:
    _, effects = _log(slaves=[]).write("a", {"x": 1})
    assert effects == [Persist("a", 1, {"x": 1}), Written(1)]


def test_an_ack_or_a_snapshot_from_outside_the_set_is_dead_lettered() -> None:
    log = _log()
    log.write("a", {"x": 1})
    with pytest.raises(DeadLetter, match="not a replica of B/router"):
        log.on_ack(Ack(broker="B/router-slave-7", version=1))
    with pytest.raises(DeadLetter):
        log.page(Snapshot(request="r", state_kind="routing_table", broker="C/router", last=True))
    assert 1 in log.pending  # the forged ack did not count


def test_writes_never_acknowledged_are_given_up_oldest_first() -> None:
    log = _log(max_pending=3)
    gave_up = []
    for i in range(5):
        _, effects = log.write(f"s{i}", {"q": i})
        gave_up += [e.version for e in effects if isinstance(e, GaveUp)]
    assert gave_up == [1, 2] and sorted(log.pending) == [3, 4, 5]
    assert log.acked(1, SLAVES[0].owner) == []  # an ack after giving up changes nothing


def test_a_tagged_write_is_owed_by_each_replica_until_it_acknowledges() -> None:
    log = _log()
    log.write("s1", {"q": 1}, tag="quotes")
    log.write("s2", {"q": 2}, tag="quotes")
    log.write("s3", {"q": 3}, tag="news")
    log.write("s4", {"q": 4})  # untagged: owed by nobody
    assert log.owing("quotes") == set(SLAVES) and log.owing("trades") == set()
    log.on_ack(Ack(broker=SLAVES[0].owner, version=1))
    log.on_ack(Ack(broker=SLAVES[0].owner, version=2))
    assert log.owing("quotes") == {SLAVES[1]}  # written at W already; slave 1 still owes
    log.on_ack(Ack(broker=SLAVES[1].owner, version=2))
    assert log.owing("quotes") == {SLAVES[1]}  # version 1 still
    log.on_ack(Ack(broker=SLAVES[1].owner, version=1))
    assert log.owing("quotes") == set() and log.owing("news") == set(SLAVES)
    assert set(log.unacked) == {3}


def test_what_a_silent_replica_owes_is_forgotten_beyond_max_pending() -> None:
    log = _log(max_pending=2)
    for i in range(4):
        log.write(f"s{i}", {"q": i}, tag=f"t{i}")
    assert sorted(log.unacked) == [3, 4]
    assert log.owing("t0") == set() and log.owing("t3") == set(SLAVES)


def _priorities(effects: list[Any]) -> set[int]:
    return {e.priority for e in effects if isinstance(e, Send)}


def test_a_write_behind_the_events_goes_at_the_lowest_priority_and_keeps_its_key_behind() -> None:
    """A hand-over's tombstone goes behind the events already in the slaves' inboxes;
    a later write of the same key follows it there until every replica acknowledged
    it (it would otherwise overtake it and be deleted by it), other keys do not."""
    log = _log()
    _, effects = log.write("s1", None, behind=True)
    assert _priorities(effects) == {0}
    assert _priorities(log.write("s2", {"q": 2})[1]) == {9}  # another key: ahead
    assert _priorities(log.write("s1", {"q": 1})[1]) == {0}  # behind the tombstone
    for version in (1, 3):
        log.on_ack(Ack(broker=SLAVES[0].owner, version=version))
    assert _priorities(log.write("s1", {"q": 3})[1]) == {0}  # slave 1 still owes them
    for version in (1, 3, 4):
        log.on_ack(Ack(broker=SLAVES[1].owner, version=version))
    log.on_ack(Ack(broker=SLAVES[0].owner, version=4))
    assert _priorities(log.write("s1", {"q": 4})[1]) == {9}  # acknowledged: ahead again
    assert set(log.unacked) == set()


def test_writes_behind_a_silent_replica_are_forgotten_beyond_max_pending() -> None:
    log = _log(max_pending=2)
    for version in range(1, 4):
        log.write("s1", {"q": version}, behind=version == 1)
    assert sorted(log.unacked) == [2, 3]  # v1 forgotten; v2 and v3 went behind it
    log.write("s2", {"q": 0})
    for version in (2, 3):
        for slave in SLAVES:
            log.on_ack(Ack(broker=slave.owner, version=version))
    assert _priorities(log.write("s1", {"q": 9})[1]) == {9}


def test_a_delete_is_a_tombstone_and_a_read_repairs_the_masters_copy() -> None:
    log = _log()
    own = {"a": (1, {"v": 1}), "b": (2, {"v": 2})}  # the master's copy missed v3, v4
    effects = log.begin_read("r", own)
    assert [e.to for e in effects if isinstance(e, Send)] == SLAVES
    assert all(isinstance(e.message, Read) for e in effects if isinstance(e, Send))
    page = {"a": (3, {"v": 3}), "b": (4, TOMBSTONE)}
    done = Snapshot(request="r", state_kind="routing_table", broker=SLAVES[0].owner, last=True)
    assert log.page(done.model_copy(update={"entries": page})) is True  # R = 2: it and the master
    result = log.finish_read("r", own)
    assert result.entries == {"a": (3, {"v": 3})} and not result.degraded
    assert result.repairs == [Persist("a", 3, {"v": 3}), Persist("b", 4, TOMBSTONE)]
    assert log.version == 4  # the next write comes after everything read
    assert log.write("c", {"v": 5})[0] == 5


def test_a_read_without_enough_replies_is_degraded_and_starts_from_what_answered() -> None:
    log = _log()
    log.begin_read("r", {"a": (1, {"v": 1})})
    assert not log.complete("r")
    result = log.finish_read("r", {"a": (1, {"v": 1})})
    assert result.degraded and result.replies == 1 and result.entries == {"a": (1, {"v": 1})}


def test_a_promoted_master_reads_its_held_replica_as_the_first_reply() -> None:
    log = _log(slaves=[SLAVES[1]])  # promoted from slave 0: N stays 3
    log.begin_read("r", own={}, held={"a": (2, {"v": 2})})
    snap = Snapshot(request="r", state_kind="routing_table", broker=SLAVES[1].owner, last=True)
    assert log.page(snap)
    assert log.finish_read("r", {}).entries == {"a": (2, {"v": 2})}


def test_an_admitted_slave_gets_the_table_in_version_order_then_counts_toward_w() -> None:
    log = _log(slaves=[SLAVES[0]])
    log.write("b", {"v": 1})
    log.write("a", {"v": 2})
    log.write("b", {"v": 3})
    newcomer = RoleId.router_slave("B", 1)
    catch_up = log.admit(newcomer)
    assert [(e.to, e.message.key, e.message.version) for e in catch_up] == [  # type: ignore[union-attr]
        (newcomer, "a", 2),
        (newcomer, "b", 3),
    ]
    _, effects = log.write("c", {"v": 4})
    assert newcomer in [e.to for e in effects if isinstance(e, Send)]
    assert log.on_ack(Ack(broker=newcomer.owner, version=4)) == [Written(4)]


# -- orderings -----------------------------------------------------------------------------

Step = tuple[str, int]  # ("write", key) | ("deliver", slave) | ("ack", slave) | ("lose", slave)
steps = st.lists(
    st.one_of(
        st.tuples(st.just("write"), st.integers(0, 4)),
        st.tuples(st.sampled_from(["deliver", "ack", "lose", "repeat"]), st.integers(0, 3)),
    ),
    max_size=60,
)


@settings(max_examples=400, deadline=None)
@given(
    slaves=st.integers(1, 4),
    before=steps,
    during=steps,
    reader=st.integers(-1, 3),
    answering=st.lists(st.integers(0, 3), max_size=4),
    seed=st.randoms(use_true_random=False),
)
# slave 1 and the master hold v1; slave 0, promoted, must not read its own replica alone
@example(2, [("write", 0), ("deliver", 1), ("ack", 1)], [], 0, [], random.Random(1))
def test_a_read_sees_every_write_acknowledged_before_it_whatever_the_order(
    slaves: int,
    before: list[Step],
    during: list[Step],
    reader: int,
    answering: list[int],
    seed: Any,
) -> None:
    """Writes whose Replicate messages reach slaves in any order, some lost; acks late,
    repeated or lost.  Then a quorum read by the master itself (``reader`` -1, its own
    copy the first reply, writes still in flight meanwhile) or by a slave promoted in its
    place (its held replica the first reply, the old master's copy gone): once R replies
    are in, every key has at least the newest version ``Written`` before the read (and,
    for the master, every write made during it); a version is written at most once."""
    replica_ids = [RoleId.match_slave("B", 0, j) for j in range(slaves)]
    log = ReplicaLog(
        owner="B/matcher-0", kind="subscription", replicas=replica_ids, n=slaves + 1, reply_to="p"
    )
    held: list[dict[str, tuple[int, dict[str, Any]]]] = [{} for _ in replica_ids]
    inflight: list[list[Replicate]] = [[] for _ in replica_ids]  # to each slave, any order
    acks: list[list[Ack]] = [[] for _ in replica_ids]
    written: list[int] = []
    versions: dict[int, str] = {}
    own: dict[str, tuple[int, dict[str, Any]]] = {}  # the master's store

    def run(step: Step) -> None:
        what, n = step
        if what == "write":
            version, effects = log.write(f"k{n}", {"n": n, "v": log.version + 1})
            versions[version] = f"k{n}"
            for effect in effects:
                if isinstance(effect, Persist):
                    own[effect.key] = (effect.version, effect.document)
                elif isinstance(effect, Send):
                    assert isinstance(effect.message, Replicate)
                    inflight[replica_ids.index(effect.to)].append(effect.message)
                elif isinstance(effect, Written):
                    written.append(effect.version)
            return
        j = n % slaves
        if what == "deliver" and inflight[j]:
            message = inflight[j].pop(seed.randrange(len(inflight[j])))
            key = message.key
            if held[j].get(key, (0, None))[0] < message.version:  # stores keep the newest
                held[j][key] = (message.version, message.table)
            acks[j].append(Ack(broker=replica_ids[j].owner, version=message.version))
        elif what in ("ack", "repeat") and acks[j]:
            ack = acks[j][0] if what == "repeat" else acks[j].pop(seed.randrange(len(acks[j])))
            written.extend(e.version for e in log.on_ack(ack) if isinstance(e, Written))
        elif what == "lose" and inflight[j]:
            inflight[j].pop(seed.randrange(len(inflight[j])))

    for step in before:
        run(step)
    assert len(written) == len(set(written)), "a version written twice"
    newest_written: dict[str, int] = {}
    for version in written:
        key = versions[version]
        newest_written[key] = max(newest_written.get(key, 0), version)
    first_during = log.version + 1
    if reader < 0 or reader >= slaves:  # the master reads, its own copy the first reply
        at_read, reading = dict(own), log
        effects = log.begin_read("read", own=at_read)
    else:  # slave ``reader`` promoted: N stays, the others are its replicas
        promoted = replica_ids[reader]
        at_read = {}  # the old master's copy is gone with it (no shared store)
        reading = ReplicaLog(
            owner="B/matcher-0",
            kind="subscription",
            replicas=[r for r in replica_ids if r != promoted],
            n=slaves + 1,
            reply_to="q",
        )
        effects = reading.begin_read("read", own=at_read, held=dict(held[reader]))
    asked = [e.to for e in effects if isinstance(e, Send)]
    assert asked == reading.replicas or reading.quorum.read == 1
    for step in during:  # writes go on while the read collects replies
        run(step)
    for j in dict.fromkeys(a % slaves for a in answering):  # who answers, in that order
        if replica_ids[j] not in reading.replicas:
            continue
        snapshot = Snapshot(
            request="read",
            state_kind="subscription",
            broker=replica_ids[j].owner,
            entries=dict(held[j]),
            last=True,
        )
        reading.page(snapshot)
    if not reading.complete("read"):
        return  # fewer than R answered: the driver reads degraded, which it counts
    result = reading.finish_read("read", own=at_read)
    expected = dict(newest_written)
    if reading is log:
        expected |= {versions[v]: v for v in sorted(versions) if v >= first_during}
    for key, version in expected.items():
        got = result.entries.get(key)
        assert got is not None and got[0] >= version, (key, version, got)
    assert live(result.entries) == result.entries
    assert all(at_read.get(r.key, (0, None))[0] < r.version for r in result.repairs)
    assert (
        reading.write("next", {})[0] > max(v for v, _ in result.entries.values())
        if (result.entries)
        else True
    )


def test_quorum_reads_always_see_the_last_acknowledged_write() -> None:
    from itertools import combinations

    from middleware.routing import Quorum, Versioned

    q = Quorum.majority(3)
    assert (q.write, q.read) == (2, 2)
    with pytest.raises(ValueError, match="W \\+ R"):
        Quorum(3, 1, 2)
    replicas = ["m", "s1", "s2"]
    for acked in combinations(replicas, 2):  # every write set of size W
        assert q.written(acked) and not q.written(acked[:1])
        state = {r: (Versioned(2, "new") if r in acked else Versioned(1, "old")) for r in replicas}
        for asked in combinations(replicas, 2):  # every read set of size R
            assert q.resolve({r: state[r] for r in asked}) == Versioned(2, "new")
    assert q.resolve({"m": None, "s1": None}) is None


def test_replica_merge_keeps_the_newest_version_and_honours_deletes() -> None:
    from middleware.routing.replicas import TOMBSTONE, live, merge_replicas

    master = {"a": (3, {"v": "a3"}), "b": (1, {"v": "b1"})}
    slave0 = {"a": (2, {"v": "a2"}), "b": (4, TOMBSTONE), "c": (5, {"v": "c5"})}
    merged = merge_replicas([master, slave0], at_least=2)
    assert merged == {"a": (3, {"v": "a3"}), "b": (4, TOMBSTONE), "c": (5, {"v": "c5"})}
    assert live(merged) == {"a": (3, {"v": "a3"}), "c": (5, {"v": "c5"})}
    with pytest.raises(ValueError, match="needs 2 replies"):
        merge_replicas([master], at_least=2)
