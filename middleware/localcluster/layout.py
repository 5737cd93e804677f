"""Where each node of a local cluster lives: names, ports, directories, environment.

Pure: no process is started here.  Ports derive from one base port so several
clusters (a developer's demo, the test session) can run side by side, each with
its own epmd:

=================  ======================  ============================
port               node ``i`` (0-based)     default cluster (base 5682)
=================  ======================  ============================
AMQP               base + i                 5682, 5683, 5684
management HTTP    base + 10000 + i         15682, 15683, 15684
Prometheus         base + 10020 + i         15702, 15703, 15704
Erlang dist        base + 20000 + i         25682, 25683, 25684
epmd (cluster)     base + 30000             35682
=================  ======================  ============================
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidArgument, UnknownName

__all__ = ["RABBITMQ_BIN", "ClusterLayout", "NodeLayout"]

RABBITMQ_BIN = Path(os.environ.get("QOSMQ_RABBITMQ_BIN", "/usr/lib/rabbitmq/bin"))
MAX_NODES = 9
#: Not 5672: teams adding the layer often run a system RabbitMQ there already.
DEFAULT_BASE_PORT = 5682
PLUGINS = (
    "rabbitmq_management",
    "rabbitmq_prometheus",
    "rabbitmq_consistent_hash_exchange",
)
_LOOPBACK_DIST = "-kernel inet_dist_use_interface {127,0,0,1}"
#: the source address of the nodes' connections to each other (see ``advanced_config``)
DIST_SOURCE = "127.0.0.2"


@dataclass(frozen=True, slots=True)
class NodeLayout:
    """One node's name, ports and directories."""

    index: int
    short_name: str
    node_name: str
    amqp_port: int
    management_port: int
    prometheus_port: int
    dist_port: int
    directory: Path

    @property
    def amqp_url(self) -> str:
        return f"amqp://127.0.0.1:{self.amqp_port}/"

    @property
    def pid_file(self) -> Path:
        return self.directory / "beam.pid"

    @property
    def log_file(self) -> Path:
        return self.directory / "stdout.log"

    @property
    def config_file(self) -> Path:
        return self.directory / "rabbitmq.conf"

    @property
    def advanced_config_file(self) -> Path:
        return self.directory / "advanced.config"


