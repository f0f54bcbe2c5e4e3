"""OTLP metrics request -> validated, column-oriented rows for the store.

Decoding (protobuf or OTLP/JSON) and validation happen once, on receipt; the spool keeps the
resulting columns, so the drain only inserts. Points that cannot be stored correctly are rejected
one by one (OTLP partial success), never the whole request:

- certificate samples (``witcert.certificate.sample``): NaN, negative values, missing or
  non-integer ``layer``/``head``/``step`` attributes, a non-integer ``witcert.tp_rank``;
- witcert counters: NaN, infinite or negative increments; the certificate histogram: negative sums;
- any point: a zero or out-of-range timestamp, too many or too long attributes, a histogram whose
  bucket counts do not match its bounds, a metric type without a raw table (exponential
  histogram, summary), and attribute sets beyond the per-request cap (a flood).

Metrics with unknown names are stored raw (and never typed). Certificate samples go straight into
``witcert_certificate_samples`` rather than through ``otel_metrics_gauge``: a raw row with its
Map columns costs five to six times the insert time and about twice the disk (docs/COLLECTOR.md).
"""

from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass, field

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import AggregationTemporality

from witcert.collector import tables
from witcert.collector.config import Limits
from witcert.integrations.telemetry import schema as ts

_COMMON = (
    "ResourceAttributes",
    "ResourceSchemaUrl",
    "ScopeName",
    "ScopeVersion",
    "ScopeAttributes",
    "ScopeDroppedAttrCount",
    "ScopeSchemaUrl",
    "ServiceName",
    "MetricName",
    "MetricDescription",
    "MetricUnit",
    "Attributes",
    "StartTimeUnix",
    "TimeUnix",
    "Flags",
    "Exemplars.FilteredAttributes",
    "Exemplars.TimeUnix",
    "Exemplars.Value",
    "Exemplars.SpanId",
    "Exemplars.TraceId",
)
COLUMNS: dict[str, tuple[str, ...]] = {
    tables.CERTIFICATE_SAMPLES: (
        "Timestamp",
        "ServiceName",
        "Instance",
        "Model",
        "Engine",
        "TpRank",
        "Layer",
        "Head",
        "Step",
        "Value",
    ),
    tables.SUM: _COMMON + ("Value", "AggregationTemporality", "IsMonotonic"),
    tables.GAUGE: _COMMON + ("Value",),
    tables.HISTOGRAM: _COMMON
    + ("Count", "Sum", "BucketCounts", "ExplicitBounds", "Min", "Max", "AggregationTemporality"),
}
# DateTime64(9) holds nanoseconds since the epoch in an Int64.
_MAX_TIME_NS = 2**63 - 1
_MAX_UINT16 = 65535
# Layer/head 65535 is the rollups' marker for "not per head"; a real head may not use it.
_MAX_LAYER_HEAD = _MAX_UINT16 - 1
_WITCERT_COUNTERS = frozenset(ts.COUNTER_METRICS)
_DELTA = AggregationTemporality.AGGREGATION_TEMPORALITY_DELTA


class RequestError(ValueError):
    """The request as a whole is unusable (undecodable body): answered with 400."""


@dataclass
class IngestBatch:
    """Rows of one request, column-oriented per table, plus what was rejected and why."""

    columns: dict[str, dict[str, list]] = field(default_factory=dict)
    accepted_points: int = 0
    rejected_points: int = 0
    # At most a few distinct reasons, for the partial-success error_message.
    messages: list[str] = field(default_factory=list)

    def table(self, name: str) -> dict[str, list]:
        found = self.columns.get(name)
        if found is None:
            found = self.columns[name] = {column: [] for column in COLUMNS[name]}
        return found

    def reject(self, count: int, reason: str) -> None:
        self.rejected_points += count
        self.note(reason)

    def note(self, reason: str) -> None:
        if reason not in self.messages and len(self.messages) < 8:
            self.messages.append(reason)

    @property
    def error_message(self) -> str:
        return "; ".join(self.messages)


