"""The chaos run's ``node`` fault: a second bounce waits for the node's restart.

The cluster here records what is asked of it, with a start that takes a while (a
RabbitMQ node booting on a busy machine); what is tested is the order the bounce asks
in, not a broker's behaviour (the chaos tests bounce real nodes)."""

from __future__ import annotations

import threading
import time

import pytest

from qosmq_bench.node_fault import NodeBounce


class _Cluster:
    def __init__(self, boot_s: float, fail: bool = False) -> None:
        self.boot_s, self.fail = boot_s, fail
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def kill(self, node: str) -> None:
        with self.lock:
            self.calls.append(f"kill {node}")

    def start(self, node: str) -> None:
        with self.lock:
            self.calls.append(f"starting {node}")
        time.sleep(self.boot_s)
        if self.fail:
            raise RuntimeError(f"{node} exited during start-up")
        with self.lock:
            self.calls.append(f"started {node}")


def test_a_second_bounce_kills_the_node_only_once_it_is_started_again() -> None:
    cluster = _Cluster(boot_s=0.2)
    bounce = NodeBounce(cluster, "n3", down_s=0.05)
    bounce()
    time.sleep(0.1)  # the restart is booting the node
    bounce()
    bounce.back()
    assert cluster.calls == [
        "kill n3",
        "starting n3",
        "started n3",
        "kill n3",
        "starting n3",
        "started n3",
    ]


def test_a_restart_that_failed_is_raised_where_the_run_waits_for_it() -> None:
    bounce = NodeBounce(_Cluster(boot_s=0.0, fail=True), "n3", down_s=0.0)
    bounce()
    with pytest.raises(RuntimeError, match="exited during start-up"):
        bounce.back()
    bounce.back()  # said once
