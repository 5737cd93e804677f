"""The options of ``qosmq bench phoenix`` (``phoenix_commands.py``): one definition
each, with the experiments each applies to (any other experiment refuses it)."""

from __future__ import annotations

import argparse
from pathlib import Path

from middleware.cli_help import renamed
from middleware.cliargs import integer, integers, names, number, out_file, path

from .options import ROLE_KINDS, add_departed_masters, fault_arguments, timeliness_arguments

__all__ = ["PHOENIX_OPTIONS", "PHOENIX_REPEATS", "add_phoenix_arguments"]


def add_phoenix_arguments(phoenix: argparse.ArgumentParser) -> None:
    """Every option of ``bench phoenix``."""
    phoenix.add_argument(
        "--experiment",
        choices=(
            *("matching", "rate", "subscriptions", "recovery", "link", "leave", "busy"),
            *("chaos", "throughput"),
        ),
        default="matching",
        help="matching: (c) one match broker; rate: (a) response time vs event rate; "
        "subscriptions: (b) response time vs subscriptions; recovery: (figure 8) SIGKILL "
        "of each role kind under load; link: a link between two routing masters cut or "
        "blackholed under load (detour, way back); leave: a whole cluster removed under "
        "load (its arc restored at its successor from the persisted state); busy: the "
        "deployment started and run beside CPU hogs, elections nobody caused counted; "
        "chaos: every fault kind in a seeded order under both client faces and both "
        "confirm modes, each subscriber's own counts checked against its filters; "
        "throughput: the idle cost, then the rate raised in steps until the deployment "
        "falls behind, with the CPU per event of every process and the messages per "
        "event on each hop",
    )
    phoenix.add_argument(
        "--idle",
        type=number(1, 3600),
        default=20.0,
        help="throughput: seconds measured with no events (the idle cost)",
    )
    phoenix.add_argument(
        "--keep-going",
        action="store_true",
        help="throughput: run every step, also after one fell behind",
    )
    phoenix.add_argument(
        "--batch-linger-ms",
        type=float,
        default=None,
        help="throughput: the topology's batch_linger_ms for every role and the client "
        "(default: the topology's default)",
    )
    phoenix.add_argument(
        "--subscriber-confirm",
        choices=("broker", "e2e"),
        default="broker",
        help="recovery: the subscription's confirm mode (e2e: the Phoenix client's e2e "
        "consumer, whose duplicate filter the duplicates count then checks)",
    )
    phoenix.add_argument(
        "--copy-batch-max",
        type=integer(1, 1000),
        default=None,
        help="throughput, recovery, rate, subscriptions, chaos: the topology's copy_batch_max, "
        "copies for one subscriber queue in one AMQP message (default: the topology's, 1)",
    )
    phoenix.add_argument(
        "--inbox-prefetch",
        type=integer(1, 1000),
        default=None,
        help="throughput, recovery, rate: the topology's inbox_prefetch, deliveries a role "
        "holds unacknowledged (default: the topology's, 16)",
    )
    phoenix.add_argument(
        "--inbox-concurrency",
        type=integer(1, 10_000),
        default=None,
        help="throughput, recovery, rate: the topology's inbox_concurrency, inbox messages "
        "a role handles at once (default: the topology's, 64)",
    )
    phoenix.add_argument(
        "--transient",
        action="store_true",
        help="throughput, recovery, rate, subscriptions, chaos: the topology's persistent = "
        "false (events and copies transient: faster, and lost from a RabbitMQ node that "
        "restarts)",
    )
    phoenix.add_argument(
        "--seed", type=integer(0, 2**31), default=1, help="chaos: the order of the faults"
    )
    phoenix.add_argument(
        "--chaos-faults",
        type=names(
            (
                *("router", "router_slave", "match", "match_slave", "freeze", "node", "silent"),
                *("cut", "blackhole", "cut_both", "leave"),
            )
        ),
        default="router,router_slave,match,match_slave,freeze,node,silent",
        help="chaos: the fault kinds (node: needs --state-dir of a local cluster; cut, "
        "blackhole, cut_both: the link B->C, or both ways, through a proxy; leave: the "
        "last cluster other than B and C removed, then joined again; with any of these "
        "every inter-cluster link goes through a proxy and the subscribers are homed at "
        "A and C, or with 4 or more clusters at every cluster)",
    )
    phoenix.add_argument(
        "--chaos-clusters",
        type=integer(3, 8),
        default=3,
        help="chaos: how many clusters (A, B, C, D, ...)",
    )
    phoenix.add_argument(
        "--window", type=number(4, 3600), default=8.0, help="chaos: seconds per fault window"
    )
    phoenix.add_argument(
        "--state-dir", type=path, help="chaos: the local cluster whose nodes it may kill"
    )
    phoenix.add_argument(
        "--hogs",
        type=integer(0, 64),
        default=2,
        help="busy: processes spinning on the cores beside the deployment",
    )
    phoenix.add_argument(
        "--suspect-ceiling",
        type=number(0, 600),
        help="busy: the topology's suspect_ceiling_s (0: the fixed detection rule; "
        "default: the topology's, 2.0)",
    )
    phoenix.add_argument(
        "--busy-seconds",
        type=number(1, 86_400),
        default=300.0,
        help="busy: seconds of steady events under the hogs",
    )
    add_departed_masters(phoenix)
    phoenix.add_argument(
        "--leave-after",
        type=number(0.1, 3600),
        help="leave: the topology's leave_after_s (default: the topology's, 3.0)",
    )
    fault_arguments(
        phoenix,
        kinds=ROLE_KINDS,
        faults_help="link: cut (connections reset, new ones refused), blackhole (open, silent)",
    )
    phoenix.add_argument(
        "--down",
        type=number(0.5, 600),
        default=2.5,
        help="link: seconds the link stays broken before it heals",
    )
    phoenix.add_argument(
        "--link-timeout",
        type=number(0.01, 60),
        help="link: the topology's link_timeout_s (default: the topology's, 1.0)",
    )
    phoenix.add_argument(
        "--heartbeat-interval",
        type=number(0.001, 60),
        help="recovery, throughput: the topology's heartbeat_interval_s, how often masters "
        "beat to their slaves (default: the topology's; docs/phoenix.md lists them)",
    )
    phoenix.add_argument(
        "--heartbeat-misses",
        type=integer(1, 100),
        help="recovery, throughput: the topology's heartbeat_misses (default: the topology's)",
    )
    phoenix.add_argument(
        "--slave-beat-interval",
        type=number(0.001, 60),
        help="recovery, throughput: the topology's slave_beat_interval_s, how often slaves "
        "beat to their master (default: the topology's)",
    )
    phoenix.add_argument(
        "--quiet-beat-interval",
        type=number(0, 60),
        help="recovery, throughput: the topology's quiet_beat_interval_s, how often a "
        "master with nothing to do and its slaves beat (0: off; default: the topology's)",
    )
    phoenix.add_argument(
        "--neighbour-check",
        type=number(0, 60),
        help="recovery, throughput: the topology's neighbour_check_s (0: off; default: the "
        "topology's)",
    )
    phoenix.add_argument(
        "--stream",
        type=number(3, 3600),
        default=5.0,
        help="recovery, link, leave: seconds of events around each fault (a kill at a "
        "random moment from 1 s to 2 s before the end)",
    )
    phoenix.add_argument(
        "--subscriptions",
        type=integers(1, 10_000_000),
        help="comma list (default: 10000,50000,100000,200000; rate: 200000)",
    )
    phoenix.add_argument(
        "--events", type=integer(1, 100_000_000), default=20_000, help="matching: events"
    )
    phoenix.add_argument(
        "--symbols",
        type=integer(1, 100_000_000),
        default=50_000,
        help="matching: distinct symbols the subscriptions pick from (fewer: more matches "
        "per event)",
    )
    timeliness_arguments(
        phoenix,
        repeats=None,
        repeats_help="repetitions: rate, subscriptions: mechanism passes, rotated (default "
        f"{PHOENIX_REPEATS['rate']}); recovery: kills per kind and rate "
        f"({PHOENIX_REPEATS['recovery']}); link: faults per kind and rate "
        f"({PHOENIX_REPEATS['link']}); leave: removals, a fresh deployment each "
        f"({PHOENIX_REPEATS['leave']})",
    )
    renamed(phoenix, "--kills", "--repeats")
    renamed(phoenix, "--cuts", "--repeats")
    phoenix.add_argument(
        "--work-dir", type=path, default=Path(".qosmq/bench-phoenix"), help="state and logs"
    )
    phoenix.add_argument("--out", type=out_file, help="also write the rows to this JSON file")


