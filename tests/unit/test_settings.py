from __future__ import annotations

import time

import pytest

from middleware.errors import ConfigurationError
from middleware.settings import LOCAL_CLUSTER_URLS, Settings


def test_defaults_point_at_the_local_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("QOSMQ_AMQP_URLS", raising=False)
    assert Settings.load().amqp_urls == LOCAL_CLUSTER_URLS


def test_comma_separated_urls_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QOSMQ_AMQP_URLS", "amqp://a:5672/, amqp://b:5673/")
    s = Settings.load()
    assert s.amqp_urls == ("amqp://a:5672/", "amqp://b:5673/")
    assert s.nodes == (("a", 5672, False), ("b", 5673, False))


def test_credentials_move_out_of_urls_and_never_print() -> None:
    s = Settings.load(amqp_urls="amqps://app:s3cr3t@rabbit.example:5671/")
    assert s.username == "app"
    assert s.password.get_secret_value() == "s3cr3t"
    assert s.amqp_urls == ("amqps://rabbit.example:5671/",)
    assert "s3cr3t" not in repr(s) and "s3cr3t" not in str(s.model_dump())


def test_nested_env_and_toml_with_env_winning(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "qosmq.toml"
    cfg.write_text('vhost = "/orders"\nprefetch = 7\n[retry]\nattempts = 3\n')
    monkeypatch.setenv("QOSMQ_PREFETCH", "9")
    monkeypatch.setenv("QOSMQ_RETRY__MAX_DELAY", "0.5")
    s = Settings.load(cfg)
    assert (s.vhost, s.prefetch, s.retry.attempts, s.retry.max_delay) == ("/orders", 9, 3, 0.5)


@pytest.mark.parametrize(
    ("overrides", "field", "env"),
    [
        ({"amqp_urls": "http://x/"}, "amqp_urls", "QOSMQ_AMQP_URLS"),
        ({"amqp_urls": ""}, "amqp_urls", "QOSMQ_AMQP_URLS"),
        ({"prefetch": 0}, "prefetch", "QOSMQ_PREFETCH"),
        ({"retry": {"attempts": 0}}, "retry.attempts", "QOSMQ_RETRY__ATTEMPTS"),
        ({"tls": {"ca_file": "/nonexistent/ca.pem"}}, "tls", "QOSMQ_TLS"),
        ({"publish_windw": 3}, "publish_windw", "QOSMQ_PUBLISH_WINDW"),
        (
            {"confirms": {"receipt_linger_ms": 10, "receipt_linger_busy_ms": 5}},
            "confirms.receipt_linger_busy_ms",
            "QOSMQ_CONFIRMS__RECEIPT_LINGER_BUSY_MS",
        ),
    ],
)
def test_bad_settings_name_field_and_env(overrides, field, env) -> None:
    with pytest.raises(ConfigurationError) as info:
        Settings.load(**overrides)
    message = str(info.value)
    assert field in message and env in message


def test_bad_env_value_fails_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QOSMQ_HEARTBEAT", "often")
    started = time.monotonic()
    with pytest.raises(ConfigurationError, match="heartbeat"):
        Settings.load()
    assert time.monotonic() - started < 1


def test_missing_config_file_is_named(tmp_path) -> None:
    with pytest.raises(ConfigurationError, match=r"does-not-exist\.toml"):
        Settings.load(tmp_path / "does-not-exist.toml")


def test_settings_are_frozen() -> None:
    s = Settings.load()
    with pytest.raises(Exception, match="frozen"):
        s.prefetch = 3  # type: ignore[misc]


def test_an_unknown_qosmq_variable_is_named_with_the_closest_setting(monkeypatch, caplog) -> None:
    """A typo in a top-level setting's variable is one warning naming the closest setting
    (a nested one, ``QOSMQ_RETRY__ATTEMPS``, is refused by the nested model already)."""
    import logging

    from middleware import settings as settings_module

    monkeypatch.setattr(settings_module, "_warned_variables", set())
    monkeypatch.setenv("QOSMQ_PUBLISH_WINDW", "3")
    monkeypatch.setenv("QOSMQ_NOTHING_LIKE_IT", "1")
    caplog.set_level(logging.WARNING, logger="middleware.settings")
    Settings.load()
    Settings.load()  # once per process and variable
    lines = [r.getMessage() for r in caplog.records]
    hint = "(did you mean QOSMQ_PUBLISH_WINDOW?)"
    assert lines.count(f"QOSMQ_PUBLISH_WINDW is not a qosmq setting {hint}: ignored") == 1
    assert "QOSMQ_NOTHING_LIKE_IT is not a qosmq setting: ignored" in lines
    assert len(lines) == 2


def test_the_configuration_reference_lists_every_setting_as_the_model_has_it() -> None:
    from pathlib import Path

    from middleware.settings import known_variables, settings_reference

    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    table = doc.split("<!-- settings:begin -->\n")[1].split("<!-- settings:end -->")[0]
    assert table == settings_reference(), (
        "docs/configuration.md differs from the settings model: paste the output of "
        "middleware.settings.settings_reference() between the settings markers"
    )
    for variable in known_variables():  # the other QOSMQ_ variables are named there too
        assert variable in doc, variable
