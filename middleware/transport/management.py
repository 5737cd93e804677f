"""The RabbitMQ management HTTP API: one authenticated JSON GET for every caller."""

from __future__ import annotations

import base64
import json
import urllib.parse
import urllib.request
from typing import Any

from ..settings import Settings

__all__ = ["get_json", "management_get", "management_put", "put_json", "vhost_path"]


def get_json(url: str, *, username: str, password: str, timeout: float = 5.0) -> Any:
    """GET ``url`` with basic auth and decode JSON; raises OSError/ValueError on failure."""
    request = urllib.request.Request(url)
    token = base64.b64encode(f"{username}:{password}".encode()).decode()
    request.add_header("Authorization", f"Basic {token}")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def put_json(url: str, body: Any, *, username: str, password: str, timeout: float = 5.0) -> int:
    """PUT ``body`` as JSON with basic auth; the HTTP status (raises OSError on failure)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="PUT")
    token = base64.b64encode(f"{username}:{password}".encode()).decode()
    request.add_header("Authorization", f"Basic {token}")
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return int(response.status)


def management_put(settings: Settings, path: str, body: Any, *, timeout: float = 5.0) -> int:
    """PUT ``body`` to ``path`` of the management API of the settings' first node that
    answers; the HTTP status."""
    last: OSError | None = None
    for host, port, _ in settings.nodes:
        url = f"http://{host}:{port + settings.management_port_offset}{path}"
        try:
            return put_json(
                url,
                body,
                username=settings.username,
                password=settings.password.get_secret_value(),
                timeout=timeout,
            )
        except OSError as exc:
            last = exc
    raise last or OSError("no node to ask")


def management_get(settings: Settings, path: str, *, timeout: float = 3.0) -> Any:
    """GET ``path`` from the management API of the settings' first node."""
    host, port, _ = settings.nodes[0]
    url = f"http://{host}:{port + settings.management_port_offset}{path}"
    return get_json(
        url,
        username=settings.username,
        password=settings.password.get_secret_value(),
        timeout=timeout,
    )


def vhost_path(settings: Settings) -> str:
    return urllib.parse.quote(settings.vhost, safe="")
