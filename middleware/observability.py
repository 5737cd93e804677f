"""Structured logging and the Prometheus endpoint every qosmq process reuses.

Log lines never carry secrets: settings hold them as ``SecretStr`` and URLs are
stripped of credentials at load time; :class:`JsonFormatter` writes only the
record's message and the ``extra`` fields it is given.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

__all__ = ["JsonFormatter", "configure_logging", "start_metrics_server"]

_STANDARD = set(vars(logging.makeLogRecord({})))


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and any ``extra`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value if isinstance(value, str | int | float | bool) else repr(value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, separators=(",", ":"))


def configure_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Configure the root logger of one of the layer's own processes (the CLI's
    ``main()``: commands, sidecars, roles); the library itself adds no handler and
    changes no logger's level in a service's process."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # aiormq/pika log every reconnect attempt at ERROR; ours say it once, with context.
    for noisy in ("aiormq", "aio_pika", "pika"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)


def start_metrics_server(
    *, host: str = "127.0.0.1", port: int = 0, registry: CollectorRegistry | None = None
) -> int:
    """Serve ``/metrics`` on ``host:port`` (loopback by default); return the bound port."""
    from prometheus_client import REGISTRY

    server, _thread = start_http_server(port, addr=host, registry=registry or REGISTRY)
    return int(server.server_address[1])
