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


def test_a_late_tick_with_nothing_waiting_unread_judges_the_silence_as_it_is() -> None:
    """The sync face looked at the socket: no byte waits, so the late look excuses
    nothing (a replies connection beside a consumer blocked on its own silent link)."""
    silence = Silence(2.0, now=0.0)
    assert not silence.tick(0.5, read=False)
    assert silence.late(3.4)
    assert silence.tick(3.4, read=False, unread=lambda: False)  # 3.4 s silent: lost at once


def test_the_sync_face_excuses_a_late_tick_only_while_bytes_wait_in_the_socket() -> None:
    """``SyncSilence`` on a real socket pair standing in for pika's transport: ticked
    late, it is excused while the peer's bytes wait unread, and finds the link lost
    when none do."""
    import socket

    from middleware.transport.silence import SyncSilence

    class Transport:
        def __init__(self, sock: socket.socket) -> None:
            self._sock = sock

    class Impl:
        def __init__(self, sock: socket.socket) -> None:
            self._transport = Transport(sock)
            self.is_open = True
            self.bytes_received = 0
            self.timers: list[object] = []

        def _adapter_call_later(self, _delay: float, callback: object) -> None:
            self.timers.append(callback)

    class Connection:
        def __init__(self, impl: Impl) -> None:
            self._impl = impl

    for waiting in (True, False):
        ours, broker = socket.socketpair()
        try:
            clock = [0.0]
            lost: list[str] = []
            impl = Impl(ours)
            watch = SyncSilence(Connection(impl), 2.0, lost.append, lambda c=clock: c[0])
            if waiting:
                broker.sendall(b"\x08\x00\x00\x00\x00\x00\x00\xce")  # a heartbeat frame
            clock[0] = 3.4  # the first look comes late: the client ran another connection
            watch._tick()
            assert lost == ([] if waiting else [watch.silence.describe()]), (waiting, lost)
        finally:
            ours.close()
            broker.close()
