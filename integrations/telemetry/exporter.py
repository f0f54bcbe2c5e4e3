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
import logging
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
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
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from witcert import __version__
from witcert.integrations.telemetry import schema as schema
from witcert.integrations.telemetry.aggregator import AggregatorSnapshot, CertificateAggregator, decode_state

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


@dataclass(frozen=True)
class EngineIdentity:
    """Who is reporting: the OTLP resource attributes of every batch."""

    model: str
    engine: str
    instance: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    tp_rank: int = 0
    service_name: str = "witcert-engine"

    def resource(self) -> Resource:
        return Resource.create(
            {
                schema.RESOURCE_SERVICE_NAME: self.service_name,
                schema.RESOURCE_INSTANCE: self.instance,
                schema.RESOURCE_MODEL: self.model,
                schema.RESOURCE_ENGINE: self.engine,
                schema.RESOURCE_TP_RANK: self.tp_rank,
            }
        )


def otlp_http_exporter(endpoint: str, *, timeout_s: float = 5.0, gzip: bool = True) -> OTLPMetricExporter:
    """The SDK's OTLP/HTTP (protobuf) metric exporter for ``endpoint`` (e.g. ``http://host:4318/v1/metrics``)."""
    return OTLPMetricExporter(
        endpoint=endpoint, timeout=timeout_s, compression=Compression.Gzip if gzip else Compression.NoCompression
    )


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
    build_cpu_seconds: float = 0.0  # background thread CPU time spent decoding and building batches
    export_cpu_seconds: float = 0.0  # background thread CPU time spent in the exporter
    build_wall_seconds: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=1024))


_STOP = object()


class TelemetryStream:
    """Streams an aggregator's counts to ``exporter`` from a background thread; the engine never waits.

    ``flush_steps``/``flush_seconds``: a flush starts at the first ``poll`` after either has passed
    since the previous flush. The background thread spends roughly 15-40 us of CPU per exported point
    (docs/TELEMETRY.md); counters cost per flush, raw samples per sampled step, hence the 10 s default.
    ``flush_steps`` must stay below the aggregator's ring (128 sampled steps by default) or raw samples
    are overwritten, and counted.
    ``max_buffered_points``: data points held while the exporter fails.
    ``export_timeout_s``: the deadline handed to each export call. ``retry_backoff_s``: first and
    largest wait between retries of a failed export.
    """

    def __init__(
        self,
        aggregator: CertificateAggregator,
        exporter: MetricExporter,
        identity: EngineIdentity,
        *,
        flush_steps: int = 2048,
        flush_seconds: float = 10.0,
        max_buffered_points: int = 1_000_000,
        export_timeout_s: float = 10.0,
        retry_backoff_s: tuple[float, float] = (0.5, 30.0),
    ) -> None:
        if flush_steps < 1 or not flush_seconds > 0:
            raise ValueError(f"flush_steps must be >= 1 and flush_seconds > 0, got {flush_steps}, {flush_seconds}")
        if max_buffered_points < 1:
            raise ValueError(f"max_buffered_points must be positive, got {max_buffered_points}")
        self.aggregator = aggregator
        self.exporter = exporter
        self.identity = identity
        self.flush_steps = flush_steps
        self.flush_seconds = flush_seconds
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
        self._provider = MeterProvider(
            metric_readers=[self._reader],
            resource=identity.resource(),
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
        self._tau_gauge = meter.create_gauge(schema.TAU, unit="1", description="Gating threshold tau in force")
        self._lag_gauge = meter.create_gauge(
            schema.EXPORT_LAG, unit="s", description="Seconds from the device snapshot to building its batch"
        )
        self._scope = InstrumentationScope(schema.INSTRUMENTATION_SCOPE, __version__)
        self._resource = identity.resource()
        self._attributes = [
            [{schema.ATTR_LAYER: layer, schema.ATTR_HEAD: head} for head in range(aggregator.num_heads)]
            for layer in range(aggregator.num_layers)
        ]
        empty = decode_state(
            aggregator.layout, np.zeros(aggregator.layout.words, dtype=np.int64), aggregator.histogram_bounds
        )
        self._previous: AggregatorSnapshot = empty
        self._previous_ns = time.time_ns()
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
            wait = max(0.0, self._next_attempt - time.monotonic()) if self._buffer else None
            try:
                item = self._inbox.get(timeout=wait)
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
            self._export_buffered(ignore_backoff=False)

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
        self._tau_gauge.set(self.aggregator.tau)
        self._lag_gauge.set((time.time_ns() - wall_ns) / 1e9)
        metrics = self._reader.take()
        metrics.append(self._histogram_metric(snapshot, previous, wall_ns))
        metrics.append(self._raw_sample_metric(snapshot, wall_ns))
        self._previous, self._previous_ns = snapshot, wall_ns
        return self._batch(metrics, dropped_reported)

    def _batch(self, metrics: list[Metric], dropped_reported: int) -> _Batch:
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
        points = [
            NumberDataPoint(
                attributes={schema.ATTR_LAYER: layer, schema.ATTR_HEAD: head, schema.ATTR_STEP: step},
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
