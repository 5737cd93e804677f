"""The chaos matrix: every fault kind crossed with both client faces and both confirm
modes, the subscribers' own counts checked against their filters
(``qosmq_bench/phoenix_chaos.py``; the same run as ``qosmq bench phoenix --experiment
chaos``).  Short here: each fault once, in the order ``QOSMQ_CHAOS_SEED`` picks (default
1); ``QOSMQ_CHAOS_ROUNDS=N`` runs the list N times (a soak).  The link faults and a
cluster's leave and rejoin run as a matrix of their own (four clusters, every
inter-cluster link through a proxy, subscribers homed at every cluster)."""

from __future__ import annotations

import os

import pytest

from qosmq_bench.phoenix_chaos import FAULTS, problems, run_chaos, summarize

pytestmark = [pytest.mark.rabbit, pytest.mark.cluster, pytest.mark.chaos, pytest.mark.slow]


def test_no_subscriber_loses_or_gets_what_it_did_not_ask_for_under_any_fault(
    settings, local_cluster, tmp_path
) -> None:
    seed = int(os.environ.get("QOSMQ_CHAOS_SEED", "1"))
    rounds = int(os.environ.get("QOSMQ_CHAOS_ROUNDS", "1"))
    rows = run_chaos(
        settings,
        directory=tmp_path,
        seed=seed,
        faults=list(FAULTS) * rounds,
        rate=80.0,
        window_s=7.0,
        cluster=local_cluster,
    )
    print(f"\nseed {seed}\n{summarize(rows)}")
    assert {r["fault"] for r in rows} >= set(FAULTS), "a fault kind did not run"
    assert not problems(rows), problems(rows)


def _four_clusters(settings, tmp_path, faults: list[str]) -> list[dict]:
    seed = int(os.environ.get("QOSMQ_CHAOS_SEED", "1"))
    rows = run_chaos(
        settings,
        directory=tmp_path,
        seed=seed,
        faults=faults,
        rate=120.0,
        window_s=7.0,
        clusters="ABCD",
    )
    print(f"\nseed {seed}\n{summarize(rows)}")
    assert {r["fault"] for r in rows} >= set(faults), "a fault kind did not run"
    homes = {r["subscriber"].rsplit("@", 1)[1] for r in rows if "@" in r["subscriber"]}
    assert homes == set("ABCD"), homes
    return rows


def test_no_subscriber_loses_copies_across_a_faulted_link(settings, tmp_path) -> None:
    """The link faults of the matrix over four clusters at 120 events/s: B's link to C
    cut, blackholed, cut both ways, with subscribers of both faces and both confirm
    modes homed at every cluster (copies from B's match broker cross the faulted link;
    events for C's type are routed around it)."""
    rows = _four_clusters(settings, tmp_path, ["cut", "blackhole", "cut_both"])
    assert not problems(rows), problems(rows)


def test_a_cluster_that_leaves_and_joins_again_loses_no_copy(settings, tmp_path) -> None:
    """D leaves (roles SIGKILLed, links cut) and joins again under traffic: its arc is
    taken over and handed back (D holds its arc's events until the hand-over is there).
    Copies for D's own subscribers while D is away are
    dead-lettered with the reason, never lost, and none of those (unless the reason says
    it may have reached them) is also delivered."""
    rows = _four_clusters(settings, tmp_path, ["leave"])
    # D's subscribers lost their copies to the leave (dead-lettered), not to nothing
    assert any(r.get("dead_lettered") for r in rows if r["fault"] == "leave"), summarize(rows)
    assert not problems(rows), problems(rows)
