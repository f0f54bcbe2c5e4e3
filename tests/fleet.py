"""A fleet of engines with known certificates, sent through the real pipeline, and the figures it must show.

Each engine runs a ``CertificateAggregator`` (torch backend, CPU) and a ``TelemetryStream`` whose
OTLP/HTTP exporter (the opentelemetry-sdk's) sends to a running witcert collector on chDB. Every
certificate is chosen: values just below, at and just above tau (0.05 as float32), at the histogram's
bucket edges (1e-3, 10^-1.5, 10^-1.25), vacuous (>= 1) and +inf. Engines decode four steps per
simulated minute over 75 minutes; a time-shifting wrapper around the exporter stamps each batch with
its simulated minute (the only thing not real: waiting 75 minutes).

- ``node-a/tp0`` and ``node-a/tp1``: one engine under tensor parallelism, heads 0-1 and 2-3 (global);
- ``node-b``: degraded 10 to 14 minutes ago (half its certificates above tau, some +inf), then healthy;
- ``node-c``: down for the last 30 minutes;
- ``node-d``: idle for the last 30 minutes, sending only its heartbeat.

``Fleet`` holds every certificate that was sent and computes each panel's figure from them directly
(float32 comparisons, as the engine makes them), independently of the SQL.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

import numpy as np
import torch
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData

from witcert.integrations.telemetry import CertificateAggregator, EngineIdentity, TelemetryStream, schema

MODEL = "fleet-model"
TAU = 0.05
LAYERS, HEADS, BATCH = 4, 2, 3  # heads per rank
STEPS_PER_MINUTE, STRIDE = 4, 2
MINUTES = 75
REPAIR_BYTES = 4096
F32_TAU = np.float32(TAU)
EDGE = {exponent: schema.CERTIFICATE_BUCKETS[schema.CERTIFICATE_BUCKETS.index(10.0 ** (exponent / 4))] for exponent in
        (-12, -6, -5)}  # fmt: skip
BELOW = np.array([0.0009, EDGE[-12], 0.0011, 0.0177, EDGE[-6], 0.0317, 0.0499, TAU], dtype=np.float32)
ABOVE = np.array([0.0501, EDGE[-5], 0.06, 0.3, 1.0, 2.5], dtype=np.float32)
BAD = np.array([0.0501, EDGE[-5], 0.07, 0.5, 1.0, np.inf], dtype=np.float32)


def _minute_start(moment: datetime) -> datetime:
    return moment.replace(second=0, microsecond=0)


# Queries are evaluated at NOW, 30 s into the current minute, so "the last 300 s" holds exactly the
# five newest minute buckets whatever the wall clock. Minute m's batches are stamped 10 s into it.
NOW = _minute_start(datetime.now(UTC)) + timedelta(seconds=30)


def minute_time(minutes_ago: int) -> datetime:
    return _minute_start(NOW) - timedelta(minutes=minutes_ago) + timedelta(seconds=10)


@dataclass(frozen=True)
class Engine:
    instance: str
    tp_rank: int
    busy: range  # minutes ago with decode steps
    idle: range = range(0)  # minutes ago with no decode, only heartbeats
    degraded: range = range(0)


FLEET = (
    Engine("node-a/tp0", 0, range(MINUTES)),
    Engine("node-a/tp1", 1, range(MINUTES)),
    Engine("node-b", 0, range(MINUTES), degraded=range(10, 15)),
    Engine("node-c", 0, range(31, MINUTES)),
    Engine("node-d", 0, range(31, MINUTES), idle=range(31)),
)
INSTANCES = tuple(engine.instance for engine in FLEET)


def certificates(engine: Engine, minute: int, step: int) -> np.ndarray:
    """The ``[L, B, H]`` float32 certificates of one step: mostly below tau, one in 256 above, more when degraded."""
    index = np.arange(LAYERS * BATCH * HEADS).reshape(LAYERS, BATCH, HEADS) + (step * 7 + engine.tp_rank * 3) * 97
    values = BELOW[index % len(BELOW)]
    if minute in engine.degraded:
        return np.where(index % 2 == 0, BAD[(index // 2) % len(BAD)], values)
    return np.where(index % 256 == 0, ABOVE[(index // 256) % len(ABOVE)], values)


@dataclass
class Record:
    """One decode step of one engine: where, when, and every certificate."""

    instance: str
    tp_rank: int
    minute: int
    step: int
    values: np.ndarray  # [L, B, H] float32

    @property
    def sampled(self) -> bool:
        return self.step % STRIDE == 0


class _ShiftedExporter(MetricExporter):
    """Forwards every batch to the real OTLP exporter, stamped at ``at`` (the simulated minute)."""

    def __init__(self, inner: OTLPMetricExporter) -> None:
        super().__init__()
        self.inner = inner
        self.at = NOW

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs) -> MetricExportResult:
        end = int(self.at.timestamp()) * 1_000_000_000
        start = end - 10_000_000_000

        def restamp(metric):
            points = [replace(p, start_time_unix_nano=start, time_unix_nano=end) for p in metric.data.data_points]
            return replace(metric, data=replace(metric.data, data_points=points))

        shifted = MetricsData(
            [
                replace(
                    rm, scope_metrics=[replace(sm, metrics=[restamp(m) for m in sm.metrics]) for sm in rm.scope_metrics]
                )
                for rm in metrics_data.resource_metrics
            ]
        )
        return self.inner.export(shifted, timeout_millis=timeout_millis)

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        self.inner.shutdown()


def _wait(stream: TelemetryStream, until, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not until():
        if time.monotonic() > deadline:
            raise TimeoutError(f"telemetry stream stuck: {stream.stats}")
        time.sleep(0.002)
    while stream.stats.batches_exported + stream.stats.export_failures < stream.stats.batches_built:
        if time.monotonic() > deadline:
            raise TimeoutError(f"telemetry stream stuck: {stream.stats}")
        time.sleep(0.002)
    assert stream.stats.export_failures == 0, stream.stats


def send(endpoint: str) -> list[Record]:
    """Run every engine of the fleet minute by minute; returns every step sent."""
    records: list[Record] = []
    for engine in FLEET:
        records.extend(_run(engine, endpoint))
    return records


def _run(engine: Engine, endpoint: str) -> list[Record]:
    aggregator = CertificateAggregator(LAYERS, HEADS, tau=TAU, stride=STRIDE, device="cpu", backend="torch")
    exporter = _ShiftedExporter(OTLPMetricExporter(endpoint=endpoint, timeout=30))
    identity = EngineIdentity(model=MODEL, engine="synthetic", tp_rank=engine.tp_rank, instance_id=engine.instance)
    stream = TelemetryStream(
        aggregator,
        exporter,
        identity,
        flush_steps=10**9,
        flush_seconds=1e9,
        heartbeat_seconds=0.05 if engine.idle else 1e9,
    )
    records, step = [], 0
    for minute in range(MINUTES - 1, -1, -1):
        if minute in engine.busy or minute in engine.idle:
            exporter.at = minute_time(minute)  # a down engine sends nothing: its last batch keeps its time
        if minute in engine.busy:
            for _ in range(STEPS_PER_MINUTE):
                values = certificates(engine, minute, step)
                certificate = torch.from_numpy(values)
                fallback = certificate > F32_TAU
                aggregator.observe_layers(0, certificate, fallback, fallback.to(torch.int64) * REPAIR_BYTES)
                records.append(Record(engine.instance, engine.tp_rank, minute, step, values))
                step += 1
            built = stream.stats.batches_built
            stream.flush()
            _wait(stream, lambda built=built: stream.stats.batches_built > built)
        elif minute in engine.idle:
            beats = stream.stats.heartbeats
            _wait(stream, lambda beats=beats: stream.stats.heartbeats > beats)
    stream.close()
    assert stream.stats.points_dropped == 0 and stream.stats.export_failures == 0
    return records


def _global_heads(record: Record) -> np.ndarray:
    return record.tp_rank * HEADS + np.arange(HEADS)


def quantile_high(values: Sequence[float], level: float) -> float:
    """The sampled value at rank floor(level x n) of the sorted values (ClickHouse's quantileExactHigh)."""
    ordered = sorted(values)
    return ordered[min(int(level * len(ordered)), len(ordered) - 1)]


def _bucket_bound(value: np.float32) -> float:
    """The upper bound of the histogram bucket holding a finite value: bucket i holds bounds[i-1] < v <= bounds[i]."""
    bounds = np.array(schema.CERTIFICATE_BUCKETS, dtype=np.float32)
    index = int((value > bounds).sum())
    return schema.CERTIFICATE_BUCKETS[index] if index < len(bounds) else math.inf


@dataclass
class Fleet:
    """Every certificate the fleet sent, and the exact figures computed from them."""

    records: list[Record] = field(default_factory=list)

    def select(self, instances: Iterable[str] = INSTANCES, minutes: Iterable[int] | None = None) -> list[Record]:
        chosen, window = set(instances), None if minutes is None else set(minutes)
        return [r for r in self.records if r.instance in chosen and (window is None or r.minute in window)]

    @staticmethod
    def coverage(records: list[Record]) -> float:
        values = np.concatenate([r.values.ravel() for r in records])
        return int((values <= F32_TAU).sum()) / values.size

    @staticmethod
    def count(records: list[Record], predicate) -> int:
        return int(sum(predicate(r.values).sum() for r in records))

    @staticmethod
    def by_cell(records: list[Record], reduce) -> dict[tuple[int, int], float]:
        """``reduce(values of one cell)`` per (layer, global head), over the given steps."""
        cells: dict[tuple[int, int], list[np.ndarray]] = {}
        for record in records:
            for layer in range(LAYERS):
                for local, head in enumerate(_global_heads(record)):
                    cells.setdefault((layer, int(head)), []).append(record.values[layer, :, local])
        return {cell: reduce(np.concatenate(parts)) for cell, parts in sorted(cells.items())}

    @staticmethod
    def samples(records: list[Record]) -> list[tuple[int, int, int, float]]:
        """The raw samples: (minute, layer, global head, max over the batch rows) of every sampled step."""
        return [
            (record.minute, layer, int(head), float(record.values[layer, :, local].max()))
            for record in records
            if record.sampled
            for layer in range(LAYERS)
            for local, head in enumerate(_global_heads(record))
        ]

    @staticmethod
    def coverage_interval(records: list[Record], tau: float) -> tuple[float, float]:
        """(at least, at most) of the coverage at ``tau`` from the sampled histogram, as the panels define it."""
        values = np.concatenate([r.values.ravel() for r in records])
        finite_share = 1 - int(np.isinf(values).sum() + np.isnan(values).sum()) / values.size
        sampled = np.concatenate([r.values.ravel() for r in records if r.sampled])
        bounds = [_bucket_bound(v) for v in sampled[np.isfinite(sampled)]]
        ceiling = next(b for b in (*schema.CERTIFICATE_BUCKETS, math.inf) if b >= tau)
        low = sum(b <= tau for b in bounds) / len(bounds)
        high = sum(b <= ceiling for b in bounds) / len(bounds)
        return finite_share * low, finite_share * high


def minutes_of(span: timedelta) -> range:
    """The minutes ago a query over [NOW - span, NOW] covers (minute buckets starting inside the range)."""
    return range(min(MINUTES, int(span.total_seconds() // 60)))


def minute_epoch(minutes_ago: int) -> int:
    """The time column of a per-minute row holding ``minutes_ago``."""
    return int((_minute_start(NOW) - timedelta(minutes=minutes_ago)).timestamp())


def _per_minute(records: list[Record], value) -> dict[int, list[Record]]:
    minutes: dict[int, list[Record]] = {}
    for record in records:
        minutes.setdefault(record.minute, []).append(record)
    return {minute_epoch(minute): value(group) for minute, group in sorted(minutes.items(), reverse=True)}


def expected_answer(fleet: Fleet, key: str, tau: str, instances: Sequence[str] = INSTANCES) -> list[tuple]:
    """Each panel's rows over the whole fleet history (a 2-hour range, minute buckets), computed from the
    certificates sent. Time columns are unix seconds; labels as the panels format them."""
    records = fleet.select(instances)
    sampled = [r for r in records if r.sampled]
    samples = Fleet.samples(records)
    total = lambda group: sum(r.values.size for r in group)  # noqa: E731
    infinite = lambda group: Fleet.count(group, np.isinf)  # noqa: E731
    fallbacks = lambda group: Fleet.count(group, lambda v: v > F32_TAU)  # noqa: E731
    if key == "coverage_now":
        return [(Fleet.coverage(records),)]
    if key == "engine_tau":
        return [(TAU, TAU, 1)]
    if key == "coverage_at_tau":
        if float(tau) == TAU:
            return [(Fleet.coverage(records), Fleet.coverage(records), 1)]
        return [(*Fleet.coverage_interval(records, float(tau)), 0)]
    if key == "largest_certificate":
        return [(max(value for *_, value in samples),)]
    if key == "fallback_now":
        return [(fallbacks(records) / total(records),)]
    if key == "inf_now":
        return [(infinite(records),)]
    if key == "coverage_overall":
        return [(t, c) for t, c in _per_minute(records, Fleet.coverage).items()]
    if key == "coverage_at_tau_over_time":
        exact = float(tau) == TAU
        rows = _per_minute(
            records,
            lambda group: (Fleet.coverage(group),) * 2 if exact else Fleet.coverage_interval(group, float(tau)),
        )
        return [(t, *interval) for t, interval in rows.items()]
    if key == "coverage_by_model":
        return [(t, MODEL, c) for t, c in _per_minute(records, Fleet.coverage).items()]
    if key == "coverage_by_layer":
        per_minute = _per_minute(
            records,
            lambda group: [
                Fleet.coverage([replace(r, values=r.values[layer]) for r in group]) for layer in range(LAYERS)
            ],
        )
        return [
            (t, f"layer {layer:03d}", covered[layer]) for t, covered in per_minute.items() for layer in range(LAYERS)
        ]
    if key == "coverage_heatmap":
        cells = Fleet.by_cell(records, lambda v: int((v <= F32_TAU).sum()) / v.size)
        return [(layer, head, value) for (layer, head), value in cells.items()]
    if key == "max_certificate_heatmap":
        cells = Fleet.by_cell(sampled, lambda v: float(v.max()))
        return [(layer, head, value) for (layer, head), value in cells.items()]
    if key == "certificate_quantiles":
        by_minute: dict[int, list[float]] = {}
        for minute, _, _, value in samples:
            by_minute.setdefault(minute_epoch(minute), []).append(value)
        return [
            (t, *(quantile_high(values, level) for level in (0.5, 0.9, 0.99)))
            for t, values in sorted(by_minute.items())
        ]
    if key == "vacuous_inf_fractions":
        return [
            (t, *fractions)
            for t, fractions in _per_minute(
                records,
                lambda g: (
                    Fleet.count(g, lambda v: np.isfinite(v) & (v >= 1)) / total(g),
                    infinite(g) / total(g),
                    Fleet.count(g, np.isnan) / total(g),
                ),
            ).items()
        ]
    if key == "fallback_rate":
        return [(t, MODEL, rate) for t, rate in _per_minute(records, lambda g: fallbacks(g) / total(g)).items()]
    if key == "repaired_bytes":
        return [(t, MODEL, b) for t, b in _per_minute(records, lambda g: fallbacks(g) * REPAIR_BYTES / 60).items()]
    if key == "samples_per_second":
        rows = []
        for instance in sorted(set(instances)):
            mine = [r for r in sampled if r.instance == instance]
            for t, rate in _per_minute(mine, lambda g: Fleet.count(g, np.isfinite) / 60).items():
                rows.append((t, instance, rate))
        return sorted(rows)
    if key == "dropped_points":
        return sorted({(minute_epoch(r.minute), r.instance, 0) for r in records})
    raise KeyError(key)
