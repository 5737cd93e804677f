"""The README's examples run as printed, against the real broker."""

from __future__ import annotations

import asyncio
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

from middleware.settings import Settings
from middleware.transport import AsyncClient, Delivery

pytestmark = pytest.mark.rabbit

README = Path(__file__).resolve().parents[2] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_the_using_the_layer_example_runs_as_printed(brokers, monkeypatch, caplog) -> None:
    monkeypatch.setenv("QOSMQ_AMQP_URLS", ",".join(brokers.urls))
    example = _python_blocks()[0]
    assert "asyncio.run(main())" in example
    try:
        exec(compile(example, "README.md (Using the layer)", "exec"), {"__name__": "__main__"})
        # it closed what it opened: nothing failed over at the loop's end
        assert "failing over" not in caplog.text

        async def lengths() -> list[int]:
            async with AsyncClient(settings=Settings.load()) as client:
                return [await client.queue_length(q) for q in ("billing", "shipping")]

        assert asyncio.run(lengths()) == [0, 0]  # both consumers took (and acked) the order
    finally:

        async def clean() -> None:
            async with AsyncClient(settings=Settings.load()) as client:
                for q in ("billing", "shipping"):
                    await client.delete_queue(q)
                await client.delete_exchange("orders")

        asyncio.run(clean())


def _snippet(block: str, params: str) -> Any:
    """A README fragment (top-level awaits) as ``async def snippet(params)`` returning its
    locals, so a test can run it as printed and look at what it made."""
    source = (
        f"async def snippet({params}):\n{textwrap.indent(block, '    ')}\n    return locals()\n"
    )
    namespace: dict[str, Any] = {}
    exec(compile(source, "README.md", "exec"), namespace)
    return namespace["snippet"]


def _block(starting: str) -> str:
    (block,) = [b for b in _python_blocks() if b.startswith(starting)]
    return block


def test_the_persistent_queues_example_runs_as_printed(
    brokers, tmp_path, monkeypatch, capsys
) -> None:
    example = _block("import asyncio\n\nfrom middleware.queues import AsyncQueues")
    monkeypatch.setenv("QOSMQ_AMQP_URLS", ",".join(brokers.urls))
    monkeypatch.setenv("QOSMQ_QUEUES__SPOOL_PATH", str(tmp_path / "spool.db"))
    try:
        exec(compile(example, "README.md (Persistent queues)", "exec"), {"__name__": "__main__"})
        out = capsys.readouterr().out
        assert out.startswith("confirmed b'...'"), out  # enqueued, taken, acked

        async def length() -> int:
            async with AsyncClient(settings=Settings.load()) as client:
                return await client.queue_length("invoices")

        assert asyncio.run(length()) == 0  # acked
    finally:

        async def clean() -> None:
            async with AsyncClient(settings=Settings.load()) as client:
                await client.delete_queue("invoices")

        asyncio.run(clean())


def test_the_weighted_dispatch_example_runs_as_printed(settings) -> None:
    snippet = _snippet(
        _block("from middleware.balancer import BalancedPublisher"), "settings, client, handler"
    )
    got: list[Delivery] = []

    async def handler(delivery: Delivery) -> None:
        got.append(delivery)

    async def run() -> None:
        async with AsyncClient(settings=settings) as client:
            try:
                made = await snippet(settings, client, handler)
                assert made["names"] == ["orders.r0", "orders.r1"]
                for _ in range(100):
                    if got:
                        break
                    await asyncio.sleep(0.05)
                assert [d.body for d in got] == [b"..."] and got[0].queue in made["names"]
            finally:
                for name in ("orders.r0", "orders.r1"):
                    await client.delete_queue(name)

    asyncio.run(run())


@pytest.mark.slow
def test_the_phoenix_examples_run_as_printed(settings, brokers, tmp_path, name, capsys) -> None:
    """The asyncio and sync Phoenix examples on a running 3-cluster deployment: each
    subscription is in place when subscribe returns, so the quote each publishes right
    after arrives (the examples print what they handle)."""
    from qosmq_bench.phoenix_deploy import Deployment

    deployment = Deployment(
        tmp_path, prefix=name, amqp_urls=brokers.urls, routing_slaves=0, match_slaves=0
    )
    asynchronous = _snippet(
        _block("from middleware.routing import PhoenixClient"), "settings, topology"
    )
    sync_block = _block("from middleware.routing import SyncPhoenixClient")

    async def run_async() -> None:
        made = await asynchronous(settings, deployment.topology)
        try:
            for _ in range(100):  # the quote published at C, handled at A
                if "quotes {'price': 5, 'symbol': 'ABC'}" in capsys.readouterr().out:
                    return
                await asyncio.sleep(0.1)
            raise AssertionError("the example's quote never reached its handler")
        finally:
            await made["a"].close()
            await made["c"].close()

    async def clean() -> None:
        async with AsyncClient(settings=settings) as client:
            for queue in ("my-quotes", "my-orders"):
                await client.delete_queue(queue)

    with deployment.running():
        try:
            asyncio.run(run_async())
            capsys.readouterr()
            exec(
                compile(sync_block, "README.md (sync Phoenix)", "exec"),
                {"settings": settings, "topology": deployment.topology},
            )
            assert "{'price': 5}" in capsys.readouterr().out  # a.run(5) handled it
        finally:
            asyncio.run(clean())


def test_the_deployment_example_of_the_phoenix_roles_guide_runs_as_printed(
    brokers, tmp_path: Path, monkeypatch, name: str
) -> None:
    """docs/phoenix-roles.md's deployment API example, as printed, in a folder holding a
    phoenix.toml (A, and B with one match slave): B's match master is SIGKILLed, its
    slave-0 serves its role, the status it took says so, and ``down`` stops everything."""
    from middleware.localcluster.manager import pid_alive
    from middleware.phoenix.ids import RoleId
    from tests.integration.phoenix_support import write_topology

    guide = README.parent / "docs" / "phoenix-roles.md"
    (block,) = re.findall(r"```python\n(.*?)```", guide.read_text(), re.S)
    write_topology(tmp_path, name, {"A": {}, "B": {"match_slaves": 1}})
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("QOSMQ_AMQP_URLS", ",".join(brokers.urls))
    namespace: dict[str, Any] = {"__name__": "__main__"}
    try:
        exec(compile(block, "docs/phoenix-roles.md", "exec"), namespace)
    finally:
        deployment = namespace.get("deployment")
        if deployment is not None and any(map(pid_alive, deployment.pids().values())):
            deployment.down()  # the example failed before its own down()
    rows, problems = namespace["rows"], namespace["problems"]
    assert problems == []
    by_start = {row.role: row for row in rows}
    slave = by_start[RoleId.match_slave("B", 0, 0)]
    assert slave.alive and slave.serves == RoleId.match("B", 0)
    assert not by_start[RoleId.match("B", 0)].alive or (
        by_start[RoleId.match("B", 0)].serves == RoleId.match_slave("B", 0, 0)
    )  # dead, or already its replacement serving the slave role it left
    assert not any(map(pid_alive, namespace["deployment"].pids().values()))
