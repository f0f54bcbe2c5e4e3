"""The collector's configuration, in one place: listeners, store, spool, limits, retention."""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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


MiB = 1024 * 1024

# Bytes of memory per byte of protobuf decoded at once: the parsed message (upb allocates up to 68
# bytes per 2-byte empty message: exponential-histogram points, measured), the rows built from
# it (about 20 per byte for the smallest valid points) and their spool encoding. Requests are
# decoded in chunks of at most ``decode_chunk_bytes``, each reserving this much of the budget.
DECODE_BYTES_PER_BYTE = 96
# OTLP/JSON: Python objects of the parsed document (about 24 bytes per byte for ``[{},{},..]``)
# plus the protobuf message built from it.
JSON_BYTES_PER_BYTE = 100
# The drain holds one spooled record's rows (at most this much per byte of the chunk they came
# from) and one insert (the client's encoded blocks and the engine's parsed block and parts).
ROWS_BYTES_PER_BYTE = 24
INSERT_BYTES_PER_BYTE = 4
# What one open HTTP connection may buffer before its request is read (aiohttp's read buffer,
# pausing the socket at twice its size).
CONNECTION_BUFFER_BYTES = 128 * 1024


class Limits(BaseModel):
    """Bounds that keep a misbehaving client or a long store outage from exhausting the host.

    Memory: everything a request holds while it is received and decoded (body, inflated body,
    parsed chunk, rows) is reserved from ``memory_budget_bytes`` before it is allocated; a request
    that does not fit now gets 503 + Retry-After, one that could never fit gets 413.
    ``CollectorConfig.working_memory_bytes`` adds what the drain and gRPC hold outside the budget.
    """

    model_config = ConfigDict(frozen=True)

    memory_budget_bytes: int = Field(256 * MiB, ge=4 * MiB)
    # The OTLP spec suggests servers accept at least this much; larger bodies get 413.
    max_body_bytes: int = Field(16 * MiB, ge=1024)
    # Cap on the decompressed size of a gzip body: a gzip bomb stops here with 413.
    max_decompressed_bytes: int = Field(64 * MiB, ge=1024)
    # OTLP/JSON bodies (after gzip): parsing JSON costs JSON_BYTES_PER_BYTE of the budget per byte.
    max_json_bytes: int = Field(4 * MiB, ge=1024)
    # Protobuf bodies are decoded in pieces of this many bytes (whole data points each).
    decode_chunk_bytes: int = Field(1 * MiB, ge=64 * 1024)
    # A single encoded data point (with its attributes and exemplars) larger than this is rejected.
    max_point_bytes: int = Field(256 * 1024, ge=1024)
    # Rows a request may expand to once resource and scope attributes are copied onto each point.
    max_row_bytes_per_request: int = Field(256 * MiB, ge=MiB)
    # Distinct attribute sets accepted per request; a flood beyond it is rejected (partial success).
    max_series_per_request: int = Field(200_000, ge=1)
    max_attributes_per_point: int = Field(64, ge=1)
    max_exemplars_per_point: int = Field(64, ge=0)
    # Strings of the OTLP data model; a point carrying a longer one is rejected (partial success).
    max_attribute_key_chars: int = Field(256, ge=1)
    max_attribute_value_chars: int = Field(4096, ge=1)
    max_attributes_chars: int = Field(16384, ge=1, description="keys and values of one attribute set")
    max_name_chars: int = Field(255, ge=1, description="metric names (the OpenTelemetry API's limit)")
    max_unit_chars: int = Field(63, ge=1)
    max_description_chars: int = Field(1023, ge=1)
    max_scope_chars: int = Field(1024, ge=1, description="scope name and version, schema URLs")
    # Points stamped later than now + this are rejected (earlier than now - retention too).
    max_future_skew_s: float = Field(600.0, ge=0.0)
    # Spool bytes on disk not yet in the store; beyond it, 503 + Retry-After.
    max_spool_bytes: int = Field(4 * 1024**3, ge=1024 * 1024)
    # Once the store has been failing this long, new requests get 503 instead of filling the spool.
    store_down_grace_s: float = Field(30.0, ge=0.0)
    retry_after_s: int = Field(5, ge=1)
    # HTTP: requests decoded at once, and waiting for a decoder; beyond both, 503 at once.
    ingest_workers: int = Field(2, ge=1)
    max_queued_requests: int = Field(8, ge=0)
    # Open connections; beyond, a request gets 503 and its connection is closed.
    max_connections: int = Field(1024, ge=16)
    # A connection must finish its request headers this long after it opens (or after its last
    # response): slow or idle connections are closed.
    header_timeout_s: float = Field(10.0, gt=0.0)
    # A request body must arrive within this long once its headers are in (408 otherwise).
    body_timeout_s: float = Field(30.0, gt=0.0)
    # gRPC messages are received whole by grpc before the handler runs: at most this many at once.
    max_grpc_message_bytes: int = Field(16 * MiB, ge=1024)

    @model_validator(mode="after")
    def _consistent(self) -> Limits:
        if self.max_point_bytes * 2 > self.decode_chunk_bytes:
            raise ValueError("decode_chunk_bytes must hold at least two of the largest data points (max_point_bytes)")
        if self.decode_chunk_bytes * DECODE_BYTES_PER_BYTE + self.max_body_bytes > self.memory_budget_bytes:
            raise ValueError(
                f"memory_budget_bytes ({self.memory_budget_bytes}) cannot hold one body of max_body_bytes and one "
                f"decoded chunk ({DECODE_BYTES_PER_BYTE} x decode_chunk_bytes)"
            )
        return self


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
    # The drain inserts each spooled request on its own (its deduplication token is its content)
    # and records progress in the spool after this many points or this long, whichever first.
    batch_max_points: int = Field(200_000, ge=1)
    batch_max_wait_s: float = Field(0.5, ge=0.0)
    # One insert carries at most this many rows, expanded bytes and days (partitions): under
    # ClickHouse's limits (max_partitions_per_insert_block = 100 in any time zone) and the memory bound.
    insert_max_rows: int = Field(262_144, ge=1)
    insert_max_bytes: int = Field(16 * MiB, ge=64 * 1024)
    insert_max_partitions: int = Field(50, ge=1, le=99)
    grpc_workers: int = Field(4, ge=1)
    limits: Limits = Field(default_factory=Limits)
    retention: Retention = Field(default_factory=Retention)

    def working_memory_bytes(self) -> int:
        """The most memory the collector's work can hold on top of its idle process, whatever the input.

        The budget (requests being received and decoded), the drain (one spooled record's rows and
        one insert: ``ROWS_BYTES_PER_BYTE`` per decoded byte, ``INSERT_BYTES_PER_BYTE`` per expanded
        byte in the client and the embedded engine), gRPC (messages grpc holds before the handler
        runs, compressed and inflated) and the HTTP connections' read buffers."""
        limits = self.limits
        drain = ROWS_BYTES_PER_BYTE * limits.decode_chunk_bytes + INSERT_BYTES_PER_BYTE * self.insert_max_bytes
        grpc = 0 if self.otlp_grpc is None else 2 * self.grpc_workers * limits.max_grpc_message_bytes
        connections = limits.max_connections * CONNECTION_BUFFER_BYTES
        return limits.memory_budget_bytes + drain + grpc + connections

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
