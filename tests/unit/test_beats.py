"""``routing.beats``: which queue names a watcher accepts as a lease."""

from __future__ import annotations

import pytest

from middleware.routing.beats import is_lease


@pytest.mark.parametrize(
    ("queue", "expected"),
    [
        ("phx.process.0123abcd.lease.1", True),
        ("phx.process.0123abcd.lease.12", True),
        ("phx.process.0123abcd", False),  # the process queue itself
        ("phx.A.router", False),  # an inbox: a forged beat must not make it consumed
        ("other.process.0123abcd.lease.1", False),  # another deployment's
        ("phx.process.01.23.lease.1", False),
        ("phx.process.0123abcd.lease.x", False),
        ("phx.process..lease.1", False),
    ],
)
def test_only_a_lease_queue_of_the_deployment_is_a_lease(queue: str, expected: bool) -> None:
    assert is_lease(queue, "phx") is expected
