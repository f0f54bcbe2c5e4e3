"""The spool on real files: torn tails, replays, retries across restarts, requests in parts,
dead letters, limits."""

from __future__ import annotations

import struct
import threading
import time
import zlib

import pytest

from witcert.collector.spool import (
    ABORTED,
    DONE,
    OPEN,
    Spool,
    SpoolBusy,
    SpoolFormatError,
    SpoolFull,
    dead_letters,
    drop_dead_letters,
    encode_payload,
    read_dead_letter,
    request_key,
    requeue_dead_letters,
)

NO_STOP = threading.Event()


def _columns(tag: int) -> dict:
    return {"t": {"a": [tag] * 3}}


def _append(spool: Spool, body: bytes, tag: int, **options) -> int:
    return spool.append(request_key(body), encode_payload(_columns(tag)), points=3, **options)


def _pending(spool: Spool, after: int = 0) -> list:
    return spool.next_entries(after, max_points=10**9, wait_s=0, stop=NO_STOP)


def test_records_survive_reopen_and_commit_removes_them(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20)
    for tag in range(3):
        assert _append(spool, bytes([tag]), tag) == tag + 1
    spool.close()
    spool = Spool(tmp_path, max_bytes=1 << 20)
    assert spool.uncommitted_points == 9
    entries = spool.next_entries(0, max_points=6, wait_s=0, stop=NO_STOP)
    assert [entry.seq for entry in entries] == [1, 2]
    assert [spool.read(entry) for entry in entries] == [_columns(0), _columns(1)]
    spool.commit(2)
    assert spool.uncommitted_points == 3
    spool.close()
    spool = Spool(tmp_path, max_bytes=1 << 20)
    (entry,) = _pending(spool)
    assert (entry.seq, spool.read(entry)) == (3, _columns(2))
    spool.close()


def test_torn_tail_is_cut_and_earlier_records_kept(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20)
    _append(spool, b"a", 1)
    _append(spool, b"b", 2)
    spool.close()
    segment = next(tmp_path.glob("seg-*.log"))
    size = segment.stat().st_size
    with open(segment, "r+b") as handle:  # a crash in the middle of writing the second record
        handle.truncate(size - 5)
    spool = Spool(tmp_path, max_bytes=1 << 20)
    assert [spool.read(entry) for entry in _pending(spool)] == [_columns(1)]
    # The cut record was never acknowledged: the client's retry is not taken for a duplicate.
    assert not spool.is_duplicate(request_key(b"b"))
    assert _append(spool, b"b", 2) == 2
    spool.close()


def test_deduplication_labels_name_the_content_not_the_position(tmp_path):
    first = Spool(tmp_path / "one", max_bytes=1 << 20)
    _append(first, b"other", 9)
    _append(first, b"body", 1)
    second = Spool(tmp_path / "two", max_bytes=1 << 20)
    _append(second, b"body", 1)  # the same request, spooled elsewhere at another position
    left, right = _pending(first)[1], _pending(second)[0]
    assert left.seq != right.seq
    assert left.token("t", 0) == right.token("t", 0)
    assert left.token("t", 0) != _pending(first)[0].token("t", 0)
    assert left.token("t", 0) != left.token("t", 1) != left.token("u", 0)
    first.close()
    second.close()


def test_a_crash_between_insert_and_commit_replays_the_same_records(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20)
    for tag in range(2):
        _append(spool, bytes([tag]), tag)
    tokens = [entry.token("t", 0) for entry in _pending(spool)]
    spool.close()  # crash: inserted, not committed
    spool = Spool(tmp_path, max_bytes=1 << 20)
    _append(spool, b"later", 9)
    assert [entry.token("t", 0) for entry in _pending(spool)][:2] == tokens
    spool.close()


def test_stored_segments_are_deleted_and_retries_still_recognised_after_restart(tmp_path):
    # Tiny segments: every record starts a new one, so committed ones can be deleted at once.
    spool = Spool(tmp_path, max_bytes=1 << 20, segment_bytes=16)
    assert _append(spool, b"body", 1) == 1
    assert _append(spool, b"other", 2) == 2
    spool.commit(2)
    assert [p.name for p in tmp_path.glob("seg-*.log")] == [f"seg-{2:020d}.log"]  # only the active one
    spool.close()
    spool = Spool(tmp_path, max_bytes=1 << 20, segment_bytes=16)
    assert spool.is_duplicate(request_key(b"body"))
    assert _pending(spool) == []
    spool.close()


def test_keys_outside_the_window_are_forgotten(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20, segment_bytes=16, dedup_window_s=0.2)
    _append(spool, b"body", 1)
    _append(spool, b"next", 2)
    spool.commit(2)
    spool.close()
    time.sleep(0.3)
    spool = Spool(tmp_path, max_bytes=1 << 20, segment_bytes=16, dedup_window_s=0.2)
    assert not spool.is_duplicate(request_key(b"body"))
    spool.close()


