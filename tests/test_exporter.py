"""TelemetryStream end to end: aggregator -> opentelemetry-sdk OTLP/HTTP exporter -> a real HTTP receiver.

The receiver decodes ``ExportMetricsServiceRequest`` with opentelemetry-proto; the sums over all
received delta points must equal the oracle exactly.
"""

from __future__ import annotations

import collections
import gzip
import math
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.metrics.v1.metrics_pb2 import AggregationTemporality
from test_aggregator import TAU, oracle, run_stream, synthetic_stream

from witcert.integrations.telemetry import CertificateAggregator, schema
from witcert.integrations.telemetry.exporter import COUNTER_METRICS, EngineIdentity, TelemetryStream, otlp_http_exporter

IDENTITY = EngineIdentity(model="test-model", engine="synthetic", instance_id="test-0")


class OTLPReceiver:
    """A minimal OTLP/HTTP metrics endpoint: stores every decoded request, answers 200 (or ``status``)."""

    def __init__(self, port: int = 0) -> None:
        self.requests: list[ExportMetricsServiceRequest] = []
        self.status = 200
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportMetricsServiceRequest()
                request.ParseFromString(body)
                if receiver.status == 200:
                    receiver.requests.append(request)
                reply = ExportMetricsServiceResponse().SerializeToString()
                self.send_response(receiver.status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1/metrics"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def metrics(self):
        for request in self.requests:
            for resource_metrics in request.resource_metrics:
                for scope_metrics in resource_metrics.scope_metrics:
                    for metric in scope_metrics.metrics:
                        yield resource_metrics.resource, metric

    def sums(self) -> dict[tuple[str, int, int], int]:
        """Per (metric, layer, head): the sum of every delta point received (layer = head = -1 when absent)."""
        totals: dict[tuple[str, int, int], int] = collections.defaultdict(int)
        for _, metric in self.metrics():
            if metric.WhichOneof("data") != "sum":
                continue
            assert metric.sum.aggregation_temporality == AggregationTemporality.AGGREGATION_TEMPORALITY_DELTA
            assert metric.sum.is_monotonic
            for point in metric.sum.data_points:
                attributes = {a.key: a.value.int_value for a in point.attributes}
                totals[metric.name, attributes.get("layer", -1), attributes.get("head", -1)] += point.as_int
        return totals

    def raw_samples(self) -> list[tuple[int, int, int, float]]:
        samples = []
        for _, metric in self.metrics():
            if metric.name == schema.CERTIFICATE_SAMPLE:
                for point in metric.gauge.data_points:
                    attributes = {a.key: a.value.int_value for a in point.attributes}
                    samples.append((attributes["layer"], attributes["head"], attributes["step"], point.as_double))
        return samples


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until_built(stream: TelemetryStream, timeout_s: float = 20.0) -> None:
    """Wait until the background thread has built a batch from every flush started so far."""
    deadline = time.monotonic() + timeout_s
    while stream.stats.batches_built < stream.stats.flushes_started and time.monotonic() < deadline:
        time.sleep(0.001)


@pytest.fixture
def receiver():
    server = OTLPReceiver()
    yield server
    server.stop()


def test_stream_delivers_exact_counts_histograms_and_raw_samples(receiver):
    num_steps, num_layers, num_heads, batch, stride = 40, 3, 4, 5, 4
    steps = synthetic_stream(num_steps, num_layers, num_heads, batch, seed=7)
    aggregator = CertificateAggregator(num_layers, num_heads, tau=TAU, stride=stride, device="cpu")
    stream = TelemetryStream(aggregator, otlp_http_exporter(receiver.endpoint), IDENTITY, flush_steps=7)
    for step in steps:
        run_stream(aggregator, [step])
        stream.poll()
    stream.close()
    expected = oracle(steps, num_layers, num_heads, stride)

    assert stream.stats.batches_exported == len(receiver.requests) >= num_steps // 7
    assert stream.stats.points_dropped == 0 and stream.stats.export_failures == 0
    sums = receiver.sums()
    for name, (metric, _, _) in COUNTER_METRICS.items():
        for layer in range(num_layers):
            for head in range(num_heads):
                assert sums.get((metric, layer, head), 0) == expected.counters[name][layer, head], (metric, layer, head)
    assert sums[schema.STEPS, -1, -1] == num_steps
    assert (schema.DROPPED_POINTS, -1, -1) not in sums

    received = receiver.raw_samples()
    numbers = [s for s in expected.raw if not math.isnan(s[3])]  # all-NaN heads are counted, not sampled
    assert len(numbers) < len(expected.raw)
    assert received == numbers
    assert any(s[3] == math.inf for s in received)
    assert all(step % stride == 0 for _, _, step, _ in received)

    buckets = np.zeros_like(expected.histogram_counts)
    value_sum = np.zeros(expected.histogram_sum.shape)
    lowest = np.full(expected.histogram_min.shape, np.inf)
    for resource, metric in receiver.metrics():
        resource_attributes = {a.key: a.value for a in resource.attributes}
        assert resource_attributes[schema.RESOURCE_MODEL].string_value == "test-model"
        assert resource_attributes[schema.RESOURCE_TP_RANK].int_value == 0
        assert resource_attributes[schema.RESOURCE_INSTANCE].string_value == "test-0"
        if metric.name == schema.CERTIFICATE_VALUE:
            assert metric.histogram.aggregation_temporality == AggregationTemporality.AGGREGATION_TEMPORALITY_DELTA
            for point in metric.histogram.data_points:
                attributes = {a.key: a.value.int_value for a in point.attributes}
                cell = attributes["layer"], attributes["head"]
                assert list(point.explicit_bounds) == list(schema.CERTIFICATE_BUCKETS)
                assert point.count == sum(point.bucket_counts)
                buckets[cell] += np.array(point.bucket_counts, dtype=np.int64)
                value_sum[cell] += point.sum
                lowest[cell] = min(lowest[cell], point.min)
        if metric.name == schema.TAU:
            assert metric.gauge.data_points[0].as_double == pytest.approx(TAU)
    np.testing.assert_array_equal(buckets, expected.histogram_counts)
    np.testing.assert_allclose(value_sum, expected.histogram_sum, rtol=1e-12)
    np.testing.assert_array_equal(lowest, expected.histogram_min)


def test_exporter_down_drops_are_bounded_counted_and_reported_once_it_is_back():
    port = free_port()
    aggregator = CertificateAggregator(2, 2, tau=TAU, stride=1, device="cpu")
    stream = TelemetryStream(
        aggregator,
        otlp_http_exporter(f"http://127.0.0.1:{port}/v1/metrics", timeout_s=0.2),
        IDENTITY,
        flush_steps=1,
        max_buffered_points=60,  # a batch here carries 20 to 30 points: two fit, older ones are dropped
        retry_backoff_s=(0.01, 0.05),
    )
    steps = synthetic_stream(12, 2, 2, 1, seed=11, padding=False)
    deadline = time.monotonic() + 20
    for step in steps:
        run_stream(aggregator, [step])
        stream.poll()
        wait_until_built(stream)  # one batch per step: else a flush due while both buffers are busy is skipped
    while stream.stats.export_failures == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stream.stats.export_failures > 0 and stream.stats.batches_built == len(steps)
    assert stream.stats.batches_exported == 0 and stream.stats.points_dropped > 0

    receiver = OTLPReceiver(port)
    try:
        stream.close()
    finally:
        receiver.stop()
    sums = receiver.sums()
    assert sums[schema.DROPPED_POINTS, -1, -1] == stream.stats.points_dropped
    # The batches that survived arrive whole: the last one holds the final counts of every cell.
    expected = oracle(steps, 2, 2, 1)
    received_samples = sum(v for (metric, _, _), v in sums.items() if metric == schema.CERTIFICATES)
    assert 0 < received_samples < expected.counters["samples"].sum()
    assert stream.stats.points_exported + stream.stats.points_dropped == stream.stats.points_built


def test_raw_samples_overwritten_on_the_device_are_counted_as_dropped(receiver):
    num_layers, num_heads = 2, 3
    aggregator = CertificateAggregator(
        num_layers, num_heads, tau=TAU, stride=1, device="cpu", ring_capacity=num_layers * num_heads
    )
    stream = TelemetryStream(aggregator, otlp_http_exporter(receiver.endpoint), IDENTITY, flush_steps=5)
    steps = synthetic_stream(10, num_layers, num_heads, 2, seed=5, padding=False)
    for step in steps:
        run_stream(aggregator, [step])
        stream.poll()
        wait_until_built(stream)  # a flush skipped under load would move the batch boundaries
    stream.close()
    raw = receiver.raw_samples()
    assert sorted({step for _, _, step, _ in raw}) == [4, 9]  # the ring held one step at each flush
    assert receiver.sums()[schema.DROPPED_POINTS, -1, -1] == 8 * num_layers * num_heads


def test_every_layer_head_series_survives_beyond_the_sdk_default_cardinality_limit(receiver):
    num_layers, num_heads = 48, 48  # 2304 series per metric: above the SDK's default of 2000
    aggregator = CertificateAggregator(num_layers, num_heads, tau=TAU, stride=1, device="cpu")
    stream = TelemetryStream(aggregator, otlp_http_exporter(receiver.endpoint), IDENTITY)
    certificate = torch.full((1, num_heads), 0.01)
    for layer in range(num_layers):
        aggregator.observe(layer, certificate)
    stream.close()
    sums = receiver.sums()
    assert sum(1 for (metric, _, _) in sums if metric == schema.CERTIFICATES) == num_layers * num_heads
    assert all(sums[schema.COVERED, layer, head] == 1 for layer in range(num_layers) for head in range(num_heads))


def test_a_raising_exporter_never_reaches_the_engine():
    class BrokenExporter(OTLPMetricExporter):
        def export(self, metrics_data, timeout_millis=10_000, **kwargs):
            raise RuntimeError("exporter bug")

    aggregator = CertificateAggregator(1, 2, tau=TAU, device="cpu")
    stream = TelemetryStream(
        aggregator, BrokenExporter(endpoint="http://127.0.0.1:9/v1/metrics"), IDENTITY, flush_steps=1
    )
    for _ in range(3):
        aggregator.observe(0, torch.full((1, 2), 0.01))
        stream.poll()
    stream.close()
    assert stream.stats.export_failures >= 1 and stream.stats.batches_exported == 0
