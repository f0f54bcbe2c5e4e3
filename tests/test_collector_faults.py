"""Fault injection: every way a request, a client or a restart has wedged, lost, doubled or blown up
the collector, reproduced against real components (chDB, sockets, child processes).

All collectors here write one chDB store (chDB opens one data path per process at a time); each
test uses its own spool directories and its own model name, and reads back only that model.
Two collectors on one store run in this process and share the store's engine (as two replicas
share a ClickHouse server); each keeps its own spool, drain and deduplication.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml
from google.rpc import status_pb2
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from witcert.cli import main as witcert_main
from witcert.collector.config import CollectorConfig, Limits, Retention
from witcert.collector.loadgen import OtlpHttpClient, samples_request
from witcert.collector.service import Collector
from witcert.collector.store import Store
from witcert.integrations.telemetry import schema as ts

DAY_NS = 86_400 * 10**9
LONG_RETENTION = Retention(raw_days=400, samples_days=400)


@pytest.fixture(scope="module")
def store_url(tmp_path_factory) -> str:
    return f"chdb://{tmp_path_factory.mktemp('faults') / 'chdb'}"


@pytest.fixture
def make_collector(store_url, tmp_path):
    """Start collectors on the module's store, each with its own spool; stop them all afterwards."""
    started: list[Collector] = []

    def make(name: str = "a", **fields) -> Collector:
        fields.setdefault("store_url", store_url)
        fields.setdefault("spool_dir", tmp_path / f"spool-{name}")
        fields.setdefault("otlp_http", "127.0.0.1:0")
        fields.setdefault("otlp_grpc", None)
        fields.setdefault("batch_max_wait_s", 0.05)
        collector = Collector(CollectorConfig(**fields))
        collector.start()
        started.append(collector)
        return collector

    yield make
    for collector in reversed(started):
        collector.stop()


