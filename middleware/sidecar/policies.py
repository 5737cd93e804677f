"""The policy that mirrors a Phoenix deployment's role queues (classic queue mirroring,
set through the management API), or why it was not set."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable

from ..phoenix.protocol import PhoenixTopology
from ..routing.wiring import cluster_settings
from ..settings import Settings
from ..transport.broker_info import BrokerInfo
from ..transport.management import management_get, management_put, vhost_path

__all__ = ["mirror_role_queues"]

log = logging.getLogger(__name__)


def broker_version(settings: Settings) -> BrokerInfo:
    """The cluster's RabbitMQ version, from its management API."""
    overview = management_get(settings, "/api/overview")
    return BrokerInfo.from_version(overview.get("rabbitmq_version"))


def mirror_role_queues(
    settings: Settings,
    topology: PhoenixTopology,
    clusters: Iterable[str],
    version_of: Callable[[Settings], BrokerInfo] | None = None,
) -> list[str]:
    """``PhoenixDeployment.mirror_inboxes``: set the policy on each of ``clusters``'
    RabbitMQ; what could not be done, as messages, each also logged."""
    mirrors = topology.inbox_mirrors
    if mirrors < 2 or topology.role_queues == "quorum":  # quorum: replicated anyway
        return []
    prefix = topology.prefix
    policy = {
        # role inboxes and control queues; not the process queues (exclusive: never
        # mirrored) nor client queues declared under other names
        "pattern": f"^{re.escape(prefix)}\\.(?!process\\.)",
        "apply-to": "queues",
        "priority": 7,
        "definition": {
            "ha-mode": "exactly",
            "ha-params": mirrors,
            "ha-sync-mode": "automatic",
        },
    }
    problems, seen = [], set()
    for cluster in clusters:
        key, conf = cluster_settings(settings, topology, cluster)
        if key in seen:
            continue
        seen.add(key)
        path = f"/api/policies/{vhost_path(conf)}/qosmq-phoenix-{prefix}"
        try:
            server = (version_of or broker_version)(conf)
            if not server.classic_mirroring:
                if topology.role_queue_kind(False) == "quorum":
                    problems.append(
                        f"cluster {cluster!r}: {server.describe()} has no classic queue "
                        "mirroring (removed in 4.0): the role queues there are quorum "
                        "queues (role_queues = auto), replicated by RabbitMQ"
                    )
                else:
                    problems.append(
                        f"cluster {cluster!r}: {server.describe()} has no classic queue "
                        "mirroring (removed in 4.0): inbox_mirrors not applied; the role "
                        "queues live on one RabbitMQ node each (role_queues = quorum, or "
                        "auto, replicates them)"
                    )
                continue
            management_put(conf, path, policy)
        except OSError as exc:
            problems.append(
                f"cluster {cluster!r}: role queues not mirrored (management API: {exc}); "
                "they live on one RabbitMQ node each"
            )
    for problem in problems:
        log.warning("%s", problem)
    return problems
