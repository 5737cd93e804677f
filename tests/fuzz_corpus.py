"""A seeded corpus of bad (and good) input, one generator per class of issue #21.

Every generator takes a ``random.Random`` and returns one case; the same seed gives the
same corpus (``QOSMQ_FUZZ_SEED`` picks another: a failing case names its seed and index).
Cases mix values the layer must accept and carry unchanged with values it must refuse
by name; the tests do not predict which is which, they check that each case ends in one
of the two (never a crash, a hang, a loop, a lost neighbour or a leaked secret)."""

from __future__ import annotations

import datetime
import decimal
import json
import math
import os
import random
import string
from typing import Any

SEED = int(os.environ.get("QOSMQ_FUZZ_SEED", "20261123"))
#: Planted in every URL, settings file and environment a case builds; never to be printed.
SECRET = "fuzz-s3cr#t/pa?ss"


def rng(klass: str, index: int = 0) -> random.Random:
    return random.Random(f"{SEED}:{klass}:{index}")


def _text(r: random.Random, most: int = 12) -> str:
    return "".join(
        r.choice(string.ascii_letters + string.digits) for _ in range(r.randint(1, most))
    )


def _deep(depth: int, leaf: Any) -> Any:
    out = leaf
    for _ in range(depth):
        out = {"a": out}
    return out


# ----------------------------------------------------------------- header tables
def header_value(r: random.Random, depth: int = 0) -> Any:
    good: list[Any] = [
        lambda: _text(r),
        lambda: r.randint(-(2**63), 2**63 - 1),
        lambda: r.uniform(-1e300, 1e300),
        lambda: r.choice([True, False, None]),
        lambda: r.randbytes(r.randint(0, 40)),
        lambda: decimal.Decimal(f"{r.randint(-999999, 999999)}.{r.randint(0, 999)}"),
        lambda: datetime.datetime(2000 + r.randint(0, 60), 1, 2, tzinfo=datetime.UTC),
        lambda: "é€😀" * r.randint(1, 5),
    ]
    if depth < 3:
        good.append(lambda: [header_value(r, depth + 1) for _ in range(r.randint(0, 4))])
        good.append(lambda: {_text(r): header_value(r, depth + 1) for _ in range(r.randint(0, 3))})
    poison: list[Any] = [
        lambda: r.choice([math.nan, math.inf, -math.inf]),
        lambda: r.choice([2**64, -(2**63) - 1, 2**200]),
        lambda: {1, 2},
        lambda: object(),
        lambda: "\udcff" + _text(r),
        lambda: decimal.Decimal(r.choice(["NaN", "Infinity", "1e999999"])),
        lambda: _deep(r.choice([200, 2000]), 1),
        lambda: "x" * r.choice([70_000, 200_000]),
        lambda: 1j,
        lambda: [1, math.nan],
        lambda: {"k" * 200: 1},
    ]
    return r.choice(poison if r.random() < 0.25 else good)()


def header_key(r: random.Random) -> Any:
    if r.random() < 0.85:
        return _text(r, 20)
    return r.choice(["k" * r.choice([128, 129, 300]), "", "\udcff", 7, b"bytes-key", None])


def headers(r: random.Random) -> dict[Any, Any]:
    return {header_key(r): header_value(r) for _ in range(r.randint(0, 5))}


# ------------------------------------------------------------- outbound messages
def message_fields(r: random.Random) -> dict[str, Any]:
    """Keyword arguments of an ``OutgoingMessage`` (without routing)."""
    fields: dict[str, Any] = {
        "body": r.randbytes(r.choice([0, 1, 64, 4096, 100_000])),
        "message_id": f"fz-{r.getrandbits(48):x}",
        "headers": headers(r),
    }
    oddities: dict[str, list[Any]] = {
        "body": ["text, not bytes", None, bytearray(b"ba"), r.randbytes(300_000)],
        "message_id": ["", "m" * 256, "\udcff", 12, "é" * 100],
        "priority": [0, 9, 255, 256, -1, "high", 2.5],
        "expiration_ms": [0, 1, 10**12, -1, 2**64, "soon"],
        "timestamp": [0.0, 1e9, -1.0, 2.0**64, math.nan, math.inf, "now"],
        "correlation_id": ["c", "c" * 300, "\udcff", 5],
        "reply_to": ["r", "\udcff", "r" * 300],
        "content_type": ["application/json", "t" * 300, "\udcff"],
    }
    for name in r.sample(sorted(oddities), r.randint(0, 3)):
        fields[name] = r.choice(oddities[name])
    return fields


