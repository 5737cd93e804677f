"""Bad settings and bad CLI input: one line naming the input, exit 2, no traceback, no secret."""

from __future__ import annotations

import math

import pytest

from middleware.cli import main
from middleware.errors import ConfigurationError
from middleware.settings import Settings

SECRET = "s3cr#t/pa?ss@word"


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"confirms": {"receipt_timeout": math.inf}}, "confirms.receipt_timeout"),
        ({"confirms": {"receipt_timeout": 1e300}}, "confirms.receipt_timeout"),
        ({"publish_timeout": math.inf}, "publish_timeout"),
        ({"publish_timeout": math.nan}, "publish_timeout"),
        ({"retry": {"initial_delay": math.inf}}, "retry.initial_delay"),
        ({"retry": {"max_delay": 1e9}}, "retry.max_delay"),
        ({"retry": {"jitter": math.nan}}, "retry.jitter"),
        ({"connect_timeout": math.inf}, "connect_timeout"),
        ({"confirms": {"receipt_busy_rate": math.inf}}, "confirms.receipt_busy_rate"),
    ],
)
def test_every_duration_is_finite_and_bounded(overrides: dict, field: str) -> None:
    with pytest.raises(ConfigurationError, match=field.replace(".", r"\.")):
        Settings.load(**overrides)


@pytest.mark.parametrize("char", ["#", "/", "?", "@", "%23"])
def test_a_password_with_url_characters_is_taken_whole(char: str) -> None:
    settings = Settings.load(amqp_urls=f"amqp://app:pa{char}ss@127.0.0.1:5682/")
    expected = "pa#ss" if char == "%23" else f"pa{char}ss"
    assert settings.password.get_secret_value() == expected
    assert settings.amqp_urls == ("amqp://127.0.0.1:5682/",)
    assert settings.username == "app"


@pytest.mark.parametrize(
    "url",
    [
        f"amqp://app:{SECRET}@127.0.0.1:56x2/",  # bad port after the credentials
        f"http://app:{SECRET}@127.0.0.1:5682/",  # bad scheme
        f"amqp://app:{SECRET}@/",  # no host
        f"amqp://app:{SECRET}@127.0.0.1:5682/,amqp://x:{SECRET}@h:99999/",
    ],
)
def test_no_error_path_shows_the_password(url: str, capsys, monkeypatch) -> None:
    with pytest.raises(ConfigurationError) as caught:
        Settings.load(amqp_urls=url)
    assert "pa?ss" not in str(caught.value) and "s3cr" not in str(caught.value)
    monkeypatch.setenv("QOSMQ_AMQP_URLS", url)
    assert main(["cluster", "status", "--state-dir", "/nonexistent-qosmq"]) == 2
    out, err = capsys.readouterr()
    assert "s3cr" not in out + err and "amqp_urls" in err


