"""End to end through real components: opentelemetry-sdk OTLP exporters -> collector -> chDB -> queries.

One collector (HTTP + gRPC, bearer token, small limits) serves the module; each test writes under
its own model name and reads back only that model, so the tests do not see each other's data.
"""

from __future__ import annotations

import gzip
import json
import math
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from datetime import UTC, datetime, timedelta

import grpc
import pytest
from google.protobuf import json_format
from google.rpc import status_pb2
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpExporter
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.sdk.metrics import Counter, Histogram, MeterProvider
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Metric,
    MetricExportResult,
    MetricsData,
    NumberDataPoint,
    PeriodicExportingMetricReader,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from witcert.cli import main as witcert_main
from witcert.collector.config import CollectorConfig, Limits
from witcert.collector.loadgen import OtlpHttpClient, samples_request
from witcert.collector.queries import Window
from witcert.collector.requests import ApiResponse, Route
from witcert.collector.service import Collector
from witcert.integrations.telemetry import schema as ts

TOKEN = "s3cret-token"
LIMITS = Limits(
    max_body_bytes=256 * 1024,
    max_decompressed_bytes=1024 * 1024,
    max_series_per_request=500,
    max_attributes_per_point=16,
)


@pytest.fixture(scope="module")
def collector(tmp_path_factory):
    root = tmp_path_factory.mktemp("collector")
    config = CollectorConfig(
        store_url=f"chdb://{root / 'chdb'}",
        spool_dir=root / "spool",
        otlp_http="127.0.0.1:0",
        otlp_grpc="127.0.0.1:0",
        token=TOKEN,
        limits=LIMITS,
        batch_max_wait_s=0.05,
    )
    page = Route("/page", lambda request: ApiResponse(200, "text/plain", f"rows at {request.path}".encode()))
    service = Collector(config, extra_routes=[page])
    service.start()
    yield service
    service.stop()


@pytest.fixture
def client(collector):
    http_client = OtlpHttpClient("127.0.0.1", collector.ports.http, token=TOKEN)
    yield http_client
    http_client.close()


def _model() -> str:
    return f"model-{uuid.uuid4().hex[:8]}"


def _window(model: str, **fields) -> Window:
    now = datetime.now(UTC)
    return Window(start=now - timedelta(hours=1), end=now + timedelta(minutes=5), model=model, **fields)


def _resource(model: str) -> Resource:
    return Resource(
        {
            ts.RESOURCE_SERVICE_NAME: "engine",
            ts.RESOURCE_INSTANCE: "node-0",
            ts.RESOURCE_MODEL: model,
            ts.RESOURCE_ENGINE: "test",
            ts.RESOURCE_TP_RANK: 0,
        }
    )


