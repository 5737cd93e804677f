"""The Phoenix decision modules stay without I/O: read from their source (AST), none
imports asyncio, threading, time, prometheus_client, an AMQP client, a store or the
layer's drivers, and none has an ``async def`` or an ``await``.  A decision that needs
any of those belongs in a driver, fed back to the machine as an input."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2] / "middleware"
#: the pure modules of routing/ and recovery/ (docs/phoenix-roles.md, "Role logic
#: without I/O"); a new machine is added here
PURE = [
    "routing/router.py",
    "routing/replicas.py",
    "routing/registry.py",
    "routing/timeliness.py",
    "phoenix/ring.py",
    "routing/matching.py",
    "routing/supervision.py",
    "routing/follower.py",
    "routing/joining.py",
    "routing/handback.py",
    "routing/takeover.py",
    "routing/subscribing.py",
    "routing/copies.py",
    "routing/parked.py",
    "phoenix/effects.py",
    "routing/dispatching.py",
    "routing/restoring.py",
    "routing/forwarding.py",
    "routing/departures.py",
    "routing/switching.py",
    "routing/records.py",
    "routing/messages.py",
    "routing/message_base.py",
    "routing/control_messages.py",
    "phoenix/ids.py",
    "phoenix/protocol.py",
    "recovery/capacity.py",
    "recovery/detector.py",
    "recovery/election.py",
    "recovery/fencing.py",
    "recovery/flood.py",
    "recovery/links.py",
    "transport/replay.py",  # not Phoenix: a failover's replay verdicts
]
BANNED = {
    "asyncio",
    "threading",
    "time",
    "prometheus_client",
    "aio_pika",
    "aiormq",
    "pika",
    "pymongo",
    "sqlite3",
    "socket",
    "subprocess",
}
#: modules of the layer that do I/O (a pure module imports none of them)
DRIVERS = {
    "transport",
    "store",
    "confirms",
    "peer",
    "performing",
    "serving",
    "router_roles",
    "match_roles",
    "replica_set",
    "wiring",
    "operator",
    "role_metrics",
    "beats",
    "deployment",
    "node",
    "zygote",
    "client",
    "delivery",
    "detours",
    "observability",
}


def _impure(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in BANNED]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            parts = module.split(".")
            if node.level == 0 and parts[0] in BANNED:
                found.append(module)
            elif (node.level > 0 or parts[0] == "middleware") and set(parts) & DRIVERS:
                found.append("." * node.level + module)
            elif node.level > 0 and not module:
                found += [a.name for a in node.names if a.name in DRIVERS]
        elif isinstance(node, ast.AsyncFunctionDef | ast.Await):
            found.append(f"async at line {node.lineno}")
    return found


@pytest.mark.parametrize("module", PURE)
def test_a_decision_module_does_no_io(module: str) -> None:
    assert _impure(ROOT / module) == []


def test_the_check_finds_io_where_there_is_some() -> None:
    """The rule itself: the drivers it names fail it."""
    assert _impure(ROOT / "routing" / "serving.py")
    assert _impure(ROOT / "routing" / "match_roles.py")
    assert _impure(ROOT / "routing" / "router_roles.py")
    assert _impure(ROOT / "routing" / "batching.py")  # the batcher's flush is a driver


#: the shape #45 asks of Phoenix's code: modules and functions a reader takes in whole
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 50
PHOENIX_DIRS = ("routing", "recovery", "phoenix")


def _too_long(path: Path) -> list[str]:
    text = path.read_text()
    found = [f"{len(text.splitlines())} lines"] if len(text.splitlines()) > MAX_MODULE_LINES else []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{node.name}: {length} lines")
    return found


@pytest.mark.parametrize(
    "module",
    sorted(str(p.relative_to(ROOT)) for d in PHOENIX_DIRS for p in (ROOT / d).glob("*.py")),
)
def test_a_phoenix_module_and_its_functions_stay_short(module: str) -> None:
    assert _too_long(ROOT / module) == []


def test_the_length_check_finds_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    long = tmp_path / "long.py"
    long.write_text(f"def f():\n{body}\n")
    assert _too_long(long) == [f"f: {MAX_FUNCTION_LINES + 1} lines"]
