"""The aggregator on a CUDA device: no host synchronisation, CUDA-graph capture equals eager, flushes stream.

Run on the H200 with ``python -m pytest -m gpu tests/test_aggregator_gpu.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_aggregator import TAU, assert_matches, oracle, synthetic_stream
from test_exporter import OTLPReceiver

from witcert.integrations.telemetry import CertificateAggregator
from witcert.integrations.telemetry.exporter import COUNTER_METRICS, EngineIdentity, TelemetryStream, otlp_http_exporter

pytestmark = pytest.mark.gpu

LAYERS, HEADS, BATCH, STRIDE = 28, 28, 16, 4


def device_stream(num_steps: int, seed: int):
    """Certificates, fallbacks, repaired bytes and active rows per step, as [L, B, H] CUDA tensors."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    for step in range(num_steps):
        value = torch.exp(torch.randn(LAYERS, BATCH, HEADS, device="cuda", generator=generator) * 4 - 6)
        pick = torch.rand(LAYERS, BATCH, HEADS, device="cuda", generator=generator)
        value = torch.where(pick < 0.05, torch.inf, torch.where(pick > 0.98, torch.nan, value))
        fallback = value > TAU
        repaired = torch.where(fallback, (pick * 4096).to(torch.int64), 0)
        active = torch.tensor(BATCH - step % 3, device="cuda")
        yield value, fallback, repaired, active


def observe_step(aggregator: CertificateAggregator, value, fallback, repaired, active) -> None:
    for layer in range(LAYERS):
        aggregator.observe(layer, value[layer], fallback[layer], repaired[layer], active_rows=active)


def test_observe_and_poll_never_synchronise_with_the_host():
    aggregator = CertificateAggregator(LAYERS, HEADS, tau=TAU, stride=STRIDE, device="cuda")
    receiver = OTLPReceiver()
    stream = TelemetryStream(
        aggregator, otlp_http_exporter(receiver.endpoint), EngineIdentity("m", "test"), flush_steps=5
    )
    inputs = list(device_stream(24, seed=1))
    observe_step(aggregator, *inputs[0])  # compiles the kernel outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in inputs[1:]:
            observe_step(aggregator, *step)
            aggregator.observe_layers(0, step[0], step[1], step[2], active_rows=step[3])
            stream.poll()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream.close()
    receiver.stop()
    snapshot = aggregator.snapshot()
    assert snapshot.step == 1 + 2 * 23
    sums = receiver.sums()
    for name, (metric, _, _) in COUNTER_METRICS.items():
        received = np.zeros((LAYERS, HEADS), dtype=np.int64)
        for (got_metric, layer, head), value in sums.items():
            if got_metric == metric:
                received[layer, head] = value
        np.testing.assert_array_equal(received, snapshot.counters()[name], err_msg=name)
    # A flush due while both host buffers are still being decoded is skipped, never waited for.
    assert stream.stats.flushes_started + stream.stats.flushes_skipped >= 4
    assert stream.stats.points_dropped == 0


def test_triton_on_the_device_matches_the_oracle():
    steps = synthetic_stream(9, 4, HEADS, 33, seed=4)  # 33 rows: more than one row block for some shapes
    aggregator = CertificateAggregator(4, HEADS, tau=TAU, stride=STRIDE, device="cuda")
    for step in steps:
        active = torch.tensor(step.active_rows, device="cuda")
        for layer, call in enumerate(step.layers):
            aggregator.observe(
                layer, call.certificate.cuda(), call.fallback.cuda(), call.repaired_bytes.cuda(), active_rows=active
            )
    assert_matches(aggregator.snapshot(), oracle(steps, 4, HEADS, STRIDE), 9)


@pytest.mark.parametrize("stacked", [False, True])
def test_cuda_graph_replays_count_exactly_like_eager(stacked):
    eager = CertificateAggregator(LAYERS, HEADS, tau=TAU, stride=STRIDE, device="cuda")
    graphed = CertificateAggregator(LAYERS, HEADS, tau=TAU, stride=STRIDE, device="cuda")
    static = [torch.zeros_like(t) for t in next(device_stream(1, seed=0))]

    def step(aggregator: CertificateAggregator) -> None:
        if stacked:
            aggregator.observe_layers(0, static[0], static[1], static[2], active_rows=static[3])
        else:
            observe_step(aggregator, *static)

    warmup = CertificateAggregator(LAYERS, HEADS, tau=TAU, stride=STRIDE, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(warmup)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(graphed)

    for inputs in device_stream(37, seed=2):
        for buffer, value in zip(static, inputs, strict=True):
            buffer.copy_(value)
        graph.replay()
        step(eager)
    got, want = graphed.snapshot(), eager.snapshot()
    assert got.step == want.step == 37
    for name, array in want.counters().items():
        np.testing.assert_array_equal(got.counters()[name], array, err_msg=name)
    np.testing.assert_array_equal(got.histogram_counts, want.histogram_counts)
    np.testing.assert_array_equal(got.raw_step, want.raw_step)
    np.testing.assert_array_equal(got.raw_value, want.raw_value)
    assert want.inf.sum() > 0 and want.nan.sum() > 0
    assert sorted(set(want.raw_step.tolist())) == list(range(0, 37, STRIDE))
