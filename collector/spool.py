"""Durable spool: a request is acknowledged only once its rows are fsync'd here.

Layout of the spool directory:

- ``seg-<first seq>.log``: append-only segments of records
  ``magic | payload length | crc32 | seq | points | request key | part | flags | payload``; a torn
  record at the tail (a crash mid-write, never acknowledged) is cut off on open. A request decoded
  in pieces is one record per piece, numbered by ``part``; the last carries the ``LAST`` flag.
- ``committed``: the highest seq known to be in the store (atomically replaced).

A request is all or nothing: the drain stores the parts of a request only once its last part is
written, and skips them if it never will be (the request failed half-way, or the collector died
before acknowledging it).
- ``dead/``: records the store refused for good (``<seq>-<key>-<part>.rec`` and a ``.json`` saying
  why), moved there so that they never block the records behind them.
- ``requeue/``: records put back for the drain (``witcert dead-letter replay`` moves them here; the
  running collector, or the next one to start, spools them again and deletes the files).

The request key (a hash of the decompressed body) identifies a request: it names the store's
deduplication labels (``token``), so a record inserted twice (a replay after a crash, a client's
retry spooled again here or by another collector) is stored once. It also recognises client
retries here: a request whose last part was spooled within ``dedup_window_s`` is acknowledged
again without being spooled twice. A segment is deleted once all its records are committed; its
request keys move to ``keys.log`` (key, time), so retries are still recognised after a restart.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
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

# Record formats: WSP3 (with part and flags) is written; WSP2 (one record per request) is read.
_MAGIC = b"WSP3"
_HEADER = struct.Struct("<4sIIQQ16sII")
_MAGIC_V2 = b"WSP2"
_HEADER_V2 = struct.Struct("<4sIIQQ16s")
LAST = 1
OPEN, DONE, ABORTED = "open", "done", "aborted"
_SEGMENT_PREFIX = "seg-"
_KEY_RECORD = struct.Struct("<16sd")
# keys.log is rewritten with only the keys still inside the window once it grows past this.
_KEYS_LOG_COMPACT_BYTES = 8 * 1024 * 1024
_MAX_KEYS = 1_000_000
DEAD = "dead"
REQUEUE = "requeue"


def request_key(body: bytes) -> bytes:
    """Identity of a request body: a client retry sends the same bytes (before compression)."""
    return hashlib.blake2b(body, digest_size=16).digest()


def encode_payload(columns: dict) -> bytes:
    # marshal, not pickle: reading a spool file must never be able to run code.
    return marshal.dumps(columns)


@dataclass(frozen=True)
class Entry:
    """A spooled record: where its payload is, and what names it in the store."""

    seq: int
    segment: Path
    offset: int  # of the payload
    length: int  # of the payload
    points: int
    key: bytes
    part: int
    flags: int
    header_size: int

    def token(self, table: str, chunk: int) -> str:
        """The store's deduplication label of one insert of this record: content, not position."""
        return f"{self.key.hex()}.{self.part}:{table}:{chunk}"


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


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _record(seq: int, points: int, key: bytes, part: int, flags: int, payload: bytes) -> bytes:
    header = _HEADER.pack(_MAGIC, len(payload), 0, seq, points, key, part, flags)
    crc = zlib.crc32(payload, zlib.crc32(header[12:]))
    return _HEADER.pack(_MAGIC, len(payload), crc, seq, points, key, part, flags) + payload


