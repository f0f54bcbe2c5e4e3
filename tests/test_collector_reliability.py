"""Nothing acknowledged is lost or doubled: store outage mid-stream, and kill -9 mid-stream.

The collector under kill -9 is a real ``witcert collector`` process; the client is the replay
client of the benchmark, which remembers which requests were acknowledged (HTTP 200).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from witcert.collector.config import CollectorConfig, Limits
from witcert.collector.loadgen import OtlpHttpClient, samples_request
from witcert.collector.service import Collector
from witcert.collector.store import Store

LAYERS, HEADS, STEPS_PER_REQUEST = 4, 8, 16
POINTS_PER_STEP = LAYERS * HEADS


# Fixed timestamps: a request rebuilt for a retry is byte-identical, as a client's retry is. Steps
# are 1 us apart, so however fast a stream sends, its points never run ahead of the clock by more
# than the collector's future skew (a million requests are 16 s).
BASE_NS = time.time_ns()
STEP_NS = 1_000


def _body(model: str, index: int) -> bytes:
    steps = range(index * STEPS_PER_REQUEST, (index + 1) * STEPS_PER_REQUEST)
    return samples_request(model, "node-0", LAYERS, HEADS, steps, time_ns=BASE_NS, step_ns=STEP_NS).SerializeToString()


def _counts_per_step(store: Store, model: str) -> dict[int, int]:
    _, rows = store.query(
        "SELECT Step, count() FROM witcert_certificate_samples WHERE Model = {m:String} GROUP BY Step", {"m": model}
    )
    return dict(rows)


def _assert_exactly_once(counts: dict[int, int], acknowledged: set[int]) -> None:
    """Acknowledged requests: every point once. Others: all or nothing, never twice."""
    assert all(count == POINTS_PER_STEP for count in counts.values()), "some step stored twice or partially"
    stored_requests = {step // STEPS_PER_REQUEST for step in counts}
    missing = acknowledged - stored_requests
    assert not missing, f"acknowledged requests lost: {sorted(missing)[:10]}"
    for index in stored_requests:
        steps = range(index * STEPS_PER_REQUEST, (index + 1) * STEPS_PER_REQUEST)
        assert all(step in counts for step in steps)


def test_store_outage_mid_stream_503_then_catch_up(tmp_path):
    limits = Limits(store_down_grace_s=0.3, retry_after_s=1)
    config = CollectorConfig(
        store_url=f"chdb://{tmp_path / 'chdb'}",
        spool_dir=tmp_path / "spool",
        otlp_http="127.0.0.1:0",
        otlp_grpc=None,
        limits=limits,
        batch_max_wait_s=0.02,
    )
    model = f"outage-{uuid.uuid4().hex[:6]}"
    with Collector(config) as collector:
        client = OtlpHttpClient("127.0.0.1", collector.ports.http)
        acknowledged: set[int] = set()
        refused = []
        for index in range(10):
            assert client.post(_body(model, index)).status == 200
            acknowledged.add(index)
        assert collector.wait_stored(20)
        collector.store.command("DETACH TABLE witcert_certificate_samples")
        try:
            deadline = time.monotonic() + 20
            index = 10
            while time.monotonic() < deadline and len(refused) < 3:
                reply = client.post(_body(model, index))
                if reply.status == 200:
                    acknowledged.add(index)
                else:
                    assert reply.status == 503
                    assert reply.headers["retry-after"] == "1"
                    refused.append(index)
                index += 1
                time.sleep(0.02)
            assert len(refused) == 3, "the collector never pushed back while the store was down"
            with urllib.request.urlopen(f"http://127.0.0.1:{collector.ports.http}/healthz") as response:
                assert response.status == 200
            ready = urllib.request.Request(f"http://127.0.0.1:{collector.ports.http}/readyz")
            with pytest.raises(urllib.error.HTTPError) as not_ready:
                urllib.request.urlopen(ready)
            assert not_ready.value.code == 503
            assert "store unavailable" in json.loads(not_ready.value.read())["reason"]
        finally:
            collector.store.command("ATTACH TABLE witcert_certificate_samples")
        assert collector.wait_stored(30), "the spool did not catch up after the store came back"
        # The clients' retries of the refused requests now succeed, once.
        for index in refused:
            assert client.post(_body(model, index)).status == 200
            acknowledged.add(index)
        assert collector.wait_stored(30)
        counts = _counts_per_step(collector.store, model)
        client.close()
    _assert_exactly_once(counts, acknowledged)
    assert {step // STEPS_PER_REQUEST for step in counts} == acknowledged


def _start_collector_process(store: Path, spool: Path) -> tuple[subprocess.Popen, int]:
    command = [sys.executable, "-m", "witcert.cli", "collector", "--store", f"chdb://{store}", "--spool", str(spool)]
    command += ["--otlp-http", "127.0.0.1:0", "--no-grpc", "--log-level", "WARNING"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    output = []
    for line in process.stdout:  # warnings (e.g. a torn spool record cut) may come first
        output.append(line)
        match = re.search(r"OTLP/HTTP [\d.]+:(\d+)", line)
        if match:
            return process, int(match.group(1))
    process.kill()
    raise AssertionError(f"collector did not start: {''.join(output)}")


def _wait_drained(port: int, stalled_s: float = 30) -> None:
    """Until the spool is empty; fails once it has not shrunk for ``stalled_s`` (a backlog of
    thousands of small requests takes a minute or more on a loaded machine, which is not a fault)."""
    smallest, progress_at = None, time.monotonic()
    while time.monotonic() - progress_at < stalled_s:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz") as response:
            spooled = json.loads(response.read())["spool_bytes"]
        if spooled == 0:
            return
        if smallest is None or spooled < smallest:
            smallest, progress_at = spooled, time.monotonic()
        time.sleep(0.1)
    raise AssertionError(f"the restarted collector stopped draining its spool ({smallest} bytes left)")


def stream(
    port: int, model: str, indices, acknowledged: set[int], stop: threading.Event, rejections: list[str]
) -> None:
    """POST numbered requests until ``stop``, noting which were acknowledged (the replay client), and
    in ``rejections`` any acknowledgement that rejects points (none should: every point is valid)."""
    client = OtlpHttpClient("127.0.0.1", port, timeout_s=5)
    while not stop.is_set():
        index = next(indices)
        try:
            reply = client.post(_body(model, index))
        except OSError:
            return  # the collector died under us: this request was not acknowledged
        if reply.status == 200:
            acknowledged.add(index)
            rejected, message = reply.partial_success()
            if rejected:
                rejections.append(f"request {index}: {rejected} points rejected: {message}")


def _stream_and_kill(tmp_path: Path, rounds: int, stream_s: float) -> None:
    store, spool = tmp_path / "chdb", tmp_path / "spool"
    model = f"kill-{uuid.uuid4().hex[:6]}"
    acknowledged: set[int] = set()
    rejections: list[str] = []
    indices = itertools.count()
    for round_index in range(rounds):
        process, port = _start_collector_process(store, spool)
        stop = threading.Event()
        threads = [
            threading.Thread(target=stream, args=(port, model, indices, acknowledged, stop, rejections))
            for _ in range(2)
        ]
        for thread in threads:
            thread.start()
        time.sleep(stream_s * (0.5 + 0.5 * ((round_index * 7919) % 10) / 10))
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        stop.set()
        for thread in threads:
            thread.join()
    assert acknowledged, "nothing was acknowledged before the kills"
    assert not rejections, rejections[:3]
    process, port = _start_collector_process(store, spool)
    try:
        _wait_drained(port)
        # A client retrying an acknowledged request after the restart is not double counted.
        last = max(acknowledged)
        assert OtlpHttpClient("127.0.0.1", port).post(_body(model, last)).status == 200
        _wait_drained(port)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    reader = Store(f"chdb://{store}", migrate=False)
    try:
        counts = _counts_per_step(reader, model)
    finally:
        reader.close()
    _assert_exactly_once(counts, acknowledged)


def test_kill_9_mid_stream_loses_nothing_acknowledged(tmp_path):
    _stream_and_kill(tmp_path, rounds=1, stream_s=3.0)


@pytest.mark.slow
def test_kill_9_repeatedly_under_sustained_stream(tmp_path):
    _stream_and_kill(tmp_path, rounds=6, stream_s=8.0)
