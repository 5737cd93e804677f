"""The RabbitMQ management HTTP API as operators run it: every node tried in turn.

Each node's API comes from ``settings.management_urls`` (``http(s)://[user:password@]
host:port[/path-prefix]``) or, when none are given, from the AMQP nodes (their host, the
port plus ``management_port_offset``, https for ``amqps://`` nodes).  https uses the
settings' TLS (CA, client certificate, verification); credentials come from the URL,
else from ``username``/``password``; a path prefix (a reverse proxy's ``/rabbitmq``) is
put before every API path.  A call goes to the first node that answers; when none does
it raises :class:`ManagementUnavailable` naming each node's error (an ``OSError``, as
the callers that read the API optionally expect).

The rabbitmq_prometheus endpoints (``prometheus_urls``, or the AMQP port plus
``prometheus_port_offset``) are built the same way, but :func:`prometheus_scrape` reads
every node, because each counts only what its own channels did.
"""

from __future__ import annotations

import base64
import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import ManagementUnavailable
from ..settings import Settings
from .message import tls_context

__all__ = [
    "ManagementUnavailable",
    "get_json",
    "management_endpoints",
    "management_get",
    "management_put",
    "prometheus_endpoints",
    "prometheus_scrape",
    "put_json",
    "vhost_path",
]


@dataclass(frozen=True)
class Endpoint:
    """One node's management API: its base URL (no credentials) and how to log in."""

    base: str  # scheme://host:port[/prefix], no trailing slash
    username: str
    password: str

    def url(self, path: str) -> str:
        return self.base + path

    def shown(self) -> str:
        return self.base  # never the credentials


def management_endpoints(settings: Settings) -> list[Endpoint]:
    """Every node's management API, in the settings' order."""
    return _endpoints(settings, settings.management_urls, settings.management_port_offset)


def prometheus_endpoints(settings: Settings) -> list[Endpoint]:
    """Every node's rabbitmq_prometheus endpoint, in the settings' order."""
    return _endpoints(settings, settings.prometheus_urls, settings.prometheus_port_offset)


def _endpoints(settings: Settings, urls: tuple[str, ...], offset: int) -> list[Endpoint]:
    password = settings.password.get_secret_value()
    if not urls:
        return [
            Endpoint(
                f"{'https' if tls else 'http'}://{host}:{port + offset}",
                settings.username,
                password,
            )
            for host, port, tls in settings.nodes
        ]
    out = []
    for url in urls:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
        host = f"[{host}]" if ":" in host else host
        port = parts.port or (443 if parts.scheme == "https" else 80)
        prefix = parts.path.rstrip("/")
        out.append(
            Endpoint(
                f"{parts.scheme}://{host}:{port}{prefix}",
                urllib.parse.unquote(parts.username) if parts.username else settings.username,
                urllib.parse.unquote(parts.password) if parts.password is not None else password,
            )
        )
    return out


def _request(
    url: str,
    *,
    username: str,
    password: str,
    timeout: float,
    data: bytes | None = None,
    method: str = "GET",
    context: ssl.SSLContext | None = None,
) -> Any:
    request = urllib.request.Request(url, data=data, method=method)
    token = base64.b64encode(f"{username}:{password}".encode()).decode()
    request.add_header("Authorization", f"Basic {token}")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    return urllib.request.urlopen(request, timeout=timeout, context=context)


def get_json(
    url: str,
    *,
    username: str,
    password: str,
    timeout: float = 5.0,
    context: ssl.SSLContext | None = None,
) -> Any:
    """GET ``url`` with basic auth and decode JSON; raises OSError/ValueError on failure."""
    with _request(
        url, username=username, password=password, timeout=timeout, context=context
    ) as response:
        return json.loads(response.read())


def put_json(
    url: str,
    body: Any,
    *,
    username: str,
    password: str,
    timeout: float = 5.0,
    context: ssl.SSLContext | None = None,
) -> int:
    """PUT ``body`` as JSON with basic auth; the HTTP status (raises OSError on failure)."""
    with _request(
        url,
        username=username,
        password=password,
        timeout=timeout,
        data=json.dumps(body).encode(),
        method="PUT",
        context=context,
    ) as response:
        return int(response.status)


def _with_tls(
    settings: Settings, endpoints: list[Endpoint]
) -> Iterator[tuple[Endpoint, ssl.SSLContext | None]]:
    """Each endpoint with the TLS context it needs (https: the settings', made once)."""
    context: ssl.SSLContext | None = None
    for endpoint in endpoints:
        if endpoint.base.startswith("https:") and context is None:
            context = tls_context(settings)
        yield endpoint, context if endpoint.base.startswith("https:") else None


def _each_node(settings: Settings, path: str, call: Any) -> Any:
    attempts: dict[str, str] = {}
    for endpoint, context in _with_tls(settings, management_endpoints(settings)):
        try:
            return call(
                endpoint.url(path),
                username=endpoint.username,
                password=endpoint.password,
                context=context,
            )
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403):  # refused here: the next node would refuse too
                raise ManagementUnavailable(
                    f"management API {endpoint.shown()} refused {endpoint.username!r} "
                    f"({exc.code} {exc.reason}): check the management credentials and tags",
                    attempts={**attempts, endpoint.shown(): f"{exc.code} {exc.reason}"},
                ) from None
            attempts[endpoint.shown()] = f"{exc.code} {exc.reason}"
        except (OSError, ValueError) as exc:
            attempts[endpoint.shown()] = str(getattr(exc, "reason", exc))
    raise ManagementUnavailable(
        f"no management API answered {path}: "
        + "; ".join(f"{base}: {why}" for base, why in attempts.items())
        + " (set management_urls, or management_port_offset, to where the API listens)",
        attempts=attempts,
    )


def management_get(settings: Settings, path: str, *, timeout: float = 3.0) -> Any:
    """GET ``path`` from the management API of the first node that answers."""

    def get(url: str, **login: Any) -> Any:
        return get_json(url, timeout=timeout, **login)

    return _each_node(settings, path, get)


def management_put(settings: Settings, path: str, body: Any, *, timeout: float = 5.0) -> int:
    """PUT ``body`` to ``path`` of the management API of the first node that answers;
    the HTTP status."""

    def put(url: str, **login: Any) -> int:
        return put_json(url, body, timeout=timeout, **login)

    result: int = _each_node(settings, path, put)
    return result


def prometheus_scrape(
    settings: Settings, path: str, *, timeout: float = 3.0
) -> dict[str, str | Exception]:
    """GET ``path`` (text) from *every* node's rabbitmq_prometheus endpoint: each node
    counts only what its own channels did, so a reader sums them.  Per node, the text or
    the error that node gave (an unreachable node is a value here, not a raise)."""
    out: dict[str, str | Exception] = {}
    for endpoint, context in _with_tls(settings, prometheus_endpoints(settings)):
        try:
            with _request(
                endpoint.url(path),
                username=endpoint.username,
                password=endpoint.password,
                timeout=timeout,
                context=context,
            ) as response:
                out[endpoint.shown()] = response.read().decode("utf-8", "replace")
        except (OSError, ValueError) as exc:
            out[endpoint.shown()] = exc
    return out


def vhost_path(settings: Settings) -> str:
    return urllib.parse.quote(settings.vhost, safe="")
