"""The ingest pipeline: validate and spool requests (durable), drain the spool into the store.

``Pipeline.ingest`` is what every receiver calls; ``readiness`` is what /readyz reports (from the
drain's own view of the store: it never waits on the store). The receivers and their wiring live
in ``service``; this module imports neither.

The drain inserts each spooled record on its own, labelled with its content (``Entry.token``), so a
record inserted twice is stored once whoever inserts it. One insert covers at most
``insert_max_partitions`` days, ``insert_max_rows`` rows and ``insert_max_bytes`` bytes; a record
the store still refuses for a reason of its rows goes to the spool's dead letters and the drain
moves on. Any other failure is an outage: the drain retries with backoff, requests keep being
spooled for ``store_down_grace_s``, then get 503.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from dataclasses import dataclass, field

from witcert.collector import otlp, tables
from witcert.collector.budget import Hold, MemoryBudget, OverBudget
from witcert.collector.config import DECODE_BYTES_PER_BYTE, JSON_BYTES_PER_BYTE, CollectorConfig
from witcert.collector.queries import Queries
from witcert.collector.requests import IngestResult, Outcome
from witcert.collector.spool import ABORTED, DONE, Entry, Spool, SpoolFull, dead_letters, encode_payload, request_key
from witcert.collector.store import Store, StoreError, refuses_data, server_answered

log = logging.getLogger(__name__)

_DAY_NS = 86_400 * 10**9
# The drain asks an idle store whether it is still there this often (readiness stays current).
_PING_EVERY_S = 5.0
# Records put back by ``witcert dead-letter replay`` are looked for this often.
_REQUEUE_EVERY_S = 1.0
# A record the store keeps refusing with an error of its own is retried this often before the
# drain tries the next record to tell a bad record from a bad store.
_PROBE_AFTER_FAILURES = 3
_GZIP_STEP = 1024 * 1024


class PayloadTooLarge(ValueError):
    pass


@dataclass
class Counters:
    """Collector self-telemetry, served on /readyz and /metrics and used by the benchmark."""

    requests: int = 0
    duplicates: int = 0
    accepted_points: int = 0
    rejected_points: int = 0
    refused_requests: int = 0
    stored_points: int = 0
    store_failures: int = 0
    dead_letter_records: int = 0
    dead_letter_points: int = 0
    requeued_points: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **increments: int) -> None:
        with self.lock:
            for name, value in increments.items():
                setattr(self, name, getattr(self, name) + value)

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "lock"}


def gunzip(body: bytes, limit: int, hold: Hold) -> bytes:
    """Inflate a gzip body, reserving each inflated step from the budget, refusing past ``limit``."""
    decompressor = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    parts, size, data = [], 0, body
    try:
        while not decompressor.eof:
            chunk = decompressor.decompress(data, _GZIP_STEP)
            data = decompressor.unconsumed_tail
            if not chunk and not data:
                break
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"decompressed body exceeds {limit} bytes")
            hold.take(len(chunk), "the inflated body")
            parts.append(chunk)
    except zlib.error as error:
        raise ValueError(f"corrupt gzip body: {error}") from None
    if not decompressor.eof:
        raise ValueError("corrupt gzip body: truncated stream")
    hold.take(size, "the inflated body")  # joined: both copies for a moment
    joined = b"".join(parts)
    del parts
    hold.give_back(size)
    return joined


class Pipeline:
    def __init__(self, config: CollectorConfig) -> None:
        self.config = config
        self.counters = Counters()
        self.budget = MemoryBudget(config.limits.memory_budget_bytes)
        self.store = Store(config.store_url, config.retention, connect=False)
        self.queries = Queries(self.store)
        self.spool: Spool | None = None
        self._stop = threading.Event()
        self._drain_thread: threading.Thread | None = None
        self._store_down_since: float | None = time.monotonic()
        self._store_error = "not connected yet"
        self._stopping = False
        self._drain_error: str | None = None
        self._dead_cache: tuple[float, dict] | None = None

    # --- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Open the spool, try the store once, start the drain (which keeps trying the store)."""
        self.spool = Spool(self.config.resolved_spool_dir(), max_bytes=self.config.limits.max_spool_bytes)
        self._connect_store()
        self._drain_thread = threading.Thread(target=self._drain, name="witcert-drain", daemon=True)
        self._drain_thread.start()

    def stop(self, drain_timeout_s: float = 10.0) -> None:
        """Give the drain up to ``drain_timeout_s`` to store what is spooled, then close."""
        self._stopping = True
        deadline = time.monotonic() + drain_timeout_s
        while self.spool is not None and self.spool.uncommitted_bytes and time.monotonic() < deadline:
            if self._store_down_since is not None:
                break
            time.sleep(0.02)
        self._stop.set()
        if self.spool is not None:
            self.spool.wake()
        if self._drain_thread is not None:
            self._drain_thread.join()
            self._drain_thread = None
        if self.spool is not None:
            self.spool.close()
        self.store.close()

    def wait_stored(self, timeout_s: float = 30.0) -> bool:
        """Block until everything acknowledged so far is in the store (tests, demo, benchmark)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.spool is not None and self.spool.uncommitted_bytes == 0:
                return True
            time.sleep(0.02)
        return False

    # --- the store's health, as the drain sees it ----------------------------------------------
    def _connect_store(self) -> bool:
        try:
            self.store.connect()
        except StoreError as error:
            self._store_failed(f"{self.store.location.describe()} is not connected: {error}")
            return False
        self._store_answered()
        return True

    def _store_failed(self, message: str) -> None:
        self._store_error = message
        if self._store_down_since is None:
            self._store_down_since = time.monotonic()
            log.warning("store unavailable, retrying: %s", message)

    def _store_answered(self) -> None:
        if self._store_down_since is not None and self._store_error != "not connected yet":
            log.info("store available again")
        self._store_down_since = None
        self._store_error = ""

    # --- health -----------------------------------------------------------------------------
    def refusal_reason(self, incoming_bytes: int = 0) -> str | None:
        """Why a new request must be refused with 503 now, or None."""
        assert self.spool is not None
        if not self.spool.has_room(incoming_bytes):
            return f"spool full ({self.spool.uncommitted_bytes} bytes waiting for the store)"
        down_since = self._store_down_since
        if down_since is not None and time.monotonic() - down_since > self.config.limits.store_down_grace_s:
            return f"store unavailable for {time.monotonic() - down_since:.0f} s: {self._store_error}"
        return None

    def dead_letter_summary(self) -> dict:
        assert self.spool is not None
        folder = self.spool.directory / "dead"
        changed = folder.stat().st_mtime
        if self._dead_cache is None or self._dead_cache[0] != changed:
            letters = dead_letters(self.spool.directory)
            summary = {
                "records": len(letters),
                "points": sum(letter.points for letter in letters),
                "last_reason": letters[-1].reason if letters else None,
            }
            self._dead_cache = (changed, summary)
        return self._dead_cache[1]

    def readiness(self) -> tuple[bool, dict]:
        """Ready: the store answers, the spool has room, the drain runs. Never waits on the store."""
        assert self.spool is not None
        reason = self.refusal_reason()
        store_ok = self._store_down_since is None
        if reason is None and not store_ok:
            reason = f"store {self._store_error}"
        if reason is None and self._drain_error:
            reason = self._drain_error
        if reason is None and self._stopping:
            reason = "shutting down"
        report = {
            "ready": reason is None,
            "reason": reason,
            "store": self.store.location.describe(),
            "store_ok": store_ok,
            "spool_bytes": self.spool.uncommitted_bytes,
            "spool_points": self.spool.uncommitted_points,
            "memory_budget_bytes": self.budget.limit,
            "memory_in_use_bytes": self.budget.used,
            "dead_letter": self.dead_letter_summary(),
            "counters": self.counters.snapshot(),
        }
        return reason is None, report

    # --- ingest (shared by the HTTP and gRPC receivers) -------------------------------------
    def ingest(
        self, body: bytes, content_type: str, encoding: str = "identity", hold: Hold | None = None
    ) -> IngestResult:
        """Decode, validate and spool (fsync) one OTLP request body.

        ``hold`` carries what the receiver already reserved for the body; everything reserved here
        is given back before returning (the body itself stays with the receiver)."""
        own = hold is None
        hold = hold if hold is not None else self.budget.hold()
        held_before = hold.amount
        self.counters.add(requests=1)
        try:
            result = self._ingest(body, content_type, encoding, hold)
        except OverBudget as error:
            result = IngestResult(Outcome.TOO_LARGE if error.never else Outcome.UNAVAILABLE, str(error))
        finally:
            hold.give_back(hold.amount - (0 if own else held_before))
        if result.outcome is Outcome.UNAVAILABLE:
            self.counters.add(refused_requests=1)
        return result

    def _ingest(self, body: bytes, content_type: str, encoding: str, hold: Hold) -> IngestResult:
        assert self.spool is not None
        limits = self.config.limits
        if self._stop.is_set() or self._stopping:
            return IngestResult(Outcome.UNAVAILABLE, "the collector is shutting down")
        if encoding == "gzip":
            try:
                body = gunzip(body, limits.max_decompressed_bytes, hold)
            except PayloadTooLarge as error:
                return IngestResult(Outcome.TOO_LARGE, str(error))
            except ValueError as error:
                return IngestResult(Outcome.INVALID, str(error))
        key = request_key(body)
        if self.spool.is_duplicate(key):
            self.counters.add(duplicates=1)
            return IngestResult(Outcome.DUPLICATE)
        reason = self.refusal_reason(len(body))
        if reason:
            return IngestResult(Outcome.UNAVAILABLE, reason)
        try:
            if content_type == otlp.JSON:
                if len(body) > limits.max_json_bytes:
                    return IngestResult(
                        Outcome.TOO_LARGE,
                        f"OTLP/JSON body of {len(body)} bytes exceeds {limits.max_json_bytes}: send protobuf",
                    )
                json_bytes = JSON_BYTES_PER_BYTE * len(body)
                hold.take(json_bytes, "decoding the OTLP/JSON body")
                body = otlp.json_to_protobuf(body)
                hold.give_back(json_bytes)
            pieces = otlp.split(body, limits)
        except otlp.RequestError as error:
            return IngestResult(Outcome.INVALID, str(error))
        if len(pieces.pieces) > 1:
            hold.take(len(body), "the pieces of the request")
        converter = otlp.Converter(limits, self.config.retention, time.time_ns())
        converter.rejected_points += pieces.oversized_points
        for message in pieces.messages:
            converter.note(message)
        outcome = self._spool_pieces(key, pieces.pieces, converter, hold)
        if outcome is not None:
            return outcome
        self.counters.add(accepted_points=converter.accepted_points, rejected_points=converter.rejected_points)
        return IngestResult(
            Outcome.ACCEPTED, converter.error_message, converter.accepted_points, converter.rejected_points
        )

    def _spool_pieces(
        self, key: bytes, pieces: list[bytes], converter: otlp.Converter, hold: Hold
    ) -> IngestResult | None:
        """Decode, convert and spool each piece; a part is written once the next one is ready, so the
        last written carries the LAST flag. None on success, else the failure's result."""
        assert self.spool is not None
        pending: tuple[bytes, int] | None = None  # the previous piece's payload, not yet written
        part = 0
        try:
            for piece in pieces:
                decode_bytes = DECODE_BYTES_PER_BYTE * len(piece)
                hold.take(decode_bytes, "decoding a piece of the request")
                try:
                    rows = converter.convert(otlp.decode(piece))
                    payload = encode_payload(rows.columns) if rows.points else None
                finally:
                    hold.give_back(decode_bytes)
                if payload is None:
                    continue
                if pending is not None:
                    self.spool.append(key, pending[0], pending[1], part=part, last=False)
                    part += 1
                hold.take(len(payload), "the spooled rows")
                pending = (payload, rows.points)
            if pending is not None:
                self.spool.append(key, pending[0], pending[1], part=part, last=True)
            return None
        except otlp.RequestError as error:
            self.spool.abort(key)
            return IngestResult(Outcome.INVALID, str(error))
        except SpoolFull as error:
            self.spool.abort(key)
            return IngestResult(Outcome.UNAVAILABLE, str(error))
        except OSError as error:  # disk full or failing: nothing was acknowledged, the client retries
            self.spool.abort(key)
            log.error("spool write failed: %s", error)
            return IngestResult(Outcome.UNAVAILABLE, f"spool write failed: {error.strerror or error}")
        except BaseException:
            self.spool.abort(key)
            raise

    # --- drain ------------------------------------------------------------------------------
    def _drain(self) -> None:
        assert self.spool is not None
        spool = self.spool
        done = spool.committed  # every record up to here is stored, skipped or dead-lettered
        first_uncommitted = 0.0
        points_uncommitted = 0
        next_requeue = next_ping = time.monotonic()
        backoff = 0.1
        while not self._stop.is_set():
            if not self.store.connected and not self._connect_store():
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.1
            now = time.monotonic()
            try:
                if now >= next_requeue:
                    next_requeue = now + _REQUEUE_EVERY_S
                    requeued = spool.take_requeued()
                    if requeued:
                        self.counters.add(requeued_points=requeued)
                # Caught up with something to commit: commit at once rather than wait for more.
                wait_s = 0.0 if done > spool.committed else 0.2
                entries = spool.next_entries(done, self.config.batch_max_points, wait_s, self._stop)
            except Exception as error:  # a bug or a damaged disk: keep the service up, say so, retry
                self._drain_error = f"cannot read the spool: {type(error).__name__}: {error}"
                log.exception("cannot read the spool")
                self._stop.wait(5.0)
                continue
            self._drain_error = None
            for entry in entries:
                state = spool.group_state(entry)
                if state not in (DONE, ABORTED):
                    self._stop.wait(0.01)  # its request is still being written
                    break
                if state == DONE and not self._store_entry(entry):
                    break  # stopping
                if not points_uncommitted:
                    first_uncommitted = time.monotonic()
                done = entry.seq
                points_uncommitted += entry.points
            idle = not entries
            if done > spool.committed and (
                idle
                or points_uncommitted >= self.config.batch_max_points
                or time.monotonic() - first_uncommitted >= self.config.batch_max_wait_s
            ):
                spool.commit(done)
                points_uncommitted = 0
            if idle and time.monotonic() >= next_ping:
                next_ping = time.monotonic() + _PING_EVERY_S
                if self.store.ping():
                    self._store_answered()
                else:
                    self._store_failed(f"{self.store.location.describe()} does not answer")
        if done > spool.committed:
            spool.commit(done)

    def _store_entry(self, entry: Entry) -> bool:
        """Insert one record (retrying through outages) or dead-letter it; False when stopping."""
        assert self.spool is not None
        try:
            columns = self.spool.read(entry)
        except (OSError, ValueError, EOFError) as error:
            self._dead_letter(entry, f"the spooled record cannot be read: {error}", [])
            return True
        backoff, refused, answered = 0.1, 0, 0
        while not self._stop.is_set():
            try:
                self._insert(entry, columns)
            except _InsertFailed as failed:
                error = failed.__cause__
                assert error is not None
                self.counters.add(store_failures=1)
                message = f"{type(error).__name__}: {str(error)[:300]}"
                if refuses_data(error):
                    refused += 1
                    if refused >= 2:  # once more, in case the store changed under us
                        self._dead_letter(entry, message, sorted(columns))
                        return True
                else:
                    self._store_failed(message)
                    if server_answered(error):
                        answered += 1
                        if answered >= _PROBE_AFTER_FAILURES and self._table_takes_other_rows(entry, failed.table):
                            self._store_answered()
                            self._dead_letter(entry, message, sorted(columns))
                            return True
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            self.counters.add(stored_points=entry.points)
            self._store_answered()
            return True
        return False

    def _table_takes_other_rows(self, failing: Entry, table: str) -> bool:
        """Whether ``table`` accepts a later record's rows while it refuses ``failing``'s: then the
        fault is the record's, not the store's. The later rows are inserted for real; their own
        turn repeats the insert, a no-op under the same labels."""
        assert self.spool is not None
        for entry in self.spool.next_entries(failing.seq, 10**12, 0.0, self._stop)[:50]:
            if entry.key == failing.key or self.spool.group_state(entry) != DONE:
                continue
            columns = self.spool.read(entry)
            if table in columns:
                try:
                    self._insert(entry, {table: columns[table]})
                except _InsertFailed:
                    return False
                return True
        return False

    def _dead_letter(self, entry: Entry, reason: str, table_names: list[str]) -> None:
        assert self.spool is not None
        self.spool.dead_letter(entry, reason, table_names)
        self.counters.add(dead_letter_records=1, dead_letter_points=entry.points)
        log.error("spool record %d (%d points) moved to the dead letters: %s", entry.seq, entry.points, reason)

    def _insert(self, entry: Entry, columns: dict[str, dict[str, list]]) -> None:
        """Insert every table of a record, in inserts within the store's limits, each labelled by content."""
        for table in sorted(columns):
            try:
                for index, chunk in enumerate(self._chunks(table, columns[table])):
                    self.store.insert_columns(table, chunk, token=entry.token(table, index))
            except Exception as error:  # sorted by the caller: the rows' fault or the store's
                raise _InsertFailed(table) from error

    def _chunks(self, table: str, columns: dict[str, list]) -> list[dict[str, list]]:
        """The rows of one table cut into inserts of at most ``insert_max_partitions`` days (the
        tables are partitioned by day), ``insert_max_rows`` rows and ``insert_max_bytes`` bytes.
        Deterministic: the same rows give the same inserts, hence the same labels."""
        config = self.config
        times = columns[otlp.TIME_COLUMN[table]]
        count = len(times)
        if not count:
            return []
        fits = count <= config.insert_max_rows and _table_bytes(table, columns) <= config.insert_max_bytes
        if fits and (max(times) - min(times)) // _DAY_NS < config.insert_max_partitions:
            return [columns]
        sizes = _row_sizes(table, columns)
        by_day: dict[int, list[int]] = {}
        for index, time_ns in enumerate(times):
            by_day.setdefault(time_ns // _DAY_NS, []).append(index)
        chunks: list[list[int]] = []
        current: list[int] = []
        days = size = 0
        for day in sorted(by_day):
            if days == config.insert_max_partitions:
                chunks.append(current)
                current, days, size = [], 0, 0
            days += 1
            for index in by_day[day]:
                if current and (
                    len(current) == config.insert_max_rows or size + sizes[index] > config.insert_max_bytes
                ):
                    chunks.append(current)
                    current, days, size = [], 1, 0
                current.append(index)
                size += sizes[index]
        chunks.append(current)
        return [{name: [values[i] for i in rows] for name, values in columns.items()} for rows in chunks]


class _InsertFailed(Exception):
    """An insert of ``table`` failed; the store's exception is the cause."""

    def __init__(self, table: str) -> None:
        super().__init__(table)
        self.table = table


_SAMPLE_STRINGS = ("ServiceName", "Instance", "Model", "Engine")


def _table_bytes(table: str, columns: dict[str, list]) -> int:
    if table == tables.CERTIFICATE_SAMPLES:  # the hot path: whole columns at C speed
        count = len(columns["Timestamp"])
        return 40 * count + sum(sum(map(len, columns[name])) for name in _SAMPLE_STRINGS)
    return sum(_row_sizes(table, columns))


def _row_sizes(table: str, columns: dict[str, list]) -> list[int]:
    """Bytes of each row once encoded for the store: maps and strings counted as copied per row."""
    count = len(columns[otlp.TIME_COLUMN[table]])
    if table == tables.CERTIFICATE_SAMPLES:
        return [40 + sum(len(columns[name][i]) for name in _SAMPLE_STRINGS) for i in range(count)]
    map_bytes: dict[int, int] = {}

    def mapped(value: dict) -> int:
        found = map_bytes.get(id(value))
        if found is None:
            found = map_bytes[id(value)] = sum(len(k) + len(v) + 2 for k, v in value.items())
        return found

    strings = [columns[name] for name in ("ResourceSchemaUrl", "ScopeName", "ScopeVersion", "ScopeSchemaUrl")]
    strings += [columns[name] for name in ("ServiceName", "MetricName", "MetricDescription", "MetricUnit")]
    maps = [columns[name] for name in ("ResourceAttributes", "ScopeAttributes", "Attributes")]
    exemplars = columns["Exemplars.FilteredAttributes"]
    sizes = []
    for i in range(count):
        size = 96 + sum(len(column[i]) for column in strings) + sum(mapped(column[i]) for column in maps)
        size += sum(mapped(filtered) + 72 for filtered in exemplars[i])
        sizes.append(size)
    if table == tables.HISTOGRAM:
        for i, counts in enumerate(columns["BucketCounts"]):
            sizes[i] += 16 * len(counts)
    return sizes