def _samples_data(model: str, values: list[float]) -> MetricsData:
    """Raw samples the way the engine side builds them: gauge points handed to the SDK exporter."""
    now = time.time_ns()
    points = [
        NumberDataPoint(
            attributes={ts.ATTR_LAYER: i % 4, ts.ATTR_HEAD: i // 4 % 8, ts.ATTR_STEP: i},
            start_time_unix_nano=now,
            time_unix_nano=now + i,
            value=value,
        )
        for i, value in enumerate(values)
    ]
    metric = Metric(ts.CERTIFICATE_SAMPLE, "sampled certificates", "1", Gauge(points))
    scope = ScopeMetrics(InstrumentationScope(ts.INSTRUMENTATION_SCOPE), [metric], None)
    return MetricsData([ResourceMetrics(_resource(model), [scope], None)])


def _drain(collector) -> None:
    assert collector.wait_stored(30), "the spool did not drain"


def test_sdk_http_exporter_end_to_end_exact_counts(collector):
    model = _model()
    exporter = HttpExporter(
        endpoint=f"http://127.0.0.1:{collector.ports.http}/v1/metrics",
        headers={"Authorization": f"Bearer {TOKEN}"},
        compression=Compression.Gzip,
        preferred_temporality={Counter: AggregationTemporality.DELTA, Histogram: AggregationTemporality.DELTA},
    )
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)
    view = View(
        instrument_name=ts.CERTIFICATE_VALUE,
        aggregation=ExplicitBucketHistogramAggregation(boundaries=ts.CERTIFICATE_BUCKETS),
    )
    provider = MeterProvider(metric_readers=[reader], resource=_resource(model), views=[view])
    meter = provider.get_meter(ts.INSTRUMENTATION_SCOPE)
    certificates = meter.create_counter(ts.CERTIFICATES)
    covered = meter.create_counter(ts.COVERED)
    fallbacks = meter.create_counter(ts.FALLBACKS)
    steps = meter.create_counter(ts.STEPS)
    values = meter.create_histogram(ts.CERTIFICATE_VALUE)
    for layer in range(3):
        for head in range(4):
            attributes = {ts.ATTR_LAYER: layer, ts.ATTR_HEAD: head}
            certificates.add(100, attributes)
            covered.add(90 + layer, attributes)
            fallbacks.add(head, attributes)
            for value in (0.001, 0.02, 0.5):
                values.record(value, attributes)
    steps.add(100)
    provider.force_flush()
    values_sent = [0.001 * i for i in range(40)] + [math.inf, 2.5]
    assert exporter.export(_samples_data(model, values_sent)) is MetricExportResult.SUCCESS
    provider.shutdown()
    _drain(collector)

    queries = collector.queries
    coverage = queries.run("coverage", _window(model)).records()
    assert sum(row["certificates"] for row in coverage) == 1200
    assert sum(row["covered"] for row in coverage) == 4 * (90 + 91 + 92)
    heatmap = {(r["layer"], r["head"]): r for r in queries.run("heatmap", _window(model)).records()}
    assert len(heatmap) == 12
    assert heatmap[(2, 3)]["coverage"] == pytest.approx(0.92)
    assert heatmap[(1, 2)]["fallbacks"] == 2
    worst = queries.run("worst-heads", _window(model, limit=4)).records()
    assert [row["layer"] for row in worst] == [0, 0, 0, 0]
    rate = queries.run("fallback-rate", _window(model)).records()
    assert sum(row["fallbacks"] for row in rate) == 3 * (0 + 1 + 2 + 3)

    samples = queries.run("samples", _window(model, limit=1000)).records()
    assert len(samples) == len(values_sent)
    assert sorted(row["step"] for row in samples) == list(range(len(values_sent)))
    assert sum(1 for row in samples if math.isinf(row["value"])) == 1
    at_tau = queries.run("coverage", _window(model, tau=0.01)).records()
    assert sum(row["samples"] for row in at_tau) == 42
    assert sum(row["covered"] for row in at_tau) == 11  # 0.000 .. 0.010 inclusive

    _, buckets = collector.store.query(
        "SELECT UpperBound, sum(Count) FROM witcert_buckets_1m WHERE Model = {m:String} GROUP BY UpperBound "
        "ORDER BY UpperBound",
        {"m": model},
    )
    # Bucket edges 10^(k/4): 0.001 sits on an edge; 0.02 is in (0.0178, 0.0316]; 0.5 in (0.316, 0.562].
    assert [count for _, count in buckets] == [12, 12, 12]
    assert buckets[0][0] == pytest.approx(10**-3)
    _, steps_rows = collector.store.query(
        "SELECT sum(Steps) FROM witcert_counts_1h WHERE Model = {m:String} AND Layer = 65535", {"m": model}
    )
    assert steps_rows == [(100,)]


def test_sdk_grpc_exporter_and_retry_is_not_double_counted(collector):
    model = _model()
    exporter = GrpcExporter(
        endpoint=f"127.0.0.1:{collector.ports.grpc}",
        insecure=True,
        headers={"authorization": f"Bearer {TOKEN}"},
        compression=grpc.Compression.Gzip,
    )
    data = _samples_data(model, [0.01] * 30)
    assert exporter.export(data) is MetricExportResult.SUCCESS
    # A client retry resends the very same request: acknowledged, stored once.
    assert exporter.export(data) is MetricExportResult.SUCCESS
    exporter.shutdown()
    _drain(collector)
    rows = collector.queries.run("samples", _window(model, limit=1000)).rows
    assert len(rows) == 30


