"""Every public exception class of the package sits in the one tree drawn in
``middleware/errors.py``, and each part exports its faces and its errors."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re

import pytest

import middleware
from middleware import errors

PARTS = ["balancer", "confirms", "localcluster", "queues", "recovery", "routing", "transport"]


def _modules() -> list[str]:
    return [m.name for m in pkgutil.walk_packages(middleware.__path__, "middleware.")]


def _public_exceptions() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for name in _modules():
        module = importlib.import_module(name)
        for cls_name, cls in inspect.getmembers(module, inspect.isclass):
            if (
                issubclass(cls, BaseException)
                and cls.__module__ == name
                and not cls_name.startswith("_")
            ):
                found[cls_name] = cls
    return found


def _drawing() -> list[tuple[int, str]]:
    """(depth, name) of each class in the docstring's drawing, root at depth 0."""
    assert errors.__doc__
    lines = errors.__doc__.split("::", 1)[1].split("\n\n", 2)[1].splitlines()
    base = len(lines[0]) - len(lines[0].lstrip())
    drawn = []
    for line in lines:
        match = re.search(r"(?:([├└])── )?(\w+)", line)
        assert match, line
        depth = 0 if match.group(1) is None else (match.start(1) - base) // 4 + 1
        drawn.append((depth, match.group(2)))
    return drawn


def test_the_walk_finds_the_feature_errors() -> None:
    found = _public_exceptions()
    for name in ("FilterError", "ClusterError", "SpoolFull", "DeploymentError", "ReplicaTimeout"):
        assert name in found


def test_every_public_exception_is_a_middleware_error_drawn_in_the_tree() -> None:
    drawn = {name for _, name in _drawing()}
    result_codes = {"QueueDoesNotExist", "ConnectionNotEstablished", "QueueSaveFailed"}
    result_codes |= {"MessageMalformed", "WindowExceeded", "QueueResult"}
    for name, cls in _public_exceptions().items():
        assert issubclass(cls, errors.MiddlewareError), f"{cls.__module__}.{name}"
        assert name in drawn or name in result_codes, f"{name} is not drawn in errors.py"


def test_the_drawing_matches_the_classes() -> None:
    """Each drawn class exists and its drawn parent is one of its bases."""
    found = _public_exceptions()
    stack: list[str] = []
    for depth, name in _drawing():
        assert name in found, f"{name} drawn but not defined"
        del stack[depth:]
        if stack:
            assert issubclass(found[name], found[stack[-1]]), f"{name} is not a {stack[-1]}"
        stack.append(name)
    assert stack[0] == "MiddlewareError"


@pytest.mark.parametrize("part", PARTS)
def test_each_part_exports_what_it_lists(part: str) -> None:
    module = importlib.import_module(f"middleware.{part}")
    names = list(module.__all__)
    assert sorted(names, key=str) == sorted(set(names), key=str)
    for name in names:
        assert getattr(module, name) is not None, f"middleware.{part}.{name}"


def test_the_parts_export_their_faces_and_errors() -> None:
    from middleware import confirms, localcluster, queues, routing

    for name in ("PhoenixClient", "SyncPhoenixClient", "PhoenixDeployment", "PhoenixTopology"):
        assert name in routing.__all__ and inspect.isclass(getattr(routing, name))
    for name in ("FilterError", "SubscriptionUnconfirmed", "DeploymentError", "RecordError"):
        assert issubclass(getattr(routing, name), errors.MiddlewareError)
    for name in ("NegativeReceipt", "ReceiptTimeout", "DuplicateMessageId", "NoRoute"):
        assert getattr(confirms, name) is getattr(errors, name)
    for code, name in enumerate(
        [
            "QueueDoesNotExist",
            "ConnectionNotEstablished",
            "QueueSaveFailed",
            "MessageMalformed",
            "WindowExceeded",
        ],
        start=1,
    ):
        assert getattr(queues, name).code == code
    assert issubclass(localcluster.NodeExited, localcluster.ClusterError)
    with pytest.raises(AttributeError):
        routing.NoSuchThing  # noqa: B018