@dataclass(frozen=True, slots=True)
class ClusterLayout:
    """N nodes on 127.0.0.1 under one state directory."""

    state_dir: Path
    size: int = 3
    base_port: int = DEFAULT_BASE_PORT
    prefix: str = "qosmq"

    def __post_init__(self) -> None:
        if not 1 <= self.size <= MAX_NODES:
            raise InvalidArgument(f"--nodes must be between 1 and {MAX_NODES}, got {self.size}")
        if not 1024 <= self.base_port <= 65535 - 30000:
            raise InvalidArgument(
                f"--base-port must be between 1024 and 35535, got {self.base_port}"
            )

    @property
    def epmd_port(self) -> int:
        return self.base_port + 30000

    @property
    def cookie_file(self) -> Path:
        # HOME is the state dir for server and CLI alike, so both read this cookie.
        return self.state_dir / ".erlang.cookie"

    @property
    def state_file(self) -> Path:
        return self.state_dir / "cluster.json"

    @property
    def nodes(self) -> tuple[NodeLayout, ...]:
        return tuple(self.node(i) for i in range(self.size))

    def node(self, index: int) -> NodeLayout:
        short = f"{self.prefix}-{index + 1}"
        return NodeLayout(
            index=index,
            short_name=short,
            node_name=f"{short}@localhost",
            amqp_port=self.base_port + index,
            management_port=self.base_port + 10000 + index,
            prometheus_port=self.base_port + 10020 + index,
            dist_port=self.base_port + 20000 + index,
            directory=self.state_dir / short,
        )

    def find(self, name: str) -> NodeLayout:
        """A node by short name (``qosmq-2``), node name, or 1-based number."""
        for node in self.nodes:
            if name in (node.short_name, node.node_name, str(node.index + 1)):
                return node
        known = ", ".join(n.short_name for n in self.nodes)
        raise UnknownName(f"no node {name!r} in this cluster (nodes: {known})")

    def base_env(self) -> dict[str, str]:
        """Environment shared by the nodes and the CLI tools (cookie, epmd)."""
        return {
            "HOME": str(self.state_dir),
            "ERL_EPMD_PORT": str(self.epmd_port),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            "RABBITMQ_CTL_ERL_ARGS": self.ctl_erl_args(),
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
        }

    @staticmethod
    def ctl_erl_args() -> str:
        """The CLI tools' Erlang flags: loopback distribution, and their connections to a
        node from ``DIST_SOURCE`` as the nodes' to each other (``advanced_config``): a
        ``rabbitmqctl`` call is a distribution peer of its node while it runs."""
        if not loopback_binds(DIST_SOURCE):
            return _LOOPBACK_DIST
        ip = DIST_SOURCE.replace(".", ",")
        return f"{_LOOPBACK_DIST} -kernel inet_dist_connect_options [{{ip,{{{ip}}}}}]"

    def node_env(self, node: NodeLayout) -> dict[str, str]:
        return {
            **self.base_env(),
            "RABBITMQ_NODENAME": node.node_name,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(node.amqp_port),
            "RABBITMQ_DIST_PORT": str(node.dist_port),
            "RABBITMQ_MNESIA_BASE": str(node.directory / "mnesia"),
            "RABBITMQ_LOG_BASE": str(node.directory / "log"),
            "RABBITMQ_CONFIG_FILE": str(node.config_file),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(node.advanced_config_file),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(node.directory / "enabled_plugins"),
            "RABBITMQ_PID_FILE": str(node.pid_file),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": _LOOPBACK_DIST,
        }

    @staticmethod
    def advanced_config() -> str:
        """The nodes connect to each other from ``DIST_SOURCE``, not from 127.0.0.1.

        RabbitMQ 3.10's management agent finds a node's distribution socket among its TCP
        sockets by the peer's address and port, and crashes when two match
        (``rabbit_net:dist_info/4``, ``no case clause matching [#Port<..>, #Port<..>]``):
        on one machine, Linux hands a client connecting to the AMQP port the same
        ephemeral port as a node's connection to another node's distribution port (the
        two destinations differ).  Restarted into the same crash while that client stays
        connected, the agent gives up and the node reports no statistics from then on
        (seen 2026-12-04: the management API's counters of every queue on node 1 stopped
        for the rest of the sitting).  Clients connect from 127.0.0.1, so a distribution
        peer on another loopback address never matches one.  Where that address cannot
        be bound (a loopback with 127.0.0.1 alone), nothing is changed."""
        if not loopback_binds(DIST_SOURCE):
            return "[].\n"
        ip = DIST_SOURCE.replace(".", ",")
        return f"[{{kernel, [{{inet_dist_connect_options, [{{ip, {{{ip}}}}}]}}]}}].\n"

    def rabbitmq_conf(self, node: NodeLayout) -> str:
        """The node's rabbitmq.conf: loopback listeners, and classic peer discovery."""
        lines = [
            f"listeners.tcp.default = 127.0.0.1:{node.amqp_port}",
            f"management.tcp.port = {node.management_port}",
            "management.tcp.ip = 127.0.0.1",
            f"prometheus.tcp.port = {node.prometheus_port}",
            "prometheus.tcp.ip = 127.0.0.1",
            "cluster_formation.peer_discovery_backend = classic_config",
            "log.file.level = info",
        ]
        lines += [
            f"cluster_formation.classic_config.nodes.{peer.index + 1} = {peer.node_name}"
            for peer in self.nodes
        ]
        return "\n".join(lines) + "\n"

    @staticmethod
    def enabled_plugins() -> str:
        return "[" + ",".join(PLUGINS) + "].\n"


def loopback_binds(address: str) -> bool:
    """A socket can be bound to ``address`` here (Linux answers for all of 127/8)."""
    try:
        with socket.socket() as probe:
            probe.bind((address, 0))
    except OSError:
        return False
    return True
