"""Service settings: pydantic-settings models read from environment variables (prefix MINITE_) and from
the `minite rollout|learner|up` command line (kebab-case flags), validated with messages that say what
is wrong. The learner's and `minite up`'s settings are the run's RunConfig (minite_core/rl/config.py,
also read from `--config run.toml`) plus the service's own fields. The shared token is a SecretStr: it
never appears in a repr, a log line or a metric; prefer the MINITE_AUTH_TOKEN environment variable to a
flag (flags are visible in `ps`)."""
from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from minite_core.rl.config import SETTINGS, RunConfig, one_of, parse, usable_device  # noqa: F401 (parse: re-exported)

MB = 1 << 20


def is_loopback(host: str) -> bool:
    """Is `host` an address only this machine can reach (127.0.0.0/8, ::1, localhost)?"""
    import ipaddress

    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it resolves to who knows what
        return False


class _Common(BaseSettings):
    """What every service process has: where it listens, auth, TLS, limits, logging, drain."""
    model_config = SettingsConfigDict(**SETTINGS, extra="forbid")

    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0 in containers)")
    auth_token: SecretStr | None = Field(None, description="shared token for weight pushes, scoring and learner "
                                         "control (env MINITE_AUTH_TOKEN); unset: no auth, which is only allowed on a "
                                         "loopback address unless --insecure")
    insecure: bool = Field(False, description="serve without a token on a non-loopback address (not recommended)")
    tls_cert: Path | None = Field(None, description="PEM certificate: serve gRPC and HTTP over TLS")
    tls_key: Path | None = Field(None, description="PEM private key for --tls-cert")
    tls_ca: Path | None = Field(None, description="CA bundle that clients use to verify peers (learner -> rollout)")
    max_message_mb: int = Field(8, ge=5, le=64, description="gRPC message size limit, MiB, both directions "
                                                            "(above the 4 MiB largest weight chunk)")
    max_body_mb: float = Field(8.0, gt=0, le=1024, description="REST request body limit, MiB: a larger body is "
                               "refused (413) before it is read")
    http_header_timeout: float = Field(10.0, gt=0, le=600, description="HTTP: seconds a connection has to send a "
                                       "complete request head (slowloris clients are closed at it)")
    http_body_timeout: float = Field(30.0, gt=0, le=3600, description="HTTP: most seconds between two reads of a "
                                     "request body (a lying Content-Length is closed at it)")
    http_keep_alive: float = Field(5.0, gt=0, le=3600, description="HTTP: idle keep-alive connections are closed "
                                   "after this many seconds")
    log_level: str = Field("info", description="debug, info, warning or error")
    drain_timeout: float = Field(20.0, ge=0, le=3600, description="on SIGTERM/SIGINT: seconds the work in flight "
                                 "(requests; the learner's step) gets to finish before it is cut; keep it below the "
                                 "orchestrator's kill timeout (Kubernetes: 30 s, docker stop: 10 s by default)")

    @field_validator("log_level")
    @classmethod
    def _level(cls, v):
        if v.lower() not in ("debug", "info", "warning", "error"):
            raise ValueError(f"log_level must be debug, info, warning or error, not {v!r}")
        return v.lower()

    @field_validator("auth_token")
    @classmethod
    def _token(cls, v):
        if v is not None and not v.get_secret_value().strip():  # "" would silently mean "no auth"
            raise ValueError("empty or blank: set a real token, or unset it to "
                             "serve without auth on a loopback address")
        return v

    @model_validator(mode="after")
    def _open_only_on_loopback(self):
        if self.auth_token is None and not self.insecure and not is_loopback(self.host):
            raise ValueError(f"no auth token: refusing to serve on {self.host}, which is not a loopback address; set "
                             "MINITE_AUTH_TOKEN (or pass --insecure to serve open anyway)")
        return self

    @model_validator(mode="after")
    def _tls_pair(self):
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        for p in (self.tls_cert, self.tls_key, self.tls_ca):
            if p is not None and not p.is_file():
                raise ValueError(f"TLS file {p} does not exist")
        return self

    @property
    def token(self) -> str | None:
        return self.auth_token.get_secret_value() if self.auth_token else None