# ------------------------------------------ what a plain AMQP client can deliver
def plain_properties(r: random.Random) -> dict[str, Any]:
    """Keyword arguments of ``pika.BasicProperties``: anything the broker passes through."""
    props: dict[str, Any] = {}
    pool: dict[str, list[Any]] = {
        "message_id": ["ok-id", b"\xff\xfe-id", "é" * 80, b""],
        "reply_to": ["", b"\xc3\x28", "nowhere"],
        "correlation_id": ["c", b"\xff"],
        "content_type": ["text/plain", b"\xe2\x82"],
        "content_encoding": ["gzip", b"\xff"],
        "type": ["t", b"\xfe"],
        "app_id": ["a", b"\x80"],
        "timestamp": [0, 1, 2**31, 2**63 - 1, 2**64 - 1],
        "priority": [0, 5, 255],
        "delivery_mode": [1, 2],
        "headers": [
            {b"\xff\xfekey": 1},
            {"n": 2**63 - 1, "m": -(2**63)},
            {"f": 1.5, "l": [1, "x", b"\x00"], "d": {"e": {"f": None}}},
            {"x-qosmq-receipt": True},  # asks for a receipt, without reply_to or id
            {"x-qosmq-receipt": "yes", "x-qosmq-expected": b"\xff"},
            {"t": datetime.datetime(2030, 1, 1)},
            {"dec": decimal.Decimal("1.5")},
        ],
    }
    for name in r.sample(sorted(pool), r.randint(1, 5)):
        props[name] = r.choice(pool[name])
    return props


# ------------------------------------------------------------------ receipts
def receipt_body(r: random.Random) -> bytes:
    """What lands on a publisher's receipt address: garbage, or a batch naming no message
    in flight (ids of this corpus are never published)."""
    unknown = f"never-sent-{r.getrandbits(32):x}"
    docs: list[Any] = [
        {"v": 1, "ok": {"q": [unknown]}, "neg": []},
        {"v": 1, "ok": {"q": unknown}},
        {"v": 1, "ok": [unknown]},
        {"v": 1, "neg": [[unknown, "q"]]},
        {"v": 1, "neg": [[unknown, "q", 5]]},
        {"v": 1, "neg": [[unknown, "q", "reason"]]},
        {"v": 2, "ok": {}},
        {"v": "1"},
        {"v": 1, "ok": {"q": [1e308 * 10]}},
        [unknown],
        None,
        "receipt",
        2**80,
    ]
    if r.random() < 0.6:
        doc = r.choice(docs)
        try:
            return json.dumps(doc).encode()
        except ValueError:  # inf
            return b'{"v": 1, "ok": {"q": [Infinity]}}'
    return r.choice(
        [
            b"",
            r.randbytes(r.randint(1, 200)),
            b"[" * r.choice([100, 100_000]),
            b'{"v": 1, "ok": ' * 20_000,
            b"\xff\xfe{}",
            b'{"v": 1, "ok": {"q": ["' + b"i" * 100_000 + b'"]}}',
        ]
    )


# ------------------------------------------------------------ filters and events
OPS = ["<", "<=", ">", ">=", "!=", "=", "in", "prefix", "exists", "==", "like", "", None, 3]


def filter_value(r: random.Random) -> Any:
    return r.choice(
        [
            r.randint(-1000, 1000),
            r.uniform(-1e6, 1e6),
            _text(r),
            True,
            None,
            math.nan,
            math.inf,
            -math.inf,
            2**63,
            -(2**64),
            2**70,
            [1, 2],
            {"a": 1},
            "\udcff",
            b"bytes",
            decimal.Decimal("1.5"),
        ]
    )


def _plausible_predicate(r: random.Random) -> list[Any]:
    attribute = r.choice(["price", "qty", "sym"])
    op = r.choice(["<", "<=", ">", ">=", "!=", "=", "in", "prefix", "exists"])
    number = r.choice([r.randint(-50, 50), r.uniform(-50, 50), 0, -0.0, 2**63 - 1, -(2**63)])
    if op == "exists":
        return [attribute, op]
    if op == "prefix":
        return [attribute, op, r.choice(["", "A", "AB", "é"])]
    if op == "in":
        return [attribute, op, [r.choice([number, "AB", True]) for _ in range(r.randint(1, 3))]]
    return [attribute, op, r.choice([number, number, "AB", "B", True, False])]


def filter_spec(r: random.Random) -> Any:
    shape = r.random()
    if shape < 0.1:
        return r.choice([5, "price", {"price": 1}, None, [[]], ["price", "<", 1], [None]])
    if shape < 0.6:
        return [_plausible_predicate(r) for _ in range(r.randint(1, 3))]
    return [
        r.choice(
            [
                [r.choice(["price", "qty", "sym", "", 7, None]), r.choice(OPS), filter_value(r)],
                [r.choice(["price", "qty"]), r.choice(OPS[:6]), filter_value(r)],
                _plausible_predicate(r),
                ["price"],
                ["price", "<", 1, "extra"],
                "price < 1",
            ]
        )
        for _ in range(r.randint(0, 4))
    ]


