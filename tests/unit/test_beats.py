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


def test_a_beat_source_may_set_the_pace_until_the_next_beat() -> None:
    from middleware.routing.beats import Beater
    from middleware.settings import Settings

    class Client:
        def __init__(self) -> None:
            self.sent: list[bytes] = []

        def publish_unwatched(self, message) -> None:
            self.sent.append(message.body)

    def beater(body) -> Beater:  # never started: no thread, no connection
        return Beater(
            Settings(), ["q1", "q2"], body, interval_s=0.2, ttl_ms=1000, priority=9, name="t"
        )

    client = Client()
    assert beater(lambda: (b"quiet", 2.0))._beat(client) == 2.0
    assert client.sent == [b"quiet", b"quiet"]
    assert beater(b"usual")._beat(client) == 0.2 and client.sent[-1] == b"usual"
    assert beater(None)._beat(client) == 0.2 and len(client.sent) == 4
