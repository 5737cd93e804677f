"""A busy machine does not make Phoenix elect (#42 item 9): the paper's deployment (3
clusters, 18 role processes) started and run beside two processes spinning on the cores
(about 2x oversubscribed with the brokers and roles here), nothing killed, every election
in the roles' own logs counted as false; then, still under the hogs, a frozen match
master and a killed routing master are found and taken over.  Twice: with events
flowing, and with so few that two clusters' masters beat quietly (quiet beats).  The
same run as ``qosmq bench phoenix --experiment busy`` (five minutes there, half a
minute here).

It runs last (marked ``last``): in one full run of two the timing-sensitive chaos tests
that ran right after it failed (not reproduced since), and a test that loads the whole
machine should not set the scene for the next one.  ``QOSMQ_BUSY_TEST=0`` leaves it out."""

from __future__ import annotations

import os

import pytest

from qosmq_bench.phoenix_busy import run_busy

pytestmark = [
    pytest.mark.rabbit,
    pytest.mark.slow,
    pytest.mark.last,
    pytest.mark.skipif(os.environ.get("QOSMQ_BUSY_TEST") == "0", reason="QOSMQ_BUSY_TEST=0"),
]


@pytest.mark.parametrize(
    ("rate", "events"),
    [(50.0, 1000), (0.5, 10)],
    # at 0.5 events/s, all owned by cluster B, the match masters of A and C take nothing
    # for more than QUIET_AFTER_S and beat quietly (every 2 s) under the hogs
    ids=["events", "quiet masters"],
)
def test_a_busy_machine_elects_nobody_and_real_faults_are_still_found(
    settings, tmp_path, rate: float, events: int
) -> None:
    result = run_busy(settings, directory=tmp_path, hogs=2, rate=rate, duration_s=30.0)
    assert result["elections_at_start"] == 0, result
    assert result["elections_steady"] == 0, result["steady_election_lines"]
    assert result["lost"] == 0 and result["events"] > events, result
    # a freeze by the beats (floor 0.5 s, ceiling 2 s: within the 2.5 s it lasts), a
    # kill by the lease at once
    assert result["freeze_detected_s"] is not None and result["freeze_detected_s"] < 2.5, result
    assert result["kill_detected_s"] is not None and result["kill_detected_s"] < 1.0, result
