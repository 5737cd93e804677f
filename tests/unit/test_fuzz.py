"""The seeded bad-input corpus (issue #21, item 13), the classes that need no broker:
command lines, settings, filters and events, receipt batches.  For every case: a named
error or a value the layer then holds correctly; never a traceback, a hang or a secret."""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from middleware.cli import main
from middleware.confirms.tracking import decode_receipts
from middleware.errors import ConfigurationError
from middleware.routing.matching import Event, Filter, FilterError, SubscriptionIndex
from middleware.settings import Settings
from tests import fuzz_corpus as corpus

ROOT = Path(__file__).resolve().parents[2]
CLI_CASES = 48
SETTINGS_CASES = 300
FILTER_CASES = 400
RECEIPT_CASES = 300


def _no_secret(text: str) -> None:
    for piece in (corpus.SECRET, "s3cr"):
        assert piece not in text, f"the planted password leaked: {text[:300]!r}"


# ---------------------------------------------------------------------- the CLI
@pytest.fixture
def cli_files(tmp_path: Path) -> Path:
    (tmp_path / "notes.txt").write_text("not toml at all\n" * 10)
    (tmp_path / "binary.bin").write_bytes(b"\xff\xfe\x00" * 100)
    (tmp_path / "bad.toml").write_text("a = [\n")
    return tmp_path


def test_fuzzed_command_lines_are_refused_in_one_line(cli_files: Path) -> None:
    """Each command line holds at least one value that must be refused: exit 2 before
    anything starts (no broker, role, benchmark or Spark), one line naming it, within
    seconds, the password of the configured URL nowhere."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(cli_files),
        "PYTHONPATH": str(ROOT),
        "QOSMQ_AMQP_URLS": f"amqp://app:{corpus.SECRET}@127.0.0.1:1/",
        "QOSMQ_CONNECT_TIMEOUT": "1",
    }

    def run(index: int) -> tuple[int, list[str], int | str, str]:
        argv = corpus.cli_argv(corpus.rng("cli", index), str(cli_files))
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "middleware.cli", *argv],
                env=env,
                cwd=cli_files,  # a default .qosmq state dir is the temp dir's
                capture_output=True,
                text=True,
                errors="replace",
                timeout=30,
            )
        except subprocess.TimeoutExpired:
            return index, argv, "hung for 30 s", ""
        return index, argv, proc.returncode, proc.stdout + proc.stderr

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, range(CLI_CASES)))
    for index, argv, code, output in results:
        where = f"seed {corpus.SEED} case {index}: qosmq {' '.join(argv)!r}"
        assert code == 2, f"{where}: exit {code}: {output[-500:]}"
        assert "Traceback" not in output, f"{where}: {output[-800:]}"
        _no_secret(output)
        lines = [line for line in output.splitlines() if line.strip()]
        assert len(lines) == 1 and ": error: " in lines[0], f"{where}: {output[-500:]}"


# ------------------------------------------------------------------ settings
def test_fuzzed_settings_are_named_or_bounded(tmp_path: Path, capsys, monkeypatch) -> None:
    for index in range(SETTINGS_CASES):
        case = corpus.settings_case(corpus.rng("settings", index))
        where = f"seed {corpus.SEED} case {index}: {case!r:.300}"
        try:
            settings = Settings.load(**case)
        except ConfigurationError as exc:
            _no_secret(str(exc))
            named = {k for k in case} | {f for v in case.values() if isinstance(v, dict) for f in v}
            assert any(name in str(exc) for name in named), f"{where}: {exc}"
        else:  # accepted: every duration finite, every count a sane int
            for name in corpus.DURATIONS:
                value = _field(settings, name)
                assert math.isfinite(value) and value >= 0, f"{where}: {name}={value}"
            _no_secret(repr(settings) + str(settings.model_dump()))
        # the same values from the environment, through the CLI
        with monkeypatch.context() as env:
            for key, value in case.items():
                env.setenv(f"QOSMQ_{key.upper()}", corpus.environment_value(value))
            code = main(["cluster", "status", "--state-dir", str(tmp_path / "none")])
        out, err = capsys.readouterr()
        assert code in (0, 2), f"{where}: exit {code}: {err}"
        assert "Traceback" not in out + err
        _no_secret(out + err)
        if code == 2:
            lines = [line for line in err.splitlines() if line.strip()]
            assert lines[0].startswith("qosmq: error:"), f"{where}: {err}"
            assert all(line.startswith("  - ") for line in lines[1:]), f"{where}: {err}"


def _field(settings: Settings, dotted: str) -> float:
    value: object = settings
    for part in dotted.split("."):
        value = getattr(value, part)
    assert isinstance(value, int | float)
    return float(value)


# --------------------------------------------------------- filters and events
def test_fuzzed_filters_are_refused_or_index_as_they_match() -> None:
    """An accepted filter survives its JSON form (what travels to the owner) and the
    index answers exactly what matching each filter alone answers (a brute-force count,
    not the index's); an event is refused with FilterError or matched without error."""
    r = corpus.rng("filters")
    index, filters = SubscriptionIndex(), {}
    refused = 0
    for i in range(FILTER_CASES):
        spec = corpus.filter_spec(r)
        try:
            flt = Filter.parse(spec)
        except FilterError:
            refused += 1
            continue
        again = Filter.parse(json.loads(json.dumps(flt.spec())))
        assert again == flt, (corpus.SEED, i, spec)
        index.add(f"s{i}", flt)
        filters[f"s{i}"] = flt
    assert 0 < refused < FILTER_CASES and filters  # the corpus holds both kinds
    matched = 0
    for i in range(FILTER_CASES):
        data = {"event_type": "bids", "attributes": corpus.event_attributes(r)}
        try:
            event = Event.parse(data)
        except FilterError:
            continue
        expected = {sid for sid, flt in filters.items() if flt.matches(event.attributes)}
        assert index.match(event.attributes) == expected, (corpus.SEED, i, data)
        matched += bool(expected)
    assert matched > FILTER_CASES // 10  # the corpus exercises matching, not only refusals


# ------------------------------------------------------------------ receipts
def test_fuzzed_receipt_batches_parse_or_are_named_malformed() -> None:
    for i in range(RECEIPT_CASES):
        body = corpus.receipt_body(corpus.rng("receipts", i))
        try:  # nothing but ValueError (not JSON, too deep, wrong shape) may come out
            receipts = decode_receipts(body)
        except ValueError as exc:
            assert str(exc), (corpus.SEED, i)
        else:
            assert all(isinstance(r.message_id, str) for r in receipts), (corpus.SEED, i)
