"""The RabbitMQ management HTTP API: one authenticated JSON GET for every caller."""

from __future__ import annotations

import base64
import json
import urllib.parse
import urllib.request
from typing import Any

from ..settings import Settings

__all__ = ["get_json", "management_get", "vhost_path"]


def get_json(url: str, *, username: str, password: str, timeout: float = 5.0) -> Any:
    """GET ``url`` with basic auth and decode JSON; raises OSError/ValueError on failure."""
    request = urllib.request.Request(url)
    token = base64.b64encode(f"{username}:{password}".encode()).decode()
    request.add_header("Authorization", f"Basic {token}")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


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
