"""The chaos run's ``node`` fault (a bench driver piece): one RabbitMQ node of the local
cluster killed, and started again a while later."""

from __future__ import annotations

import threading
import time
from typing import Any

__all__ = ["NODE_DOWN_S", "NodeBounce"]

NODE_DOWN_S = 8.0  # how long the killed RabbitMQ node stays down


class NodeBounce:
    """The ``node`` fault: SIGKILL one RabbitMQ node, start it again ``down_s`` later in
    a thread. A node's start can take longer than a window on a busy machine, so a
    bounce first waits until the node of the bounce before is back (:meth:`back`, which
    the run also calls before each window and at its end): killed while it still
    booted, its start failed in the restart thread (seed 31, two rounds, one CPU)."""

    def __init__(self, cluster: Any, node: str, down_s: float = NODE_DOWN_S) -> None:
        self.cluster, self.node, self.down_s = cluster, node, down_s
        self._restart: threading.Thread | None = None
        self._failed: list[BaseException] = []

    def __call__(self) -> None:
        self.back()
        self.cluster.kill(self.node)
        self._restart = threading.Thread(target=self._start, name="node restart", daemon=True)
        self._restart.start()

    def _start(self) -> None:
        time.sleep(self.down_s)
        try:
            self.cluster.start(self.node)
        except BaseException as exc:  # raised by back(), in the run's own flow
            self._failed.append(exc)

    def back(self) -> None:
        """Wait until the node is started again; raise why, if it did not start."""
        if self._restart is not None:
            self._restart.join()
            self._restart = None
        if self._failed:
            raise self._failed.pop()
