"""The silent-link rule: 1.5 heartbeats of silence, a late tick excuses."""

from __future__ import annotations

from middleware.transport.silence import Silence


def test_a_link_that_reads_nothing_for_one_and_a_half_heartbeats_is_lost() -> None:
    silence = Silence(2.0, now=0.0)  # broker beats every 1 s, ticks every 0.5 s
    now, verdicts = 0.0, []
    while now < 4.0:
        now += silence.interval
        verdicts.append((now, silence.tick(now, read=False)))
    assert next(t for t, lost in verdicts if lost) == 3.0
    assert not any(lost for t, lost in verdicts if t < 3.0)


def test_anything_read_restarts_the_count() -> None:
    silence = Silence(2.0, now=0.0)
    for now in (0.5, 1.0, 1.5, 2.0, 2.5):
        assert not silence.tick(now, read=False)
    assert not silence.tick(3.0, read=True)  # a heartbeat frame came
    for now in (3.5, 4.0, 4.5, 5.0, 5.5):
        assert not silence.tick(now, read=False)
    assert silence.tick(6.0, read=False)


def test_a_late_tick_excuses_the_silence_so_far() -> None:
    """The process did not run (a blocked loop, SIGSTOP): what the broker sent may wait
    unread in the socket, so the silence is counted again from there."""
    silence = Silence(2.0, now=0.0)
    assert not silence.tick(0.5, read=False)
    assert not silence.tick(30.0, read=False)  # 29.5 s late
    for now in (30.5, 31.0, 31.5, 32.0, 32.5):
        assert not silence.tick(now, read=False)
    assert silence.tick(33.0, read=False)


def test_describe_names_the_limit() -> None:
    assert "15 s" in Silence(10, now=0.0).describe()