def event_attributes(r: random.Random) -> Any:
    if r.random() < 0.1:
        return r.choice([None, [1], "price=1", 5])
    if r.random() < 0.6:
        return {
            name: r.choice([r.randint(-50, 50), r.uniform(-50, 50), "AB", "ABC", "B", True, 0])
            for name in r.sample(["price", "qty", "sym"], r.randint(0, 3))
        }
    return {
        r.choice(["price", "qty", "sym", "", 7]): filter_value(r) for _ in range(r.randint(0, 4))
    }


# ------------------------------------------------------------------ settings
DURATIONS = [
    "connect_timeout",
    "publish_timeout",
    "close_grace",
    "retry.initial_delay",
    "retry.max_delay",
    "retry.jitter",
    "retry.multiplier",
    "confirms.receipt_timeout",
    "confirms.receipt_linger_ms",
    "confirms.receipt_busy_rate",
]
COUNTS = [
    "heartbeat",
    "prefetch",
    "publish_window",
    "max_message_size",
    "management_port_offset",
    "metrics_port",
    "retry.attempts",
    "confirms.max_attempts",
    "confirms.receipt_batch",
    "confirms.dedup_window",
    "queues.spool_max_messages",
    "queues.max_message_bytes",
    "queues.drain_batch",
]
BAD_NUMBERS = ["inf", "-inf", "nan", "1e300", "-1", "0", "", "x", "1e", "99999999999999999999999"]


def settings_case(r: random.Random) -> dict[str, Any]:
    """Overrides for ``Settings.load`` (nested fields as dicts), with the secret planted."""
    password = SECRET
    out: dict[str, Any] = {}
    for name in r.sample(DURATIONS + COUNTS, r.randint(1, 3)):
        value: Any = r.choice([*BAD_NUMBERS, math.inf, math.nan, -5, 10**30, True, [], {}])
        if "." in name:
            section, field = name.split(".")
            out.setdefault(section, {})[field] = value
        else:
            out[name] = value
    if r.random() < 0.5:
        out["amqp_urls"] = r.choice(
            [
                f"amqp://app:{password}@127.0.0.1:56x2/",
                f"amqp://app:{password}@/",
                f"http://app:{password}@127.0.0.1:5672/",
                f"amqp://app:{password}@127.0.0.1:99999/",
                f"amqp://app:{password}@127.0.0.1:5682/,,",
                f"amqp://app:{password}@[::1/",
            ]
        )
    else:
        out["password"] = password
    if r.random() < 0.3:
        out[r.choice(["event_loop", "log_level", "log_format", "vhost"])] = r.choice(
            ["nope", "", 5, "\udcff"]
        )
    return out


def environment_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


# ----------------------------------------------------------------------- CLI
#: Commands that only read or refuse: a fuzzed command line must not start brokers,
#: roles, benchmarks or Spark, so those take a value that must be refused first.
CLI_BAD_INT = ["0", "-1", "x", "", "1e3", "99999999999999999999", "nan"]
CLI_BAD_FLOAT = ["nan", "inf", "-inf", "-1", "x", "", "1e400"]


def cli_argv(r: random.Random, tmp: str) -> list[str]:
    bad_path = r.choice(
        [
            f"{tmp}/absent",
            f"{tmp}/notes.txt",
            f"{tmp}/binary.bin",
            tmp,
            "",
            "/proc/self/mem",
            f"{tmp}/bad.toml",
        ]
    )
    cases = [
        ["cluster", "up", "--nodes", r.choice(["0", "10", "-3", "x", ""])],
        ["cluster", "up", "--base-port", r.choice(["80", "0", "70000", "x", "-1"])],
        ["cluster", "status", r.choice(["--nope", "extra", "--json=1"])],
        ["cluster", r.choice(["stop", "kill", "start"]), r.choice(["qosmq-9", "0", "", "x" * 300])],
        ["cluster", r.choice(["", "boom"])],
        ["spool", r.choice(["status", "drain"]), "--path", bad_path],
        ["bench", "confirms", "--window", r.choice(CLI_BAD_INT)],
        ["bench", "confirms", "--modes", r.choice(["", "fast", "e2e,,", "\udcff"])],
        ["bench", "confirms", "--duration", r.choice(CLI_BAD_FLOAT)],
        ["bench", "balance", "--replicas", r.choice(CLI_BAD_INT)],
        ["bench", "balance", "--rates", r.choice(["", "x", "-1", "nan"])],
        ["bench", "phoenix", "--experiment", r.choice(["", "nope"])],
        ["bench", "phoenix", "--events", r.choice(CLI_BAD_INT)],
        ["bench", "transport", "--messages", r.choice(CLI_BAD_INT)],
        ["bench", "queues", "--size", r.choice(CLI_BAD_INT)],
        ["demo", "--queues", r.choice(["", "0", "x", "-1"])],
        ["spark", "confirms", "--repeats", r.choice(CLI_BAD_INT)],
        ["spark", "phoenix", "--rates", r.choice(["", "x", "-5", "nan"])],
        ["sidecar", "balancer", "--replicas", r.choice(CLI_BAD_INT)],
        ["sidecar", "router", "--role", r.choice(["", "boss"])],
        ["sidecar", "matcher", "--topology", bad_path],
        ["phoenix", r.choice(["up", "status", "join"]), "--topology", bad_path],
        ["phoenix", "configure", "--batch-max", r.choice(CLI_BAD_INT)],
        ["--config", bad_path, "cluster", "status"],
        [r.choice(["nope", "", "--help-me"])],
    ]
    return r.choice(cases)


