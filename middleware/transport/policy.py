"""Which node to try next, and the one retry policy (tenacity) built from settings.

Shared by both faces: the async core and the sync face ask the same
:class:`NodeRotation` for the next node and build their retrying objects
from the same :class:`~middleware.settings.RetrySettings`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    retry_if_not_exception_type,
    stop_after_attempt,
    wait_exponential,
    wait_random,
)
from tenacity.wait import wait_base

from ..errors import GetTimeout, RetryableError
from ..settings import RetrySettings, Settings

__all__ = [
    "Node",
    "NodeRotation",
    "async_retrying",
    "backoff",
    "backoff_delay",
    "sync_retrying",
]


@dataclass(frozen=True, slots=True)
class Node:
    host: str
    port: int
    tls: bool

    def __str__(self) -> str:
        return f"{'amqps' if self.tls else 'amqp'}://{self.host}:{self.port}"


class NodeRotation:
    """Round-robin over the cluster's nodes, starting after the one that failed last."""

    def __init__(self, settings: Settings) -> None:
        self.nodes = tuple(Node(h, p, t) for h, p, t in settings.nodes)
        self._next = 0
        self._lock = threading.Lock()

    def take(self) -> Node:
        """The next node to try."""
        with self._lock:
            node = self.nodes[self._next % len(self.nodes)]
            self._next += 1
            return node

    def prefer(self, node: Node) -> None:
        """Try ``node`` first next time (e.g. the one a cluster member list says is up)."""
        with self._lock:
            self._next = self.nodes.index(node) if node in self.nodes else self._next


def backoff(policy: RetrySettings) -> wait_base:
    """Exponential backoff with jitter, from settings."""
    return wait_exponential(
        multiplier=policy.initial_delay, max=policy.max_delay, exp_base=policy.multiplier
    ) + wait_random(0, policy.jitter)


def backoff_delay(policy: RetrySettings) -> Callable[[int], float]:
    """The backoff before try number ``n + 1`` after ``n`` tries, from the one policy (for
    loops that are not tenacity's: resends after a receipt timeout or a broker nack)."""
    wait = backoff(policy)

    def delay(attempt: int) -> float:
        state = RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
        state.attempt_number = attempt
        return float(wait(state))

    return delay


#: what the policy retries: a ``RetryableError``, except a get the broker gave up on
#: (each try costs the broker's whole wait and a connection)
_RETRIED = retry_if_exception_type(RetryableError) & retry_if_not_exception_type(GetTimeout)


def retried(exc: BaseException) -> bool:
    """Whether the policy tries again after ``exc`` (for a first try made outside it)."""
    return isinstance(exc, RetryableError) and not isinstance(exc, GetTimeout)


def async_retrying(policy: RetrySettings, *, attempts: int | None = None) -> AsyncRetrying:
    """Retry :class:`RetryableError` with the settings' backoff; re-raise the last error."""
    return AsyncRetrying(
        retry=_RETRIED,
        stop=stop_after_attempt(attempts or policy.attempts),
        wait=backoff(policy),
        reraise=True,
    )


def sync_retrying(policy: RetrySettings, *, attempts: int | None = None) -> Retrying:
    """The same policy for the sync face."""
    return Retrying(
        retry=_RETRIED,
        stop=stop_after_attempt(attempts or policy.attempts),
        wait=backoff(policy),
        reraise=True,
    )
