"""The spool on real files: torn tails, crash between insert and commit, retries across restarts, limits."""

from __future__ import annotations

import threading
import time

import pytest

from witcert.collector.spool import Spool, SpoolBusy, SpoolFormatError, SpoolFull, request_key

NO_STOP = threading.Event()


def _columns(tag: int) -> dict:
    return {"t": {"a": [tag] * 3}}


def test_records_survive_reopen_and_commit_removes_them(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20)
    for tag in range(3):
        assert spool.append(request_key(bytes([tag])), _columns(tag), points=3) == tag + 1
    spool.close()
    spool = Spool(tmp_path, max_bytes=1 << 20)
    assert spool.uncommitted_points == 9
    batch = spool.next_batch(max_points=6, max_wait_s=0, stop=NO_STOP)
    assert (batch.first_seq, batch.last_seq) == (1, 2)
    assert batch.payloads == [_columns(0), _columns(1)]
    spool.commit(batch)
    assert spool.uncommitted_points == 3
    spool.close()
    spool = Spool(tmp_path, max_bytes=1 << 20)
    batch = spool.next_batch(max_points=6, max_wait_s=0, stop=NO_STOP)
    assert (batch.first_seq, batch.last_seq, batch.payloads) == (3, 3, [_columns(2)])
    spool.close()


def test_torn_tail_is_cut_and_earlier_records_kept(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20)
    spool.append(request_key(b"a"), _columns(1), points=3)
    spool.append(request_key(b"b"), _columns(2), points=3)
    spool.close()
    segment = next(tmp_path.glob("seg-*.log"))
    size = segment.stat().st_size
    with open(segment, "r+b") as handle:  # a crash in the middle of writing the second record
        handle.truncate(size - 5)
    spool = Spool(tmp_path, max_bytes=1 << 20)
    batch = spool.next_batch(max_points=100, max_wait_s=0, stop=NO_STOP)
    assert batch.payloads == [_columns(1)]
    # The cut record was never acknowledged: the client's retry is spooled, not taken as a duplicate.
    assert spool.append(request_key(b"b"), _columns(2), points=3) == 2
    spool.close()


def test_crash_between_insert_and_commit_replays_the_same_batch(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20)
    for tag in range(2):
        spool.append(request_key(bytes([tag])), _columns(tag), points=3)
    batch = spool.next_batch(max_points=100, max_wait_s=0, stop=NO_STOP)
    assert batch.token == "1-2"
    spool.close()  # crash: inserted, not committed
    spool = Spool(tmp_path, max_bytes=1 << 20)
    spool.append(request_key(b"later"), _columns(9), points=3)
    replay = spool.next_batch(max_points=100, max_wait_s=0, stop=NO_STOP)
    # Exactly the same range, hence the same deduplication token, although more records wait now.
    assert replay.token == "1-2"
    spool.commit(replay)
    assert spool.next_batch(max_points=100, max_wait_s=0, stop=NO_STOP).token == "3-3"
    spool.close()


def test_stored_segments_are_deleted_and_retries_still_recognised_after_restart(tmp_path):
    # Tiny segments: every record starts a new one, so committed ones can be deleted at once.
    spool = Spool(tmp_path, max_bytes=1 << 20, segment_bytes=16)
    key = request_key(b"body")
    assert spool.append(key, _columns(1), points=3) == 1
    assert spool.append(request_key(b"other"), _columns(2), points=3) == 2
    spool.commit(spool.next_batch(max_points=100, max_wait_s=0, stop=NO_STOP))
    assert [p.name for p in tmp_path.glob("seg-*.log")] == [f"seg-{2:020d}.log"]  # only the active one
    spool.close()
    spool = Spool(tmp_path, max_bytes=1 << 20, segment_bytes=16)
    assert spool.is_duplicate(key)
    assert spool.append(key, _columns(1), points=3) is None
    assert spool.next_batch(max_points=100, max_wait_s=0, stop=NO_STOP) is None
    spool.close()


def test_keys_outside_the_window_are_forgotten(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20, segment_bytes=16, dedup_window_s=0.2)
    key = request_key(b"body")
    spool.append(key, _columns(1), points=3)
    spool.append(request_key(b"next"), _columns(2), points=3)
    spool.commit(spool.next_batch(max_points=100, max_wait_s=0, stop=NO_STOP))
    spool.close()
    time.sleep(0.3)
    spool = Spool(tmp_path, max_bytes=1 << 20, segment_bytes=16, dedup_window_s=0.2)
    assert not spool.is_duplicate(key)
    spool.close()


def test_full_spool_refuses_and_one_directory_per_collector(tmp_path):
    spool = Spool(tmp_path, max_bytes=4096)
    spool.append(request_key(b"1"), {"t": {"a": list(range(1000, 1600))}}, points=600)
    with pytest.raises(SpoolFull):
        spool.append(request_key(b"2"), {"t": {"a": list(range(1000, 1600))}}, points=600)
    with pytest.raises(SpoolBusy, match="in use by another collector"):
        Spool(tmp_path, max_bytes=4096)
    spool.close()


def test_next_batch_waits_for_company_then_returns_what_it_has(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20)
    assert spool.next_batch(max_points=10, max_wait_s=0.05, stop=NO_STOP) is None
    spool.append(request_key(b"x"), _columns(1), points=3)
    batch = spool.next_batch(max_points=10, max_wait_s=0.05, stop=NO_STOP)
    assert batch.payloads == [_columns(1)]
    spool.close()


def test_a_spool_of_another_format_is_refused_not_cut(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20)
    spool.append(request_key(b"a"), _columns(1), points=3)
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