def decode_request(body: bytes, content_type: str) -> ExportMetricsServiceRequest:
    """Parse an OTLP metrics request body (``application/x-protobuf`` or ``application/json``)."""
    request = ExportMetricsServiceRequest()
    if content_type == "application/json":
        try:
            json_format.Parse(body.decode("utf-8"), request, ignore_unknown_fields=True)
        except (json_format.ParseError, UnicodeDecodeError, RecursionError) as error:
            raise RequestError(f"body is not an OTLP/JSON ExportMetricsServiceRequest: {error}") from None
        return request
    try:
        request.ParseFromString(body)
    except (DecodeError, RecursionError) as error:
        raise RequestError(f"body is not a protobuf ExportMetricsServiceRequest: {error}") from None
    return request


def any_value_text(value: AnyValue) -> str:
    """An attribute value as the text the ClickHouse exporter stores in its Map columns."""
    kind = value.WhichOneof("value")
    if kind == "string_value":
        return value.string_value
    if kind == "int_value":
        return str(value.int_value)
    if kind == "double_value":
        return repr(value.double_value)
    if kind == "bool_value":
        return "true" if value.bool_value else "false"
    if kind == "bytes_value":
        return base64.b64encode(value.bytes_value).decode()
    if kind is None:
        return ""
    return json.dumps(_any_value_json(value), separators=(",", ":"))


def _any_value_json(value: AnyValue):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_any_value_json(item) for item in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _any_value_json(kv.value) for kv in value.kvlist_value.values}
    if kind == "bytes_value":
        return base64.b64encode(value.bytes_value).decode()
    return getattr(value, kind) if kind else None


def _unsigned(value: AnyValue, limit: int) -> int | None:
    """An integer attribute in [0, limit], sent as int or as decimal text; None otherwise."""
    kind = value.WhichOneof("value")
    if kind == "int_value":
        number = value.int_value
    elif kind == "string_value" and value.string_value.isdigit():
        number = int(value.string_value)
    else:
        return None
    return number if 0 <= number <= limit else None


