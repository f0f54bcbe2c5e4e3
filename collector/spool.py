"""Durable spool: a request is acknowledged only once its rows are fsync'd here.

Layout of the spool directory:

- ``seg-<first seq>.log``: append-only segments of records
  ``magic | payload length | crc32 | seq | points | request key | payload``; a torn record at the tail
  (a crash mid-write, never acknowledged) is cut off on open.
- ``committed``: the highest seq known to be in the store (atomically replaced).
- ``pending``: the seq range of the batch being inserted now. After a crash, the drain first
  re-inserts exactly that range with the same deduplication token, so the store drops the copy.

The request key (a hash of the decompressed body) identifies client retries: a body seen within
``dedup_window_s`` is acknowledged again without being spooled twice. A segment is deleted once
all its records are committed; its request keys move to ``keys.log`` (key, time), so retries are
still recognised after a restart without keeping the rows on disk.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import marshal
import os
import struct
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# Record format version: WSP2 = marshal payloads. A spool in another format is refused, never cut.
_MAGIC = b"WSP2"
_HEADER = struct.Struct("<4sIIQQ16s")
_SEGMENT_PREFIX = "seg-"
_KEY_RECORD = struct.Struct("<16sd")
# keys.log is rewritten with only the keys still inside the window once it grows past this.
_KEYS_LOG_COMPACT_BYTES = 8 * 1024 * 1024
_MAX_KEYS = 1_000_000


def request_key(body: bytes) -> bytes:
    """Identity of a request body: a client retry sends the same bytes (before compression)."""
    return hashlib.blake2b(body, digest_size=16).digest()


@dataclass(frozen=True)
class _Entry:
    seq: int
    segment: Path
    offset: int
    length: int
    points: int


@dataclass(frozen=True)
class SpoolBatch:
    """Consecutive records the drain inserts together; first..last name its deduplication token."""

    first_seq: int
    last_seq: int
    payloads: list[object]

    @property
    def token(self) -> str:
        return f"{self.first_seq}-{self.last_seq}"


class SpoolBusy(RuntimeError):
    """Another collector holds the spool directory."""


class SpoolFormatError(RuntimeError):
    """The spool was written by an incompatible version."""


class SpoolFull(RuntimeError):
    """The spool holds max_bytes not yet in the store."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="ascii") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class Spool:
    def __init__(
        self,
        directory: Path,
        max_bytes: int,
        segment_bytes: int = 32 * 1024 * 1024,
        dedup_window_s: float = 300.0,
    ) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.dedup_window_s = dedup_window_s
        self._lock = threading.Lock()
        self._has_records = threading.Condition(self._lock)
        self._uncommitted: list[_Entry] = []
        self._uncommitted_bytes = 0
        self._recent_keys: OrderedDict[bytes, float] = OrderedDict()
        # segment -> highest seq in it, and the request keys (with arrival time) of its records
        self._segments: dict[Path, int] = {}
        self._segment_keys: dict[Path, list[tuple[bytes, float]]] = {}
        self._active: Path | None = None
        self._active_file = None
        self._next_seq = 1
        self._lock_fd: int | None = None
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    # --- opening and recovery -------------------------------------------------------------
    def _open(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise SpoolBusy(
                f"the spool {self.directory} is in use by another collector; give each its own --spool"
            ) from None
        self.committed = int(self._read_marker("committed") or 0)
        pending_text = self._read_marker("pending")
        self.pending: tuple[int, int] | None = None
        if pending_text:
            first, last = (int(part) for part in pending_text.split("-"))
            self.pending = (first, last)
        self._load_keys()
        segments = sorted(self.directory.glob(f"{_SEGMENT_PREFIX}*.log"), key=lambda p: int(p.stem[4:]))
        for index, segment in enumerate(segments):
            self._scan(segment, is_last=index == len(segments) - 1)
        self._next_seq = max([self.committed + 1] + [seq + 1 for seq in self._segments.values()])

    def _load_keys(self) -> None:
        path = self.directory / "keys.log"
        if not path.exists():
            return
        data = path.read_bytes()
        now = time.time()
        usable = len(data) - len(data) % _KEY_RECORD.size  # a torn last record is ignored
        for key, seen in _KEY_RECORD.iter_unpack(data[:usable]):
            if now - seen <= self.dedup_window_s:
                self._recent_keys[key] = seen
        self._rewrite_keys_log()

    def _rewrite_keys_log(self) -> None:
        tmp = self.directory / "keys.tmp"
        with open(tmp, "wb") as handle:
            handle.write(b"".join(_KEY_RECORD.pack(key, seen) for key, seen in self._recent_keys.items()))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, self.directory / "keys.log")
        _fsync_dir(self.directory)

    def _read_marker(self, name: str) -> str | None:
        path = self.directory / name
        return path.read_text(encoding="ascii").strip() if path.exists() else None

    def _scan(self, segment: Path, is_last: bool) -> None:
        mtime = segment.stat().st_mtime
        highest = 0
        keys = self._segment_keys.setdefault(segment, [])
        good_end = 0
        with open(segment, "rb") as handle:
            data = handle.read()
        offset = 0
        while offset + _HEADER.size <= len(data):
            magic, length, crc, seq, points, key = _HEADER.unpack_from(data, offset)
            if magic != _MAGIC and magic.startswith(b"WSP"):
                raise SpoolFormatError(
                    f"spool {segment} holds records in format {magic.decode(errors='replace')}, this version "
                    f"reads {_MAGIC.decode()}: drain it with the witcert version that wrote it, or move it aside"
                )
            end = offset + _HEADER.size + length
            if magic != _MAGIC or end > len(data):
                break
            payload = data[offset + _HEADER.size : end]
            if zlib.crc32(payload, zlib.crc32(key, seq)) != crc:
                break
            highest = seq
            self._recent_keys[key] = mtime
            keys.append((key, mtime))
            if seq > self.committed:
                self._uncommitted.append(_Entry(seq, segment, offset + _HEADER.size, length, points))
                self._uncommitted_bytes += length
            offset = good_end = end
        if good_end < len(data):
            if is_last:
                # Never acknowledged: the fsync that would have acknowledged it did not complete.
                log.warning("spool %s: cutting a torn record at byte %d", segment, good_end)
                with open(segment, "r+b") as handle:
                    handle.truncate(good_end)
                    os.fsync(handle.fileno())
            else:
                log.error(
                    "spool %s: corrupt record at byte %d; the rest of this segment is unreadable", segment, good_end
                )
        if highest:
            self._segments[segment] = highest
        else:
            del self._segment_keys[segment]
            segment.unlink()

    # --- writing ----------------------------------------------------------------------------
    def is_duplicate(self, key: bytes) -> bool:
        with self._lock:
            return key in self._recent_keys

    def has_room(self, incoming_bytes: int = 0) -> bool:
        return self._uncommitted_bytes + incoming_bytes <= self.max_bytes

    def append(self, key: bytes, columns: dict, points: int) -> int | None:
        """fsync one request's rows; return its seq, or None when the key was already spooled."""
        # marshal, not pickle: reading a spool file must never be able to run code.
        payload = marshal.dumps(columns)
        with self._lock:
            if key in self._recent_keys:
                return None
            if not self.has_room(len(payload)):
                raise SpoolFull(f"spool holds {self._uncommitted_bytes} bytes not yet stored (limit {self.max_bytes})")
            seq = self._next_seq
            handle = self._writable_segment(seq)
            offset = handle.tell()
            crc = zlib.crc32(payload, zlib.crc32(key, seq))
            handle.write(_HEADER.pack(_MAGIC, len(payload), crc, seq, points, key) + payload)
            handle.flush()
            os.fdatasync(handle.fileno())
            self._next_seq = seq + 1
            assert self._active is not None
            self._segments[self._active] = seq
            self._segment_keys.setdefault(self._active, []).append((key, time.time()))
            self._uncommitted.append(_Entry(seq, self._active, offset + _HEADER.size, len(payload), points))
            self._uncommitted_bytes += len(payload)
            self._remember(key)
            self._has_records.notify_all()
            return seq

    def _remember(self, key: bytes) -> None:
        now = time.time()
        self._recent_keys[key] = now
        while self._recent_keys:
            oldest_key, seen = next(iter(self._recent_keys.items()))
            if now - seen <= self.dedup_window_s and len(self._recent_keys) <= _MAX_KEYS:
                break
            del self._recent_keys[oldest_key]

    def _writable_segment(self, seq: int):
        if self._active_file is not None and self._active_file.tell() < self.segment_bytes:
            return self._active_file
        if self._active_file is not None:
            self._active_file.close()
        self._active = self.directory / f"{_SEGMENT_PREFIX}{seq:020d}.log"
        self._active_file = open(self._active, "ab")
        _fsync_dir(self.directory)
        return self._active_file

    # --- draining ---------------------------------------------------------------------------
    @property
    def uncommitted_points(self) -> int:
        with self._lock:
            return sum(entry.points for entry in self._uncommitted)

    @property
    def uncommitted_bytes(self) -> int:
        return self._uncommitted_bytes

    def next_batch(self, max_points: int, max_wait_s: float, stop: threading.Event) -> SpoolBatch | None:
        """The next records to insert: the pending range after a crash, else up to max_points of
        consecutive records, waiting up to max_wait_s for company. None when there is nothing."""
        deadline = time.monotonic() + max_wait_s
        with self._lock:
            while True:
                if stop.is_set():
                    return None
                chosen = self._choose(max_points, past_deadline=time.monotonic() >= deadline)
                if chosen:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0 and not self._uncommitted:
                    return None
                self._has_records.wait(timeout=min(max(remaining, 0.01), 0.5))
        batch = SpoolBatch(chosen[0].seq, chosen[-1].seq, [self._read(entry) for entry in chosen])
        if self.pending != (batch.first_seq, batch.last_seq):
            _write_atomically(self.directory / "pending", batch.token)
            self.pending = (batch.first_seq, batch.last_seq)
        return batch

    def _choose(self, max_points: int, past_deadline: bool) -> list[_Entry]:
        if self.pending:
            first, last = self.pending
            chosen = [entry for entry in self._uncommitted if first <= entry.seq <= last]
            if chosen:
                return chosen
            self.pending = None
        if not self._uncommitted:
            return []
        if not past_deadline and sum(entry.points for entry in self._uncommitted) < max_points:
            return []
        chosen, points = [], 0
        for entry in self._uncommitted:
            if chosen and points + entry.points > max_points:
                break
            chosen.append(entry)
            points += entry.points
        return chosen

    def _read(self, entry: _Entry) -> object:
        with open(entry.segment, "rb") as handle:
            handle.seek(entry.offset)
            return marshal.loads(handle.read(entry.length))

    def commit(self, batch: SpoolBatch) -> None:
        """Record that the batch is in the store, then drop segments no longer needed."""
        _write_atomically(self.directory / "committed", str(batch.last_seq))
        (self.directory / "pending").unlink(missing_ok=True)
        with self._lock:
            self.committed = batch.last_seq
            self.pending = None
            kept = [entry for entry in self._uncommitted if entry.seq > batch.last_seq]
            self._uncommitted_bytes -= sum(e.length for e in self._uncommitted if e.seq <= batch.last_seq)
            self._uncommitted = kept
            self._drop_committed_segments()

    def _drop_committed_segments(self) -> None:
        """Delete segments whose records are all stored, keeping their request keys in keys.log."""
        done = [s for s, highest in self._segments.items() if s != self._active and highest <= self.committed]
        if not done:
            return
        keys_log = self.directory / "keys.log"
        if keys_log.exists() and keys_log.stat().st_size > _KEYS_LOG_COMPACT_BYTES:
            self._rewrite_keys_log()
        else:
            with open(keys_log, "ab") as handle:
                for segment in done:
                    handle.write(b"".join(_KEY_RECORD.pack(key, seen) for key, seen in self._segment_keys[segment]))
                handle.flush()
                os.fsync(handle.fileno())
        for segment in done:
            segment.unlink(missing_ok=True)
            del self._segments[segment]
            del self._segment_keys[segment]

    def close(self) -> None:
        with self._lock:
            if self._active_file is not None:
                self._active_file.close()
                self._active_file = None
            self._has_records.notify_all()
            if self._lock_fd is not None:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
                os.close(self._lock_fd)
                self._lock_fd = None
