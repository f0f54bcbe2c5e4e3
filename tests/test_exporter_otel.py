"""The engine-side stream speaks OpenTelemetry's language: identity from the SDK's resource detection
(stable across restarts, overridable from the environment), configuration from the SDK's exporter
variables, global head indices under tensor parallelism, and a heartbeat while the engine is idle.

The end-to-end cases run the real opentelemetry-sdk exporters (OTLP/HTTP and OTLP/gRPC) against a
running witcert collector on chDB that requires a bearer token.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import uuid

import pytest
import torch
from test_exporter import OTLPReceiver

from witcert.collector.config import CollectorConfig
from witcert.collector.service import Collector
from witcert.integrations.telemetry import (
    CertificateAggregator,
    EngineIdentity,
    TelemetryStream,
    otlp_http_exporter,
    schema,
)
from witcert.integrations.telemetry.exporter import (
    TelemetryConfigError,
    export_configured,
    export_interval_s,
    otlp_exporter,
)

TOKEN = "otel-env-token"
OTEL_VARIABLES = (
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
    "OTEL_EXPORTER_OTLP_HEADERS",
    "OTEL_EXPORTER_OTLP_METRICS_HEADERS",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL",
    "OTEL_EXPORTER_OTLP_COMPRESSION",
    "OTEL_EXPORTER_OTLP_METRICS_COMPRESSION",
    "OTEL_EXPORTER_OTLP_TIMEOUT",
    "OTEL_METRIC_EXPORT_INTERVAL",
    "WITCERT_COLLECTOR_ENDPOINT",
)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch):
    for name in OTEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)


# --- identity -----------------------------------------------------------------------------------------


def _resource(identity: EngineIdentity) -> dict:
    return dict(identity.resource().attributes)


def test_identity_is_the_sdks_detection_with_a_stable_uuid5_instance():
    attributes = _resource(EngineIdentity(model="qwen", engine="sglang", tp_rank=1, instance_key="30000/1"))
    assert attributes[schema.RESOURCE_SERVICE_NAME] == "witcert-engine"
    assert attributes[schema.RESOURCE_HOST_NAME] == socket.gethostname()
    assert attributes[schema.RESOURCE_MODEL] == "qwen" and attributes[schema.RESOURCE_TP_RANK] == 1
    instance = uuid.UUID(attributes[schema.RESOURCE_INSTANCE])
    assert instance.version == 5
    # Anything that tells two engines apart gives another id; the same engine always the same one.
    others = [
        EngineIdentity(model="qwen", engine="sglang", tp_rank=0, instance_key="30000/1"),
        EngineIdentity(model="llama", engine="sglang", tp_rank=1, instance_key="30000/1"),
        EngineIdentity(model="qwen", engine="sglang", tp_rank=1, instance_key="30001/1"),
    ]
    assert len({str(instance)} | {identity.instance for identity in others}) == 4
    assert EngineIdentity(model="qwen", engine="sglang", tp_rank=1, instance_key="30000/1").instance == str(instance)


def test_a_restarted_engine_reports_under_the_same_instance():
    program = (
        "from witcert.integrations.telemetry import EngineIdentity;"
        "print(EngineIdentity(model='m', engine='e', instance_key='k').instance)"
    )
    runs = [
        subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True).stdout.strip()
        for _ in range(2)
    ]
    assert runs[0] == runs[1] == EngineIdentity(model="m", engine="e", instance_key="k").instance


def test_otel_variables_override_the_detected_identity(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("OTEL_SERVICE_NAME", "checkout-llm")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.instance.id=rack7-gpu3,host.name=node-7,team=infra")
    attributes = _resource(EngineIdentity(model="m", engine="e", instance_id="from-code"))
    assert attributes[schema.RESOURCE_SERVICE_NAME] == "checkout-llm"
    assert attributes[schema.RESOURCE_INSTANCE] == "rack7-gpu3"
    assert attributes[schema.RESOURCE_HOST_NAME] == "node-7" and attributes["team"] == "infra"


def test_an_instance_id_in_code_replaces_the_derived_one():
    assert EngineIdentity(model="m", engine="e", instance_id="engine-a").instance == "engine-a"


# --- configuration --------------------------------------------------------------------------------------


def test_protocol_and_interval_variables_are_checked(monkeypatch: pytest.MonkeyPatch):
    assert not export_configured()
    assert export_interval_s() == 10.0
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "2500")
    assert export_interval_s() == 2.5
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "soon")
    with pytest.raises(TelemetryConfigError, match="OTEL_METRIC_EXPORT_INTERVAL='soon'"):
        export_interval_s()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(TelemetryConfigError, match="OTEL_EXPORTER_OTLP_PROTOCOL='http/json'"):
        otlp_exporter()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    assert export_configured()


def test_the_shorthand_endpoint_gets_the_metrics_path(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("WITCERT_COLLECTOR_ENDPOINT", "http://collector:4318")
    exporter = otlp_exporter()
    try:
        assert exporter._endpoint == "http://collector:4318/v1/metrics"
    finally:
        exporter.shutdown()


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("otel-env")
    config = CollectorConfig(
        store_url=f"chdb://{root / 'store'}",
        otlp_http="127.0.0.1:0",
        otlp_grpc="127.0.0.1:0",
        spool_dir=root / "spool",
        token=TOKEN,
    )
    with Collector(config) as running:
        yield running


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_a_stream_configured_by_environment_variables_alone_reaches_the_collector(
    collector: Collector, monkeypatch: pytest.MonkeyPatch, protocol: str
):
    port = collector.ports.grpc if protocol == "grpc" else collector.ports.http
    instance = f"env-{protocol.replace('/', '-')}"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"authorization=Bearer%20{TOKEN}")  # the collector requires it
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "10")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "50")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "checkout-llm")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", f"service.instance.id={instance}")

    aggregator = CertificateAggregator(2, 3, tau=0.05, stride=1, device="cpu")
    stream = TelemetryStream(aggregator, None, EngineIdentity(model="env-model", engine="synthetic"))
    assert stream.flush_seconds == 0.05
    certificates = torch.tensor([[0.01, 0.06, 0.04]]).expand(2, 1, 3).contiguous()
    for _ in range(6):
        aggregator.observe_layers(0, certificates)
        time.sleep(0.02)
        stream.poll()
    stream.close()
    assert stream.stats.export_failures == 0 and stream.stats.batches_exported > 1
    assert collector.wait_stored(30)

    _, rows = collector.store.query(
        f"SELECT sum(Certificates), sum(Covered) FROM witcert_counts_1m WHERE Instance = '{instance}'"
    )
    assert rows == [(2 * 3 * 6, 2 * 2 * 6)]
    _, names = collector.store.query(
        "SELECT DISTINCT ServiceName FROM otel_metrics_sum "
        f"WHERE ResourceAttributes['{schema.RESOURCE_INSTANCE}'] = '{instance}'"
    )
    assert names == [("checkout-llm",)]


# --- tensor parallelism and the heartbeat ---------------------------------------------------------------


@pytest.fixture
def receiver():
    server = OTLPReceiver()
    yield server
    server.stop()


def test_ranks_export_global_head_indices(receiver: OTLPReceiver):
    heads = 3
    for rank in (0, 1):
        aggregator = CertificateAggregator(1, heads, tau=0.05, stride=1, device="cpu")
        identity = EngineIdentity(model="tp-model", engine="synthetic", tp_rank=rank)
        stream = TelemetryStream(aggregator, otlp_http_exporter(receiver.endpoint), identity)
        aggregator.observe(0, torch.full((1, heads), 0.01))
        stream.close()
    counted = {head for (metric, _, head), _ in receiver.sums().items() if metric == schema.CERTIFICATES}
    assert counted == set(range(2 * heads))
    assert {head for _, head, _, _ in receiver.raw_samples()} == set(range(2 * heads))


def test_an_idle_engine_still_sends_a_heartbeat(receiver: OTLPReceiver):
    aggregator = CertificateAggregator(1, 2, tau=0.05, device="cpu")
    stream = TelemetryStream(
        aggregator,
        otlp_http_exporter(receiver.endpoint),
        EngineIdentity(model="idle", engine="synthetic"),
        heartbeat_seconds=0.1,
    )
    deadline = time.monotonic() + 20
    while len(receiver.requests) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)  # nothing decodes and nothing polls
    stream.close()
    assert stream.stats.heartbeats >= 3 and stream.stats.flushes_started == 0
    names = [
        [
            metric.name
            for resource in request.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
        ]
        for request in receiver.requests[:3]
    ]
    assert names == [[schema.TAU]] * 3
