"""The deployment as an operator sees it: ``qosmq phoenix status`` lists every role's
process and what it serves; a role killed by SIGKILL makes it fail, naming the role."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from middleware.localcluster.manager import pid_alive
from middleware.phoenix.ids import RoleId
from tests.integration.phoenix_support import cli, eventually, running

pytestmark = [pytest.mark.rabbit, pytest.mark.slow]


@dataclass
class Run:
    name: str
    pids: dict[str, int]  # phoenix.json: role key -> PID
    report: str  # status with every role running
    failed: subprocess.CalledProcessError  # status with C's match master killed


@pytest.fixture(scope="module")
def run(brokers, module_settings, module_name, tmp_path_factory) -> Run:
    settings, name = module_settings, module_name
    directory = tmp_path_factory.mktemp("deployment")
    with running(directory, name, settings, ",".join(brokers.urls), {c: {} for c in "ABC"}) as d:
        report = cli(d, "status")
        pids = json.loads(d.state_file.read_text())
        killed = d.kill(RoleId.match("C", 0))
        eventually(lambda: not pid_alive(killed), "the killed role gone", 10)
        with pytest.raises(subprocess.CalledProcessError) as failed:
            cli(d, "status")
    return Run(name, pids, report, failed.value)


def test_status_lists_each_role_serving_the_role_it_started_as(run: Run) -> None:
    for key, pid in run.pids.items():
        line = rf"^{re.escape(key)} +{pid} +running +{re.escape(key)} +\d+ "
        assert re.search(line, run.report, re.M), run.report


def test_status_names_each_roles_inbox(run: Run) -> None:
    assert f"{run.name}.C.match.0\n" in run.report, run.report


def test_status_fails_naming_a_killed_role(run: Run) -> None:
    assert run.failed.returncode == 1
    assert "1 role(s) down: C/matcher-0" in run.failed.stderr
    assert re.search(r"^C/matcher-0 +\d+ +down ", run.failed.stdout, re.M), run.failed.stdout


def test_roles_write_their_cpu_profile_when_profile_dir_is_set(
    brokers, module_settings, module_name, tmp_path
) -> None:
    """``QOSMQ_PROFILE_DIR``: each role process runs under cProfile and writes
    ``<pid>.prof`` when it stops; the profile holds the role's own code."""
    import os
    import pstats

    from middleware.sidecar.deployment import PhoenixDeployment
    from tests.integration.phoenix_support import write_topology

    profiles = tmp_path / "profiles"
    clusters = {"A": {"routing_slaves": 0, "match_slaves": 0}}
    topology_file, _ = write_topology(tmp_path, f"{module_name}p", clusters)
    env = {**os.environ, "QOSMQ_AMQP_URLS": ",".join(brokers.urls)}
    env["QOSMQ_PROFILE_DIR"] = str(profiles)
    deployed = PhoenixDeployment(
        topology_file, tmp_path / "state", settings=module_settings, env=env
    )
    pids = deployed.up()
    try:
        role = RoleId.router("A")
        eventually(lambda: deployed.serves(role) == role, "the router serving", 30)
    finally:
        deployed.down()
    for pid in pids.values():
        eventually(lambda p=pid: not pid_alive(p), f"role {pid} stopped", 20)
    written = sorted(p.name for p in profiles.glob("*.prof"))
    assert written == sorted(f"{pid}.prof" for pid in pids.values()), written
    functions = {name for _, _, name in pstats.Stats(str(profiles / written[0])).stats}
    assert "run" in functions and "serve" in functions, sorted(functions)[:20]


def processes_naming(*words: str) -> list[int]:
    """PIDs of this machine's processes whose argv holds every one of ``words`` (read
    from ``/proc``: an independent count, not the deployment's own records)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if entry.name.isdigit() and all(w.encode() in argv for w in words):
            found.append(int(entry.name))
    return found


def test_an_up_that_fails_leaves_no_process_behind(
    brokers, module_settings, module_name, tmp_path
) -> None:
    """``up`` that gives up on roles not serving in time stops every process it started
    (found by the bench: a deployment slow to load its subscriptions left 18 roles and
    their zygotes running after the error).  Counted from ``/proc``, not from the
    deployment's own records."""
    import os

    from middleware.sidecar.deployment import DeploymentError, PhoenixDeployment
    from tests.integration.phoenix_support import write_topology

    clusters = {"A": {"routing_slaves": 1, "match_slaves": 1}}
    topology_file, _ = write_topology(tmp_path, f"{module_name}f", clusters)

    env = {**os.environ, "QOSMQ_AMQP_URLS": ",".join(brokers.urls)}
    deployed = PhoenixDeployment(
        topology_file, tmp_path / "state", settings=module_settings, env=env
    )
    with pytest.raises(DeploymentError, match="not serving after"):
        deployed.up(timeout=0.01)
    try:
        assert processes_naming(str(topology_file)) == []
        assert deployed.pids() == {}
    finally:
        deployed.down()


def test_a_bench_ended_by_sigterm_takes_its_roles_down(brokers, tmp_path) -> None:
    """SIGTERM to ``qosmq bench phoenix`` (a CI job's timeout, ``timeout``) ends it the way
    Ctrl-C does: exit 143, and the roles it started are stopped.  Before, Python's default
    SIGTERM ended the bench at once and left 18 roles and their zygotes running.  The
    processes are counted from ``/proc`` by the bench's work directory in their argv."""
    import os
    import signal
    import sys
    import time

    work = tmp_path / "bench"

    def roles() -> list[int]:
        return processes_naming(str(work), "sidecar")

    env = {k: v for k, v in os.environ.items() if k != "QOSMQ_AMQP_URLS"}
    argv = [sys.executable, "-m", "middleware.cli", "bench", "phoenix"]
    argv += ["--experiment", "throughput", "--subscriptions", "100", "--rates", "50"]
    argv += ["--duration", "120", "--idle", "1", "--work-dir", str(work)]
    argv += ["--uri", ",".join(brokers.urls)]
    bench = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 90
        while len(roles()) < 18 and bench.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(roles()) == 18, (bench.poll(), roles())
        time.sleep(2)  # into the run
        bench.send_signal(signal.SIGTERM)
        _, err = bench.communicate(timeout=60)
        assert bench.returncode == 143, err.decode()[-2000:]
        assert "qosmq: terminated" in err.decode()
        assert roles() == []
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        for pid in roles():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