#: ``bench phoenix --repeats`` when not given, by experiment
PHOENIX_REPEATS = {"rate": 1, "subscriptions": 1, "recovery": 10, "link": 5, "leave": 5}
#: the ``bench phoenix`` options that only some experiments use (any other refuses them)
PHOENIX_OPTIONS: dict[str, tuple[str, ...]] = {
    "seed": ("chaos",),
    "chaos_faults": ("chaos",),
    "chaos_clusters": ("chaos",),
    "window": ("chaos",),
    "state_dir": ("chaos",),
    "hogs": ("busy",),
    "suspect_ceiling": ("busy",),
    "busy_seconds": ("busy",),
    "idle": ("throughput",),
    "keep_going": ("throughput",),
    "batch_linger_ms": ("throughput",),
    "copy_batch_max": ("throughput", "recovery", "rate", "subscriptions", "chaos"),
    "transient": ("throughput", "recovery", "rate", "subscriptions", "chaos"),
    "inbox_prefetch": ("throughput", "recovery", "rate"),
    "inbox_concurrency": ("throughput", "recovery", "rate"),
    "subscriber_confirm": ("recovery",),
    "departed_masters": ("leave",),
    "leave_after": ("leave",),
    "faults": ("link",),
    "down": ("link",),
    "link_timeout": ("link",),
    "kinds": ("recovery",),
    "heartbeat_interval": ("recovery", "throughput"),
    "heartbeat_misses": ("recovery", "throughput"),
    "slave_beat_interval": ("recovery", "throughput"),
    "quiet_beat_interval": ("recovery", "throughput"),
    "neighbour_check": ("recovery", "throughput"),
    "stream": ("recovery", "link", "leave"),
    "events": ("matching",),
    "symbols": ("matching",),
    "subscriptions": ("matching", "rate", "subscriptions", "leave", "throughput"),
    "repeats": ("rate", "subscriptions", "recovery", "link", "leave"),
    "mechanisms": ("rate", "subscriptions", "throughput"),
    "duration": ("rate", "subscriptions", "throughput"),
    "warmup": ("rate", "subscriptions", "throughput"),
    "inbox_mirrors": ("rate", "subscriptions"),
    "role_queues": ("rate", "subscriptions"),
    "max_steal": ("rate", "subscriptions"),
    "steal_retries": ("rate", "subscriptions"),
    "rates": ("rate", "subscriptions", "recovery", "link", "leave", "busy", "chaos", "throughput"),
}
