"""The ingest pipeline: validate and spool requests (durable), drain the spool into the store.

``Pipeline.ingest`` is what every receiver calls; ``readiness`` is what /readyz reports. The
receivers and their wiring live in ``service``; this module imports neither.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from witcert.collector import otlp
from witcert.collector.config import CollectorConfig
from witcert.collector.queries import Queries
from witcert.collector.requests import IngestResult, Outcome
from witcert.collector.spool import Spool, SpoolBatch, SpoolFull, request_key
from witcert.collector.store import Store

log = logging.getLogger(__name__)


@dataclass
class Counters:
    """Collector self-telemetry, served on /readyz and used by the benchmark."""

    requests: int = 0
    duplicates: int = 0
    accepted_points: int = 0
    rejected_points: int = 0
    refused_requests: int = 0
    stored_points: int = 0
    store_failures: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **increments: int) -> None:
        with self.lock:
            for name, value in increments.items():
                setattr(self, name, getattr(self, name) + value)

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "lock"}


class Pipeline:
    def __init__(self, config: CollectorConfig) -> None:
        self.config = config
        self.counters = Counters()
        self.store: Store | None = None
        self.spool: Spool | None = None
        self.queries: Queries | None = None
        self._stop = threading.Event()
        self._drain_thread: threading.Thread | None = None
        self._store_down_since: float | None = None
        self._stopping = False
        self._drain_error: str | None = None
        self._last_store_error = ""

    # --- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Open the store and the spool, start the drain thread."""
        limits = self.config.limits
        self.store = Store(self.config.store_url, self.config.retention)
        try:
            self.queries = Queries(self.store)
            self.spool = Spool(self.config.resolved_spool_dir(), max_bytes=limits.max_spool_bytes)
            self._drain_thread = threading.Thread(target=self._drain, name="witcert-drain", daemon=True)
            self._drain_thread.start()
        except BaseException:
            self.stop()
            raise

    def stop(self, drain_timeout_s: float = 10.0) -> None:
        """Give the drain up to ``drain_timeout_s`` to store what is spooled, then close."""
        self._stopping = True
        deadline = time.monotonic() + drain_timeout_s
        while self.spool is not None and self.spool.uncommitted_bytes and time.monotonic() < deadline:
            if self._store_down_since is not None:
                break
            time.sleep(0.05)
        self._stop.set()
        if self._drain_thread is not None:
            self._drain_thread.join()
            self._drain_thread = None
        if self.spool is not None:
            self.spool.close()
        if self.store is not None:
            self.store.close()
            self.store = None

    def wait_stored(self, timeout_s: float = 30.0) -> bool:
        """Block until everything acknowledged so far is in the store (tests, demo, benchmark)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.spool is not None and self.spool.uncommitted_bytes == 0:
                return True
            time.sleep(0.02)
        return False

    # --- health -----------------------------------------------------------------------------
    def refusal_reason(self, incoming_bytes: int = 0) -> str | None:
        """Why a new request must be refused with 503 now, or None."""
        assert self.spool is not None
        if not self.spool.has_room(incoming_bytes):
            return f"spool full ({self.spool.uncommitted_bytes} bytes waiting for the store)"
        down_since = self._store_down_since
        if down_since is not None and time.monotonic() - down_since > self.config.limits.store_down_grace_s:
            return f"store unavailable for {time.monotonic() - down_since:.0f} s: {self._last_store_error}"
        return None

    def readiness(self) -> tuple[bool, dict]:
        assert self.spool is not None and self.store is not None
        reason = self.refusal_reason()
        # An idle collector learns of an outage only by asking; a busy one from its inserts.
        store_ok = self._store_down_since is None and self.store.ping()
        if reason is None and not store_ok:
            reason = f"store {self.store.location.describe()} does not answer"
        if reason is None and self._drain_error:
            reason = self._drain_error
        report = {
            "ready": reason is None,
            "reason": reason,
            "store": self.store.location.describe(),
            "store_ok": store_ok,
            "spool_bytes": self.spool.uncommitted_bytes,
            "spool_points": self.spool.uncommitted_points,
            "counters": self.counters.snapshot(),
        }
        return reason is None, report

    # --- ingest (shared by the HTTP and gRPC receivers) -------------------------------------
    def ingest(self, body: bytes, content_type: str) -> IngestResult:
        """Decode, validate, spool (fsync) one decompressed OTLP request body."""
        assert self.spool is not None
        self.counters.add(requests=1)
        if self._stop.is_set() or self._stopping:
            return IngestResult(Outcome.UNAVAILABLE, "the collector is shutting down")
        key = request_key(body)
        if self.spool.is_duplicate(key):
            self.counters.add(duplicates=1)
            return IngestResult(Outcome.DUPLICATE)
        reason = self.refusal_reason(len(body))
        if reason:
            self.counters.add(refused_requests=1)
            return IngestResult(Outcome.UNAVAILABLE, reason)
        try:
            request = otlp.decode_request(body, content_type)
        except otlp.RequestError as error:
            return IngestResult(Outcome.INVALID, str(error))
        batch = otlp.convert_request(request, self.config.limits)
        if batch.accepted_points:
            try:
                if self.spool.append(key, batch.columns, batch.accepted_points) is None:
                    self.counters.add(duplicates=1)
                    return IngestResult(Outcome.DUPLICATE)
            except SpoolFull as error:
                self.counters.add(refused_requests=1)
                return IngestResult(Outcome.UNAVAILABLE, str(error))
            except OSError as error:  # disk full or failing: nothing was acknowledged, the client retries
                log.error("spool write failed: %s", error)
                self.counters.add(refused_requests=1)
                return IngestResult(Outcome.UNAVAILABLE, f"spool write failed: {error.strerror or error}")
        self.counters.add(accepted_points=batch.accepted_points, rejected_points=batch.rejected_points)
        return IngestResult(Outcome.ACCEPTED, batch.error_message, batch.accepted_points, batch.rejected_points)

    # --- drain ------------------------------------------------------------------------------
    def _drain(self) -> None:
        assert self.spool is not None
        backoff = 0.1
        while not self._stop.is_set():
            try:
                batch = self.spool.next_batch(self.config.batch_max_points, self.config.batch_max_wait_s, self._stop)
            except Exception as error:  # a bug or a damaged disk: keep the service up, say so, retry
                self._drain_error = f"cannot read the spool: {type(error).__name__}: {error}"
                log.exception("cannot read the spool")
                self._stop.wait(5.0)
                continue
            self._drain_error = None
            if batch is None:
                continue
            while not self._stop.is_set():
                try:
                    stored = self._insert(batch)
                    self.spool.commit(batch)
                except Exception as error:  # the store's failures are many kinds; all mean retry later
                    self.counters.add(store_failures=1)
                    self._last_store_error = f"{type(error).__name__}: {str(error)[:300]}"
                    if self._store_down_since is None:
                        self._store_down_since = time.monotonic()
                        log.warning("store insert failed, retrying: %s", self._last_store_error)
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, 5.0)
                    continue
                self.counters.add(stored_points=stored)
                if self._store_down_since is not None:
                    log.info("store available again")
                self._store_down_since = None
                backoff = 0.1
                break

    def _insert(self, batch: SpoolBatch) -> int:
        """Insert every table of a batch, each with its own deduplication token; return rows."""
        assert self.store is not None
        merged: dict[str, dict[str, list]] = {}
        for payload in batch.payloads:
            assert isinstance(payload, dict)
            for table, columns in payload.items():
                target = merged.setdefault(table, {name: [] for name in columns})
                for name, values in columns.items():
                    target[name].extend(values)
        rows = 0
        for table in sorted(merged):
            columns = merged[table]
            count = len(next(iter(columns.values())))
            if count:
                self.store.insert_columns(table, columns, token=f"{batch.token}:{table}")
                rows += count
        return rows
