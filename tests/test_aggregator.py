"""CertificateAggregator against a plain-Python oracle of its documented semantics (docs/TELEMETRY.md).

The synthetic stream injects +inf, NaN, values exactly at tau, at 1 and at histogram bounds, padded
batch rows, fallbacks and repaired bytes; every count must match exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from witcert.integrations.telemetry import CertificateAggregator
from witcert.integrations.telemetry.aggregator import COUNTER_NAMES
from witcert.integrations.telemetry.schema import CERTIFICATE_BUCKETS

TAU = 0.05


@dataclass
class LayerCall:
    certificate: torch.Tensor  # float32 [B, H]
    fallback: torch.Tensor  # bool [B, H]
    repaired_bytes: torch.Tensor  # int64 [B, H]


@dataclass
class Step:
    layers: list[LayerCall]
    active_rows: int  # rows at or beyond this index are padding


def synthetic_stream(
    num_steps: int, num_layers: int, num_heads: int, batch: int, *, seed: int, padding: bool = True
) -> list[Step]:
    rng = np.random.default_rng(seed)
    special = np.array([np.float32(TAU), 1.0, 0.0, CERTIFICATE_BUCKETS[3], CERTIFICATE_BUCKETS[20]], dtype=np.float32)
    steps = []
    for _ in range(num_steps):
        layers = []
        for _ in range(num_layers):
            values = (10.0 ** rng.uniform(-7.0, 1.5, (batch, num_heads))).astype(np.float32)
            pick = rng.random((batch, num_heads))
            values = np.where(pick < 0.08, np.inf, values)
            values = np.where((pick >= 0.08) & (pick < 0.11), np.nan, values)
            values = np.where(
                (pick >= 0.11) & (pick < 0.2), special[rng.integers(0, len(special), values.shape)], values
            )
            if not steps:  # the first step is sampled: make sure it carries +inf and an all-NaN head
                values[:, 0], values[-1, -1] = np.nan, np.inf
            fallback = rng.random((batch, num_heads)) < 0.3
            repaired = np.where(fallback, rng.integers(1, 1 << 20, (batch, num_heads)), 0)
            layers.append(
                LayerCall(
                    torch.from_numpy(values), torch.from_numpy(fallback), torch.from_numpy(repaired.astype(np.int64))
                )
            )
        steps.append(Step(layers, int(rng.integers(0, batch + 1)) if padding and steps else batch))
    return steps


@dataclass
class Expected:
    counters: dict[str, np.ndarray]
    histogram_counts: np.ndarray
    histogram_sum: np.ndarray
    histogram_min: np.ndarray
    histogram_max: np.ndarray
    raw: list[tuple[int, int, int, float]]  # (layer, head, step, value) in write order


def oracle(steps: list[Step], num_layers: int, num_heads: int, stride: int) -> Expected:
    """The documented semantics, one certificate at a time."""
    bounds = np.array(CERTIFICATE_BUCKETS, dtype=np.float32)
    tau = np.float32(TAU)
    counters = {name: np.zeros((num_layers, num_heads), dtype=np.int64) for name in COUNTER_NAMES}
    hist = np.zeros((num_layers, num_heads, len(bounds) + 1), dtype=np.int64)
    hsum = np.zeros((num_layers, num_heads))
    hmin = np.full((num_layers, num_heads), np.inf)
    hmax = np.full((num_layers, num_heads), -np.inf)
    raw = []
    for step_index, step in enumerate(steps):
        sampled = step_index % stride == 0
        for layer, call in enumerate(step.layers):
            for head in range(num_heads):
                column = []
                for row in range(step.active_rows):
                    value = np.float32(call.certificate[row, head].item())
                    column.append(value)
                    counters["samples"][layer, head] += 1
                    counters["covered"][layer, head] += bool(value <= tau)
                    counters["vacuous"][layer, head] += bool(math.isfinite(value) and value >= 1.0)
                    counters["inf"][layer, head] += bool(value == np.inf)
                    counters["nan"][layer, head] += bool(math.isnan(value))
                    counters["fallbacks"][layer, head] += bool(call.fallback[row, head])
                    counters["repaired_bytes"][layer, head] += int(call.repaired_bytes[row, head])
                    if sampled and math.isfinite(value):
                        hist[layer, head, int((value > bounds).sum())] += 1
                        hsum[layer, head] += float(value)
                        hmin[layer, head] = min(hmin[layer, head], float(value))
                        hmax[layer, head] = max(hmax[layer, head], float(value))
                if sampled and column:
                    numbers = [float(v) for v in column if not math.isnan(v)]
                    worst = max(numbers) if numbers else math.nan
                    raw.append((layer, head, step_index, worst))
    return Expected(counters, hist, hsum, hmin, hmax, raw)


def run_stream(aggregator: CertificateAggregator, steps: list[Step]) -> None:
    for step in steps:
        active = torch.tensor(step.active_rows, device=aggregator.device)
        for layer, call in enumerate(step.layers):
            aggregator.observe(layer, call.certificate, call.fallback, call.repaired_bytes, active_rows=active)


def assert_matches(snapshot, expected: Expected, steps: int) -> None:
    assert snapshot.step == steps
    for name, array in expected.counters.items():
        np.testing.assert_array_equal(snapshot.counters()[name], array, err_msg=name)
    np.testing.assert_array_equal(snapshot.histogram_counts, expected.histogram_counts)
    np.testing.assert_allclose(snapshot.histogram_sum, expected.histogram_sum, rtol=1e-12)
    np.testing.assert_array_equal(snapshot.histogram_min, expected.histogram_min)
    np.testing.assert_array_equal(snapshot.histogram_max, expected.histogram_max)
    count = expected.histogram_counts.sum(-1)
    with np.errstate(invalid="ignore"):
        np.testing.assert_allclose(snapshot.finite_mean, expected.histogram_sum / count, rtol=1e-12)
    got = list(zip(snapshot.raw_layer, snapshot.raw_head, snapshot.raw_step, strict=True))
    assert got == [(layer, head, step) for layer, head, step, _ in expected.raw]
    np.testing.assert_array_equal(snapshot.raw_value, np.array([v for *_, v in expected.raw]))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_counts_histogram_and_raw_samples_are_exact(backend):
    # The Triton path runs in the interpreter here: a few launches only.
    num_steps, num_layers, num_heads, batch, stride = (20, 3, 4, 5, 3) if backend == "torch" else (7, 2, 3, 4, 3)
    steps = synthetic_stream(num_steps, num_layers, num_heads, batch, seed=1)
    aggregator = CertificateAggregator(num_layers, num_heads, tau=TAU, stride=stride, device="cpu", backend=backend)
    run_stream(aggregator, steps)
    expected = oracle(steps, num_layers, num_heads, stride)
    assert expected.counters["inf"].sum() > 0 and expected.counters["nan"].sum() > 0
    assert any(v == math.inf for *_, v in expected.raw) and any(math.isnan(v) for *_, v in expected.raw)
    assert_matches(aggregator.snapshot(), expected, num_steps)


def test_triton_and_torch_paths_agree_on_stacked_layers():
    steps = synthetic_stream(4, 3, 5, 3, seed=2)
    snapshots = []
    for backend in ("torch", "triton"):
        aggregator = CertificateAggregator(3, 5, tau=TAU, stride=2, device="cpu", backend=backend)
        for step in steps:
            aggregator.observe_layers(
                0,
                torch.stack([c.certificate for c in step.layers]),
                torch.stack([c.fallback for c in step.layers]),
                torch.stack([c.repaired_bytes for c in step.layers]),
                active_rows=torch.tensor(step.active_rows),
            )
        snapshots.append(aggregator.snapshot())
    assert_matches(snapshots[0], oracle(steps, 3, 5, 2), 4)
    assert_matches(snapshots[1], oracle(steps, 3, 5, 2), 4)


def test_stride_is_honoured_and_the_ring_keeps_the_newest_samples():
    num_layers, num_heads, stride = 2, 3, 4
    steps = synthetic_stream(17, num_layers, num_heads, 2, seed=3, padding=False)
    # Room for two sampled steps: five are sampled (0, 4, 8, 12, 16), the oldest three are overwritten.
    aggregator = CertificateAggregator(
        num_layers, num_heads, tau=TAU, stride=stride, device="cpu", ring_capacity=2 * num_layers * num_heads
    )
    run_stream(aggregator, steps)
    snapshot = aggregator.snapshot()
    assert snapshot.raw_written == 5 * num_layers * num_heads
    assert snapshot.raw_first_index == 3 * num_layers * num_heads
    assert sorted(set(snapshot.raw_step.tolist())) == [12, 16]
    assert (
        snapshot.histogram_count.sum()
        == np.isfinite(np.stack([[c.certificate.numpy() for c in steps[s].layers] for s in range(0, 17, stride)])).sum()
    )
    assert snapshot.samples.sum() == 17 * num_layers * num_heads * 2


def test_step_advances_at_step_layer_only():
    # A pipeline stage holding layers 2 and 3 of 4: its first layer starts each step.
    aggregator = CertificateAggregator(4, 2, tau=TAU, stride=2, device="cpu", step_layer=2)
    for _ in range(3):
        for layer in (2, 3):
            aggregator.observe(layer, torch.full((1, 2), 0.01))
    snapshot = aggregator.snapshot()
    assert snapshot.step == 3
    assert sorted(set(snapshot.raw_step.tolist())) == [0, 2]
    assert snapshot.samples[:2].sum() == 0 and (snapshot.samples[2:] == 3).all()


def test_restart_extrema_starts_a_new_interval_for_min_and_max_only():
    aggregator = CertificateAggregator(1, 1, tau=TAU, stride=1, device="cpu")
    aggregator.observe(0, torch.tensor([[0.5]]))
    aggregator.restart_extrema()
    aggregator.observe(0, torch.tensor([[0.25]]))
    aggregator.observe(0, torch.tensor([[0.125]]))
    snapshot = aggregator.snapshot()
    assert snapshot.histogram_min[0, 0] == 0.125 and snapshot.histogram_max[0, 0] == 0.25
    assert snapshot.histogram_count[0, 0] == 3 and snapshot.histogram_sum[0, 0] == 0.875


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tau": 1.0}, "tau must be in"),
        ({"tau": math.nan}, "tau must be in"),
        ({"tau": 0.0}, "tau must be in"),
        ({"stride": 0}, "stride"),
        ({"ring_capacity": 3}, "cannot hold one sampled step"),
        ({"step_layer": 2}, "step_layer"),
        ({"histogram_bounds": (1.0, 0.5)}, "strictly increasing"),
        ({"backend": "cuda"}, "backend"),
    ],
)
def test_bad_configuration_is_refused_clearly(kwargs, message):
    arguments = {"tau": TAU, "device": "cpu"} | kwargs
    with pytest.raises(ValueError, match=message):
        CertificateAggregator(2, 2, **arguments)


def test_bad_observations_are_refused_without_touching_the_counts():
    aggregator = CertificateAggregator(2, 3, tau=TAU, device="cpu")
    good = torch.full((2, 3), 0.01)
    bad_calls = [
        ((0, torch.zeros(2, 4)), ValueError, "heads"),
        ((2, good), ValueError, "outside"),
        ((-1, good), ValueError, "outside"),
        ((0, torch.zeros(2, 3, dtype=torch.int32)), TypeError, "floating-point"),
        ((0, torch.zeros(0, 3)), ValueError, "no rows"),
        ((0, torch.zeros(3)), ValueError, r"\[B, H_q\]"),
        ((0, good, torch.zeros(2, 2, dtype=torch.bool)), ValueError, "fallback"),
        ((0, good, None, torch.zeros(2, 3)), TypeError, "repaired_bytes"),
    ]
    for args, error, message in bad_calls:
        with pytest.raises(error, match=message):
            aggregator.observe(*args)
    with pytest.raises(ValueError, match="active_rows"):
        aggregator.observe(0, good, active_rows=torch.tensor(1.0))
    with pytest.raises(ValueError, match="must start at it"):
        CertificateAggregator(3, 3, tau=TAU, device="cpu", step_layer=1).observe_layers(0, torch.zeros(2, 1, 3))
    snapshot = aggregator.snapshot()
    assert snapshot.step == 0 and snapshot.samples.sum() == 0
