from __future__ import annotations

from pathlib import Path

import pytest

from middleware.errors import UnknownName
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
    with pytest.raises(UnknownName, match="qosmq-1, qosmq-2, qosmq-3"):
        ClusterLayout(state_dir=Path("/tmp/x")).find("nope")


def test_down_finds_a_node_a_failed_start_never_recorded(tmp_path: Path) -> None:
    """A start that failed (a peer crashed) records no beam PID for the nodes that did
    come up; ``down`` still finds each by the PID file its environment names, and leaves
    a process that only has the PID file's number (a stale file) alone."""
    import os
    import subprocess

    from middleware.localcluster.manager import LocalCluster, pid_alive

    cluster = LocalCluster(ClusterLayout(state_dir=tmp_path, size=2, base_port=5990))
    first, second = cluster.layout.nodes
    for node in (first, second):
        node.directory.mkdir(parents=True)
    node_env = {**os.environ, "RABBITMQ_PID_FILE": str(first.pid_file)}
    orphan = subprocess.Popen(["sleep", "60"], env=node_env)  # stands for node 1's beam
    stranger = subprocess.Popen(["sleep", "60"])  # a process whose PID a stale file holds
    try:
        first.pid_file.write_text(f"{orphan.pid}\n")
        second.pid_file.write_text(f"{stranger.pid}\n")
        assert cluster.beam_pid(first) == orphan.pid
        assert cluster.beam_pid(second) is None
        cluster.down(timeout=5)
        orphan.wait(timeout=5)
        assert not pid_alive(orphan.pid) and stranger.poll() is None
    finally:
        for process in (orphan, stranger):
            process.kill()
            process.wait()
