"""What the Spark jobs share: the session, the settings that travel with a task, result
folders that never overwrite, CSV output, Ctrl-C between tasks, and the one job shape
(``drive``: each task on an executor, its rows and per-event records back, the records
appended to Parquet, errors kept as data) that the confirm-mode, Phoenix and failure
jobs run."""

from __future__ import annotations

import argparse
import csv
import logging
import os
import platform
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from middleware import __version__
from middleware.cli import URI_HELP, use_uris
from middleware.cliargs import ERROR_PREFIX
from middleware.errors import ConfigurationError
from middleware.settings import Settings

__all__ = [
    "Driven",
    "StopAfterCell",
    "drive",
    "execute",
    "failure",
    "hms",
    "new_result_dir",
    "on_executor",
    "on_executors",
    "progress_printer",
    "session",
    "settings_payload",
    "slots",
    "write_csv",
]


def session(app: str, master: str | None) -> Any:
    """A SparkSession for a job (``master`` None: spark-submit's); a clear error without
    PySpark."""
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        raise ConfigurationError(
            "the Spark job needs PySpark: pip install 'qosmq[spark]' (make setup installs it)"
        ) from None
    # Python workers must run the interpreter that has qosmq installed (on a cluster, set
    # PYSPARK_PYTHON to the executors' environment with `pip install qosmq[spark]`).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app)
    if master:
        builder = builder.master(master)
    spark = (
        builder.config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        # a part of a cell that failed stops meeting the others: they give up after this
        .config("spark.barrier.sync.timeout", "120s")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    # py4j says INFO "Closing down clientserver connection" from a finaliser, at
    # interpreter exit too, when the stream it logs to may be closed (a traceback then)
    logging.getLogger("py4j").setLevel(logging.WARNING)
    return spark


def settings_payload(settings: Settings) -> dict[str, Any]:
    """The settings as a task carries them to its executor (``Settings.load(**payload)``)."""
    data = settings.model_dump(mode="json")
    data["password"] = settings.password.get_secret_value()  # travels with the task only
    data["amqp_urls"] = ",".join(settings.amqp_urls)
    return data


def on_executor(spark: Any, function: Callable[..., dict[str, Any]], *args: Any) -> Any:
    """``function(*args)`` as one Spark task (on an executor, not the driver); its result."""
    return spark.sparkContext.parallelize([args], 1).map(lambda a: function(*a)).collect()[0]


def on_executors(
    spark: Any, function: Callable[..., dict[str, Any]], count: int, *args: Any
) -> list[Any]:
    """``function(*args, context)`` as ``count`` Spark tasks started together (a barrier
    stage: Spark starts all or none, on as many slots), ``context`` being each task's
    ``BarrierTaskContext`` (``partitionId()``, ``barrier()``, ``allGather()``); their
    results in task order.  ``function`` must not raise (an error is data): Spark would
    run the whole stage again."""

    def task(rows: Any) -> list[Any]:
        from pyspark import BarrierTaskContext

        (args_,) = list(rows)
        return [function(*args_, BarrierTaskContext.get())]

    rdd = spark.sparkContext.parallelize([args] * count, count)
    return list(rdd.barrier().mapPartitions(task).collect())


def slots(spark: Any) -> int:
    """Task slots the Spark application has now (what a barrier stage may take)."""
    return int(spark.sparkContext.defaultParallelism)


def failure(exc: BaseException) -> dict[str, str]:
    """A task's error as data (it comes back to the driver with what finished)."""
    return {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}


def progress_printer(
    total: int, describe: Callable[[dict[str, Any]], str]
) -> Callable[[int, dict[str, Any], dict[str, Any]], None]:
    """``drive``'s ``progress``: one line on stderr per finished task, ``[i/total]``,
    the task as ``describe`` tells it, and its error or ``done``."""

    def progress(i: int, task: dict[str, Any], result: dict[str, Any]) -> None:
        print(
            f"[{i}/{total}] {describe(task)}: {result.get('error') or 'done'}",
            file=sys.stderr,
            flush=True,
        )

    return progress


def new_result_dir(parent: Path, job: str) -> Path:
    """A new folder ``JOB-<UTC time>`` under ``parent``; an earlier result is never
    overwritten."""
    stamp = time.strftime(f"{job}-%Y%m%d-%H%M%S", time.gmtime())
    for n in range(1000):
        path = parent / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            path.mkdir(parents=True, exist_ok=False)
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"could not create a new result folder under {parent}")


def write_csv(path: Path, rows: list[dict[str, Any]], first: Sequence[str]) -> None:
    """Rows as CSV, the ``first`` columns first, the others sorted."""
    keys = sorted({k for r in rows for k in r}, key=lambda k: (k not in first, k))
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


