"""The OTLP stream: asynchronous flushes of a ``CertificateAggregator`` to an OpenTelemetry metric exporter.

The engine thread calls ``poll()`` once per decode step (outside CUDA-graph capture). Every
``flush_steps`` polls or ``flush_seconds`` it enqueues one device-to-host copy of the aggregator's
state into a pinned buffer and records an event; a later poll hands the buffer to a background thread
once the event has completed. The engine thread therefore never waits on the device, on the network
or on the background thread, and the background thread never calls CUDA (a call from another thread
could disturb a graph capture in the engine thread).

The background thread turns consecutive host copies into OTLP (docs/TELEMETRY.md lists every metric):

- per-(layer, head) counters: differences of the cumulative device counters, added to opentelemetry-sdk
  counters, collected with delta temporality (a View raises the cardinality limit to fit L x H);
- the histogram of sampled finite values: built as delta ``HistogramDataPoint`` s from the device's
  bucket counts (the SDK's histogram instrument can only re-bucket single values, and the device
  already bucketed every row);
- raw samples: gauge points built by hand with attributes layer, head and step, ``+inf`` kept (the
  SDK's instruments drop non-finite measurements); a sample that is NaN (every row of that head was
  NaN) is left out, since the ``nan`` counter already reports it and the collector refuses NaN samples.

Each flush becomes one batch; batches wait in a buffer bounded by ``max_buffered_points`` while the
exporter fails, are retried oldest first with exponential backoff, and are dropped oldest first when the
buffer is full. Dropped points (including raw samples overwritten on the device before a flush read
them) are counted and exported later as ``witcert.telemetry.dropped``.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import os
import queue
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from urllib.parse import urlsplit

import numpy as np
import torch
from grpc import Compression as GrpcCompression
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.sdk.environment_variables import (
    OTEL_EXPORTER_OTLP_COMPRESSION,
    OTEL_EXPORTER_OTLP_ENDPOINT,
    OTEL_EXPORTER_OTLP_METRICS_COMPRESSION,
    OTEL_EXPORTER_OTLP_METRICS_ENDPOINT,
    OTEL_EXPORTER_OTLP_METRICS_PROTOCOL,
    OTEL_EXPORTER_OTLP_PROTOCOL,
    OTEL_METRIC_EXPORT_INTERVAL,
)
from opentelemetry.sdk.metrics import Counter, MeterProvider
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricExporter,
    MetricExportResult,
    MetricReader,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.metrics.view import View
from opentelemetry.sdk.resources import OTELResourceDetector, Resource, get_aggregated_resources
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from witcert import __version__
from witcert.integrations.telemetry import schema
from witcert.integrations.telemetry.aggregator import AggregatorSnapshot, CertificateAggregator, decode_state
from witcert.integrations.telemetry.schema import dither_seed_text

_log = logging.getLogger(__name__)

# Aggregator counter name -> (OTLP metric name, unit, description).
COUNTER_METRICS: dict[str, tuple[str, str, str]] = {
    "samples": (schema.CERTIFICATES, "{certificate}", "Certificates computed (every step, every active row)"),
    "covered": (schema.COVERED, "{certificate}", "Certificates <= tau"),
    "vacuous": (schema.VACUOUS, "{certificate}", "Finite certificates >= 1: no guarantee"),
    "inf": (schema.INFINITE, "{certificate}", "Certificates equal to +inf (a valid, vacuous bound)"),
    "nan": (schema.NAN, "{certificate}", "NaN certificates: a kernel bug"),
    "fallbacks": (schema.FALLBACKS, "{head}", "Head-rows repaired from the exact K/V backup"),
    "repaired_bytes": (schema.REPAIRED_BYTES, "By", "Bytes paged in from the exact K/V backup"),
}


# OpenTelemetry's namespace for UUID v5 service.instance.id values derived from a stable identity (semconv).
SERVICE_INSTANCE_NAMESPACE = uuid.UUID("4d63009a-8d0f-11ee-aad7-4c796ed8e320")
DEFAULT_SERVICE_NAME = "witcert-engine"
DEFAULT_FLUSH_SECONDS = 10.0
# Environment variables of the OpenTelemetry SDK configuration and witcert's shorthand.
COLLECTOR_ENDPOINT_ENV = "WITCERT_COLLECTOR_ENDPOINT"
_ENDPOINT_ENVS = (COLLECTOR_ENDPOINT_ENV, OTEL_EXPORTER_OTLP_METRICS_ENDPOINT, OTEL_EXPORTER_OTLP_ENDPOINT)
_PROTOCOL_ENVS = (OTEL_EXPORTER_OTLP_METRICS_PROTOCOL, OTEL_EXPORTER_OTLP_PROTOCOL)
_COMPRESSION_ENVS = (OTEL_EXPORTER_OTLP_METRICS_COMPRESSION, OTEL_EXPORTER_OTLP_COMPRESSION)
PROTOCOLS = ("http/protobuf", "grpc")


class TelemetryConfigError(ValueError):
    """An OpenTelemetry or witcert telemetry variable has a value the stream cannot use."""


@dataclass(frozen=True)
class EngineIdentity:
    """Who is reporting: the OTLP resource of every batch, detected the OpenTelemetry way.

    ``service.name`` defaults to ``witcert-engine``; ``host.name`` (with ``host.id`` and ``host.arch``)
    comes from the SDK's host detector; ``service.instance.id`` is a UUID v5 in OpenTelemetry's
    namespace over the host, engine, model, ``instance_key`` (what tells apart engines of one model
    on one host, e.g. a port) and TP rank, so a restarted engine reports under the same id and each
    rank is a single writer of its own series. ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES``
    override any of them (the SDK's environment detector runs last); ``instance_id`` does in code.
    """

    model: str
    engine: str
    tp_rank: int = 0
    instance_key: str = ""
    instance_id: str | None = None
    service_name: str = DEFAULT_SERVICE_NAME
    # The pool's dither seed (docs/THEORY.md, section 2: the certificates' probability is over its draw).
    dither_seed: int | None = None

    @functools.cached_property
    def _resource(self) -> Resource:
        (host_detector,) = entry_points(group="opentelemetry_resource_detector", name="host")
        base = Resource(
            {
                schema.RESOURCE_SERVICE_NAME: self.service_name,
                schema.RESOURCE_SERVICE_VERSION: __version__,
                schema.RESOURCE_MODEL: self.model,
                schema.RESOURCE_ENGINE: self.engine,
                schema.RESOURCE_TP_RANK: self.tp_rank,
            }
            | ({} if self.dither_seed is None else {schema.RESOURCE_DITHER_SEED: dither_seed_text(self.dither_seed)})
        )
        detected = get_aggregated_resources([host_detector.load()(), OTELResourceDetector()], base)
        if self.instance_id is not None and schema.RESOURCE_INSTANCE not in detected.attributes:
            return detected.merge(Resource({schema.RESOURCE_INSTANCE: self.instance_id}))
        if schema.RESOURCE_INSTANCE in detected.attributes:
            return detected
        attributes = detected.attributes
        stable = "\x1f".join(
            str(part)
            for part in (
                attributes.get(schema.RESOURCE_HOST_NAME, ""),
                attributes.get(schema.RESOURCE_HOST_ID, ""),
                attributes.get(schema.RESOURCE_SERVICE_NAME),
                attributes.get(schema.RESOURCE_ENGINE),
                attributes.get(schema.RESOURCE_MODEL),
                self.instance_key,
                attributes.get(schema.RESOURCE_TP_RANK),
            )
        )
        return detected.merge(Resource({schema.RESOURCE_INSTANCE: str(uuid.uuid5(SERVICE_INSTANCE_NAMESPACE, stable))}))

    def resource(self) -> Resource:
        """The resource attributes of every batch (detected once)."""
        return self._resource

    @property
    def instance(self) -> str:
        """The ``service.instance.id`` this engine reports under (the dashboards' instance)."""
        return str(self._resource.attributes[schema.RESOURCE_INSTANCE])


def otlp_http_exporter(endpoint: str, *, timeout_s: float = 5.0, gzip: bool = True) -> OTLPMetricExporter:
    """The SDK's OTLP/HTTP (protobuf) metric exporter for ``endpoint`` (e.g. ``http://host:4318/v1/metrics``)."""
    return OTLPMetricExporter(
        endpoint=endpoint, timeout=timeout_s, compression=Compression.Gzip if gzip else Compression.NoCompression
    )


def export_configured(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment names a metrics endpoint (witcert's shorthand or OpenTelemetry's)."""
    environ = os.environ if environ is None else environ
    return any(environ.get(name, "").strip() for name in _ENDPOINT_ENVS)


def _first(environ: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            return value
    return None


def otlp_exporter(endpoint: str | None = None) -> MetricExporter:
    """The SDK's OTLP metric exporter as OpenTelemetry's environment variables configure it.

    ``OTEL_EXPORTER_OTLP_[METRICS_]PROTOCOL`` picks ``http/protobuf`` (the default) or ``grpc``; the
    SDK's exporter then reads the endpoint, headers, compression, timeout and TLS variables itself.
    ``endpoint`` (or ``WITCERT_COLLECTOR_ENDPOINT``, its shorthand) is the metrics endpoint and wins over
    the OpenTelemetry endpoint variables; over HTTP a URL with no path gets ``/v1/metrics``. Unless a
    compression variable says otherwise, batches are gzip-compressed.
    """
    environ = os.environ
    protocol = _first(environ, _PROTOCOL_ENVS) or "http/protobuf"
    if protocol not in PROTOCOLS:
        name = next(name for name in _PROTOCOL_ENVS if environ.get(name, "").strip())
        raise TelemetryConfigError(
            f"{name}={protocol!r}: the witcert stream exports over {' or '.join(PROTOCOLS)} "
            "(opentelemetry-python has no http/json metric exporter)"
        )
    endpoint = endpoint or environ.get(COLLECTOR_ENDPOINT_ENV, "").strip() or None
    gzip_default = _first(environ, _COMPRESSION_ENVS) is None
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcExporter

        compression = GrpcCompression.Gzip if gzip_default else None
        return GrpcExporter(endpoint=endpoint, compression=compression)
    if endpoint is not None and urlsplit(endpoint).path in ("", "/"):
        endpoint = endpoint.rstrip("/") + "/v1/metrics"
    return OTLPMetricExporter(endpoint=endpoint, compression=Compression.Gzip if gzip_default else None)


def export_interval_s(environ: Mapping[str, str] | None = None) -> float:
    """``OTEL_METRIC_EXPORT_INTERVAL`` (milliseconds) in seconds, or the stream's default of 10 s."""
    environ = os.environ if environ is None else environ
    text = environ.get(OTEL_METRIC_EXPORT_INTERVAL, "").strip()
    if not text:
        return DEFAULT_FLUSH_SECONDS
    try:
        milliseconds = float(text)
    except ValueError:
        milliseconds = float("nan")
    if not milliseconds > 0 or not math.isfinite(milliseconds):
        raise TelemetryConfigError(
            f"{OTEL_METRIC_EXPORT_INTERVAL}={text!r}: expected a positive number of milliseconds"
        )
    return milliseconds / 1000.0


class _OnDemandReader(MetricReader):
    """A metric reader collected by the stream's thread when it builds a batch, with delta temporality."""

    def __init__(self) -> None:
        super().__init__(preferred_temporality={Counter: AggregationTemporality.DELTA})
        self._collected: MetricsData | None = None

    def _receive_metrics(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs) -> None:
        self._collected = metrics_data

    def take(self) -> list[Metric]:
        self._collected = None
        self.collect()
        data, self._collected = self._collected, None
        if data is None:
            return []
        return [metric for rm in data.resource_metrics for sm in rm.scope_metrics for metric in sm.metrics]

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        self._collected = None


@dataclass
class _Batch:
    data: MetricsData
    points: int
    dropped_reported: int  # the witcert.telemetry.dropped count this batch carries (re-counted if it is dropped)


@dataclass
class StreamStats:
    """Counters of the stream itself (read them from any thread; they are informative, not locked)."""

    flushes_started: int = 0
    flushes_skipped: int = 0  # a flush was due but both host buffers were still busy
    batches_built: int = 0
    points_built: int = 0
    batches_exported: int = 0
    export_failures: int = 0
    points_exported: int = 0
    points_dropped: int = 0
    heartbeats: int = 0  # batches holding only the tau gauge, built while no flush came
    build_cpu_seconds: float = 0.0  # background thread CPU time spent decoding and building batches
    export_cpu_seconds: float = 0.0  # background thread CPU time spent in the exporter
    build_wall_seconds: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=1024))


_STOP = object()


class TelemetryStream:
    """Streams an aggregator's counts to ``exporter`` from a background thread; the engine never waits.

    ``exporter``: any SDK ``MetricExporter``; ``None`` builds the OTLP exporter OpenTelemetry's
    environment variables describe (``otlp_exporter``).
    ``flush_steps``/``flush_seconds``: a flush starts at the first ``poll`` after either has passed
    since the previous flush; ``flush_seconds`` defaults to ``OTEL_METRIC_EXPORT_INTERVAL``, else 10 s.
    The background thread spends roughly 15-40 us of CPU per exported point (docs/TELEMETRY.md);
    counters cost per flush, raw samples per sampled step, hence the 10 s default.
    ``flush_steps`` must stay below the aggregator's ring (128 sampled steps by default) or raw samples
    are overwritten, and counted.
    ``heartbeat_seconds`` (default: ``flush_seconds``): when no batch was built for that long (an idle
    engine polls nothing), the thread exports the tau gauge alone, so a silent instance means a down one.
    ``first_head``: the global index of the aggregator's head 0 (under tensor parallelism, the rank's
    first head; default ``identity.tp_rank * aggregator.num_heads``): heads are exported by global index.
    ``max_buffered_points``: data points held while the exporter fails.
    ``export_timeout_s``: the deadline handed to each export call. ``retry_backoff_s``: first and
    largest wait between retries of a failed export.
    """

    def __init__(
        self,
        aggregator: CertificateAggregator,
        exporter: MetricExporter | None,
        identity: EngineIdentity,
        *,
        flush_steps: int = 2048,
        flush_seconds: float | None = None,
        heartbeat_seconds: float | None = None,
        first_head: int | None = None,
        max_buffered_points: int = 1_000_000,
        export_timeout_s: float = 10.0,
        retry_backoff_s: tuple[float, float] = (0.5, 30.0),
    ) -> None:
        flush_seconds = export_interval_s() if flush_seconds is None else flush_seconds
        heartbeat_seconds = flush_seconds if heartbeat_seconds is None else heartbeat_seconds
        first_head = identity.tp_rank * aggregator.num_heads if first_head is None else first_head
        if flush_steps < 1 or not flush_seconds > 0 or not heartbeat_seconds > 0:
            raise ValueError(
                "flush_steps must be >= 1, flush_seconds and heartbeat_seconds > 0, got "
                f"{flush_steps}, {flush_seconds}, {heartbeat_seconds}"
            )
        if max_buffered_points < 1:
            raise ValueError(f"max_buffered_points must be positive, got {max_buffered_points}")
        if first_head < 0:
            raise ValueError(f"first_head must be >= 0, got {first_head}")
        self.aggregator = aggregator
        self.exporter = otlp_exporter() if exporter is None else exporter
        self.identity = identity
        self.flush_steps = flush_steps
        self.flush_seconds = flush_seconds
        self.heartbeat_seconds = heartbeat_seconds
        self.first_head = first_head
        self.max_buffered_points = max_buffered_points
        self.export_timeout_s = export_timeout_s
        self.retry_backoff_s = retry_backoff_s
        self.stats = StreamStats()

        # Engine-thread side: two host buffers, so one can be copied into while the thread decodes the other.
        on_cuda = aggregator.device.type == "cuda"
        self._host_buffers = [
            torch.empty(aggregator.layout.words, dtype=torch.int64, pin_memory=on_cuda) for _ in range(2)
        ]
        self._events = [torch.cuda.Event() if on_cuda else None for _ in range(2)]
        self._free_buffers: queue.SimpleQueue[int] = queue.SimpleQueue()
        for index in range(len(self._host_buffers)):
            self._free_buffers.put(index)
        self._copies_in_flight: collections.deque[tuple[int, int]] = collections.deque()  # (buffer, wall ns)
        self._polls_since_flush = 0
        self._last_flush = time.monotonic()
        self._closed = False

        # Background-thread side.
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._reader = _OnDemandReader()
        cells = aggregator.num_layers * aggregator.num_heads
        self._resource = identity.resource()
        self._provider = MeterProvider(
            metric_readers=[self._reader],
            resource=self._resource,
            shutdown_on_exit=False,
            # One series per (layer, head); the default limit (2000) would fold larger models into overflow.
            views=[View(instrument_name="witcert.*", aggregation_cardinality_limit=cells + 16)],
        )
        meter = self._provider.get_meter(schema.INSTRUMENTATION_SCOPE, __version__)
        self._counters = {
            name: meter.create_counter(metric, unit=unit, description=description)
            for name, (metric, unit, description) in COUNTER_METRICS.items()
        }
        self._steps_counter = meter.create_counter(schema.STEPS, unit="{step}", description="Decode steps observed")
        self._dropped_counter = meter.create_counter(
            schema.DROPPED_POINTS, unit="{point}", description="Telemetry points dropped before export"
        )
        self._scope = InstrumentationScope(schema.INSTRUMENTATION_SCOPE, __version__)
        self._attributes = [
            [{schema.ATTR_LAYER: layer, schema.ATTR_HEAD: first_head + head} for head in range(aggregator.num_heads)]
            for layer in range(aggregator.num_layers)
        ]
        empty = decode_state(
            aggregator.layout, np.zeros(aggregator.layout.words, dtype=np.int64), aggregator.histogram_bounds
        )
        self._previous: AggregatorSnapshot = empty
        self._previous_ns = time.time_ns()
        self._last_batch = time.monotonic()
        self._raw_cursor = 0
        self._dropped_unreported = 0
        self._buffer: collections.deque[_Batch] = collections.deque()
        self._buffered_points = 0
        self._backoff = retry_backoff_s[0]
        self._next_attempt = 0.0
        self._thread = threading.Thread(target=self._run, name="witcert-telemetry", daemon=True)
        self._thread.start()

    # --- engine thread -------------------------------------------------------------------------------

    def poll(self) -> None:
        """Call once per decode step, outside graph capture: hands finished copies over, starts a due flush.

        Call it in idle iterations of the engine loop too: the time-based flush is checked here only.
        """
        if self._closed:
            return
        self._polls_since_flush += 1
        self._hand_over_finished_copies()
        if self._polls_since_flush >= self.flush_steps or time.monotonic() - self._last_flush >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        """Start a flush now (asynchronously); skipped, and counted, while both host buffers are busy."""
        if self._closed or (self.aggregator.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return
        self._polls_since_flush = 0
        self._last_flush = time.monotonic()
        try:
            index = self._free_buffers.get_nowait()
        except queue.Empty:
            self.stats.flushes_skipped += 1
            return
        self.stats.flushes_started += 1
        self._host_buffers[index].copy_(self.aggregator.state, non_blocking=True)
        self.aggregator.restart_extrema()
        event = self._events[index]
        if event is None:
            self._inbox.put((index, time.time_ns()))
            return
        event.record()
        self._copies_in_flight.append((index, time.time_ns()))

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush everything counted so far, export what can be exported within ``timeout_s``, stop the thread.

        It waits for the device and for the exporter: call it at shutdown, never in the step loop.
        """
        if self._closed:
            return
        for index, _ in self._copies_in_flight:
            self._events[index].synchronize()
        self._hand_over_finished_copies()
        self._inbox.put((self.aggregator.state.cpu().numpy(), time.time_ns()))
        self._closed = True
        self._inbox.put(_STOP)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            _log.warning(
                "telemetry thread still exporting after %.1f s; %d points left", timeout_s, self._buffered_points
            )

    def _hand_over_finished_copies(self) -> None:
        while self._copies_in_flight:
            index, wall_ns = self._copies_in_flight[0]
            if not self._events[index].query():
                return
            self._copies_in_flight.popleft()
            self._inbox.put((index, wall_ns))

    # --- background thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        stopping = False
        while True:
            heartbeat_due = self._last_batch + self.heartbeat_seconds
            wake = min(self._next_attempt, heartbeat_due) if self._buffer else heartbeat_due
            try:
                item = self._inbox.get(timeout=max(0.0, wake - time.monotonic()))
            except queue.Empty:
                item = None
            if item is _STOP:
                stopping = True
            elif item is not None:
                self._build_safely(*item)
            if not self._inbox.empty():
                continue  # build whatever waits before exporting: that frees the engine's host buffers
            if stopping:
                self._report_late_drops()
                self._export_buffered(ignore_backoff=True)
                self._shutdown_sdk()
                return
            if time.monotonic() >= self._last_batch + self.heartbeat_seconds:
                self._heartbeat()
            self._export_buffered(ignore_backoff=False)

    def _heartbeat(self) -> None:
        """A batch with the tau gauge alone: the instance is up though it decodes nothing."""
        self._enqueue(self._batch([self._tau_metric(time.time_ns())], 0))
        self.stats.heartbeats += 1

    def _tau_metric(self, wall_ns: int) -> Metric:
        # Gauges are built by hand, like the raw samples: one point per batch, never a stale value repeated.
        point = NumberDataPoint({}, self._previous_ns, wall_ns, float(self.aggregator.tau))
        return Metric(schema.TAU, "Gating threshold tau in force", "1", Gauge([point]))

    def _lag_metric(self, lag_s: float, wall_ns: int) -> Metric:
        point = NumberDataPoint({}, self._previous_ns, wall_ns, lag_s)
        return Metric(schema.EXPORT_LAG, "Seconds from the device snapshot to building its batch", "s", Gauge([point]))

    def _build_safely(self, source: int | np.ndarray, wall_ns: int) -> None:
        cpu_start, wall_start = time.thread_time(), time.perf_counter()
        try:
            if isinstance(source, np.ndarray):
                snapshot = self._decode(source)
            else:
                try:
                    snapshot = self._decode(self._host_buffers[source].numpy())
                finally:
                    self._free_buffers.put(source)
            self._enqueue(self._build(snapshot, wall_ns))
        except Exception:  # a telemetry bug must not take the engine down: log it, keep the thread alive
            _log.exception("building a telemetry batch failed; its counts stay in the next batch")
        self.stats.build_cpu_seconds += time.thread_time() - cpu_start
        self.stats.build_wall_seconds.append(time.perf_counter() - wall_start)

    def _decode(self, state: np.ndarray) -> AggregatorSnapshot:
        aggregator = self.aggregator
        return decode_state(aggregator.layout, state, aggregator.histogram_bounds, raw_since=self._raw_cursor)

    def _build(self, snapshot: AggregatorSnapshot, wall_ns: int) -> _Batch:
        previous = self._previous
        attributes = self._attributes
        for name, counter in self._counters.items():
            delta = snapshot.counters()[name] - previous.counters()[name]
            for layer, head in zip(*np.nonzero(delta), strict=True):
                counter.add(int(delta[layer, head]), attributes[layer][head])
        if snapshot.step > previous.step:
            self._steps_counter.add(snapshot.step - previous.step)
        self._dropped_unreported += max(0, snapshot.raw_first_index - self._raw_cursor)
        self._raw_cursor = snapshot.raw_written
        dropped_reported = self._dropped_unreported
        if dropped_reported:
            self._dropped_counter.add(dropped_reported)
            self._dropped_unreported = 0
        metrics = self._reader.take()
        metrics.append(self._tau_metric(wall_ns))
        metrics.append(self._lag_metric((time.time_ns() - wall_ns) / 1e9, wall_ns))
        metrics.append(self._histogram_metric(snapshot, previous, wall_ns))
        metrics.append(self._raw_sample_metric(snapshot, wall_ns))
        self._previous, self._previous_ns = snapshot, wall_ns
        return self._batch(metrics, dropped_reported)

    def _batch(self, metrics: list[Metric], dropped_reported: int) -> _Batch:
        self._last_batch = time.monotonic()
        data = MetricsData([ResourceMetrics(self._resource, [ScopeMetrics(self._scope, metrics, "")], "")])
        points = sum(len(metric.data.data_points) for metric in metrics)
        self.stats.batches_built += 1
        self.stats.points_built += points
        return _Batch(data, points, dropped_reported)

    def _report_late_drops(self) -> None:
        """At shutdown, drops that happened after the last batch was built still get a batch of their own."""
        while self._dropped_unreported:
            dropped, self._dropped_unreported = self._dropped_unreported, 0
            self._dropped_counter.add(dropped)
            self._enqueue(self._batch(self._reader.take(), dropped))

    def _histogram_metric(self, snapshot: AggregatorSnapshot, previous: AggregatorSnapshot, wall_ns: int) -> Metric:
        counts = snapshot.histogram_counts - previous.histogram_counts
        sums = snapshot.histogram_sum - previous.histogram_sum
        totals = counts.sum(-1)
        bounds = list(snapshot.histogram_bounds)
        points = [
            HistogramDataPoint(
                attributes=self._attributes[layer][head],
                start_time_unix_nano=self._previous_ns,
                time_unix_nano=wall_ns,
                count=int(totals[layer, head]),
                sum=float(sums[layer, head]),
                bucket_counts=counts[layer, head].tolist(),
                explicit_bounds=bounds,
                min=float(snapshot.histogram_min[layer, head]),
                max=float(snapshot.histogram_max[layer, head]),
            )
            for layer, head in zip(*np.nonzero(totals), strict=True)
        ]
        return Metric(
            name=schema.CERTIFICATE_VALUE,
            description="Finite certificate values at sampled steps",
            unit="1",
            data=Histogram(points, AggregationTemporality.DELTA),
        )

    def _raw_sample_metric(self, snapshot: AggregatorSnapshot, wall_ns: int) -> Metric:
        # An all-NaN head is already counted by witcert.certificate.nan; the collector refuses NaN samples.
        keep = ~np.isnan(snapshot.raw_value)
        start_ns = self._previous_ns
        # Plain Python numbers (tolist): numpy scalars would cost a conversion per attribute.
        first_head = self.first_head
        points = [
            NumberDataPoint(
                attributes={schema.ATTR_LAYER: layer, schema.ATTR_HEAD: first_head + head, schema.ATTR_STEP: step},
                start_time_unix_nano=start_ns,
                time_unix_nano=wall_ns,
                value=value,
            )
            for layer, head, step, value in zip(
                snapshot.raw_layer[keep].tolist(),
                snapshot.raw_head[keep].tolist(),
                snapshot.raw_step[keep].tolist(),
                snapshot.raw_value[keep].tolist(),
                strict=True,
            )
        ]
        return Metric(
            name=schema.CERTIFICATE_SAMPLE,
            description="Sampled certificate per (layer, head, step): max over the batch rows, +inf kept",
            unit="1",
            data=Gauge(points),
        )

    def _enqueue(self, batch: _Batch) -> None:
        self._buffer.append(batch)
        self._buffered_points += batch.points
        while self._buffered_points > self.max_buffered_points and self._buffer:
            dropped = self._buffer.popleft()
            self._buffered_points -= dropped.points
            self.stats.points_dropped += dropped.points
            # Its own report of earlier drops is lost with it: count those again.
            self._dropped_unreported += dropped.points + dropped.dropped_reported

    def _export_buffered(self, *, ignore_backoff: bool) -> None:
        while self._buffer:
            if not ignore_backoff and time.monotonic() < self._next_attempt:
                return
            batch = self._buffer[0]
            cpu_start = time.thread_time()
            try:
                result = self.exporter.export(batch.data, timeout_millis=self.export_timeout_s * 1000)
            except Exception:  # an exporter that raises is treated as a failed export, never as a crash
                _log.exception("telemetry export raised")
                result = MetricExportResult.FAILURE
            self.stats.export_cpu_seconds += time.thread_time() - cpu_start
            if result is not MetricExportResult.SUCCESS:
                self.stats.export_failures += 1
                self._next_attempt = time.monotonic() + self._backoff
                self._backoff = min(self._backoff * 2, self.retry_backoff_s[1])
                if ignore_backoff:
                    return
                continue
            self._buffer.popleft()
            self._buffered_points -= batch.points
            self.stats.batches_exported += 1
            self.stats.points_exported += batch.points
            self._backoff = self.retry_backoff_s[0]

    def _shutdown_sdk(self) -> None:
        if self._buffered_points:
            _log.warning("telemetry closed with %d points not exported", self._buffered_points)
        try:
            self.exporter.shutdown()
        finally:
            self._provider.shutdown()
