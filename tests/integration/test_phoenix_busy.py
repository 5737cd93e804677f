"""A busy machine does not make Phoenix elect (#42 item 9): the paper's deployment (3
clusters, 18 role processes) started and run beside two processes spinning on the cores
(about 2x oversubscribed with the brokers and roles here), nothing killed, every election
in the roles' own logs counted as false; then, still under the hogs, a frozen match
master and a killed routing master are found and taken over.  The same run as ``qosmq
bench phoenix --experiment busy`` (five minutes there, half a minute here).

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


def test_a_busy_machine_elects_nobody_and_real_faults_are_still_found(settings, tmp_path) -> None:
    result = run_busy(settings, directory=tmp_path, hogs=2, rate=50.0, duration_s=30.0)
    assert result["elections_at_start"] == 0, result
    assert result["elections_steady"] == 0, result["steady_election_lines"]
    assert result["lost"] == 0 and result["events"] > 1000, result
    # a freeze by the beats (floor 0.5 s, ceiling 2 s: within the 2.5 s it lasts), a
    # kill by the lease at once
    assert result["freeze_detected_s"] is not None and result["freeze_detected_s"] < 2.5, result
    assert result["kill_detected_s"] is not None and result["kill_detected_s"] < 1.0, result
