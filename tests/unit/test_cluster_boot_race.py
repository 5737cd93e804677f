"""A node that loses RabbitMQ 3.10's feature-flag boot race is started again; any other
start-up failure is reported at once. Real processes: a stand-in rabbitmq-server script
that fails the way the real one does (its output), counted per start."""

from __future__ import annotations

import os
import signal
import socket
import stat
from pathlib import Path

import pytest

from middleware.localcluster import manager
from middleware.localcluster.layout import ClusterLayout
from middleware.localcluster.manager import LocalCluster, NodeExited, lost_boot_race

RACE = (
    "BOOT FAILED\n{error,{incompatible_feature_flags,{badrpc,{'EXIT',{{badmap,undefined},"
    "[{maps,get,[depends_on,undefined,[]]}]}}}}}\n"
)


def _stand_in(bin_dir: Path, starts: Path, *, fail_first: int, output: str) -> None:
    """A ``rabbitmq-server`` that fails its first ``fail_first`` starts printing ``output``,
    then writes its PID file (as RabbitMQ does once booted) and runs."""
    bin_dir.mkdir()
    script = bin_dir / "rabbitmq-server"
    script.write_text(
        "#!/bin/sh\n"
        f'echo start >> "{starts}"\n'
        f'if [ "$(wc -l < "{starts}")" -le {fail_first} ]; then\n'
        f"  cat <<'EOF'\n{output}EOF\n"
        "  exit 1\n"
        "fi\n"
        'echo $$ > "$RABBITMQ_PID_FILE"\n'
        "exec sleep 60\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> LocalCluster:
    monkeypatch.setattr(manager, "RABBITMQ_BIN", tmp_path / "bin")
    monkeypatch.setattr(manager, "_amqp_handshake", lambda port, timeout: True)
    monkeypatch.setattr(manager, "BOOT_RACE_DELAY_S", 0.05)
    # ports below the kernel's ephemeral range (32768-60999): nothing binds them here
    c = LocalCluster(ClusterLayout(state_dir=tmp_path / "state", size=1, base_port=3100))
    c._prepare_dirs()
    return c


def _started_pid(cluster: LocalCluster) -> int:
    return int(cluster.layout.nodes[0].pid_file.read_text())


def test_a_node_that_lost_the_boot_race_is_started_again(cluster, tmp_path) -> None:
    starts = tmp_path / "starts"
    _stand_in(tmp_path / "bin", starts, fail_first=2, output=RACE)
    node = cluster.layout.nodes[0]
    try:
        cluster._start_nodes([node], timeout=20)
        assert len(starts.read_text().splitlines()) == 3  # two lost races, then up
        assert cluster._pids(node)["beam"] == _started_pid(cluster)
    finally:
        os.kill(_started_pid(cluster), signal.SIGKILL)


def test_the_race_is_retried_a_bounded_number_of_times(cluster, tmp_path) -> None:
    starts = tmp_path / "starts"
    _stand_in(tmp_path / "bin", starts, fail_first=99, output=RACE)
    with pytest.raises(NodeExited, match="exited during start-up"):
        cluster._start_nodes([cluster.layout.nodes[0]], timeout=20)
    assert len(starts.read_text().splitlines()) == manager.BOOT_RACE_ATTEMPTS


def test_any_other_start_up_failure_is_reported_at_once(cluster, tmp_path) -> None:
    starts = tmp_path / "starts"
    # an earlier start's race in the (appended) log must not make this one look like it
    cluster.layout.nodes[0].log_file.write_text(RACE)
    _stand_in(tmp_path / "bin", starts, fail_first=1, output="BOOT FAILED\n{error,eaddrinuse}\n")
    with pytest.raises(NodeExited, match="eaddrinuse"):
        cluster._start_nodes([cluster.layout.nodes[0]], timeout=20)
    assert len(starts.read_text().splitlines()) == 1


def test_lost_boot_race_reads_the_start_up_output() -> None:
    assert lost_boot_race(RACE)
    assert not lost_boot_race("BOOT FAILED\n{error,{cannot_log_to_file,eacces}}\n")


def test_a_port_nothing_listens_on_is_free_and_one_with_a_listener_is_not() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert manager._port_in_use(port)
    assert not manager._port_in_use(port)