# ------------------------------------------------------------ Phoenix messages
PHOENIX_KINDS = [
    "advertise",
    "subscribe",
    "unsubscribe",
    "unsubscribed",
    "publish",
    "heartbeat",
    "join",
    "handover",
    "replicate",
    "ack",
    "read",
    "snapshot",
    "configure",
    "takeover",
    "answer",
    "confirmation",
    "beat",
    "election",
    "election_answer",
    "coordinator",
    "nope",
    "",
    7,
]


def phoenix_body(r: random.Random, prefix: str) -> bytes:
    """A message for a Phoenix role's inbox: garbage, or a role message from a sender or
    about a cluster the topology does not have, or with fields out of shape.  Never an
    operator's ``configure``, and events only of types nobody subscribes to: a well-formed
    order from a legitimate role is obeyed (Phoenix authenticates no one)."""
    if r.random() < 0.25:
        return r.choice(
            [
                b"",
                r.randbytes(r.randint(1, 100)),
                b"[" * 50_000,
                b"null",
                b'"subscribe"',
                json.dumps(_deep(300, 1)).encode(),
                b'{"kind": "publish", "event_type": "x", "event": ' * 5000,
            ]
        )
    doc: dict[str, Any] = {
        "kind": r.choice(PHOENIX_KINDS),
        "event_type": r.choice([f"fz-nobody-{r.randint(0, 3)}", "", 5, None, "x" * 300]),
    }
    optional: dict[str, list[Any]] = {
        "event": [
            {"event_type": "fz-nobody-0", "attributes": event_attributes(r)},
            {"event_type": "bad type!", "attributes": {}},
            "event",
            None,
        ],
        "filter": [filter_spec(r), "price < 1", [[1, 2, 3, 4]]],
        "latency_level": [0, 1, 6, -1, "fast", 2**70],
        "queue": [f"{prefix}.fz", "", "q" * 300, 5, "amq.nope"],
        "confirm": ["broker", "e2e", "maybe"],
        "subscription_id": [f"fz-{r.getrandbits(32):x}", "", 3],
        "home": ["Z", "", None, 5],
        "hops": [["Z"] * r.randint(0, 40), "A", [1]],
        "replica": [True, "yes"],
        "broker": ["B/match-0/slave-99", "Z/router", "B/evil", "", 7],
        "predicted_t": [-1.0, 1e308, "soon"],
        "cluster": ["Z", "", "A/../B", 3],
        "arc": [[0, 2**64], [5, 1], "all", [1]],
        "table": [{"queue": -1, "service_rate": "fast"}, {"x": _deep(50, 1)}, [], None],
        "service_rate": [-1.0, 1e308, "fast", 0.0],
        "switches": [{"outer": "maybe"}, {"batch_max": 0}, {"x": _deep(50, 1)}, []],
        "master": ["B/match-0", "B/router", "Z/router", 7],
        "outcome": [{"removed": "yes"}, {"evil": 1}, {"error": "x" * 300}],
        "version": [-1, 2**70, "v1"],
        "key": ["k", "", 5],
        "state_kind": ["routing_table", "subscription", "nope"],
        "request": ["r-1", 5],
        "reply_to": ["", f"{prefix}.nobody", 5],
        "entries": [{"k": [1, {}]}, {"k": "v"}, [1, 2]],
        "last": [True, "no"],
        "priority": [0, 9, 300, -1],
        "unknown_field": [1],
    }
    for name in r.sample(sorted(optional), r.randint(0, 6)):
        doc[name] = r.choice(optional[name])
    if doc["kind"] in ("join", "handover") and doc.get("cluster") in (None, "A", "B", "C"):
        doc["cluster"] = "Z"  # a cluster the topology does not have
    try:  # NaN and Infinity go out as JSON's non-standard literals
        return json.dumps(doc, default=repr).encode()
    except (ValueError, RecursionError):
        return b'{"kind": "heartbeat", "event_type": "-", "predicted_t": NaN}'
