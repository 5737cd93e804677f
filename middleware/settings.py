"""One pydantic settings object per process.

Read once in ``main()`` (or by the caller) with :meth:`Settings.load`; every
component takes the frozen object, keyword-only.  Sources, strongest first:
keyword arguments, environment (``QOSMQ_*``, nested with ``__``), the TOML file
given with ``--config``, defaults.  A bad value fails at start-up with a
:class:`~middleware.errors.ConfigurationError` that names the field, the
environment variable that sets it, and the expected form.
"""

from __future__ import annotations

import contextvars
import difflib
import logging
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Self, get_args, get_origin
from urllib.parse import unquote, urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from .errors import ConfigurationError
from .runtime import EventLoopName, uvloop_installed

__all__ = [
    "LOCAL_CLUSTER_URLS",
    "ConfirmSettings",
    "QueueSettings",
    "RetrySettings",
    "Settings",
    "TLSSettings",
]

ENV_PREFIX = "QOSMQ_"
#: QOSMQ_ variables that are not settings: the CLI's, the local cluster's and the tests'
OTHER_VARIABLES = frozenset(
    {
        "QOSMQ_STATE_DIR",
        "QOSMQ_RABBITMQ_BIN",
        "QOSMQ_TEST_BASE_PORT",
        "QOSMQ_TEST_DOCKER",
        "QOSMQ_CHAOS_SEED",
        "QOSMQ_CHAOS_ROUNDS",
        "QOSMQ_FUZZ_SEED",
        "QOSMQ_BUSY_TEST",
    }
)
log = logging.getLogger(__name__)
_warned_variables: set[str] = set()
#: The URLs of the embedded default: ``qosmq cluster up`` with its default ports.
LOCAL_CLUSTER_URLS = (
    "amqp://127.0.0.1:5682/",
    "amqp://127.0.0.1:5683/",
    "amqp://127.0.0.1:5684/",
)
_config_file: contextvars.ContextVar[Path | None] = contextvars.ContextVar(
    "qosmq_config_file", default=None
)


class _Frozen(BaseModel):
    # allow_inf_nan=False: an infinite timeout or delay is a hang, never a setting
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class RetrySettings(_Frozen):
    """The one reconnect/republish policy (tenacity), per resource."""

    attempts: int = Field(8, ge=1, le=1000, description="tries before giving up (1..1000)")
    initial_delay: float = Field(0.1, ge=0, le=60, description="first backoff in seconds (0..60)")
    max_delay: float = Field(3.0, gt=0, le=600, description="longest backoff in seconds (0..600]")
    multiplier: float = Field(2.0, ge=1, le=100, description="backoff growth factor (1..100)")
    jitter: float = Field(0.1, ge=0, le=60, description="random extra delay in seconds (0..60)")


class ConfirmSettings(_Frozen):
    """End-to-end confirms: receipt timing, batching and duplicate suppression."""

    receipt_timeout: float = Field(
        5.0, gt=0, le=3600, description="seconds to wait for all receipts (0..3600]"
    )
    max_attempts: int = Field(4, ge=1, le=100, description="sends per message, first included")
    receipt_batch: int = Field(256, ge=1, le=65535, description="receipts per batch message")
    receipt_linger_ms: float = Field(
        5.0, ge=0, le=10000, description="longest wait to fill a batch"
    )
    receipt_linger_busy_ms: float = Field(
        25.0,
        ge=0,
        le=10000,
        description="longest wait to fill a batch while the process sends more than "
        "receipt_busy_rate receipts/s (at least receipt_linger_ms)",
    )
    receipt_busy_rate: float = Field(
        500.0,
        gt=0,
        le=1e9,
        description="receipts/s a process sends above which batches wait longer",
    )
    receipt_linger_age_fraction: float = Field(
        0.1,
        ge=0,
        le=1,
        description="while busy, a batch may also wait this fraction of how long its first "
        "message had waited since it was published (0: off)",
    )
    receipt_linger_max_ms: float = Field(
        250.0,
        ge=0,
        le=10000,
        description="longest wait to fill a batch under that rule "
        "(at least receipt_linger_busy_ms)",
    )
    receipt_scope: Literal["process", "consumer"] = Field(
        "process",
        description="process: the asyncio consumers of one event loop batch receipts for "
        "a publisher together; consumer: each batches its own",
    )
    dedup_window: int = Field(100_000, ge=1, description="(queue, id) pairs remembered")

    @field_validator("receipt_linger_busy_ms")
    @classmethod
    def _busy_not_shorter(cls, value: float, info: ValidationInfo) -> float:
        quiet = info.data.get("receipt_linger_ms")
        if quiet is not None and value < quiet:
            raise ValueError(f"must be at least receipt_linger_ms ({quiet})")
        return value