def _model(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def _count(collector: Collector, sql: str, model: str) -> int:
    _, rows = collector.store.query(sql, {"m": model})
    return rows[0][0]


def _samples(collector: Collector, model: str) -> int:
    return _count(collector, "SELECT count() FROM witcert_certificate_samples WHERE Model = {m:String}", model)


def _request(model: str) -> ExportMetricsServiceRequest:
    request = ExportMetricsServiceRequest()
    resource_metrics = request.resource_metrics.add()
    for key, value in ((ts.RESOURCE_MODEL, model), (ts.RESOURCE_INSTANCE, "node-0"), (ts.RESOURCE_TP_RANK, "0")):
        resource_metrics.resource.attributes.add(key=key, value=AnyValue(string_value=value))
    resource_metrics.scope_metrics.add().scope.name = ts.INSTRUMENTATION_SCOPE
    return request


def _add_sample(request: ExportMetricsServiceRequest, time_ns: int, step: int, value: float = 0.01, **attributes):
    metrics = request.resource_metrics[0].scope_metrics[0].metrics
    metric = next((m for m in metrics if m.name == ts.CERTIFICATE_SAMPLE), None) or metrics.add(
        name=ts.CERTIFICATE_SAMPLE
    )
    point = metric.gauge.data_points.add(time_unix_nano=time_ns, as_double=value)
    fields = {ts.ATTR_LAYER: 0, ts.ATTR_HEAD: 0, ts.ATTR_STEP: step, **attributes}
    for key, attribute in fields.items():
        any_value = AnyValue(string_value=attribute) if isinstance(attribute, str) else AnyValue(int_value=attribute)
        point.attributes.add(key=key, value=any_value)
    return point


def _post(collector: Collector, body: bytes, **options):
    client = OtlpHttpClient("127.0.0.1", collector.ports.http)
    try:
        return client.post(body, **options)
    finally:
        client.close()


def _url(collector: Collector, path: str) -> str:
    return f"http://127.0.0.1:{collector.ports.http}{path}"


def _get(collector: Collector, path: str, timeout: float = 10) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(_url(collector, path), timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        with error:
            return error.code, error.read().decode()


# --- 1. partitions: one request, or many merged, spread over many days ---------------------------


def test_points_on_150_days_in_one_request_are_stored_and_storing_goes_on(make_collector):
    collector = make_collector(retention=LONG_RETENTION)
    model = _model("days")
    now = time.time_ns()
    request = _request(model)
    gauge = request.resource_metrics[0].scope_metrics[0].metrics.add(name="fault.days").gauge
    for day in range(150):
        gauge.data_points.add(time_unix_nano=now - day * DAY_NS, as_double=float(day))
        _add_sample(request, now - day * DAY_NS, step=day)
    reply = _post(collector, request.SerializeToString())
    assert reply.status == 200 and reply.partial_success() == (0, "")
    later = _request(model)
    _add_sample(later, now, step=1000)
    assert _post(collector, later.SerializeToString()).status == 200
    assert collector.wait_stored(20), "the drain is stuck on a request spanning 150 partitions"
    raw = "SELECT count() FROM otel_metrics_gauge WHERE ResourceAttributes['witcert.model'] = {m:String}"
    assert _count(collector, raw, model) == 150
    assert _samples(collector, model) == 151


def test_one_point_a_day_over_110_requests_drained_together_are_stored(make_collector):
    # The drain waits up to 0.5 s for company: the requests below reach it together.
    collector = make_collector(retention=LONG_RETENTION, batch_max_wait_s=0.5)
    model = _model("merged")
    now = time.time_ns()
    bodies = []
    for day in range(110):
        request = _request(model)
        _add_sample(request, now - day * DAY_NS, step=day)
        bodies.append(request.SerializeToString())
    client = OtlpHttpClient("127.0.0.1", collector.ports.http)
    assert all(client.post(body).status == 200 for body in bodies)
    client.close()
    assert collector.wait_stored(20), "the drain is stuck on a batch spanning 110 partitions"
    assert _samples(collector, model) == 110


def _blocks_inserted(collector: Collector, table: str) -> int:
    """The table's insert counter: each insert of rows of one day takes one block number."""
    _, rows = collector.store.query(
        "SELECT max(max_block_number) FROM system.parts WHERE database = currentDatabase() AND table = {t:String}",
        {"t": table},
    )
    return rows[0][0]


def test_a_request_over_the_insert_limits_is_stored_once_in_inserts_within_them(make_collector):
    limits = {"insert_max_rows": 100, "insert_max_bytes": 64 * 1024}
    left, right = make_collector("left", **limits), make_collector("right", **limits)
    model, now = _model("inserts"), time.time_ns()
    request = _request(model)
    _resource_attributes(request, 1, 1000)  # copied onto each raw row: about 1 KiB a row
    for step in range(1000):
        _add_sample(request, now, step)
    _gauge_points(request, "fault.inserts", now, 1000)
    body = request.SerializeToString()
    before = {table: _blocks_inserted(left, table) for table in ("witcert_certificate_samples", "otel_metrics_gauge")}
    assert _post(left, body).status == 200
    assert left.wait_stored(20)
    assert _blocks_inserted(left, "witcert_certificate_samples") - before["witcert_certificate_samples"] == 10
    assert _blocks_inserted(left, "otel_metrics_gauge") - before["otel_metrics_gauge"] >= 1000 * 1000 // (64 * 1024)
    # The other replica cuts the same request into the same labelled inserts: the store drops them.
    assert _post(right, body).status == 200
    assert right.wait_stored(20)
    raw = "SELECT count() FROM otel_metrics_gauge WHERE ResourceAttributes['witcert.model'] = {m:String}"
    assert _count(left, raw, model) == 1000
    assert _samples(left, model) == 1000


# --- 2. deduplication labels: spool replacement, two collectors on one store --------------------


def _numbered_request(model: str, index: int, now: int) -> bytes:
    return samples_request(model, "node-0", 2, 2, range(index * 4, index * 4 + 4), time_ns=now).SerializeToString()


def test_a_fresh_spool_on_the_same_store_loses_nothing(make_collector):
    model, now = _model("respool"), time.time_ns()

    def send_one_by_one(collector: Collector, indices: range) -> None:
        for index in indices:  # each drained alone: the first spool's record numbers recur in the second
            assert _post(collector, _numbered_request(model, index, now)).status == 200
            assert collector.wait_stored(20)

    first = make_collector("first")
    send_one_by_one(first, range(10))
    first.stop()
    second = make_collector("second")  # same store, new spool directory
    send_one_by_one(second, range(10, 20))
    assert _samples(second, model) == 20 * 16


def test_two_collectors_on_one_store_a_retry_crossing_them_is_stored_once(make_collector):
    model, now = _model("replicas"), time.time_ns()
    left, right = make_collector("left"), make_collector("right")
    for index in range(10):
        assert _post(left if index < 5 else right, _numbered_request(model, index, now)).status == 200
    # The clients did not see these acknowledgements and retry on the other collector.
    assert _post(right, _numbered_request(model, 4, now)).status == 200
    assert _post(left, _numbered_request(model, 5, now)).status == 200
    assert left.wait_stored(20) and right.wait_stored(20)
    _, rows = left.store.query(
        "SELECT Step, count() FROM witcert_certificate_samples WHERE Model = {m:String} GROUP BY Step", {"m": model}
    )
    assert dict(rows) == {step: 4 for step in range(40)}


# --- 3. memory: child process, peak RSS against the documented bound ----------------------------

MEMORY_LIMITS = Limits(
    memory_budget_bytes=96 * 1024**2,
    max_body_bytes=8 * 1024**2,
    max_decompressed_bytes=16 * 1024**2,
    decode_chunk_bytes=256 * 1024,
    max_point_bytes=64 * 1024,
    max_row_bytes_per_request=32 * 1024**2,
    max_connections=64,
)


def _rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{field} missing for pid {pid}")


@contextmanager
def _collector_process(tmp_path: Path, config: CollectorConfig, store: str | None = None):
    config_file = tmp_path / "collector.json"
    config_file.write_text(config.model_dump_json())
    command = [sys.executable, "-m", "witcert.cli", "collector", "--config", str(config_file)]
    command += ["--store", store or f"chdb://{tmp_path / 'child-chdb'}", "--spool", str(tmp_path / "child-spool")]
    command += ["--otlp-http", "127.0.0.1:0", "--no-grpc", "--log-level", "WARNING"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    output = []
    try:
        for line in process.stdout:
            output.append(line)
            match = re.search(r"OTLP/HTTP [\d.]+:(\d+)", line)
            if match:
                break
        else:
            raise AssertionError(f"the collector did not start: {''.join(output)}")
        yield process, int(match.group(1))
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _concurrently(count: int, send) -> list:
    results: list = [None] * count

    def run(index: int) -> None:
        try:
            results[index] = send(index)
        except OSError as error:
            results[index] = error

    threads = [threading.Thread(target=run, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def _resource_attributes(request: ExportMetricsServiceRequest, count: int, chars: int) -> None:
    for index in range(count):
        attribute = request.resource_metrics[0].resource.attributes.add(key=f"attr{index}")
        attribute.value.string_value = "x" * chars


def _gauge_points(request: ExportMetricsServiceRequest, name: str, now: int, count: int) -> None:
    gauge = request.resource_metrics[0].scope_metrics[0].metrics.add(name=name).gauge
    for step in range(count):
        gauge.data_points.add(time_unix_nano=now + step, as_double=1.0)


def _memory_bound_kib(config: CollectorConfig) -> int:
    return config.working_memory_bytes() // 1024


def test_gzip_and_attribute_expansion_stay_within_the_memory_budget(tmp_path):
    config = CollectorConfig(limits=MEMORY_LIMITS, batch_max_wait_s=0.05, otlp_grpc=None)
    now = time.time_ns()
    with _collector_process(tmp_path, config) as (process, port):
        warm = samples_request("warm", "n", 4, 4, range(4), time_ns=now).SerializeToString()
        assert OtlpHttpClient("127.0.0.1", port).post(warm).status == 200
        time.sleep(0.5)
        baseline = _rss_kib(process.pid, "VmRSS")
        # Four concurrent gzip requests of 8 MiB once inflated (~140k samples each).
        big = samples_request("gzip", "n", 32, 32, range(140), time_ns=now).SerializeToString()
        assert len(big) <= MEMORY_LIMITS.max_decompressed_bytes
        compressed = gzip.compress(big, compresslevel=1)
        replies = _concurrently(
            4, lambda _: OtlpHttpClient("127.0.0.1", port).post(compressed, headers={"Content-Encoding": "gzip"})
        )
        statuses = [getattr(reply, "status", reply) for reply in replies]
        assert all(status in (200, 503) for status in statuses), statuses
        # 60 resource attributes of 4,000 characters on 3,000 points: 0.72 GB once copied onto each row.
        request = _request("expand")
        _resource_attributes(request, 60, 4000)
        for step in range(3000):
            _add_sample(request, now, step)
        _gauge_points(request, "fault.expand", now, 3000)
        reply = OtlpHttpClient("127.0.0.1", port).post(request.SerializeToString())
        assert reply.status == 200
        rejected, message = reply.partial_success()
        assert rejected == 6000 and "attributes" in message
        # Within the caps per attribute set, but copied onto every row: the rows are bounded per request.
        request = _request("rows")
        _resource_attributes(request, 4, 3500)
        _gauge_points(request, "fault.rows", now, 40_000)
        reply = OtlpHttpClient("127.0.0.1", port).post(request.SerializeToString())
        assert reply.status == 200
        rejected, message = reply.partial_success()
        assert rejected > 0 and "rows" in message
        # The costliest shape to decode: empty exponential-histogram points, 2 bytes each on the wire.
        request = _request("dense")
        dense = request.resource_metrics[0].scope_metrics[0].metrics.add(name="fault.dense")
        dense.exponential_histogram.ParseFromString(b"\x0a\x00" * 400_000)
        reply = OtlpHttpClient("127.0.0.1", port).post(request.SerializeToString(), compress=True)
        assert reply.status == 200 and reply.partial_success()[0] == 400_000
        peak = _rss_kib(process.pid, "VmHWM")
    growth = peak - baseline
    assert growth <= _memory_bound_kib(config), f"peak RSS grew {growth} KiB over {baseline} KiB"


def _strings_request(model: str, now: int, text: str) -> ExportMetricsServiceRequest:
    """Seven points, each carrying ``text`` in another string of the OTLP data model."""
    request = _request(model)
    metrics = request.resource_metrics[0].scope_metrics[0].metrics
    for field in ("name", "description", "unit"):
        metric = metrics.add(name="fault.ok")
        setattr(metric, field, text)
        metric.gauge.data_points.add(time_unix_nano=now, as_double=1.0)
    keyed = metrics.add(name="fault.key").gauge.data_points.add(time_unix_nano=now, as_double=1.0)
    keyed.attributes.add(key=text, value=AnyValue(int_value=1))
    valued = metrics.add(name="fault.value").gauge.data_points.add(time_unix_nano=now, as_double=1.0)
    valued.attributes.add(key="k", value=AnyValue(string_value=text))
    for field in ("name", "version"):
        scoped = request.resource_metrics[0].scope_metrics.add()
        setattr(scoped.scope, field, text)
        scoped.metrics.add(name="fault.scope").gauge.data_points.add(time_unix_nano=now, as_double=1.0)
    return request


def test_every_otlp_string_is_capped(make_collector):
    collector = make_collector(limits=Limits(max_body_bytes=32 * 1024**2, max_decompressed_bytes=64 * 1024**2))
    model, now = _model("strings"), time.time_ns()
    # Over each string's cap: rejected one by one when decoded, each with its reason.
    reply = _post(collector, _strings_request(model, now, "z" * 20_000).SerializeToString())
    assert reply.status == 200
    rejected, message = reply.partial_success()
    assert rejected == 7
    for phrase in ("metric name", "description", "unit", "attribute key", "attribute value", "scope name", "version"):
        assert phrase in message, (phrase, message)
    # 4 MiB strings: left out before decoding (the piece that would hold them is capped).
    reply = _post(collector, _strings_request(model, now, "z" * (4 * 1024**2)).SerializeToString(), compress=True)
    assert reply.status == 200
    rejected, message = reply.partial_success()
    assert rejected == 7
    for phrase in ("metric (name, description, unit", "scope (name, version", "data point (attributes"):
        assert phrase in message, (phrase, message)
    assert collector.wait_stored(20)
    stored = "SELECT count() FROM otel_metrics_gauge WHERE ResourceAttributes['witcert.model'] = {m:String}"
    assert _count(collector, stored, model) == 0


# --- 4. connections: idle, slow, oversized; health while saturated -----------------------------


def test_idle_and_slow_connections_lock_nobody_out(make_collector):
    limits = Limits(header_timeout_s=2.0, body_timeout_s=3.0)
    collector = make_collector(limits=limits)
    port = collector.ports.http
    idle, slow = [], []
    try:
        for _ in range(260):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(b"POST /v1/metrics HTTP/1.1\r\nX-Trickle: ")  # headers that never end
            idle.append(sock)
        for _ in range(16):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(
                b"POST /v1/metrics HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                b"Content-Length: %d\r\n\r\nabc" % (16 * 1024**2)
            )
            slow.append(sock)
        began = time.monotonic()
        assert _get(collector, "/healthz", timeout=3)[0] == 200
        status, body = _get(collector, "/readyz", timeout=3)
        assert status == 200, body
        model = _model("fresh")
        request = _request(model)
        _add_sample(request, time.time_ns(), step=1)
        assert _post(collector, request.SerializeToString()).status == 200
        assert time.monotonic() - began < 3
        # The server closes what never completes its headers or its body, however it trickles in:
        # a byte on every idle connection each 0.5 s, well within the header timeout between bytes.
        until = time.monotonic() + limits.body_timeout_s + 1.5
        while time.monotonic() < until:
            for sock in idle:
                try:
                    sock.send(b"a")
                except OSError:  # closed by the server
                    pass
            time.sleep(0.5)
        for sock in idle + slow:
            sock.settimeout(2)
            try:
                data = sock.recv(4096)
            except (ConnectionResetError, TimeoutError) as error:
                data = error
            assert data == b"" or isinstance(data, ConnectionResetError) or data.startswith(b"HTTP/1.1 408"), data
    finally:
        for sock in idle + slow:
            sock.close()


def test_connections_beyond_the_cap_get_a_503_they_can_read(make_collector):
    collector = make_collector(limits=Limits(max_connections=16))
    held = [socket.create_connection(("127.0.0.1", collector.ports.http), timeout=5) for _ in range(20)]
    try:
        time.sleep(0.2)  # the server has taken them
        request = _request(_model("crowd"))
        _add_sample(request, time.time_ns(), step=1)
        reply = _post(collector, request.SerializeToString())
        assert reply.status == 503 and reply.headers.get("retry-after")
        assert "too many open connections" in json.loads(reply.body)["message"]
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)
    assert _post(collector, request.SerializeToString()).status == 200


def test_a_body_over_the_limit_gets_a_413_the_client_can_read(make_collector):
    collector = make_collector(limits=Limits(max_body_bytes=256 * 1024))
    request = urllib.request.Request(
        _url(collector, "/v1/metrics"), data=b"\0" * (8 * 1024**2), headers={"Content-Type": "application/x-protobuf"}
    )
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(request, timeout=10)
    with error.value:
        assert error.value.code == 413
        assert "exceeds" in status_pb2.Status.FromString(error.value.read()).message


def test_health_answers_while_ingest_is_saturated(make_collector):
    collector = make_collector(limits=Limits(ingest_workers=1, max_queued_requests=1))
    body = samples_request("busy", "n", 32, 32, range(32), time_ns=time.time_ns()).SerializeToString()
    stop = threading.Event()
    statuses: list[int] = []

    def load() -> None:
        client = OtlpHttpClient("127.0.0.1", collector.ports.http)
        while not stop.is_set():
            statuses.append(client.post(body, headers={"X-Variant": str(uuid.uuid4())}).status)
        client.close()

    threads = [threading.Thread(target=load) for _ in range(6)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(0.5)
        for path in ("/healthz", "/readyz"):
            began = time.monotonic()
            assert _get(collector, path, timeout=5)[0] == 200
            assert time.monotonic() - began < 1.0
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert 503 in statuses, "with one worker and six clients, some requests must be shed"
    assert set(statuses) <= {200, 503}


# --- 5. the store down at start -----------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_an_unreachable_clickhouse_at_start_listens_spools_and_says_why(tmp_path):
    store = f"clickhouse://default@127.0.0.1:{_free_port()}/default"
    with _collector_process(tmp_path, CollectorConfig(), store=store) as (process, port):
        idle_bytes = _rss_kib(process.pid, "VmRSS") * 1024
        url = f"http://127.0.0.1:{port}"
        with pytest.raises(urllib.error.HTTPError) as not_ready:
            urllib.request.urlopen(url + "/readyz", timeout=5)
        with not_ready.value:
            assert not_ready.value.code == 503
            assert "127.0.0.1" in json.loads(not_ready.value.read())["reason"]
        request = samples_request("down", "n", 1, 1, range(2), time_ns=time.time_ns()).SerializeToString()
        assert OtlpHttpClient("127.0.0.1", port).post(request).status == 200
        with urllib.request.urlopen(url + "/healthz", timeout=5) as response:
            assert response.status == 200
    # The Kubernetes manifest runs this process (with gRPC): its limit holds the idle process and
    # the most the default settings let its work hold.
    manifest = Path(__file__).parents[1] / "deploy/kubernetes/collector.yaml"
    (statefulset,) = [d for d in yaml.safe_load_all(manifest.read_text()) if d["kind"] == "StatefulSet"]
    limit = statefulset["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"]
    assert limit.endswith("Gi")
    assert idle_bytes + CollectorConfig().working_memory_bytes() <= float(limit[:-2]) * 1024**3


def test_a_busy_chdb_store_at_start_is_drained_once_it_is_free(make_collector, store_url, tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys\nfrom witcert.collector.store import Store\n"
            f"s = Store({store_url!r})\nprint('held', flush=True)\nsys.stdin.read()\ns.close()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        collector = make_collector("waiting")
        status, body = _get(collector, "/readyz")
        assert status == 503 and "in use by another process" in json.loads(body)["reason"]
        model = _model("busy")
        request = _request(model)
        _add_sample(request, time.time_ns(), step=7)
        assert _post(collector, request.SerializeToString()).status == 200
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert collector.wait_stored(30), "the spool was not drained once the store was free"
    assert _samples(collector, model) == 1
    assert _get(collector, "/readyz")[0] == 200


# --- 6, 7, 8. input that used to give 500 or be acknowledged then dropped -----------------------


def test_unicode_digits_are_rejected_with_a_reason_never_a_500(make_collector):
    collector = make_collector()
    model, now = _model("digits"), time.time_ns()
    request = _request(model)
    _add_sample(request, now, step=1, layer="²")
    _add_sample(request, now, step=2, head="٣")
    _add_sample(request, now, step="¹")
    _add_sample(request, now, step=3, layer="4")  # ASCII digits as text are fine
    reply = _post(collector, request.SerializeToString())
    assert reply.status == 200
    assert reply.partial_success()[0] == 3
    ranked = _request(model)
    ranked.resource_metrics[0].resource.attributes[2].value.string_value = "²"
    _add_sample(ranked, now, step=4)
    reply = _post(collector, ranked.SerializeToString())
    assert reply.status == 200
    rejected, message = reply.partial_success()
    assert rejected == 1 and "tp_rank" in message
    assert collector.wait_stored(20)
    assert _samples(collector, model) == 1
    for query in ("limit=²", "layer=²", "from=-²h", "interval=²"):
        status, body = _get(collector, f"/api/v1/samples?{urllib.parse.quote(query, safe='=')}")
        assert status == 400 and json.loads(body)["error"], query
    with socket.create_connection(("127.0.0.1", collector.ports.http), timeout=5) as sock:
        sock.sendall("POST /v1/metrics HTTP/1.1\r\nHost: x\r\nContent-Length: ²\r\n\r\n".encode())
        assert sock.recv(4096).split(b"\r\n")[0].endswith(b" 400 Bad Request")


def test_timestamps_outside_retention_and_skew_are_rejected_with_the_reason(make_collector):
    collector = make_collector(limits=Limits(max_future_skew_s=600))
    model, now = _model("time"), time.time_ns()
    year_ns = lambda year: int(datetime(year, 1, 1, tzinfo=UTC).timestamp() * 1e9)  # noqa: E731
    request = _request(model)
    for step, moment in enumerate((year_ns(2262) + 5 * DAY_NS, year_ns(2200), now + 3600 * 10**9, now - 31 * DAY_NS)):
        _add_sample(request, moment, step=step)
    _add_sample(request, now, step=99)
    gauge = request.resource_metrics[0].scope_metrics[0].metrics.add(name="fault.old").gauge
    gauge.data_points.add(time_unix_nano=now - 8 * DAY_NS, as_double=1.0)  # raw tables keep 7 days
    gauge.data_points.add(time_unix_nano=year_ns(2200), as_double=1.0)
    reply = _post(collector, request.SerializeToString())
    assert reply.status == 200
    rejected, message = reply.partial_success()
    assert rejected == 6
    assert "retention" in message and "future" in message
    assert collector.wait_stored(20)
    _, rows = collector.store.query(
        "SELECT Step FROM witcert_certificate_samples WHERE Model = {m:String}", {"m": model}
    )
    assert rows == [(99,)]


def test_otlp_json_trace_and_span_ids_are_hex(make_collector):
    collector = make_collector()
    model, now = _model("json"), time.time_ns()
    trace_id, span_id = "5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174"
    document = {
        "resourceMetrics": [
            {
                "resource": {"attributes": [{"key": ts.RESOURCE_MODEL, "value": {"stringValue": model}}]},
                "scopeMetrics": [
                    {
                        "metrics": [
                            {
                                "name": "fault.exemplar",
                                "gauge": {
                                    "dataPoints": [
                                        {
                                            "timeUnixNano": str(now),
                                            "asDouble": 1.5,
                                            "exemplars": [
                                                {
                                                    "timeUnixNano": str(now),
                                                    "asDouble": 1.5,
                                                    "traceId": trace_id,
                                                    "spanId": span_id,
                                                }
                                            ],
                                        }
                                    ]
                                },
                            }
                        ]
                    }
                ],
            }
        ]
    }
    reply = _post(collector, json.dumps(document).encode(), content_type="application/json")
    assert reply.status == 200, reply.body
    assert collector.wait_stored(20)
    _, rows = collector.store.query(
        "SELECT Exemplars.TraceId, Exemplars.SpanId FROM otel_metrics_gauge "
        "WHERE ResourceAttributes['witcert.model'] = {m:String}",
        {"m": model},
    )
    assert rows == [([trace_id], [span_id])]
    document["resourceMetrics"][0]["scopeMetrics"][0]["metrics"][0]["gauge"]["dataPoints"][0]["exemplars"][0][
        "traceId"
    ] = "not-hex"
    reply = _post(collector, json.dumps(document).encode(), content_type="application/json")
    assert reply.status == 400 and "traceId" in json.loads(reply.body)["message"]


def test_a_get_with_a_body_is_not_taken_for_a_second_request(make_collector):
    collector = make_collector()
    model = _model("smuggle")
    request = _request(model)
    _add_sample(request, time.time_ns(), step=1)
    inner = request.SerializeToString()
    smuggled = (
        b"POST /v1/metrics HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
        b"Content-Length: %d\r\n\r\n" % len(inner)
    ) + inner
    with socket.create_connection(("127.0.0.1", collector.ports.http), timeout=5) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(smuggled) + smuggled)
        sock.settimeout(1.0)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except TimeoutError:
            pass
    assert received.count(b"HTTP/1.1 ") == 1, received
    assert collector.wait_stored(20)
    assert _samples(collector, model) == 0


READ_API_CASES = [
    "from=0001-01-01",
    "to=9999-12-31T00:00:00",
    "from=yesterday",
    "from=-99999999999999d",
    "limit=0",
    "limit=-1",
    "limit=100001",
    "limit=1e3",
    "tau=nan",
    "tau=-1",
    "tau=inf",
    "interval=0",
    "layer=65535",
    "head=-5",
    "format=xml",
    "colour=blue",
    "model=" + "m" * 5000,
]


def test_every_read_api_parameter_is_validated_to_a_400_with_a_message(make_collector):
    collector = make_collector()
    for query in READ_API_CASES:
        status, body = _get(collector, f"/api/v1/samples?{query}")
        assert status == 400, (query, body)
        assert json.loads(body)["error"], query
    assert _get(collector, "/api/v1/samples?limit=5&from=-1h&layer=0")[0] == 200


# --- dead letters ---------------------------------------------------------------------------------


def test_a_batch_the_store_refuses_goes_to_dead_letters_and_is_replayed(make_collector, capsys):
    collector = make_collector("dead")
    collector.store.command("ALTER TABLE witcert_certificate_samples ADD CONSTRAINT fault_small CHECK Value < 10")
    try:
        model, now = _model("dead"), time.time_ns()
        refused = _request(model)
        _add_sample(refused, now, step=1, value=50.0)
        accepted = _request(model)
        _add_sample(accepted, now, step=2)
        assert _post(collector, refused.SerializeToString()).status == 200
        assert _post(collector, accepted.SerializeToString()).status == 200
        assert collector.wait_stored(20), "a refused batch blocked the ones behind it"
        assert _samples(collector, model) == 1
        status, body = _get(collector, "/readyz")
        report = json.loads(body)
        assert status == 200 and report["dead_letter"]["records"] == 1
        assert "VIOLATED_CONSTRAINT" in report["dead_letter"]["last_reason"]
        assert "witcert_collector_dead_letter_records 1" in _get(collector, "/metrics")[1]
        spool = str(collector.config.resolved_spool_dir())
        assert witcert_main(["dead-letter", "list", "--spool", spool]) == 0
        listing = capsys.readouterr().out
        assert "VIOLATED_CONSTRAINT" in listing and "witcert_certificate_samples" in listing
        assert witcert_main(["dead-letter", "list", "--spool", spool, "--format", "json"]) == 0
        (letter,) = json.loads(capsys.readouterr().out)
        assert witcert_main(["dead-letter", "show", letter["name"], "--spool", spool]) == 0
        rows = json.loads(capsys.readouterr().out)[letter["name"]]["witcert_certificate_samples"]
        assert (rows["Model"], rows["Step"], rows["Value"]) == ([model], [1], [50.0])
    finally:
        collector.store.command("ALTER TABLE witcert_certificate_samples DROP CONSTRAINT fault_small")
    assert witcert_main(["dead-letter", "replay", "--spool", spool]) == 0
    deadline = time.monotonic() + 20
    while _samples(collector, model) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _samples(collector, model) == 2
    assert json.loads(_get(collector, "/readyz")[1])["dead_letter"]["records"] == 0


@pytest.mark.slow
def test_soak_under_load_with_periodic_kills_keeps_rss_bounded(tmp_path):
    """Minutes of streaming with a kill -9 every ~20 s; RSS sampled every 0.5 s into rss.csv."""
    from test_collector_reliability import _assert_exactly_once, stream

    config = CollectorConfig(limits=MEMORY_LIMITS, batch_max_wait_s=0.2)
    model = _model("soak")
    acknowledged: set[int] = set()
    rejections: list[str] = []
    next_index = iter(range(10**9))
    samples: list[tuple[float, int, int]] = []
    began = time.monotonic()
    for round_index in range(9):
        with _collector_process(tmp_path, config, store=f"chdb://{tmp_path / 'soak-chdb'}") as (process, port):
            stop = threading.Event()
            threads = [
                threading.Thread(target=stream, args=(port, model, next_index, acknowledged, stop, rejections))
                for _ in range(2)
            ]
            for thread in threads:
                thread.start()
            until = time.monotonic() + 15 + 10 * ((round_index * 7919) % 10) / 10
            while time.monotonic() < until:
                samples.append((time.monotonic() - began, process.pid, _rss_kib(process.pid, "VmRSS")))
                time.sleep(0.5)
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
            stop.set()
            for thread in threads:
                thread.join()
    assert not rejections, rejections[:3]
    (tmp_path / "rss.csv").write_text("seconds,pid,rss_kib\n" + "".join(f"{t:.1f},{p},{r}\n" for t, p, r in samples))
    with _collector_process(tmp_path, config, store=f"chdb://{tmp_path / 'soak-chdb'}") as (process, port):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=10) as response:
                if json.loads(response.read())["spool_bytes"] == 0:
                    break
            time.sleep(0.2)
    reader = Store(f"chdb://{tmp_path / 'soak-chdb'}", migrate=False)
    try:
        _, rows = reader.query(
            "SELECT Step, count() FROM witcert_certificate_samples WHERE Model = {m:String} GROUP BY Step",
            {"m": model},
        )
    finally:
        reader.close()
    _assert_exactly_once(dict(rows), acknowledged)
    first = {pid: rss for _, pid, rss in reversed(samples)}
    growth = max(rss - first[pid] for _, pid, rss in samples)
    assert growth <= _memory_bound_kib(config), f"RSS grew {growth} KiB within one process (see rss.csv)"
