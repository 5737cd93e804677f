"""The files users run without this machine's help: they must at least parse and agree."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_compose_file_parses_and_describes_three_nodes_mongo_and_the_layer() -> None:
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    services = compose["services"]
    assert {"rabbit-1", "rabbit-2", "rabbit-3", "mongo", "qosmq"} <= set(services)
    conf = compose["configs"]["rabbitmq_conf"]["content"]
    for n in (1, 2, 3):
        assert f"rabbit@rabbit-{n}" in conf
    for service in services.values():  # published ports stay on loopback
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:")


def test_dockerfile_installs_the_package_and_runs_the_cli() -> None:
    text = (ROOT / "docker" / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11", text, re.M)
    assert "pip install" in text and 'ENTRYPOINT ["qosmq"]' in text
    assert "COPY qosmq_bench" in text  # the image's default command is a benchmark


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in readme and "make test" in ci
    assert "make demo" in readme


def test_console_script_and_extras() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["qosmq"] == "middleware.cli:main"
    assert {"spark", "test", "dev"} <= set(project["optional-dependencies"])
    assert (ROOT / "middleware" / "py.typed").exists()


def _imports(package: str) -> list[tuple[str, str]]:
    """(file name, absolute module imported) for every import in a package's sources."""
    found = []
    for source in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                found += [(source.name, alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.append((source.name, node.module))
    return found


def test_the_library_imports_nothing_from_the_benchmarks() -> None:
    """``qosmq_bench`` uses the library; the library never imports it (#25 item 4)."""
    assert [i for i in _imports("middleware") if i[1].split(".")[0] == "qosmq_bench"] == []
    assert not (ROOT / "middleware" / "bench").exists()


def test_the_benchmark_commands_come_through_the_entry_point_group() -> None:
    import importlib.metadata

    from middleware.cli import COMMANDS_GROUP, _parser

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    declared = pyproject["project"]["entry-points"][COMMANDS_GROUP]
    assert declared == {"bench": "qosmq_bench.commands:register"}
    installed = {e.name: e.value for e in importlib.metadata.entry_points(group=COMMANDS_GROUP)}
    assert installed == declared  # the editable install is up to date
    commands = _parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert {"bench", "spark", "demo", "spool", "sidecar", "phoenix", "cluster"} <= set(commands)


def test_the_benchmarks_use_only_the_parts_public_surface() -> None:
    """``qosmq_bench`` imports each part by its package (``from middleware.routing import
    PhoenixDeployment``), never a module inside it (#25 item 4): what a user can do."""
    deep = [
        i
        for i in _imports("qosmq_bench")
        if i[1].startswith("middleware.") and i[1].count(".") >= 2
    ]
    assert deep == []


def test_the_readme_is_read_in_five_minutes() -> None:
    """#25: about 250 lines at most; what the layer is and the two commands in the first
    60; no dated measurement (they live in docs/results.md)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250
    head = "\n".join(lines[:60])
    assert "make demo" in head and "make test" in head
    assert "results.md" in "\n".join(lines)


def test_pymongo_is_an_extra_and_its_absence_is_named(monkeypatch) -> None:
    import sys

    import pytest

    from middleware.errors import ConfigurationError
    from middleware.routing.store import MongoStateStore

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("pymongo") for d in project["dependencies"])
    assert any(d.startswith("pymongo") for d in project["optional-dependencies"]["mongo"])
    monkeypatch.setitem(sys.modules, "pymongo", None)  # as if not installed
    with pytest.raises(ConfigurationError, match=r"qosmq\[mongo\]"):
        MongoStateStore("mongodb://127.0.0.1:1/")


def test_version_comes_from_the_package_metadata() -> None:
    import middleware

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert middleware.__version__ == project["version"]
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")


def test_the_test_double_example_in_the_docs_runs_as_printed() -> None:
    """docs/testing.md's example of ``middleware.testing`` (no broker needed)."""
    text = (ROOT / "docs" / "testing.md").read_text()
    section = text.split("## Testing a service without RabbitMQ")[1]
    example = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    assert "asyncio.run(main())" in example and "InMemoryClient" in example
    exec(compile(example, "docs/testing.md", "exec"), {"__name__": "__main__"})
