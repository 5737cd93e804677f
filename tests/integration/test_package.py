"""The package as users get it: the wheel and the sdist build from the tracked files, the
wheel installs into a fresh virtualenv, and there ``qosmq --version`` answers and every
module of the library imports.

Without network: the build uses this environment's setuptools (``--no-isolation``), the
wheel goes in with ``--no-deps``, and the fresh venv reaches the dependencies through a
path line to this environment's site-packages (a path line runs none of the ``.pth``
files there, so this checkout's editable install stays out of the fresh venv).
"""

from __future__ import annotations

import os
import pkgutil
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

import middleware

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _run(*cmd: object, cwd: Path | None = None) -> str:
    done = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{cmd}: {done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _tracked_copy(to: Path) -> Path:
    """The files git tracks (what a clone has), without build leftovers of this tree."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("needs a git checkout")
    for name in _run("git", "ls-files", cwd=ROOT).splitlines():
        source = ROOT / name
        if source.is_file():
            (to / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, to / name)
    return to


def test_wheel_and_sdist_build_and_the_wheel_runs_in_a_fresh_venv(tmp_path: Path) -> None:
    source = _tracked_copy(tmp_path / "src")
    dist = tmp_path / "dist"
    _run(sys.executable, "-m", "build", "--no-isolation", "--sdist", "--wheel", "-o", dist, source)
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    wheel = dist / f"qosmq-{version}-py3-none-any.whl"
    sdist = dist / f"qosmq-{version}.tar.gz"
    assert wheel.exists() and sdist.exists(), sorted(p.name for p in dist.iterdir())
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
    assert any(n.endswith(".dist-info/LICENSE") or "/licenses/LICENSE" in n for n in names)
    assert "middleware/py.typed" in names and "qosmq_bench/commands.py" in names
    with tarfile.open(sdist) as tar:
        assert f"qosmq-{version}/LICENSE" in tar.getnames()

    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv)
    _run(venv / "bin" / "pip", "install", "-q", "--no-deps", "--no-index", wheel)
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = Path(_run(venv / "bin" / "python", "-c", where).strip())
    (site / "qosmq-test-deps.pth").write_text(sysconfig.get_path("purelib") + "\n")

    assert _run(venv / "bin" / "qosmq", "--version").strip() == f"qosmq {version}"
    modules = sorted(
        m.name
        for m in pkgutil.walk_packages(middleware.__path__, "middleware.")
        if not m.name.endswith("__main__")
    )
    script = (
        "import importlib, middleware\n"
        f"assert middleware.__file__.startswith({str(site)!r}), middleware.__file__\n"
        f"assert middleware.__version__ == {version!r}, middleware.__version__\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "print('imported', len(" + repr(modules) + "))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [venv / "bin" / "python", "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"imported {len(modules)}" in done.stdout
