"""What the layer reads from a broker's version, for every version it is designed for."""

from __future__ import annotations

import pytest

from middleware.transport.broker_info import NEWEST_KNOWN, BrokerInfo


@pytest.mark.parametrize(
    ("version", "mirroring", "levels", "transient", "rates"),
    [
        ("3.10.8", True, 0, True, True),
        ("3.13.7", True, 0, True, True),
        ("4.0.5", False, 2, True, False),
        ("4.2.1", False, 2, True, False),
        ("4.3.0", False, 2, False, False),
        ("4.1.0-rc.1", False, 2, True, False),
    ],
)
def test_each_version_decides_by_its_facts(version, mirroring, levels, transient, rates) -> None:
    info = BrokerInfo.from_version(version)
    assert info.version is not None
    assert info.classic_mirroring is mirroring
    assert info.quorum_priority_levels == levels
    assert info.transient_nonexclusive_queues is transient
    assert info.management_message_stats is rates
    assert bool(info.notices()) is (not mirroring)  # 3.x: nothing to say


def test_server_properties_as_either_library_decodes_them() -> None:
    info = BrokerInfo.from_properties(
        {
            b"product": b"RabbitMQ",
            "version": "4.0.5",
            "capabilities": {"publisher_confirms": True, b"basic.nack": True, "x": False},
        }
    )
    assert (info.product, info.version) == ("RabbitMQ", (4, 0, 5))
    assert info.capabilities == {"publisher_confirms", "basic.nack"}


@pytest.mark.parametrize("odd", ["unknown", "", None, "v4", b"\xff"])
def test_an_unknown_version_is_said_once_and_taken_as_the_newest_known(odd) -> None:
    info = BrokerInfo.from_properties({"version": odd} if odd is not None else {})
    assert info.version is None and info.effective == NEWEST_KNOWN
    assert "not recognised" in info.notices()[0]
    assert not info.classic_mirroring and not info.transient_nonexclusive_queues