def test_grpc_without_token_is_refused(collector):
    exporter = GrpcExporter(endpoint=f"127.0.0.1:{collector.ports.grpc}", insecure=True, timeout=5)
    assert exporter.export(_samples_data(_model(), [0.1])) is MetricExportResult.FAILURE
    exporter.shutdown()


def test_grpc_garbage_is_invalid_argument(collector):
    with grpc.insecure_channel(f"127.0.0.1:{collector.ports.grpc}") as channel:
        export = channel.unary_unary("/opentelemetry.proto.collector.metrics.v1.MetricsService/Export")
        with pytest.raises(grpc.RpcError) as error:
            export(b"\xff\xfe garbage", metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=10)
    assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "not a protobuf" in error.value.details()


def test_otlp_json_and_replayed_body(collector, client):
    model = _model()
    request = samples_request(model, "node-1", layers=2, heads=2, steps=range(5), time_ns=time.time_ns())
    body = json_format.MessageToJson(request).encode()
    first = client.post(body, content_type="application/json")
    assert first.status == 200, first.body
    assert json.loads(first.body) == {}
    assert client.post(body, content_type="application/json", compress=True).status == 200
    _drain(collector)
    assert len(collector.queries.run("samples", _window(model, limit=1000)).rows) == 20


def test_bad_points_get_partial_success_and_good_ones_are_stored(collector, client):
    model = _model()
    request = samples_request(model, "node-1", layers=1, heads=1, steps=range(4), time_ns=time.time_ns())
    points = request.resource_metrics[0].scope_metrics[0].metrics[0].gauge.data_points
    points[0].as_double = math.nan
    points[1].as_double = -0.5
    del points[2].attributes[0]  # no layer
    counter = request.resource_metrics[0].scope_metrics[0].metrics.add(name=ts.COVERED)
    counter.sum.aggregation_temporality = 1
    negative = counter.sum.data_points.add(time_unix_nano=time.time_ns(), as_double=-3)
    negative.attributes.add(key=ts.ATTR_LAYER, value=AnyValue(int_value=0))
    reply = client.post(request.SerializeToString())
    assert reply.status == 200
    rejected, message = reply.partial_success()
    assert rejected == 4
    assert "certificates are >= 0" in message and "layer, head" in message and "finite and >= 0" in message
    _drain(collector)
    rows = collector.queries.run("samples", _window(model, limit=10)).records()
    assert [row["step"] for row in rows] == [3]


def test_unknown_metric_is_stored_raw_not_typed(collector, client):
    model = _model()
    request = samples_request(model, "node-1", layers=1, heads=1, steps=range(1), time_ns=time.time_ns())
    metrics = request.resource_metrics[0].scope_metrics[0].metrics
    metrics[0].name = "vendor.custom.metric"
    assert client.post(request.SerializeToString()).status == 200
    _drain(collector)
    _, raw = collector.store.query(
        "SELECT count(), any(Attributes['layer']) FROM otel_metrics_gauge "
        "WHERE MetricName = 'vendor.custom.metric' AND ResourceAttributes['witcert.model'] = {m:String}",
        {"m": model},
    )
    assert raw == [(1, "0")]
    assert collector.queries.run("samples", _window(model)).rows == []


def test_attribute_flood_is_capped(collector, client):
    model = _model()
    request = samples_request(model, "node-1", layers=1, heads=1, steps=range(1), time_ns=time.time_ns())
    metric = request.resource_metrics[0].scope_metrics[0].metrics.add(name="flood.metric")
    now = time.time_ns()
    for i in range(LIMITS.max_series_per_request + 100):
        point = metric.gauge.data_points.add(time_unix_nano=now, as_double=1.0)
        point.attributes.add(key="request_id", value=AnyValue(string_value=str(i)))
    reply = client.post(request.SerializeToString(), compress=True)
    assert reply.status == 200
    rejected, message = reply.partial_success()
    assert rejected == 100
    assert "attribute sets" in message


