"""The README's first example runs as printed, against the real broker."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from middleware.settings import Settings
from middleware.transport import AsyncClient

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