def _parse_record(data: bytes, offset: int, where: object) -> tuple[int, int, bytes, int, int, int, int] | None:
    """(seq, points, key, part, flags, payload offset, end) of the record at ``offset``, or None when
    what is there is not a whole valid record (a torn tail)."""
    magic = data[offset : offset + 4]
    if magic == _MAGIC and offset + _HEADER.size <= len(data):
        _, length, crc, seq, points, key, part, flags = _HEADER.unpack_from(data, offset)
        start = offset + _HEADER.size
        header_tail = data[offset + 12 : start]
    elif magic == _MAGIC_V2 and offset + _HEADER_V2.size <= len(data):
        _, length, crc, seq, points, key = _HEADER_V2.unpack_from(data, offset)
        part, flags, start = 0, LAST, offset + _HEADER_V2.size
        header_tail = None
    elif magic.startswith(b"WSP") and len(magic) == 4:
        raise SpoolFormatError(
            f"spool {where} holds records in format {magic.decode(errors='replace')}, this version reads "
            f"{_MAGIC.decode()} and {_MAGIC_V2.decode()}: drain it with the witcert version that wrote it, "
            "or move it aside"
        )
    else:
        return None
    end = start + length
    if end > len(data):
        return None
    payload = data[start:end]
    expected = (
        zlib.crc32(payload, zlib.crc32(key, seq))
        if header_tail is None
        else zlib.crc32(payload, zlib.crc32(header_tail))
    )
    if expected != crc:
        return None
    return seq, points, key, part, flags, start, end


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
        self._uncommitted: list[Entry] = []
        self._uncommitted_bytes = 0
        self._recent_keys: OrderedDict[bytes, float] = OrderedDict()
        # segment -> highest seq in it, and the request keys (with arrival time) of its records
        self._segments: dict[Path, int] = {}
        self._segment_keys: dict[Path, list[tuple[bytes, float]]] = {}
        self._active: Path | None = None
        self._active_file = None
        self._next_seq = 1
        self._lock_fd: int | None = None
        # Requests spooled in several parts, by key: OPEN while being written, then DONE (last part
        # written, acknowledged) or ABORTED (never acknowledged: the drain skips its parts).
        self._groups: dict[bytes, str] = {}
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    # --- opening and recovery -------------------------------------------------------------
    def _open(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        for name in (DEAD, REQUEUE):
            (self.directory / name).mkdir(exist_ok=True)
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
        self._load_keys()
        segments = sorted(self.directory.glob(f"{_SEGMENT_PREFIX}*.log"), key=lambda p: int(p.stem[4:]))
        for index, segment in enumerate(segments):
            self._scan(segment, is_last=index == len(segments) - 1)
        # Parts of a request whose last part never made it were never acknowledged: skipped.
        whole = {entry.key for entry in self._uncommitted if entry.flags & LAST}
        for entry in self._uncommitted:
            if not entry.flags & LAST:
                self._groups[entry.key] = DONE if entry.key in whole else ABORTED
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
        _write_atomically(
            self.directory / "keys.log",
            b"".join(_KEY_RECORD.pack(key, seen) for key, seen in self._recent_keys.items()),
        )

    def _read_marker(self, name: str) -> str | None:
        path = self.directory / name
        return path.read_text(encoding="ascii").strip() if path.exists() else None

    def _scan(self, segment: Path, is_last: bool) -> None:
        mtime = segment.stat().st_mtime
        highest = 0
        keys = self._segment_keys.setdefault(segment, [])
        data = segment.read_bytes()
        offset = 0
        while offset < len(data):
            parsed = _parse_record(data, offset, segment)
            if parsed is None:
                break
            seq, points, key, part, flags, start, end = parsed
            highest = seq
            if flags & LAST:  # a request is known (a retry is a duplicate) only once whole
                self._recent_keys[key] = mtime
                keys.append((key, mtime))
            if seq > self.committed:
                self._uncommitted.append(
                    Entry(seq, segment, start, end - start, points, key, part, flags, start - offset)
                )
                self._uncommitted_bytes += end - start
            offset = end
        if offset < len(data):
            if is_last:
                # Never acknowledged: the fsync that would have acknowledged it did not complete.
                log.warning("spool %s: cutting a torn record at byte %d", segment, offset)
                with open(segment, "r+b") as handle:
                    handle.truncate(offset)
                    os.fsync(handle.fileno())
            else:
                log.error(
                    "spool %s: corrupt record at byte %d; the rest of this segment is unreadable", segment, offset
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

    def append(self, key: bytes, payload: bytes, points: int, part: int = 0, last: bool = True) -> int:
        """Write one record; the last part of a request is fsync'd with all before it. Returns its seq."""
        with self._lock:
            if not self.has_room(len(payload)):
                raise SpoolFull(f"spool holds {self._uncommitted_bytes} bytes not yet stored (limit {self.max_bytes})")
            seq = self._next_seq
            handle = self._writable_segment(seq)
            offset = handle.tell()
            record = _record(seq, points, key, part, LAST if last else 0, payload)
            handle.write(record)
            handle.flush()
            if last:
                os.fdatasync(handle.fileno())
            self._next_seq = seq + 1
            if not last:
                self._groups.setdefault(key, OPEN)
            elif key in self._groups:
                self._groups[key] = DONE
            assert self._active is not None
            self._segments[self._active] = seq
            header = len(record) - len(payload)
            entry = Entry(
                seq, self._active, offset + header, len(payload), points, key, part, LAST if last else 0, header
            )
            self._uncommitted.append(entry)
            self._uncommitted_bytes += len(payload)
            if last:
                self._segment_keys.setdefault(self._active, []).append((key, time.time()))
                self._remember(key)
            self._has_records.notify_all()
            return seq

    def abort(self, key: bytes) -> None:
        """The request whose parts were being written under ``key`` will not be acknowledged."""
        with self._lock:
            if self._groups.get(key) == OPEN:
                self._groups[key] = ABORTED
                self._has_records.notify_all()

    def group_state(self, entry: Entry) -> str:
        """DONE when the record may be stored (its request is whole), OPEN while its request is still
        being written, ABORTED when it never will be."""
        if entry.flags & LAST:
            return DONE
        with self._lock:
            return self._groups.get(entry.key, ABORTED)

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
            # Parts of a request written here earlier are made durable with its last part, which
            # may land in the next segment: sync this one before leaving it.
            os.fdatasync(self._active_file.fileno())
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

    def next_entries(self, after_seq: int, max_points: int, wait_s: float, stop: threading.Event) -> list[Entry]:
        """Records after ``after_seq`` not yet committed, up to ``max_points`` (at least one), waiting up
        to ``wait_s`` for the first."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            while not stop.is_set():
                chosen, points = [], 0
                for entry in self._uncommitted:
                    if entry.seq <= after_seq:
                        continue
                    if chosen and points + entry.points > max_points:
                        break
                    chosen.append(entry)
                    points += entry.points
                if chosen:
                    return chosen
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                self._has_records.wait(timeout=min(remaining, 0.5))
        return []

    def wake(self) -> None:
        with self._lock:
            self._has_records.notify_all()

    def read(self, entry: Entry) -> dict:
        with open(entry.segment, "rb") as handle:
            handle.seek(entry.offset)
            return marshal.loads(handle.read(entry.length))

    def commit(self, last_seq: int) -> None:
        """Record that every record up to ``last_seq`` is in the store (or dead-lettered)."""
        _write_atomically(self.directory / "committed", str(last_seq).encode())
        with self._lock:
            self.committed = last_seq
            done = [entry for entry in self._uncommitted if entry.seq <= last_seq]
            self._uncommitted = [entry for entry in self._uncommitted if entry.seq > last_seq]
            self._uncommitted_bytes -= sum(entry.length for entry in done)
            waiting = {entry.key for entry in self._uncommitted}
            for key in [key for key, state in self._groups.items() if state != OPEN and key not in waiting]:
                del self._groups[key]
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

    # --- dead letters -----------------------------------------------------------------------
    def dead_letter(self, entry: Entry, reason: str, tables: list[str]) -> Path:
        """Keep a record the store refused for good under ``dead/`` (durably), with the reason."""
        with open(entry.segment, "rb") as handle:
            handle.seek(entry.offset - entry.header_size)
            record = handle.read(entry.header_size + entry.length)
        name = f"{entry.seq:020d}-{entry.key.hex()}-{entry.part}"
        folder = self.directory / DEAD
        note = {
            "seq": entry.seq,
            "request_key": entry.key.hex(),
            "part": entry.part,
            "points": entry.points,
            "tables": tables,
            "reason": reason,
            "dead_since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        _write_atomically(folder / f"{name}.json", json.dumps(note).encode())
        _write_atomically(folder / f"{name}.rec", record)
        return folder / f"{name}.rec"

    def take_requeued(self) -> int:
        """Spool again the records put back under ``requeue/``; return how many points."""
        points = 0
        for path in sorted((self.directory / REQUEUE).glob("*.rec")):
            data = path.read_bytes()
            parsed = _parse_record(data, 0, path)
            if parsed is None:
                log.error("requeued record %s is damaged; left in place", path)
                continue
            _, count, key, part, flags, start, end = parsed
            self.append(key, data[start:end], count, part=part, last=True)
            path.unlink()
            points += count
        return points

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


# --- dead letters, for the collector's /readyz and the ``witcert dead-letter`` command ------------


@dataclass(frozen=True)
class DeadLetter:
    name: str
    seq: int
    request_key: str
    part: int
    points: int
    tables: list[str]
    reason: str
    dead_since: str


def dead_letters(spool_dir: Path) -> list[DeadLetter]:
    """The records under ``dead/``, oldest first."""
    found = []
    for path in sorted((Path(spool_dir) / DEAD).glob("*.rec")):
        note_path = path.with_suffix(".json")
        try:
            note = json.loads(note_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            note = {"reason": "(no note)", "points": 0, "tables": [], "seq": 0, "request_key": "", "part": 0}
        found.append(
            DeadLetter(
                name=path.stem,
                seq=int(note.get("seq", 0)),
                request_key=str(note.get("request_key", "")),
                part=int(note.get("part", 0)),
                points=int(note.get("points", 0)),
                tables=list(note.get("tables", [])),
                reason=str(note.get("reason", "")),
                dead_since=str(note.get("dead_since", "")),
            )
        )
    return found


def read_dead_letter(spool_dir: Path, name: str) -> dict:
    """The rows of one dead record, column-oriented per table."""
    path = Path(spool_dir) / DEAD / f"{name}.rec"
    data = path.read_bytes()
    parsed = _parse_record(data, 0, path)
    if parsed is None:
        raise SpoolFormatError(f"dead record {path} is damaged")
    return marshal.loads(data[parsed[5] : parsed[6]])


def requeue_dead_letters(spool_dir: Path, names: list[str] | None = None) -> list[str]:
    """Move dead records (all, or those named) to ``requeue/``, where the drain takes them again."""
    spool_dir = Path(spool_dir)
    moved = []
    for letter in dead_letters(spool_dir):
        if names is not None and letter.name not in names:
            continue
        source = spool_dir / DEAD / f"{letter.name}.rec"
        os.replace(source, spool_dir / REQUEUE / source.name)
        source.with_suffix(".json").unlink(missing_ok=True)
        moved.append(letter.name)
    if moved:
        _fsync_dir(spool_dir / REQUEUE)
        _fsync_dir(spool_dir / DEAD)
    return moved


def drop_dead_letters(spool_dir: Path, names: list[str]) -> list[str]:
    """Delete the named dead records for good."""
    dropped = []
    for name in names:
        path = Path(spool_dir) / DEAD / f"{name}.rec"
        if path.exists():
            path.unlink()
            path.with_suffix(".json").unlink(missing_ok=True)
            dropped.append(name)
    return dropped