def provenance(settings: Settings) -> list[str]:
    """A report's first lines: what ran where and when, and against which brokers."""
    return [
        f"- qosmq {__version__}, Python {platform.python_version()}, host {socket.gethostname()}"
        f", {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- brokers: {', '.join(settings.amqp_urls)} (vhost {settings.vhost})",
    ]


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend, or None without matplotlib (no charts)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def hms(seconds: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(seconds))


class StopAfterCell:
    """Ctrl-C while a job runs: the running task finishes, then the job stops and
    writes what finished; a second Ctrl-C stops at once.  (A KeyboardInterrupt raised
    inside a py4j call makes py4j cancel the command, and that fails with a Py4JError
    instead; so the first Ctrl-C only asks.)  Outside the main thread: no handler."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def __enter__(self) -> StopAfterCell:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def _on_sigint(self, signum: int, frame: Any) -> None:
        self.requested = True
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the next one stops now
        print(
            "\ninterrupted: finishing the running cell (Ctrl-C again to stop at once)",
            file=sys.stderr,
            flush=True,
        )

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def add_uri(p: argparse.ArgumentParser) -> None:
    """``--uri`` as the ``qosmq`` command has it, for a job started by spark-submit."""
    p.add_argument("--uri", action="append", help=URI_HELP)


def execute(
    args: argparse.Namespace,
    *,
    job: str,
    validate: Callable[[argparse.Namespace], object],
    run: Callable[[argparse.Namespace], Path],
) -> int:
    """A job's command: validate the grid (exit 2 naming the problem, nothing started),
    run it, print where the results went and the report."""
    use_uris(getattr(args, "uri", None))  # spark-submit's entry point parses them itself
    try:
        validate(args)
    except ValueError as exc:
        print(f"{ERROR_PREFIX} {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        out = run(args)
    except ConfigurationError as exc:  # found once Spark answered (e.g. too few slots)
        print(f"{ERROR_PREFIX} {exc}", file=sys.stderr)
        return 2
    print(f"results: {out}")
    print((out / "report.md").read_text())
    return 0


@dataclass
class Driven:
    """What a job's tasks brought back: their rows (records taken out), their errors,
    whether any record reached ``records.parquet``, whether Ctrl-C stopped it early."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    records_written: bool = False
    interrupted: bool = False


def drive(
    spark: Any,
    out: Path,
    function: Callable[..., dict[str, Any]],
    payload: Mapping[str, Any],
    tasks: Sequence[dict[str, Any]],
    *,
    extra: Sequence[Any] = (),
    append_records: Callable[[Any, Path, dict[str, Any], Sequence[Any]], None] | None = None,
    label: Callable[[dict[str, Any]], dict[str, Any]] = dict,
    progress: Callable[[int, dict[str, Any], dict[str, Any]], None] | None = None,
    merge: Callable[[dict[str, Any], list[dict[str, Any]]], dict[str, Any]] | None = None,
) -> Driven:
    """The one job shape: ``function(payload, task, *extra)`` as one Spark task per task,
    in order. It returns ``{"rows": [...]}`` (each row may carry ``records``: per-event
    tuples, handed to ``append_records`` and not kept in the row) and, if it failed,
    ``error`` and ``trace`` with the rows finished before. A first Ctrl-C stops after the
    current task, a second at once; what finished is returned either way.

    A task with ``"parts": n`` > 1 runs as ``n`` Spark tasks started together
    (:func:`on_executors`, each given its ``BarrierTaskContext`` last), and ``merge(task,
    results)`` makes the one result of them."""
    driven = Driven()
    try:
        with StopAfterCell() as stop:
            for i, task in enumerate(tasks, 1):
                if stop.requested:
                    driven.interrupted = True
                    break
                parts = int(task.get("parts", 1))
                if parts > 1 and merge is not None:
                    results = on_executors(spark, function, parts, dict(payload), task, *extra)
                    result = merge(task, results)
                else:
                    result = on_executor(spark, function, dict(payload), task, *extra)
                for row in result.get("rows", []):
                    records = row.pop("records", None)
                    driven.rows.append(row)
                    if records and append_records is not None:
                        append_records(spark, out, row, records)
                        driven.records_written = True
                if "error" in result:
                    driven.errors.append({**label(task), "error": result["error"]})
                    print(result.get("trace", ""), file=sys.stderr)
                if progress is not None:
                    progress(i, task, result)
    except KeyboardInterrupt:  # a second Ctrl-C: stop now
        driven.interrupted = True
    if driven.interrupted:
        print("\ninterrupted: writing the finished cells", file=sys.stderr)
    return driven