class RolloutSettings(_Common):
    model_dir: Path = Field(Path("runs/tiny-model"), description="HF checkpoint directory (config.json, *.safetensors)")
    precision: str = Field("nvfp4", description="nvfp4 (W4A4), bf16 or fp32")
    backend: str = Field("torch", description="kernel backend: torch or triton")
    device: str = Field("cpu", description="torch device, e.g. cpu or cuda")
    grpc_port: int = Field(50051, ge=0, le=65535, description="gRPC port (0: pick a free one)")
    http_port: int = Field(8000, ge=0, le=65535, description="REST, /metrics and /health port")
    model_name: str = Field("minite-tiny", description="the model name the APIs report and accept")
    max_slots: int = Field(16, ge=1, le=4096, description="KV-cache slots: sequences decoded together")
    max_seq_len: int | None = Field(None, ge=2, description="KV-cache length (default: the model's context, at most 4096)")
    overlap: bool = Field(True, description="on CUDA, launch each decode step before the host reads the last one's "
                          "tokens (the same tokens; --no-overlap: step by step)")
    prefill_graphs: bool = Field(True, description="on CUDA, replay each small prefill (rollout.PREFILL_GRAPH_TOKENS) "
                                 "from the CUDA graph of its (rows, length) bucket (the same bits; "
                                 "--no-prefill-graphs: launched eagerly)")
    max_waiting: int = Field(256, ge=1, description="queued sequences beyond which requests get 429 / RESOURCE_EXHAUSTED")
    max_tokens_limit: int = Field(1024, ge=1, description="largest max_tokens a request may ask for")
    max_n: int = Field(64, ge=1, description="largest n (samples per request)")
    max_stop: int = Field(64, ge=0, le=65536, description="most `stop` strings a REST request may give")
    max_stop_chars: int = Field(1024, ge=1, le=1 << 20, description="longest `stop` string, characters")
    push_idle_timeout: float = Field(30.0, gt=0, le=3600, description="seconds without a message after which a "
                                     "weight push is abandoned and its update lock released")
    max_stop_token_ids: int = Field(1024, ge=0, le=1 << 20, description="most stop_token_ids a request may give "
                                    "(REST and gRPC)")

    @field_validator("precision", "backend")
    @classmethod
    def _choices(cls, v, info):
        return one_of(v, info)

    @field_validator("device")
    @classmethod
    def _device(cls, v):
        return usable_device(v)


class LearnerSettings(_Common, RunConfig):
    model_config = SettingsConfigDict(**SETTINGS, extra="forbid")

    grpc_port: int = Field(50052, ge=0, le=65535, description="gRPC port (0: pick a free one)")
    http_port: int = Field(8001, ge=0, le=65535, description="REST, /metrics and /health port")
    rollout: list[str] = Field(default_factory=list, description="rollout replica gRPC address host:port (repeat the flag)")
    run_dir: Path = Field(Path("runs/learner"), description="metrics.jsonl, checkpoints and the plot")
    chunk_mb: float = Field(2.0, ge=1.0, le=4.0, description="weight-push message size, MiB")
    weight_sync: str = Field("auto", description="how weight versions reach the replicas: grpc (a stream of chunks), "
                             "shared (a shared-memory arena: /dev/shm or CUDA IPC; a replica that cannot open it is "
                             "streamed to) or auto (shared for replicas on this host, grpc for the others)")
    keep_versions: int = Field(4, ge=1, le=1024, description="recent weight versions kept for Score at an older version")
    exit_when_done: bool = Field(False, description="stop the service after the last step")

    @field_validator("weight_sync")
    @classmethod
    def _learner_choices(cls, v, info):
        return one_of(v, info)

    @field_validator("rollout")
    @classmethod
    def _addresses(cls, v):
        for a in v:
            host, _, port = a.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"rollout address {a!r} is not host:port")
        return v
