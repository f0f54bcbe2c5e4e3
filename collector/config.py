"""The collector's configuration, in one place: listeners, store, spool, limits, retention."""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

DEFAULT_HTTP = "127.0.0.1:4318"
DEFAULT_GRPC = "127.0.0.1:4317"


def default_data_dir() -> Path:
    """The user's data directory for witcert (XDG on Linux), where the default chDB store and spool live."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "witcert"


def default_store_url() -> str:
    return f"chdb://{default_data_dir() / 'chdb'}"


def parse_listen_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 as ``[::1]:4318``) -> (host, port); port 0 asks the OS for a free one."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ValueError(f"listen address {address!r} is not HOST:PORT")
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"listen address {address!r}: port {port} is out of range")
    host = host.strip("[]") or "127.0.0.1"
    return host, port


class Retention(BaseModel):
    """Days each table keeps its rows (ClickHouse TTL, applied when the schema is created)."""

    model_config = ConfigDict(frozen=True)

    raw_days: int = Field(7, ge=1, description="otel_metrics_* raw tables")
    samples_days: int = Field(30, ge=1, description="witcert_certificate_samples")
    rollup_1m_days: int = Field(90, ge=1, description="witcert_counts_1m, witcert_buckets_1m")
    rollup_1h_days: int = Field(730, ge=1, description="witcert_counts_1h, witcert_buckets_1h")


class Limits(BaseModel):
    """Bounds that keep a misbehaving client or a long store outage from exhausting the host."""

    model_config = ConfigDict(frozen=True)

    # The OTLP spec suggests servers accept at least this much; larger bodies get 413.
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    # Cap on the decompressed size of a gzip body: a gzip bomb stops here with 413.
    max_decompressed_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    # Request bodies held in memory at once, across all connections; beyond it, 503 + Retry-After.
    max_inflight_bytes: int = Field(256 * 1024 * 1024, ge=1024)
    # Distinct attribute sets accepted per request; a flood beyond it is rejected (partial success).
    max_series_per_request: int = Field(200_000, ge=1)
    max_attributes_per_point: int = Field(64, ge=1)
    max_attribute_value_chars: int = Field(4096, ge=1)
    # Spool bytes on disk not yet in the store; beyond it, 503 + Retry-After.
    max_spool_bytes: int = Field(4 * 1024**3, ge=1024 * 1024)
    # Once the store has been failing this long, new requests get 503 instead of filling the spool.
    store_down_grace_s: float = Field(30.0, ge=0.0)
    retry_after_s: int = Field(5, ge=1)


class CollectorConfig(BaseModel):
    """Everything ``witcert collector`` and ``Collector(config)`` need."""

    model_config = ConfigDict(frozen=True)

    store_url: str = Field(default_factory=default_store_url)
    # None disables the listener. Port 0 picks a free port (tests, demo); bound ports are reported.
    otlp_http: str | None = DEFAULT_HTTP
    otlp_grpc: str | None = DEFAULT_GRPC
    # None: next to a chDB store (``<path>.spool``), else under the data dir, named after the server.
    spool_dir: Path | None = None
    # Bearer token required on every OTLP and API request when set (read from --token-file).
    token: str | None = None
    # Spool records drained per store insert, and the longest a record waits for company.
    batch_max_points: int = Field(200_000, ge=1)
    batch_max_wait_s: float = Field(0.5, ge=0.0)
    grpc_workers: int = Field(4, ge=1)
    limits: Limits = Field(default_factory=Limits)
    retention: Retention = Field(default_factory=Retention)

    def resolved_spool_dir(self) -> Path:
        if self.spool_dir is not None:
            return Path(self.spool_dir)
        parts = urlsplit(self.store_url)
        if parts.scheme == "chdb":
            path = Path(unquote(parts.netloc + parts.path)).expanduser().resolve()
            return path.with_name(path.name + ".spool")
        server = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{parts.hostname}_{parts.port}_{parts.path.strip('/')}")
        return default_data_dir() / f"spool-{server}"

    @field_validator("otlp_http", "otlp_grpc")
    @classmethod
    def _valid_address(cls, value: str | None) -> str | None:
        if value is not None:
            parse_listen_address(value)
        return value

    @field_validator("token")
    @classmethod
    def _non_empty_token(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("the bearer token is empty")
        return value.strip() if value is not None else None