def test_a_request_in_parts_is_stored_whole_or_not_at_all(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20)
    key = request_key(b"big")
    _append(spool, b"big", 1, part=0, last=False)
    (first,) = _pending(spool)
    assert spool.group_state(first) == OPEN and not spool.is_duplicate(key)
    _append(spool, b"big", 2, part=1, last=True)
    assert [spool.group_state(entry) for entry in _pending(spool)] == [DONE, DONE]
    assert spool.is_duplicate(key)
    _append(spool, b"failed", 3, part=0, last=False)
    spool.abort(request_key(b"failed"))
    assert spool.group_state(_pending(spool)[-1]) == ABORTED
    _append(spool, b"crashed", 4, part=0, last=False)
    spool.close()  # the collector dies before the last part of "crashed"
    spool = Spool(tmp_path, max_bytes=1 << 20)
    states = [spool.group_state(entry) for entry in _pending(spool)]
    assert states == [DONE, DONE, ABORTED, ABORTED]
    assert not spool.is_duplicate(request_key(b"crashed"))  # its retry is spooled again
    spool.close()


def test_dead_letters_keep_the_record_and_replay_spools_it_again(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20)
    _append(spool, b"refused", 5)
    (entry,) = _pending(spool)
    spool.dead_letter(entry, "Code: 469. VIOLATED_CONSTRAINT", ["t"])
    spool.commit(entry.seq)
    (letter,) = dead_letters(tmp_path)
    assert (letter.points, letter.tables, letter.reason) == (3, ["t"], "Code: 469. VIOLATED_CONSTRAINT")
    assert read_dead_letter(tmp_path, letter.name) == _columns(5)
    assert requeue_dead_letters(tmp_path) == [letter.name]
    assert dead_letters(tmp_path) == []
    assert spool.take_requeued() == 3
    (again,) = _pending(spool, after=entry.seq)
    assert spool.read(again) == _columns(5) and again.token("t", 0) == entry.token("t", 0)
    assert not list((tmp_path / "requeue").iterdir())
    spool.dead_letter(again, "refused again", ["t"])
    (letter,) = dead_letters(tmp_path)
    assert drop_dead_letters(tmp_path, [letter.name, "no-such-record"]) == [letter.name]
    assert dead_letters(tmp_path) == [] and not list((tmp_path / "dead").iterdir())
    spool.close()


def test_full_spool_refuses_and_one_directory_per_collector(tmp_path):
    spool = Spool(tmp_path, max_bytes=4096)
    spool.append(request_key(b"1"), encode_payload({"t": {"a": list(range(1000, 1600))}}), points=600)
    with pytest.raises(SpoolFull):
        spool.append(request_key(b"2"), encode_payload({"t": {"a": list(range(1000, 1600))}}), points=600)
    with pytest.raises(SpoolBusy, match="in use by another collector"):
        Spool(tmp_path, max_bytes=4096)
    spool.close()


def test_next_entries_waits_for_the_first_record(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20)
    assert spool.next_entries(0, max_points=10, wait_s=0.05, stop=NO_STOP) == []
    threading.Timer(0.05, lambda: _append(spool, b"x", 1)).start()
    (entry,) = spool.next_entries(0, max_points=10, wait_s=5, stop=NO_STOP)
    assert spool.read(entry) == _columns(1)
    spool.close()


def test_records_of_the_previous_format_are_read(tmp_path):
    payload = encode_payload(_columns(7))
    key = request_key(b"old")
    crc = zlib.crc32(payload, zlib.crc32(key, 1))
    record = struct.pack("<4sIIQQ16s", b"WSP2", len(payload), crc, 1, 3, key) + payload
    (tmp_path / f"seg-{1:020d}.log").write_bytes(record)
    spool = Spool(tmp_path, max_bytes=1 << 20)
    (entry,) = _pending(spool)
    assert (spool.read(entry), spool.group_state(entry), entry.part) == (_columns(7), DONE, 0)
    assert spool.is_duplicate(key)
    spool.close()


def test_a_spool_of_another_format_is_refused_not_cut(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20)
    _append(spool, b"a", 1)
    spool.close()
    segment = next(tmp_path.glob("seg-*.log"))
    data = bytearray(segment.read_bytes())
    data[:4] = b"WSP1"  # as an older version would have written it
    segment.write_bytes(bytes(data))
    with pytest.raises(SpoolFormatError, match="format WSP1"):
        Spool(tmp_path, max_bytes=1 << 20)
    assert segment.read_bytes() == bytes(data)  # acknowledged data is never cut
    with pytest.raises(SpoolFormatError):  # not SpoolBusy: the failed open released its lock
        Spool(tmp_path, max_bytes=1 << 20)