def _cli(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("qosmq") and ": error: " in lines[0], err
    return err


@pytest.mark.parametrize(
    "variable, value",
    [("QOSMQ_RETRY", "{not json"), ("QOSMQ_CONFIRMS", "nope"), ("QOSMQ_QUEUES", "[1,")],
)
def test_nested_settings_that_are_not_json(variable, value, capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(variable, value)
    err = _cli(capsys, ["cluster", "status", "--state-dir", str(tmp_path)])
    assert variable.removeprefix("QOSMQ_").lower() in err and "JSON" in err


@pytest.mark.parametrize(
    "content, says",
    [(b"a = [\n", "not valid TOML"), (b"\xff\xfe = 1\n", "not UTF-8"), (b"[x\n", "TOML")],
)
def test_config_files_that_are_not_toml(content, says, capsys, tmp_path) -> None:
    path = tmp_path / "bad.toml"
    path.write_bytes(content)
    err = _cli(capsys, ["--config", str(path), "cluster", "status", "--state-dir", str(tmp_path)])
    assert says in err and str(path) in err


@pytest.mark.parametrize(
    "argv, says",
    [
        (["cluster", "up", "--nodes", "0"], "--nodes: 0 is out of range (expected 1 to 9)"),
        (["cluster", "up", "--nodes", "10"], "--nodes: 10 is out of range (expected 1 to 9)"),
        (["cluster", "up", "--base-port", "80"], "--base-port: 80 is out of range"),
        (["cluster", "stop", "qosmq-9"], "no node 'qosmq-9'"),
        (["cluster", "kill", "7"], "no node"),
        (["cluster", "freeze", "7"], "no node"),
        (["cluster", "thaw", "qosmq-9"], "no node"),
    ],
)
def test_cluster_arguments_out_of_range(argv, says, capsys, tmp_path) -> None:
    err = _cli(capsys, [*argv, "--state-dir", str(tmp_path)])
    assert says in err


@pytest.mark.parametrize(
    "topic, says",
    [
        ("", "--topic: the name is empty"),
        ("a\x01b", "has control characters"),
        ("t" * 201, "is 201 bytes long (at most 200 in UTF-8)"),
        ("é" * 101, "is 202 bytes long"),
        ("a\udcffb", "is not valid UTF-8 text"),  # bytes of argv that are not UTF-8
    ],
)
def test_a_balancer_topic_the_broker_cannot_carry_is_refused_at_once(topic, says, capsys) -> None:
    """Refused when parsed, before any connection (the broker here is unreachable)."""
    err = _cli(capsys, ["sidecar", "balancer", "--topic", topic])
    assert says in err and "connection" not in err


def test_spool_status_of_a_missing_file_creates_nothing(capsys, tmp_path) -> None:
    path = tmp_path / "absent.sqlite3"
    err = _cli(capsys, ["spool", "status", "--path", str(path)])
    assert "no spool at" in err and not path.exists()


def test_spool_status_of_a_file_that_is_not_a_spool(capsys, tmp_path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("hello, this is not SQLite\n" * 100)
    err = _cli(capsys, ["spool", "status", "--path", str(path)])
    assert "is not a qosmq spool" in err


def test_config_is_taken_after_the_command_too(tmp_path, capsys) -> None:
    missing = tmp_path / "missing.toml"
    assert main(["cluster", "status", "--state-dir", str(tmp_path), "--config", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"--config: file {missing} does not exist" in err and "Traceback" not in err
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("qosmq ")


def test_every_option_of_every_command_has_help_and_shows_its_default(capsys) -> None:
    from middleware.cli import _parser
    from middleware.cli_help import undocumented

    parser = _parser()
    assert undocumented(parser) == []
    assert main(["bench", "queues", "--help"]) == 0
    text = capsys.readouterr().out
    assert "seconds per cell (default: 10.0)" in text and "(default: 256)" in text


def test_a_benchmark_refuses_an_output_folder_that_does_not_exist_before_running(
    tmp_path, capsys
) -> None:
    missing = tmp_path / "no" / "x.json"
    for command in (["bench", "confirms"], ["bench", "transport"], ["bench", "phoenix"]):
        assert main([*command, "--out", str(missing)]) == 2  # refused when parsed
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("qosmq: error:"), err
        assert "folder" in err and "does not exist" in err and "[1/" not in err


@pytest.mark.parametrize(
    "argv, dest, value",
    [
        (["bench", "confirms", "--json", "x.json"], "out", "x.json"),
        (["bench", "phoenix", "--kills", "3"], "repeats", 3),
        (["bench", "phoenix", "--cuts", "2"], "repeats", 2),
        (["bench", "balance", "--rate", "100,200"], "rates", "100,200"),
        (["bench", "node-loss", "--rate", "20"], "rates", "20"),
        (["spark", "faults", "--runs", "4"], "repeats", 4),
        (["spark", "confirms", "--no-progress"], "quiet", True),
        (["sidecar", "balancer", "--topic", "t", "--i1", "0.2"], "sample_interval", 0.2),
    ],
)
def test_a_renamed_option_still_works_and_names_its_new_name(argv, dest, value, capsys) -> None:
    """One name per concept: an option's former name is taken as the new one, with one
    line saying the new name (the closing notes list old -> new)."""
    from pathlib import Path

    from middleware.cli import _parser

    args = _parser().parse_args(argv)
    got = getattr(args, dest)
    assert (str(got) if isinstance(got, Path) else got) == value
    err = capsys.readouterr().err
    assert err.startswith("qosmq: note: ") and " is now --" in err, err


def test_an_option_of_another_experiment_is_refused_in_one_line(capsys, tmp_path) -> None:
    work = tmp_path / "work"
    argv = ["bench", "phoenix", "--experiment", "recovery", "--hogs", "3"]
    assert main([*argv, "--work-dir", str(work)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "qosmq: error: --hogs is for --experiment busy, not recovery", err
    assert not work.exists()  # refused before anything started


def test_a_benchmark_names_an_unreachable_broker_before_it_preloads(
    capsys, tmp_path, monkeypatch
) -> None:
    """``--uri`` (after the command too) is what the benchmark connects to; nobody answers
    there: one line naming it, nothing preloaded, no work folder made."""
    monkeypatch.setenv("QOSMQ_AMQP_URLS", "amqp://127.0.0.1:2/")  # restored after the test
    work = tmp_path / "work"
    argv = ["bench", "phoenix", "--experiment", "rate", "--work-dir", str(work)]
    assert main([*argv, "--uri", "amqp://127.0.0.1:1/"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qosmq: error: no RabbitMQ answers at amqp://127.0.0.1:1/"), err
    assert len(err.splitlines()) == 1 and not work.exists()


def test_the_live_progress_line_has_rates_and_confirm_latency() -> None:
    from qosmq_bench.confirms import _Tally, progress_line

    tally = _Tally()
    for i in range(100):
        tally.sent[f"m{i}"] = 10.0
        if i < 80:
            tally.confirmed[f"m{i}"] = 10.0 + i / 1000
            tally.handled[("q", f"m{i}")] = 10.0
    line = progress_line(tally, 2.0, (50, 40, 40), 0.5)
    assert "sent     100/s" in line and "confirmed      80/s" in line
    assert "consumed      80/s" in line and "p50 39.0 ms p99 78.0 ms" in line


def test_the_transport_and_queue_cells_print_live_lines_while_they_run() -> None:
    """``Live`` (bench transport, bench queues): a line per interval while the cell runs,
    rates over the interval and confirm latency so far; none with --quiet."""
    import time

    from qosmq_bench.live import Live

    lines: list[str] = []
    with Live("layer", lines.append, 0.05).running() as live:
        for _ in range(50):
            begun = time.perf_counter()
            live.sent += 1
            live.confirmed_since(begun - 0.002)
            live.consumed += 1
            time.sleep(0.004)
    assert len(lines) >= 2, lines
    assert lines[0].startswith("  layer ") and "sent" in lines[0] and "consumed" in lines[0]
    assert "confirm p50 2." in lines[-1], lines[-1]
    quiet = Live("layer", None, 0.01)
    with quiet.running():
        quiet.sent += 1
        time.sleep(0.05)
    assert quiet.sent == 1  # counted, nothing printed


def test_a_spark_job_refuses_an_option_of_another_experiment(capsys) -> None:
    assert main(["spark", "faults", "--experiment", "link", "--kinds", "router"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "qosmq: error: --kinds is for --experiment recovery, not link", err


def _throughput_fields(monkeypatch, tmp_path, extra: list[str]) -> dict[str, object]:
    """The topology fields ``bench phoenix --experiment throughput`` with ``extra`` hands
    its deployment (not started here)."""
    import qosmq_bench.phoenix_commands as commands
    import qosmq_bench.phoenix_throughput as throughput

    seen: dict[str, object] = {}
    monkeypatch.setattr(commands, "brokers_answer", lambda settings: None)  # none here

    def run_throughput(settings, **kwargs):
        seen.update(kwargs["topology_fields"])
        return {"idle": {"roles_pct": 0, "cpu_pct": {}, "messages_per_s": {}}, "steps": []}

    monkeypatch.setattr(throughput, "run_throughput", run_throughput)
    argv = ["bench", "phoenix", "--experiment", "throughput", "--work-dir", str(tmp_path)]
    assert main([*argv, *extra]) == 0
    return seen


def test_the_throughput_experiment_takes_the_detection_fields(monkeypatch, tmp_path) -> None:
    """``--heartbeat-interval``, ``--heartbeat-misses``, ``--slave-beat-interval`` and
    ``--neighbour-check`` reach the deployment's topology (what its idle cost depends on)."""
    extra = ["--heartbeat-interval", "0.5", "--heartbeat-misses", "3"]
    extra += ["--slave-beat-interval", "1", "--neighbour-check", "0"]
    assert _throughput_fields(monkeypatch, tmp_path, extra) == {
        "heartbeat_interval_s": 0.5,
        "heartbeat_misses": 3,
        "slave_beat_interval_s": 1.0,
        "neighbour_check_s": 0.0,
    }


def test_the_inbox_fields_reach_the_throughput_deployment(monkeypatch, tmp_path) -> None:
    """``--inbox-prefetch`` and ``--inbox-concurrency`` set the topology's fields."""
    extra = ["--inbox-prefetch", "64", "--inbox-concurrency", "128"]
    assert _throughput_fields(monkeypatch, tmp_path, extra) == {
        "inbox_prefetch": 64,
        "inbox_concurrency": 128,
    }


def test_the_detection_fields_are_refused_where_nothing_reads_them(capsys, tmp_path) -> None:
    argv = ["bench", "phoenix", "--experiment", "matching", "--slave-beat-interval", "1"]
    assert main([*argv, "--work-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qosmq: error: --slave-beat-interval is for --experiment recovery")


def test_sigterm_ends_a_command_as_ctrl_c_does_and_the_handler_is_put_back() -> None:
    """While a command runs, SIGTERM raises (so ``finally`` blocks run); a second one
    during the cleanup is swallowed by a Python handler (not SIG_IGN, which a process
    the cleanup starts would inherit); the previous handler comes back afterwards."""
    import os
    import signal

    from middleware.cli import _sigterm_as_interrupt, _Terminated

    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with pytest.raises(_Terminated), _sigterm_as_interrupt():
            os.kill(os.getpid(), signal.SIGTERM)
            raise AssertionError("SIGTERM did not end the block")
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        with pytest.raises(_Terminated), _sigterm_as_interrupt():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                raise AssertionError("SIGTERM did not end the block")
            except _Terminated:
                during_cleanup = signal.getsignal(signal.SIGTERM)
                assert callable(during_cleanup)
                os.kill(os.getpid(), signal.SIGTERM)  # swallowed
                raise
    finally:
        signal.signal(signal.SIGTERM, previous)
