from __future__ import annotations

from pathlib import Path

import pytest

from middleware.localcluster import ClusterLayout


def test_ports_and_names_derive_from_the_base() -> None:
    layout = ClusterLayout(state_dir=Path("/tmp/x"), size=3, base_port=5672)
    n2 = layout.node(1)
    assert (n2.short_name, n2.node_name) == ("qosmq-2", "qosmq-2@localhost")
    assert (n2.amqp_port, n2.management_port, n2.prometheus_port, n2.dist_port) == (
        5673,
        15673,
        15693,
        25673,
    )
    assert layout.epmd_port == 35672
    assert layout.find("2") == layout.find("qosmq-2") == n2


def test_everything_binds_to_loopback() -> None:
    layout = ClusterLayout(state_dir=Path("/tmp/x"))
    conf = layout.rabbitmq_conf(layout.node(0))
    assert "listeners.tcp.default = 127.0.0.1:5682" in conf
    assert "management.tcp.ip = 127.0.0.1" in conf and "prometheus.tcp.ip = 127.0.0.1" in conf
    env = layout.node_env(layout.node(0))
    assert env["RABBITMQ_NODE_IP_ADDRESS"] == "127.0.0.1"
    assert "{127,0,0,1}" in env["RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS"]
    assert env["ERL_EPMD_ADDRESS"] == "127.0.0.1"


@pytest.mark.parametrize("size", [0, 10])
def test_bad_sizes_are_refused(size: int) -> None:
    with pytest.raises(ValueError, match="--nodes"):
        ClusterLayout(state_dir=Path("/tmp/x"), size=size)


def test_unknown_node_is_named() -> None:
    with pytest.raises(KeyError, match="qosmq-1, qosmq-2, qosmq-3"):
        ClusterLayout(state_dir=Path("/tmp/x")).find("nope")
