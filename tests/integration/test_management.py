"""The management API as operators run it, against the real brokers' API: behind an https
reverse proxy with a path prefix (a real TLS server here, its certificate made for the
test), credentials from the URL, a first node that does not answer, and the named error
when none does."""

from __future__ import annotations

import http.server
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from middleware.errors import ManagementUnavailable
from middleware.settings import Settings
from middleware.transport.management import management_endpoints, management_get

pytestmark = pytest.mark.rabbit
PREFIX = "/rabbitmq"


def _api_port(settings: Settings) -> int:
    host, port, _ = settings.nodes[0]
    api = port + settings.management_port_offset
    try:
        urllib.request.urlopen(f"http://{host}:{api}/api/overview", timeout=3)
    except urllib.error.HTTPError:  # 401: it answers
        return api
    except OSError:
        pytest.skip("the brokers' management API does not answer where the settings say")
    return api


class _Proxy(http.server.BaseHTTPRequestHandler):
    upstream = ""
    seen: list[str] = []

    def do_GET(self) -> None:
        self.seen.append(self.path)
        if not self.path.startswith(PREFIX + "/"):
            self.send_error(404, "outside the prefix")
            return
        request = urllib.request.Request(self.upstream + self.path[len(PREFIX) :])
        request.add_header("Authorization", self.headers.get("Authorization", ""))
        try:
            with urllib.request.urlopen(request, timeout=5) as answer:
                status, body = answer.status, answer.read()
        except urllib.error.HTTPError as exc:
            status, body = exc.code, exc.read()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def https_proxy(settings: Settings, tmp_path: Path) -> Iterator[tuple[int, Path]]:
    api = _api_port(settings)
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"),
            *("-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
    )
    handler = type("Proxy", (_Proxy,), {"upstream": f"http://127.0.0.1:{api}", "seen": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], cert
    finally:
        server.shutdown()
        server.server_close()


def _dead_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again: nothing listens there


def test_https_with_a_prefix_and_url_credentials_after_a_dead_node(settings, https_proxy) -> None:
    port, cert = https_proxy
    user = settings.username
    secret = settings.password.get_secret_value()
    configured = settings.model_copy(
        update={
            "management_urls": (
                f"http://127.0.0.1:{_dead_port()}",
                f"https://{user}:{secret}@127.0.0.1:{port}{PREFIX}/",
            ),
            "username": "someone-else",  # the URL's credentials win
            "tls": settings.tls.model_copy(update={"ca_file": cert}),
        }
    )
    overview = management_get(configured, "/api/overview")
    assert overview["rabbitmq_version"]  # the real API answered through the proxy
    bases = [e.base for e in management_endpoints(configured)]
    assert bases[1] == f"https://127.0.0.1:{port}{PREFIX}" and secret not in bases[1]


def test_no_node_answering_is_one_named_error(settings, https_proxy) -> None:
    port, cert = https_proxy
    configured = settings.model_copy(
        update={
            "management_urls": (
                f"http://127.0.0.1:{_dead_port()}",
                f"https://127.0.0.1:{port}/elsewhere",  # answers 404: outside the prefix
            ),
            "tls": settings.tls.model_copy(update={"ca_file": cert}),
        }
    )
    with pytest.raises(ManagementUnavailable) as info:
        management_get(configured, "/api/overview")
    assert len(info.value.attempts) == 2 and "404" in str(info.value)
    assert settings.password.get_secret_value() not in str(info.value)
    wrong = settings.model_copy(
        update={
            "management_urls": (f"https://nobody:wrong@127.0.0.1:{port}{PREFIX}",),
            "tls": settings.tls.model_copy(update={"ca_file": cert}),
        }
    )
    with pytest.raises(ManagementUnavailable, match="refused 'nobody'"):
        management_get(wrong, "/api/overview")
    untrusted = settings.model_copy(  # the proxy's certificate is not trusted: refused
        update={"management_urls": (f"https://127.0.0.1:{port}{PREFIX}",)}
    )
    with pytest.raises(ManagementUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
        management_get(untrusted, "/api/overview")


def _established(port_of_interest: set[int]) -> list[tuple[str, int]]:
    """(source address, destination port) of every established TCP connection on this
    machine whose destination is one of ``port_of_interest`` (from /proc/net/tcp)."""
    found = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, state = fields[1], fields[2], fields[3]
        if state != "01":  # ESTABLISHED
            continue
        r_port = int(remote.split(":")[1], 16)
        if r_port in port_of_interest:
            raw = bytes.fromhex(local.split(":")[0])[::-1]  # little-endian IPv4
            found.append((".".join(str(b) for b in raw), r_port))
    return found


def test_the_nodes_reach_each_other_from_their_own_loopback_address(brokers) -> None:
    """The local cluster's nodes connect to each other's distribution port from
    127.0.0.2, clients from 127.0.0.1: RabbitMQ 3.10's management agent crashed for good
    (no statistics from the node any more) when a client's ephemeral port was also a
    node connection's (``ClusterLayout.advanced_config``).  Read from the kernel's
    socket table: with the nodes connecting from 127.0.0.1, as before, this fails."""
    from middleware.localcluster.layout import DIST_SOURCE, loopback_binds

    if brokers.cluster is None:
        pytest.skip(f"needs the local cluster (brokers from {brokers.source})")
    if not loopback_binds(DIST_SOURCE):
        pytest.skip(f"{DIST_SOURCE} cannot be bound here: the nodes keep 127.0.0.1")
    layout = brokers.cluster.layout
    dist_ports = {node.dist_port for node in layout.nodes}
    connections = _established(dist_ports)
    assert len(connections) >= layout.size - 1, connections  # a cluster, connected
    assert {source for source, _ in connections} == {DIST_SOURCE}, connections


def test_a_rabbitmqctl_call_reaches_its_node_from_the_nodes_own_address(brokers) -> None:
    """A ``rabbitmqctl`` call is a distribution peer of its node while it runs, and it
    connects from ``DIST_SOURCE`` as the nodes do (``ClusterLayout.ctl_erl_args``): from
    127.0.0.1, as before, its ephemeral port could be a client's too, which crashed the
    node's management agent.  The connections to the distribution ports that appear
    while a call runs (3 s), from the kernel's socket table: with the CLI's flags as
    before, the call's comes from 127.0.0.1 and this fails."""
    from middleware.localcluster.layout import DIST_SOURCE, loopback_binds

    if brokers.cluster is None:
        pytest.skip(f"needs the local cluster (brokers from {brokers.source})")
    if not loopback_binds(DIST_SOURCE):
        pytest.skip(f"{DIST_SOURCE} cannot be bound here: the CLI keeps 127.0.0.1")
    cluster = brokers.cluster
    dist_ports = {node.dist_port for node in cluster.layout.nodes}
    before = Counter(_established(dist_ports))
    answers: list[str] = []
    call = threading.Thread(
        target=lambda: answers.append(
            cluster.ctl(cluster.layout.nodes[0].short_name, "eval", "timer:sleep(3000).")
        )
    )
    call.start()
    appeared: Counter[tuple[str, int]] = Counter()
    while call.is_alive():
        now = Counter(_established(dist_ports)) - before
        appeared |= now
        time.sleep(0.05)
    call.join()
    assert answers and answers[0].strip() == "ok", answers
    assert appeared, "no connection of the call's to a distribution port seen"
    assert {source for source, _ in appeared} == {DIST_SOURCE}, appeared