class _Converter:
    """Walks one request; holds the per-request state (attribute-set flood guard)."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.batch = IngestBatch()
        self.series: set[tuple[str, bytes]] = set()

    def attributes(self, attributes) -> dict[str, str] | str:
        """Map of text values, or the reason the attributes are refused."""
        if len(attributes) > self.limits.max_attributes_per_point:
            return f"more than {self.limits.max_attributes_per_point} attributes on a point"
        converted = {kv.key: any_value_text(kv.value) for kv in attributes}
        longest = max((len(text) for text in converted.values()), default=0)
        if longest > self.limits.max_attribute_value_chars:
            return f"an attribute value longer than {self.limits.max_attribute_value_chars} characters"
        return converted

    def new_series(self, metric_name: str, attributes) -> bool:
        """Count distinct attribute sets per request; False once the cap is reached (a flood)."""
        key = (metric_name, b"".join(kv.SerializeToString(deterministic=True) for kv in attributes))
        if key in self.series:
            return True
        if len(self.series) >= self.limits.max_series_per_request:
            return False
        self.series.add(key)
        return True

    def convert(self, request: ExportMetricsServiceRequest) -> IngestBatch:
        for resource_metrics in request.resource_metrics:
            resource = resource_metrics.resource
            resource_attrs = self.attributes(resource.attributes)
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    if isinstance(resource_attrs, str):
                        self.batch.reject(_count_points(metric), f"resource: {resource_attrs}")
                        continue
                    self.metric(resource_metrics, resource_attrs, scope_metrics, metric)
        return self.batch

    def metric(self, resource_metrics, resource_attrs: dict[str, str], scope_metrics, metric) -> None:
        kind = metric.WhichOneof("data")
        name = metric.name
        if not name:
            self.batch.reject(_count_points(metric), "a metric without a name")
            return
        if name == ts.CERTIFICATE_SAMPLE and kind == "gauge":
            self.samples(resource_attrs, metric)
            return
        if name == ts.CERTIFICATE_SAMPLE or (name in _WITCERT_COUNTERS and kind != "sum"):
            self.batch.reject(_count_points(metric), f"{name} must be a {'gauge' if kind == 'sum' else 'sum'}")
            return
        if kind not in ("sum", "gauge", "histogram"):
            self.batch.reject(_count_points(metric), f"{name}: metric type {kind} has no table here")
            return
        scope = scope_metrics.scope
        scope_attrs = self.attributes(scope.attributes)
        if isinstance(scope_attrs, str):
            self.batch.reject(_count_points(metric), f"scope: {scope_attrs}")
            return
        common = (
            resource_attrs,
            resource_metrics.schema_url,
            scope.name,
            scope.version,
            scope_attrs,
            scope.dropped_attributes_count,
            scope_metrics.schema_url,
            resource_attrs.get(ts.RESOURCE_SERVICE_NAME, ""),
            name,
            metric.description,
            metric.unit,
        )
        if kind == "histogram":
            self.histograms(common, metric)
        else:
            self.numbers(common, metric, kind)

    def point_prefix(self, name: str, point) -> list | str:
        """The common columns from Attributes to Exemplars, or the reason the point is refused."""
        if not 0 < point.time_unix_nano <= _MAX_TIME_NS or point.start_time_unix_nano > _MAX_TIME_NS:
            return f"{name}: time_unix_nano missing or out of range"
        attributes = self.attributes(point.attributes)
        if isinstance(attributes, str):
            return f"{name}: {attributes}"
        if not self.new_series(name, point.attributes):
            return f"more than {self.limits.max_series_per_request} attribute sets in one request"
        exemplar_attrs, exemplar_times, exemplar_values, span_ids, trace_ids = [], [], [], [], []
        for exemplar in point.exemplars:
            filtered = self.attributes(exemplar.filtered_attributes)
            exemplar_attrs.append(filtered if isinstance(filtered, dict) else {})
            exemplar_times.append(min(exemplar.time_unix_nano, _MAX_TIME_NS))
            is_int = exemplar.WhichOneof("value") == "as_int"
            exemplar_values.append(float(exemplar.as_int) if is_int else exemplar.as_double)
            span_ids.append(exemplar.span_id.hex())
            trace_ids.append(exemplar.trace_id.hex())
        return [
            attributes,
            point.start_time_unix_nano,
            point.time_unix_nano,
            point.flags,
            exemplar_attrs,
            exemplar_times,
            exemplar_values,
            span_ids,
            trace_ids,
        ]

    def numbers(self, common: tuple, metric, kind: str) -> None:
        data = getattr(metric, kind)
        name = metric.name
        is_witcert_counter = name in _WITCERT_COUNTERS
        table = self.batch.table(tables.SUM if kind == "sum" else tables.GAUGE)
        extra: tuple = ()
        if kind == "sum":
            extra = (int(data.aggregation_temporality), bool(data.is_monotonic))
            if is_witcert_counter and data.aggregation_temporality != _DELTA:
                self.batch.note(f"{name}: not delta temporality, stored raw but not rolled up")
        for point in data.data_points:
            value = float(point.as_int) if point.WhichOneof("value") == "as_int" else point.as_double
            if is_witcert_counter and not (math.isfinite(value) and value >= 0):
                self.batch.reject(1, f"{name}: increments must be finite and >= 0, got {value}")
                continue
            if name == ts.TAU and not (math.isfinite(value) and value > 0):
                self.batch.reject(1, f"{name}: tau must be finite and > 0, got {value}")
                continue
            prefix = self.point_prefix(name, point)
            if isinstance(prefix, str):
                self.batch.reject(1, prefix)
                continue
            self.append(table, (*common, *prefix, value, *extra))

    def histograms(self, common: tuple, metric) -> None:
        data = metric.histogram
        name = metric.name
        table = self.batch.table(tables.HISTOGRAM)
        temporality = int(data.aggregation_temporality)
        for point in data.data_points:
            bounds = list(point.explicit_bounds)
            counts = list(point.bucket_counts)
            if counts and len(counts) != len(bounds) + 1:
                self.batch.reject(1, f"{name}: {len(counts)} bucket counts for {len(bounds)} bounds")
                continue
            if sum(counts) != point.count and counts:
                self.batch.reject(1, f"{name}: bucket counts do not add up to count")
                continue
            if name == ts.CERTIFICATE_VALUE and (math.isnan(point.sum) or point.sum < 0):
                self.batch.reject(1, f"{name}: certificates are >= 0, got sum {point.sum}")
                continue
            prefix = self.point_prefix(name, point)
            if isinstance(prefix, str):
                self.batch.reject(1, prefix)
                continue
            minimum = point.min if point.HasField("min") else 0.0
            maximum = point.max if point.HasField("max") else 0.0
            self.append(
                table, (*common, *prefix, point.count, point.sum, counts, bounds, minimum, maximum, temporality)
            )

    def append(self, table: dict[str, list], row: tuple) -> None:
        for column, value in zip(table.values(), row, strict=True):
            column.append(value)
        self.batch.accepted_points += 1

    def samples(self, resource_attrs: dict[str, str], metric) -> None:
        """The hot path: one typed row per sampled certificate, without building attribute maps."""
        points = metric.gauge.data_points
        tp_text = resource_attrs.get(ts.RESOURCE_TP_RANK, "0")
        if not (tp_text.isdigit() and int(tp_text) <= _MAX_UINT16):
            self.batch.reject(len(points), f"{ts.RESOURCE_TP_RANK} must be an integer 0..65535, got {tp_text!r}")
            return
        table = self.batch.table(tables.CERTIFICATE_SAMPLES)
        timestamps, values, layers, heads, steps = (
            table["Timestamp"],
            table["Value"],
            table["Layer"],
            table["Head"],
            table["Step"],
        )
        accepted = 0
        for point in points:
            value = point.as_double if point.WhichOneof("value") != "as_int" else float(point.as_int)
            if not value >= 0:  # also catches NaN
                self.batch.reject(1, f"{ts.CERTIFICATE_SAMPLE}: certificates are >= 0 (+inf allowed), got {value}")
                continue
            time_ns = point.time_unix_nano
            if not 0 < time_ns <= _MAX_TIME_NS:
                self.batch.reject(1, f"{ts.CERTIFICATE_SAMPLE}: time_unix_nano missing or out of range")
                continue
            layer = head = step = None
            for kv in point.attributes:
                key = kv.key
                if key == ts.ATTR_LAYER:
                    layer = _unsigned(kv.value, _MAX_LAYER_HEAD)
                elif key == ts.ATTR_HEAD:
                    head = _unsigned(kv.value, _MAX_LAYER_HEAD)
                elif key == ts.ATTR_STEP:
                    step = _unsigned(kv.value, 2**64 - 1)
            if layer is None or head is None or step is None:
                self.batch.reject(
                    1, f"{ts.CERTIFICATE_SAMPLE}: attributes layer, head (0..65534) and step (>= 0) are required"
                )
                continue
            timestamps.append(time_ns)
            values.append(value)
            layers.append(layer)
            heads.append(head)
            steps.append(step)
            accepted += 1
        for column, constant in (
            ("ServiceName", resource_attrs.get(ts.RESOURCE_SERVICE_NAME, "")),
            ("Instance", resource_attrs.get(ts.RESOURCE_INSTANCE, "")),
            ("Model", resource_attrs.get(ts.RESOURCE_MODEL, "")),
            ("Engine", resource_attrs.get(ts.RESOURCE_ENGINE, "")),
            ("TpRank", int(tp_text)),
        ):
            table[column].extend([constant] * accepted)
        self.batch.accepted_points += accepted


def _count_points(metric) -> int:
    kind = metric.WhichOneof("data")
    return len(getattr(metric, kind).data_points) if kind else 0


def convert_request(request: ExportMetricsServiceRequest, limits: Limits) -> IngestBatch:
    """Validate every data point and lay the accepted ones out as rows for the store's tables."""
    return _Converter(limits).convert(request)
