"""Random ids from a pool of randomness (``middleware/unique.py``)."""

from __future__ import annotations

import os
import threading

from middleware.transport.message import new_message_id
from middleware.unique import _RandomPool, random_hex


def test_ids_have_their_length_and_do_not_repeat() -> None:
    ids = [random_hex(8) for _ in range(20_000)]  # several pools' worth
    assert all(len(i) == 16 and int(i, 16) >= 0 for i in ids)
    assert len(set(ids)) == len(ids)
    assert len(new_message_id()) == 32


def test_threads_never_get_the_same_bytes() -> None:
    pool, got = _RandomPool(), []

    def draw() -> None:
        got.extend(pool.hex(16) for _ in range(5_000))

    threads = [threading.Thread(target=draw) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == len(got) == 20_000


def test_a_forked_child_draws_its_own_ids() -> None:
    random_hex(8)  # the parent has a pool with bytes left in it
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent
        os.write(write, ",".join(random_hex(8) for _ in range(4)).encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 1000).decode().split(",")
    os.close(read)
    os.waitpid(pid, 0)
    parent = [random_hex(8) for _ in range(4)]
    assert not set(child) & set(parent)