def _raw_post(collector, body: bytes, headers: dict[str, str], path: str = "/v1/metrics"):
    request = urllib.request.Request(f"http://127.0.0.1:{collector.ports.http}{path}", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as error:
        with error:
            return error.code, error.read(), dict(error.headers)


def _gzip_bomb() -> bytes:
    return gzip.compress(b"\0" * (LIMITS.max_decompressed_bytes * 4), compresslevel=9)


AUTH = {"Authorization": f"Bearer {TOKEN}"}
PB = {"Content-Type": "application/x-protobuf", **AUTH}
VALID = samples_request("bad-input", "n", 1, 1, range(3), time_ns=1_700_000_000_000_000_000).SerializeToString()


@pytest.mark.parametrize(
    ("case", "body", "headers", "status", "phrase"),
    [
        ("garbage protobuf", b"\xff\xfe\x00garbage", PB, 400, "not a protobuf"),
        ("truncated protobuf", VALID[: len(VALID) // 2], PB, 400, "not a protobuf"),
        ("garbage json", b"{not json", {**PB, "Content-Type": "application/json"}, 400, "OTLP/JSON"),
        ("wrong content type", VALID, {**PB, "Content-Type": "text/plain"}, 415, "Content-Type"),
        ("unknown encoding", VALID, {**PB, "Content-Encoding": "br"}, 415, "Content-Encoding"),
        ("corrupt gzip", b"\x1f\x8b\x08\x00garbage", {**PB, "Content-Encoding": "gzip"}, 400, "gzip"),
        ("truncated gzip", gzip.compress(VALID)[:-12], {**PB, "Content-Encoding": "gzip"}, 400, "gzip"),
        ("gzip bomb", _gzip_bomb(), {**PB, "Content-Encoding": "gzip"}, 413, "decompressed"),
        ("body over the limit", b"\0" * (LIMITS.max_body_bytes + 1), PB, 413, "exceeds"),
        ("no token", VALID, {"Content-Type": "application/x-protobuf"}, 401, "bearer token"),
        ("wrong token", VALID, {**PB, "Authorization": "Bearer nope"}, 401, "bearer token"),
    ],
)
def test_bad_input_gets_a_clear_4xx_and_the_service_stays_up(collector, case, body, headers, status, phrase):
    code, payload, reply_headers = _raw_post(collector, body, headers)
    assert code == status, (case, payload)
    # Errors come as google.rpc.Status in the request's encoding (JSON when that was unusable).
    if reply_headers["Content-Type"] == "application/x-protobuf":
        message = status_pb2.Status.FromString(payload).message
    else:
        message = json.loads(payload)["message"]
    assert phrase in message
    assert _raw_post(collector, VALID, PB)[0] == 200
    with urllib.request.urlopen(f"http://127.0.0.1:{collector.ports.http}/healthz", timeout=5) as response:
        assert response.status == 200


def test_wrong_path_and_method(collector):
    assert _raw_post(collector, VALID, PB, path="/v1/traces")[0] == 404
    request = urllib.request.Request(f"http://127.0.0.1:{collector.ports.http}/v1/metrics", method="PUT", headers=AUTH)
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(request, timeout=5)
    with error.value:
        assert error.value.code == 405


def _get(collector, path: str, token: str | None = TOKEN):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(f"http://127.0.0.1:{collector.ports.http}{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode(), response.headers.get("Content-Type")
    except urllib.error.HTTPError as error:
        with error:
            return error.code, error.read().decode(), error.headers.get("Content-Type")


def test_read_api_json_csv_errors_and_mounted_route(collector, client):
    model = _model()
    request = samples_request(model, "node-7", layers=2, heads=3, steps=range(4), time_ns=time.time_ns(), inf_every=5)
    assert client.post(request.SerializeToString()).status == 200
    _drain(collector)
    # Steps are stamped 20 ms apart from now: the window must reach past now.
    until = urllib.parse.quote((datetime.now(UTC) + timedelta(minutes=5)).isoformat())
    status, body, content_type = _get(collector, f"/api/v1/samples?model={model}&limit=100&from=-10m&to={until}")
    assert status == 200 and content_type == "application/json"
    rows = json.loads(body)["rows"]
    assert len(rows) == 24
    assert sum(1 for row in rows if row["value"] == "inf") == 4
    query = f"model={model}&tau=0.002&format=csv&from=-10m&to={until}"
    status, body, content_type = _get(collector, f"/api/v1/heatmap?{query}")
    assert status == 200 and content_type.startswith("text/csv")
    lines = body.strip().splitlines()
    assert lines[0].startswith("layer,head,samples,covered,coverage")
    assert len(lines) == 1 + 6
    assert _get(collector, "/api/v1/samples?tau=abc")[0] == 400
    assert "unknown report" in _get(collector, "/api/v1/nope")[1]
    assert _get(collector, "/api/v1/samples", token=None)[0] == 401
    assert _get(collector, "/page/x") == (200, "rows at /page/x", "text/plain")
    assert _get(collector, "/readyz", token=None)[0] == 200


def test_query_cli_through_the_api(collector, client, capsys, tmp_path):
    model = _model()
    request = samples_request(model, "node-3", layers=1, heads=2, steps=range(3), time_ns=time.time_ns())
    assert client.post(request.SerializeToString()).status == 200
    _drain(collector)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    url = f"http://127.0.0.1:{collector.ports.http}"
    until = (datetime.now(UTC) + timedelta(minutes=5)).isoformat()
    argv = ["query", "samples", "--url", url, "--token-file", str(token_file), "--model", model, "--to", until]
    argv += ["--format", "csv"]
    assert witcert_main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "time,model,instance,tp_rank,layer,head,step,value"
    assert len(lines) == 7
    argv = ["query", "worst-heads", "--url", url, "--token-file", str(token_file), "--model", model, "--tau", "0.05"]
    argv += ["--to", until]
    assert witcert_main([*argv, "--format", "json"]) == 0
    assert [row["head"] for row in json.loads(capsys.readouterr().out)["rows"]] == [0, 1]
    assert witcert_main(argv) == 0
    assert "worst-heads" in capsys.readouterr().out  # the table's title
    assert witcert_main(["query", "samples", "--url", url, "--model", model]) == 1
    assert "401" in capsys.readouterr().err


def test_parse_otlp_json_with_string_int64(collector, client):
    """OTLP/JSON encodes 64-bit integers as strings; both forms must be read."""
    model = _model()
    now = time.time_ns()
    document = {
        "resourceMetrics": [
            {
                "resource": {"attributes": [{"key": ts.RESOURCE_MODEL, "value": {"stringValue": model}}]},
                "scopeMetrics": [
                    {
                        "metrics": [
                            {
                                "name": ts.CERTIFICATE_SAMPLE,
                                "gauge": {
                                    "dataPoints": [
                                        {
                                            "timeUnixNano": str(now),
                                            "asDouble": 0.25,
                                            "attributes": [
                                                {"key": "layer", "value": {"intValue": "1"}},
                                                {"key": "head", "value": {"intValue": 2}},
                                                {"key": "step", "value": {"intValue": "99"}},
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
    assert json_format.Parse(json.dumps(document), ExportMetricsServiceRequest())
    reply = client.post(json.dumps(document).encode(), content_type="application/json")
    assert reply.status == 200, reply.body
    _drain(collector)
    rows = collector.queries.run("samples", _window(model)).records()
    assert [(row["layer"], row["head"], row["step"], row["value"]) for row in rows] == [(1, 2, 99, 0.25)]