class QueueSettings(_Frozen):
    """Persistent queues (EMQ): message limits and the local spool."""

    spool_enabled: bool = Field(True, description="hold messages locally while unreachable")
    spool_path: Path = Field(Path(".qosmq/spool.sqlite3"), description="SQLite spool file")
    spool_max_messages: int = Field(1_000_000, ge=1, description="spool capacity (messages)")
    spool_synchronous: Literal["NORMAL", "FULL"] = Field(
        "NORMAL", description="NORMAL survives a killed process; FULL also a power loss"
    )
    max_message_bytes: int = Field(1_048_576, ge=1, description="larger bodies are malformed")
    drain_batch: int = Field(256, ge=1, le=65535, description="spool entries sent per batch")


class TLSSettings(_Frozen):
    """TLS for ``amqps://`` URLs."""

    ca_file: Path | None = Field(None, description="PEM file of the CA that signed the broker")
    cert_file: Path | None = Field(None, description="client certificate (PEM), for mutual TLS")
    key_file: Path | None = Field(None, description="client private key (PEM), for mutual TLS")
    verify: bool = Field(True, description="check the broker's certificate and host name")

    @model_validator(mode="after")
    def _files_exist(self) -> Self:
        for name in ("ca_file", "cert_file", "key_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"tls.{name}: file {path} does not exist")
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("tls.cert_file and tls.key_file go together: give both or neither")
        return self


class Settings(BaseSettings):
    """Settings of a qosmq process (client, sidecar, benchmark)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        frozen=True,
        extra="forbid",
        allow_inf_nan=False,
    )

    amqp_urls: Annotated[tuple[str, ...], NoDecode] = Field(
        LOCAL_CLUSTER_URLS,
        description="the cluster's nodes: comma-separated amqp:// or amqps:// URLs",
    )
    vhost: str = Field("/", min_length=1, description="virtual host, e.g. / or /orders")
    username: str = Field("guest", min_length=1, description="AMQP user name")
    password: SecretStr = Field(SecretStr("guest"), description="AMQP password (never logged)")
    tls: TLSSettings = Field(default_factory=TLSSettings)
    client_name: str = Field("qosmq", description="connection name shown in the management UI")
    connect_timeout: float = Field(5.0, gt=0, le=300, description="seconds per node (> 0)")
    heartbeat: int = Field(10, ge=0, le=600, description="AMQP heartbeat in seconds (0 = off)")
    retry: RetrySettings = Field(default_factory=RetrySettings)
    confirms: ConfirmSettings = Field(default_factory=ConfirmSettings)
    queues: QueueSettings = Field(default_factory=QueueSettings)
    publish_window: int = Field(256, ge=1, le=65535, description="unconfirmed publishes (>= 1)")
    publish_timeout: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="seconds to wait for a broker confirm (0..3600]; then ConfirmTimeout, "
        "not sent again (both faces)",
    )
    prefetch: int = Field(128, ge=1, le=65535, description="unacked deliveries per consumer")
    consume_timeout: float = Field(
        5.0,
        gt=0,
        le=300,
        description="seconds to wait for a basic.consume's answer (a quorum queue whose "
        "leader's node is frozen holds it for 65 s); past this the asyncio client closes "
        "the channel and subscribes again (in the background after a failover), the sync "
        "client reconnects and replays",
    )
    close_grace: float = Field(
        5.0,
        ge=0,
        le=300,
        description="seconds a consumer's cancel, or close, lets the handlers already "
        "running finish and settle (asyncio client); the longest a close waits for the "
        "broker's answers to unconfirmed publishes and the resends of refused ones; the "
        "longest the sync client's close waits for the broker's answer before it drops "
        "the socket",
    )
    consumer_check_s: float = Field(
        5.0,
        ge=0,
        le=3600,
        description="seconds between a consumer's checks that its queue still exists and "
        "still counts it (a passive declare): a queue deleted without a basic.cancel, or "
        "declared again since, is found and the consumer subscribed again (0: off)",
    )
    max_message_size: int = Field(
        134_217_728,
        ge=4096,
        le=536_870_912,
        description="the brokers' max_message_size in bytes (RabbitMQ's default 128 MiB): "
        "larger bodies are refused before sending",
    )
    coalesce_writes: bool = Field(
        True,
        description="asyncio client, amqp:// nodes: one socket write per event-loop turn, "
        "not one per frame",
    )
    event_loop: EventLoopName = Field(
        "auto", description="auto: uvloop where installed, else asyncio's own loop"
    )
    gc_freeze: bool = Field(
        True,
        description="Phoenix roles: freeze the tables loaded at start so full garbage "
        "collections skip them",
    )
    management_urls: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        description="the management API of each node, tried in turn: comma-separated "
        "http(s)://[user:password@]host:port[/path-prefix] URLs (https with the tls "
        "settings; credentials from the URL, else username and password); empty: each "
        "AMQP node's host at its port + management_port_offset, https for amqps nodes",
    )
    management_port_offset: int = Field(
        10000,
        ge=0,
        description="without management_urls: management API port = AMQP port + this "
        "(the local cluster's; a default RabbitMQ listens on 15672 for AMQP 5672: 10000)",
    )
    prometheus_urls: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        description="the rabbitmq_prometheus endpoint of every node (all are read and "
        "summed): comma-separated http(s)://[user:password@]host:port[/path-prefix] URLs; "
        "empty: each AMQP node's host at its port + prometheus_port_offset",
    )
    prometheus_port_offset: int = Field(
        10020,
        ge=0,
        description="without prometheus_urls: rabbitmq_prometheus port = AMQP port + this "
        "(a default RabbitMQ serves it on 15692 for AMQP 5672: 10020, as the local cluster)",
    )
    balancer_rates: Literal["auto", "management", "prometheus", "none"] = Field(
        "auto",
        description="where the balancer sidecar reads replicas' arrival and service rates: "
        "management (message_stats, deprecated from RabbitMQ 4.0), prometheus (the "
        "rabbitmq_prometheus plugin's per-queue counters on every node), none (rates 0); "
        "auto: management before 4.0, prometheus from 4.0, by the version the broker reports",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="the qosmq processes' log level (the library sets none)"
    )
    log_format: Literal["text", "json"] = Field(
        "text", description="the qosmq processes' log lines: text, or one JSON object a line"
    )
    trace_file: Path | None = Field(
        None,
        description="the qosmq processes (CLI, sidecars, Phoenix roles): append every span "
        "as a JSON line to this file (needs opentelemetry-sdk: pip install "
        "'qosmq[tracing]' opentelemetry-sdk); a service sets its own tracer provider",
    )
    metrics_host: str = Field("127.0.0.1", description="address of the Prometheus endpoint")
    metrics_port: int | None = Field(None, ge=0, le=65535, description="0 = any free port")
    profile_dir: Path | None = Field(
        None,
        description="a Phoenix role process runs under cProfile (its main thread's CPU "
        "time) and writes <profile_dir>/<pid>.prof when it stops (for performance work; "
        "off by default)",
    )

    @field_validator("event_loop")
    @classmethod
    def _loop_installed(cls, value: str) -> str:
        if value == "uvloop" and not uvloop_installed():
            raise ValueError("uvloop is not installed (pip install uvloop); use auto or asyncio")
        return value

    @field_validator("amqp_urls", mode="before")
    @classmethod
    def _split_urls(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("management_urls", "prometheus_urls", mode="before")
    @classmethod
    def _split_management_urls(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("management_urls", "prometheus_urls")
    @classmethod
    def _check_management_urls(cls, urls: tuple[str, ...]) -> tuple[str, ...]:
        for url in urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(
                    f"{_mask(url)!r} is not http(s)://[USER:PASSWORD@]HOST[:PORT][/PREFIX]"
                )
            try:
                parts.port  # noqa: B018 - raises ValueError on a bad port
            except ValueError:
                raise ValueError(f"{_mask(url)!r}: the port is not a number 0-65535") from None
        return urls

    @field_validator("amqp_urls")
    @classmethod
    def _check_urls(cls, urls: tuple[str, ...]) -> tuple[str, ...]:
        if not urls:
            raise ValueError("give at least one URL, e.g. amqp://127.0.0.1:5672/")
        for url in urls:
            parts = urlsplit(url)
            if parts.scheme not in ("amqp", "amqps") or not parts.hostname:
                raise ValueError(f"{_mask(url)!r} is not amqp://HOST[:PORT]/ or amqps://...")
            try:
                parts.port  # noqa: B018 - raises ValueError on a bad port
            except ValueError as exc:
                raise ValueError(f"{_mask(url)!r} has a bad port") from exc
        return urls

    @model_validator(mode="before")
    @classmethod
    def _credentials_out_of_urls(cls, data: Any) -> Any:
        """Move user:password out of URLs into the secret fields, so no URL holds a secret.

        The credentials are everything between ``//`` and the last ``@``, so a password
        holding ``#``, ``/``, ``?`` or ``@`` works unescaped (percent-escapes are decoded too)."""
        if not isinstance(data, dict) or "amqp_urls" not in data:
            return data
        urls = cls._split_urls(data["amqp_urls"])
        if not isinstance(urls, list | tuple):
            return data
        clean = []
        for url in urls:
            userinfo, bare = _split_userinfo(str(url))
            if userinfo is not None:
                user, colon, password = userinfo.partition(":")
                data.setdefault("username", unquote(user))
                if colon:
                    data.setdefault("password", unquote(password))
            clean.append(bare)
        return {**data, "amqp_urls": tuple(clean)}

    @property
    def nodes(self) -> tuple[tuple[str, int, bool], ...]:
        """``(host, port, tls)`` of every node, in the configured order."""
        out = []
        for url in self.amqp_urls:
            parts = urlsplit(url)
            tls = parts.scheme == "amqps"
            out.append((parts.hostname or "", parts.port or (5671 if tls else 5672), tls))
        return tuple(out)

    def starting_at(self, index: int) -> Self:
        """These settings with the node list rotated to start at node ``index`` (mod N):
        spreads connections over the cluster, and places client-local queue leaders."""
        k = index % len(self.amqp_urls)
        return self.model_copy(update={"amqp_urls": self.amqp_urls[k:] + self.amqp_urls[:k]})

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = _config_file.get()
        if path is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
        return tuple(sources)

    @classmethod
    def load(cls, config: Path | str | None = None, **overrides: Any) -> Self:
        """Read the settings once; raise :class:`ConfigurationError` naming bad fields."""
        path = Path(config) if config is not None else None
        if path is not None and not path.is_file():
            raise ConfigurationError(f"--config: file {path} does not exist")
        token = _config_file.set(path)
        warn_unknown_variables(os.environ)
        try:
            return cls(**overrides)
        except ValidationError as exc:
            raise ConfigurationError(_explain(cls, exc)) from None
        except SettingsError as exc:  # a nested setting's environment value is not JSON
            raise ConfigurationError(
                f"invalid configuration: {exc}; a nested setting in the environment is a JSON "
                """object, e.g. QOSMQ_RETRY='{"attempts": 5}', or one field at a time, """
                "e.g. QOSMQ_RETRY__ATTEMPTS=5"
            ) from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigurationError(f"--config {path}: not valid TOML ({exc})") from None
        except UnicodeDecodeError as exc:
            raise ConfigurationError(
                f"--config {path}: not UTF-8 text (byte {exc.start}); save it as UTF-8 TOML"
            ) from None
        except OSError as exc:
            raise ConfigurationError(f"--config {path}: cannot read it ({exc.strerror})") from None
        finally:
            _config_file.reset(token)


def known_variables() -> frozenset[str]:
    """Every environment variable a setting reads (nested ones with ``__``), and the
    other ``QOSMQ_`` variables the project reads."""
    names = set(OTHER_VARIABLES)
    for name, info in Settings.model_fields.items():
        names.add(f"{ENV_PREFIX}{name}".upper())
        nested = info.annotation
        if isinstance(nested, type) and issubclass(nested, BaseModel):
            names.update(f"{ENV_PREFIX}{name}__{sub}".upper() for sub in nested.model_fields)
    return frozenset(names)


def unknown_variables(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """``QOSMQ_`` variables no setting reads: (name, the closest known name or None)."""
    known = known_variables()
    bare = {k.removeprefix(ENV_PREFIX): k for k in known}  # the prefix would make all close
    out = []
    for name in sorted(environ):
        upper = name.upper()
        if upper.startswith(ENV_PREFIX) and upper not in known:
            close = difflib.get_close_matches(upper.removeprefix(ENV_PREFIX), bare, 1, 0.7)
            out.append((name, bare[close[0]] if close else None))
    return out


def warn_unknown_variables(environ: Mapping[str, str]) -> None:
    """One log line per unknown ``QOSMQ_`` variable and process (a typo is not silent)."""
    for name, close in unknown_variables(environ):
        if name not in _warned_variables:
            _warned_variables.add(name)
            hint = f" (did you mean {close}?)" if close else ""
            log.warning("%s is not a qosmq setting%s: ignored", name, hint)


def _split_userinfo(url: str) -> tuple[str | None, str]:
    """``(userinfo, url without it)``; userinfo is what lies between ``//`` and the last
    ``@`` (None when the URL has none)."""
    scheme, slashes, rest = url.partition("//")
    if not slashes or "@" not in rest:
        return None, url
    userinfo, _, host = rest.rpartition("@")
    return userinfo, f"{scheme}//{host}"


def _mask(url: str) -> str:
    """The URL for messages: everything between ``//`` and the last ``@`` masked, whether
    or not the URL parses (a password may hold any character)."""
    userinfo, bare = _split_userinfo(url)
    if userinfo is None:
        return url
    scheme, _, host = bare.partition("//")
    return f"{scheme}//***@{host}"


def _explain(cls: type[BaseModel], exc: ValidationError) -> str:
    lines = [f"invalid configuration ({exc.error_count()} problem(s)):"]
    for err in exc.errors(include_input=False, include_url=False):
        loc = [str(part) for part in err["loc"]]
        field = ".".join(loc) or "(settings)"
        env = ENV_PREFIX + "__".join(loc).upper() if loc else ""
        expected = _describe(cls, loc)
        line = f"  - {field}: {err['msg']}"
        if env:
            line += f" (set by {env} or [{loc[0]}] in the --config file)"
        if expected:
            line += f"; expected: {expected}"
        lines.append(line)
    return "\n".join(lines)


def _describe(cls: type[BaseModel], loc: list[str]) -> str:
    model: Any = cls
    info = None
    for part in loc:
        fields = getattr(model, "model_fields", None)
        if not fields or part not in fields:
            break
        info = fields[part]
        model = info.annotation
    return (info.description or "") if info is not None else ""


def _type_name(annotation: Any) -> str:
    """A field's type for readers: ``path or none``, ``one of: a, b``, ``comma list``."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return "one of: " + ", ".join(str(a) for a in args)
    if args and type(None) in args:
        return " or ".join(_type_name(a) for a in args if a is not type(None)) + " or none"
    if origin is tuple:
        return "comma list"
    name = getattr(annotation, "__name__", str(annotation))
    return {"SecretStr": "secret", "Path": "path"}.get(name, name)


def _default_text(name: str, default: Any) -> str:
    if name == "amqp_urls":
        return "the local cluster's three nodes"
    if isinstance(default, SecretStr):
        return "`guest`"
    if default is None or default == ():
        return "none"
    return f"`{default}`"


def settings_reference() -> str:
    """Every setting as a Markdown table (field, environment variable, type, default,
    description), nested ones with their own rows: ``docs/configuration.md`` holds it
    and a test keeps the two equal (``python -c "from middleware.settings import
    settings_reference as r; print(r(), end='')"`` prints it)."""
    rows = ["| setting | environment | type | default | meaning |", "|---|---|---|---|---|"]

    def add(prefix: str, env: str, model: type[BaseModel]) -> None:
        for name, info in model.model_fields.items():
            nested = info.annotation
            if isinstance(nested, type) and issubclass(nested, BaseModel):
                add(f"{prefix}{name}.", f"{env}{name.upper()}__", nested)
                continue
            text = (info.description or "").replace("|", "\\|")
            rows.append(
                f"| `{prefix}{name}` | `{env}{name.upper()}` | {_type_name(info.annotation)} "
                f"| {_default_text(name, info.default)} | {text} |"
            )

    add("", ENV_PREFIX, Settings)
    return "\n".join(rows) + "\n"
