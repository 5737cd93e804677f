"""The turns threads take on one ``SyncClient`` (``sync_turns``): pure threading, no broker."""

from __future__ import annotations

import threading
import time

from middleware.transport.sync_turns import Turns


def _started(target, *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args)
    thread.start()
    return thread


def _until(done, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_a_thread_takes_turns_inside_its_own_turn() -> None:
    turns = Turns(lambda: None)
    with turns.turn(), turns.turn(), turns.turn():
        assert not turns.wanted()
    with turns.turn():  # released: free again
        pass


def test_turns_go_in_the_order_threads_asked_and_each_wait_interrupts_the_holder() -> None:
    interrupts: list[int] = []
    turns = Turns(lambda: interrupts.append(1))
    order: list[int] = []

    def take(k: int) -> None:
        with turns.turn():
            order.append(k)

    turns.acquire()
    waiting = []
    for k in range(5):
        waiting.append(_started(take, k))
        _until(lambda k=k: len(turns._queue) == k + 1)  # k asked before k + 1
    assert turns.wanted() and len(interrupts) == 5
    turns.release()
    for thread in waiting:
        thread.join(5)
    assert order == [0, 1, 2, 3, 4]
    assert not turns.wanted()


def test_the_holder_that_asks_again_goes_behind_the_threads_already_waiting() -> None:
    turns = Turns(lambda: None)
    order: list[str] = []
    turns.acquire()
    other = _started(lambda: (turns.acquire(), order.append("other"), turns.release()))
    _until(turns.wanted)
    turns.release()
    with turns.turn():  # a runner's next step
        order.append("runner")
    other.join(5)
    assert order == ["other", "runner"]


def test_a_waiter_that_is_interrupted_leaves_the_queue_for_the_others() -> None:
    class Stop(BaseException):
        pass

    calls = []

    def interrupt() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise Stop  # the first waiter is stopped while it asks (a ^C)

    turns = Turns(interrupt)
    turns.acquire()
    outcome: list[str] = []

    def first() -> None:
        try:
            turns.acquire()
        except Stop:
            outcome.append("stopped")

    _started(first).join(5)
    assert outcome == ["stopped"] and not turns.wanted()
    second = _started(lambda: (turns.acquire(), outcome.append("second"), turns.release()))
    _until(turns.wanted)
    turns.release()
    second.join(5)
    assert outcome == ["stopped", "second"]


def test_a_forked_child_takes_a_turn_another_thread_held_at_the_fork() -> None:
    import os
    import signal

    forked: list[int] = []
    turns = Turns(lambda: None, forked=lambda: forked.append(os.getpid()))
    held, done = threading.Event(), threading.Event()

    def holder() -> None:
        with turns.turn():
            held.set()
            done.wait(5)

    thread = _started(holder)
    held.wait(5)
    pid = os.fork()
    if pid == 0:  # the child: the holder thread is not here
        signal.alarm(10)
        status = 1
        try:
            with turns.turn():
                status = 0 if forked == [os.getpid()] else 2
        finally:
            os._exit(status)
    done.set()
    thread.join(5)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert forked == []  # the parent's turns are untouched
    with turns.turn():
        pass
