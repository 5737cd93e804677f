"""Where a Phoenix deployment's steady state spends its Python calls, start-up taken out.

A role's profile (``QOSMQ_PROFILE_DIR``: cProfile on the main thread's CPU time) holds
its start too: loading 20 000 subscriptions calls the router's route as often as a
minute of events.  Run the same throughput step twice with two durations, one profile
directory each, and the difference between the two is the steady state of the extra
seconds alone::

    for d in 10 40; do QOSMQ_PROFILE_DIR=/tmp/prof$d qosmq bench phoenix \\
        --experiment throughput --subscriptions 20000 --rates 200 --duration $d \\
        --idle 3 --keep-going --copy-batch-max 32; done
    python scripts/profile_diff.py /tmp/prof10 /tmp/prof40 --events 5976

``--events``: the events the longer run offered beyond the shorter (rate x the extra
seconds).  Prints, per role kind (summed over its processes), the function calls and
profiled time per event by package, then the costliest functions.  cProfile charges
every Python call, so its times overstate code made of many small calls; the call
counts are exact.  A diagnostic for performance work, not part of the layer.
"""

from __future__ import annotations

import argparse
import collections
import pstats
from pathlib import Path

Key = tuple[str, int, str]

PACKAGES = ("aiormq", "pamqp", "asyncio", "pydantic", "pika", "uvloop")


def kind_of(stats: dict[Key, tuple]) -> str:
    """The role a profile is of, by the handler it ran (a slave serves neither)."""
    functions = {(Path(k[0]).name, k[2]) for k in stats}
    if ("ring_router.py", "_route") in functions:
        return "router"
    if ("match_master.py", "_on_publish") in functions:
        return "match master"
    return "other (slaves)"


def group_of(key: Key) -> str:
    """The package (or the layer's subpackage) a function belongs to."""
    path, _, name = key
    if path == "~":
        return f"builtin {name[:48]}"
    if "middleware/" in path:
        return "layer " + path.split("middleware/", 1)[1].split("/", 1)[0]
    return next((p for p in PACKAGES if p in path), Path(path).name)


def load(directory: Path) -> dict[str, tuple[collections.Counter, collections.Counter]]:
    """Per role kind: calls and own time per function, summed over its processes."""
    kinds: dict[str, tuple[collections.Counter, collections.Counter]] = {}
    for file in sorted(directory.glob("*.prof")):
        stats = pstats.Stats(str(file)).stats  # type: ignore[attr-defined]
        calls, times = kinds.setdefault(
            kind_of(stats), (collections.Counter(), collections.Counter())
        )
        for key, (_, ncalls, tottime, *_rest) in stats.items():
            calls[key] += ncalls
            times[key] += tottime
    return kinds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shorter", type=Path)
    parser.add_argument("longer", type=Path)
    parser.add_argument("--events", type=float, required=True)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    before, after = load(args.shorter), load(args.longer)
    for kind in sorted(after):
        calls0, times0 = before.get(kind, (collections.Counter(), collections.Counter()))
        calls1, times1 = after[kind]
        calls = {k: calls1[k] - calls0[k] for k in calls1}
        times = {k: times1[k] - times0[k] for k in times1}
        per = args.events
        print(
            f"\n== {kind}: {sum(calls.values()) / per:.0f} calls, "
            f"{sum(times.values()) / per * 1e3:.2f} ms profiled per event"
        )
        groups_t: collections.Counter = collections.Counter()
        groups_c: collections.Counter = collections.Counter()
        for key in calls:
            groups_t[group_of(key)] += times[key]
            groups_c[group_of(key)] += calls[key]
        for group, spent in groups_t.most_common(args.top):
            print(f"{spent / per * 1e6:8.1f} us {groups_c[group] / per:8.1f} calls  {group}")
        print("-- functions")
        for key in sorted(times, key=times.__getitem__, reverse=True)[: args.top]:
            where = key[0].split("site-packages/")[-1].split("middleware/")[-1]
            print(
                f"{times[key] / per * 1e6:8.1f} us {calls[key] / per:8.2f} calls  "
                f"{where}:{key[1]}({key[2]})"
            )


if __name__ == "__main__":
    main()
