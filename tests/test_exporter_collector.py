"""Engine side to storage: aggregator -> TelemetryStream (SDK OTLP/HTTP exporter) -> collector -> chDB -> reports.

The same synthetic stream as tests/test_aggregator.py; the stored rollups and samples must equal the
oracle exactly, +inf included.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

from test_aggregator import TAU, oracle, run_stream, synthetic_stream

from witcert.collector.queries import Window
from witcert.integrations.telemetry import CertificateAggregator
from witcert.integrations.telemetry.exporter import EngineIdentity, TelemetryStream, otlp_http_exporter


def test_counts_and_samples_arrive_in_the_store_exactly(collector):
    num_steps, num_layers, num_heads, batch, stride = 24, 2, 3, 4, 4
    steps = synthetic_stream(num_steps, num_layers, num_heads, batch, seed=21)
    aggregator = CertificateAggregator(num_layers, num_heads, tau=TAU, stride=stride, device="cpu")
    identity = EngineIdentity(model="e2e-model", engine="synthetic", instance_id="engine-0")
    endpoint = f"http://127.0.0.1:{collector.ports.http}/v1/metrics"
    stream = TelemetryStream(aggregator, otlp_http_exporter(endpoint), identity, flush_steps=5)
    for step in steps:
        run_stream(aggregator, [step])
        stream.poll()
    stream.close()
    assert stream.stats.points_dropped == 0 and stream.stats.export_failures == 0
    assert collector.wait_stored(30), "the collector did not store everything"
    expected = oracle(steps, num_layers, num_heads, stride)

    now = datetime.now(UTC)
    window = Window(start=now - timedelta(hours=1), end=now + timedelta(minutes=5), model="e2e-model", limit=1000)
    heatmap = {(row["layer"], row["head"]): row for row in collector.queries.run("heatmap", window).records()}
    assert len(heatmap) == num_layers * num_heads
    for (layer, head), row in heatmap.items():
        assert row["certificates"] == expected.counters["samples"][layer, head]
        assert row["covered"] == expected.counters["covered"][layer, head]
        assert row["vacuous"] == expected.counters["vacuous"][layer, head]
        assert row["infinite"] == expected.counters["inf"][layer, head]
        assert row["fallbacks"] == expected.counters["fallbacks"][layer, head]

    _, totals = collector.store.query(
        "SELECT sum(NaNs), sum(RepairedBytes), sumIf(Steps, Layer = 65535) FROM witcert_counts_1m "
        "WHERE Model = {m:String}",
        {"m": "e2e-model"},
    )
    assert totals == [
        (expected.counters["nan"].sum(), expected.counters["repaired_bytes"].sum(), num_steps),
    ]

    stored = sorted(
        (row["layer"], row["head"], row["step"], row["value"])
        for row in collector.queries.run("samples", window).records()
    )
    numbers = sorted(sample for sample in expected.raw if not math.isnan(sample[3]))
    assert stored == numbers
    assert any(value == math.inf for *_, value in stored)

    _, buckets = collector.store.query(
        "SELECT sum(Count) FROM witcert_buckets_1m WHERE Model = {m:String}", {"m": "e2e-model"}
    )
    assert buckets == [(expected.histogram_counts.sum(),)]
