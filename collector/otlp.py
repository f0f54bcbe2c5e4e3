"""OTLP metrics request -> validated, column-oriented rows for the store.

Decoding (protobuf or OTLP/JSON) and validation happen once, on receipt; the spool keeps the
resulting columns, so the drain only inserts. A large protobuf request is decoded in pieces
(``wire.split_request``) so that the memory decoding takes is bounded by the piece. Points that
cannot be stored correctly are rejected one by one (OTLP partial success), never the whole request:

- certificate samples (``witcert.certificate.sample``): NaN, negative values, missing or
  non-integer ``layer``/``head``/``step`` attributes, a non-integer ``witcert.tp_rank`` (integers are
  ASCII digits: ``int`` also reads "²"'s neighbours such as "٣", ``isdigit`` even says yes to "²");
- witcert counters: NaN, infinite or negative increments; the certificate histogram: negative sums;
- any point: a timestamp missing, later than now + ``max_future_skew_s`` or older than the retention
  of the table it goes to; a string of the data model longer than its cap (metric name, unit,
  description, scope name and version, schema URLs, attribute keys and values, all attributes of
  a set); too many attributes or exemplars; exemplar ids of the wrong length; a histogram whose
  bucket counts do not match its bounds; a metric type without a raw table (exponential histogram,
  summary); attribute sets beyond the per-request cap (a flood); rows beyond the per-request cap
  once resource and scope attributes are copied onto every point.

Metrics with unknown names are stored raw (and never typed). Certificate samples go straight into
``witcert_certificate_samples`` rather than through ``otel_metrics_gauge``: a raw row with its
Map columns costs about four times the insert time and 1.8 times the disk (docs/COLLECTOR.md).
"""

from __future__ import annotations

import base64
import json
import math
import time
from dataclasses import dataclass, field

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import AggregationTemporality

from witcert.collector import tables, wire
from witcert.collector.config import Limits, Retention
from witcert.integrations.telemetry import schema as ts

PROTOBUF = "application/x-protobuf"
JSON = "application/json"

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
# The time column each table is partitioned by (``toDate``), in its column list.
TIME_COLUMN = {table: ("Timestamp" if table == tables.CERTIFICATE_SAMPLES else "TimeUnix") for table in COLUMNS}
# DateTime64(9) holds nanoseconds since the epoch in an Int64.
_MAX_TIME_NS = 2**63 - 1
_DAY_NS = 86_400 * 10**9
_MAX_UINT16 = 65535
# Layer/head 65535 is the rollups' marker for "not per head"; a real head may not use it.
_MAX_LAYER_HEAD = _MAX_UINT16 - 1
_WITCERT_COUNTERS = frozenset(ts.COUNTER_METRICS)
_DELTA = AggregationTemporality.AGGREGATION_TEMPORALITY_DELTA
# Shared by every row without exemplars or attributes: one object instead of one per row.
_NO_EXEMPLARS: tuple = ((), (), (), (), ())
_NO_ATTRIBUTES: dict[str, str] = {}
# Fixed bytes of a row once encoded for the store (numbers, lengths of strings, map sizes).
_RAW_ROW_BYTES = 96
_SAMPLE_ROW_BYTES = 40
# Exemplar ids: 16-byte trace ids and 8-byte span ids (or empty), per the OTLP data model.
_TRACE_ID_BYTES, _SPAN_ID_BYTES = 16, 8


class RequestError(ValueError):
    """The request as a whole is unusable (undecodable body): answered with 400."""


def decode(body: bytes) -> ExportMetricsServiceRequest:
    """Parse a protobuf ``ExportMetricsServiceRequest``."""
    request = ExportMetricsServiceRequest()
    try:
        request.ParseFromString(body)
    except (DecodeError, RecursionError) as error:
        raise RequestError(f"body is not a protobuf ExportMetricsServiceRequest: {error}") from None
    return request


def split(body: bytes, limits: Limits) -> wire.Split:
    """A protobuf body as pieces of at most ``decode_chunk_bytes`` (itself when small enough)."""
    if len(body) <= limits.decode_chunk_bytes:
        return wire.Split(pieces=[body])
    try:
        return wire.split_request(body, limits.decode_chunk_bytes, limits.max_point_bytes)
    except wire.WireError as error:
        raise RequestError(f"body is not a protobuf ExportMetricsServiceRequest: {error}") from None


# --- OTLP/JSON ------------------------------------------------------------------------------------

_DATA_KINDS = ("gauge", "sum", "histogram", "exponentialHistogram", "exponential_histogram", "summary")
_ID_FIELDS = {
    "traceId": _TRACE_ID_BYTES,
    "trace_id": _TRACE_ID_BYTES,
    "spanId": _SPAN_ID_BYTES,
    "span_id": _SPAN_ID_BYTES,
}


def json_to_protobuf(body: bytes) -> bytes:
    """An OTLP/JSON request as protobuf bytes.

    OTLP/JSON differs from protobuf's JSON mapping in one way that matters here: trace and span ids
    are hex strings, not base64 (the OTLP specification, "JSON Protobuf Encoding")."""
    try:
        document = json.loads(body)
    except (ValueError, RecursionError) as error:
        raise RequestError(f"body is not an OTLP/JSON ExportMetricsServiceRequest: {error}") from None
    _hex_ids_to_base64(document)
    request = ExportMetricsServiceRequest()
    try:
        json_format.ParseDict(document, request, ignore_unknown_fields=True)
    except (json_format.ParseError, RecursionError, TypeError, ValueError) as error:
        raise RequestError(f"body is not an OTLP/JSON ExportMetricsServiceRequest: {error}") from None
    return request.SerializeToString()


def _items(parent: object, *keys: str) -> list:
    """``parent[key]`` for the first key present, when it is a list (else nothing to walk)."""
    if isinstance(parent, dict):
        for key in keys:
            found = parent.get(key)
            if isinstance(found, list):
                return found
    return []


def _hex_ids_to_base64(document: object) -> None:
    for resource_metrics in _items(document, "resourceMetrics", "resource_metrics"):
        for scope_metrics in _items(resource_metrics, "scopeMetrics", "scope_metrics"):
            for metric in _items(scope_metrics, "metrics"):
                if not isinstance(metric, dict):
                    continue
                for kind in _DATA_KINDS:
                    for point in _items(metric.get(kind), "dataPoints", "data_points"):
                        for exemplar in _items(point, "exemplars"):
                            if isinstance(exemplar, dict):
                                _exemplar_ids(exemplar)


def _exemplar_ids(exemplar: dict) -> None:
    for key, size in _ID_FIELDS.items():
        text = exemplar.get(key)
        if text is None or text == "":
            continue
        try:
            raw = bytes.fromhex(text) if isinstance(text, str) and text.isascii() else None
        except ValueError:
            raw = None
        if raw is None or len(raw) != size:
            raise RequestError(f"exemplar {key} must be {2 * size} hex digits (OTLP/JSON), got {str(text)[:40]!r}")
        exemplar[key] = base64.b64encode(raw).decode()


# --- attribute values -----------------------------------------------------------------------------


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
    """An integer attribute in [0, limit], sent as int or as ASCII decimal text; None otherwise."""
    kind = value.WhichOneof("value")
    if kind == "int_value":
        number = value.int_value
    elif kind == "string_value" and _is_decimal(value.string_value):
        number = int(value.string_value)
    else:
        return None
    return number if 0 <= number <= limit else None


def _is_decimal(text: str) -> bool:
    # 20 digits hold any UInt64; longer text is not an integer the store can hold anyway.
    return 0 < len(text) <= 20 and text.isascii() and text.isdigit()


# --- conversion -----------------------------------------------------------------------------------


@dataclass
class Rows:
    """Rows of one piece of a request, column-oriented per table."""

    columns: dict[str, dict[str, list]] = field(default_factory=dict)
    points: int = 0

    def table(self, name: str) -> dict[str, list]:
        found = self.columns.get(name)
        if found is None:
            found = self.columns[name] = {column: [] for column in COLUMNS[name]}
        return found


class Converter:
    """Validates the pieces of one request and lays accepted points out as rows.

    Holds what spans the pieces: the attribute sets seen (flood guard), the rows' bytes so far,
    and the rejections with their reasons (the request's partial success)."""

    def __init__(self, limits: Limits, retention: Retention, now_ns: int) -> None:
        self.limits = limits
        self.newest_ns = now_ns + int(limits.max_future_skew_s * 1e9)
        self.oldest_ns = {
            tables.CERTIFICATE_SAMPLES: now_ns - retention.samples_days * _DAY_NS,
            **{table: now_ns - retention.raw_days * _DAY_NS for table in tables.RAW},
        }
        self.retention_days = {tables.CERTIFICATE_SAMPLES: retention.samples_days}
        self.retention_days.update(dict.fromkeys(tables.RAW, retention.raw_days))
        self.series: set[tuple[str, bytes]] = set()
        self.row_bytes = 0
        self.accepted_points = 0
        self.rejected_points = 0
        # At most a few distinct reasons, for the partial-success error_message.
        self.messages: list[str] = []
        self.rows = Rows()

    # --- bookkeeping --------------------------------------------------------------------------
    def reject(self, count: int, reason: str) -> None:
        self.rejected_points += count
        self.note(reason)

    def note(self, reason: str) -> None:
        if reason not in self.messages and len(self.messages) < 8:
            self.messages.append(reason)

    @property
    def error_message(self) -> str:
        return "; ".join(self.messages)

    def convert(self, request: ExportMetricsServiceRequest) -> Rows:
        """The rows of one piece (a whole request when it is small)."""
        self.rows = Rows()
        for resource_metrics in request.resource_metrics:
            resource_attrs = self.attributes(resource_metrics.resource.attributes)
            resource_problem = resource_attrs if isinstance(resource_attrs, str) else None
            if resource_problem is None and len(resource_metrics.schema_url) > self.limits.max_scope_chars:
                resource_problem = f"a resource schema URL longer than {self.limits.max_scope_chars} characters"
            for scope_metrics in resource_metrics.scope_metrics:
                if resource_problem is not None:
                    scope_problem = f"resource: {resource_problem}"
                else:
                    scope_problem = self.scope_problem(scope_metrics)
                for metric in scope_metrics.metrics:
                    if scope_problem is not None:
                        self.reject(_count_points(metric), scope_problem)
                        continue
                    assert isinstance(resource_attrs, dict)
                    self.metric(resource_metrics, resource_attrs, scope_metrics, metric)
        self.accepted_points += self.rows.points
        return self.rows

    def scope_problem(self, scope_metrics) -> str | None:
        scope, cap = scope_metrics.scope, self.limits.max_scope_chars
        for what, text in (
            ("name", scope.name),
            ("version", scope.version),
            ("schema URL", scope_metrics.schema_url),
        ):
            if len(text) > cap:
                return f"scope: a scope {what} longer than {cap} characters"
        return None

    def attributes(self, attributes) -> dict[str, str] | str:
        """Map of text values, or the reason the attributes are refused."""
        limits = self.limits
        if not attributes:
            return _NO_ATTRIBUTES
        if len(attributes) > limits.max_attributes_per_point:
            return f"more than {limits.max_attributes_per_point} attributes in a set"
        converted = {}
        total = 0
        for kv in attributes:
            key = kv.key
            if len(key) > limits.max_attribute_key_chars:
                return f"an attribute key longer than {limits.max_attribute_key_chars} characters"
            text = any_value_text(kv.value)
            if len(text) > limits.max_attribute_value_chars:
                return f"an attribute value longer than {limits.max_attribute_value_chars} characters"
            total += len(key) + len(text)
            if total > limits.max_attributes_chars:
                return f"attributes of one set longer than {limits.max_attributes_chars} characters in all"
            converted[key] = text
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

    def time_problem(self, name: str, time_ns: int, table: str) -> str | None:
        if time_ns <= 0:
            return f"{name}: time_unix_nano missing"
        if time_ns > self.newest_ns:
            return f"{name}: time_unix_nano more than {self.limits.max_future_skew_s:g} s in the future"
        if time_ns < self.oldest_ns[table]:
            return f"{name}: time_unix_nano older than the {self.retention_days[table]}-day retention of {table}"
        return None

    def take_row_bytes(self, count: int, row_bytes: int) -> int:
        """How many of ``count`` rows of ``row_bytes`` each still fit the request's cap."""
        room = self.limits.max_row_bytes_per_request - self.row_bytes
        fitting = min(count, max(room, 0) // max(row_bytes, 1))
        self.row_bytes += fitting * row_bytes
        if fitting < count:
            self.reject(
                count - fitting,
                f"rows beyond {self.limits.max_row_bytes_per_request} bytes in one request "
                "(resource and scope attributes are copied onto every point)",
            )
        return fitting

    # --- metrics ------------------------------------------------------------------------------
    def metric(self, resource_metrics, resource_attrs: dict[str, str], scope_metrics, metric) -> None:
        kind = metric.WhichOneof("data")
        name = metric.name
        limits = self.limits
        for what, text, cap in (
            ("name", name, limits.max_name_chars),
            ("description", metric.description, limits.max_description_chars),
            ("unit", metric.unit, limits.max_unit_chars),
        ):
            if len(text) > cap:
                self.reject(_count_points(metric), f"a metric {what} longer than {cap} characters")
                return
        if not name:
            self.reject(_count_points(metric), "a metric without a name")
            return
        if name == ts.CERTIFICATE_SAMPLE and kind == "gauge":
            self.samples(resource_attrs, metric)
            return
        if name == ts.CERTIFICATE_SAMPLE or (name in _WITCERT_COUNTERS and kind != "sum"):
            self.reject(_count_points(metric), f"{name} must be a {'gauge' if kind == 'sum' else 'sum'}")
            return
        if kind not in ("sum", "gauge", "histogram"):
            self.reject(_count_points(metric), f"{name}: metric type {kind} has no table here")
            return
        scope = scope_metrics.scope
        scope_attrs = self.attributes(scope.attributes)
        if isinstance(scope_attrs, str):
            self.reject(_count_points(metric), f"scope: {scope_attrs}")
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
        common_bytes = _RAW_ROW_BYTES + sum(len(item) for item in common if isinstance(item, str))
        common_bytes += _map_bytes(resource_attrs) + _map_bytes(scope_attrs)
        if kind == "histogram":
            self.histograms(common, common_bytes, metric)
        else:
            self.numbers(common, common_bytes, metric, kind)

    def point_prefix(self, name: str, point, table: str) -> tuple[list, int] | str:
        """The common columns from Attributes to Exemplars and their bytes, or why the point is refused."""
        problem = self.time_problem(name, point.time_unix_nano, table)
        if problem is not None:
            return problem
        if point.start_time_unix_nano > _MAX_TIME_NS:
            return f"{name}: start_time_unix_nano out of range"
        attributes = self.attributes(point.attributes)
        if isinstance(attributes, str):
            return f"{name}: {attributes}"
        if not self.new_series(name, point.attributes):
            return f"more than {self.limits.max_series_per_request} attribute sets in one request"
        exemplars = _NO_EXEMPLARS
        size = _map_bytes(attributes)
        if point.exemplars:
            if len(point.exemplars) > self.limits.max_exemplars_per_point:
                return f"{name}: more than {self.limits.max_exemplars_per_point} exemplars on a point"
            exemplars = ([], [], [], [], [])
            for exemplar in point.exemplars:
                filtered = self.attributes(exemplar.filtered_attributes)
                if isinstance(filtered, str):
                    return f"{name}: exemplar {filtered}"
                if len(exemplar.trace_id) not in (0, _TRACE_ID_BYTES) or len(exemplar.span_id) not in (
                    0,
                    _SPAN_ID_BYTES,
                ):
                    return f"{name}: exemplar trace_id must be {_TRACE_ID_BYTES} bytes and span_id {_SPAN_ID_BYTES}"
                is_int = exemplar.WhichOneof("value") == "as_int"
                exemplars[0].append(filtered)
                exemplars[1].append(min(exemplar.time_unix_nano, _MAX_TIME_NS))
                exemplars[2].append(float(exemplar.as_int) if is_int else exemplar.as_double)
                exemplars[3].append(exemplar.span_id.hex())
                exemplars[4].append(exemplar.trace_id.hex())
                size += _map_bytes(filtered) + 72
        row = [attributes, point.start_time_unix_nano, point.time_unix_nano, point.flags, *exemplars]
        return row, size

    def numbers(self, common: tuple, common_bytes: int, metric, kind: str) -> None:
        data = getattr(metric, kind)
        name = metric.name
        is_witcert_counter = name in _WITCERT_COUNTERS
        table_name = tables.SUM if kind == "sum" else tables.GAUGE
        table = self.rows.table(table_name)
        extra: tuple = ()
        if kind == "sum":
            extra = (int(data.aggregation_temporality), bool(data.is_monotonic))
            if is_witcert_counter and data.aggregation_temporality != _DELTA:
                self.note(f"{name}: not delta temporality, stored raw but not rolled up")
        for point in data.data_points:
            value = float(point.as_int) if point.WhichOneof("value") == "as_int" else point.as_double
            if is_witcert_counter and not (math.isfinite(value) and value >= 0):
                self.reject(1, f"{name}: increments must be finite and >= 0, got {value}")
                continue
            if name == ts.TAU and not (math.isfinite(value) and value > 0):
                self.reject(1, f"{name}: tau must be finite and > 0, got {value}")
                continue
            prefix = self.point_prefix(name, point, table_name)
            if isinstance(prefix, str):
                self.reject(1, prefix)
                continue
            row, size = prefix
            if not self.take_row_bytes(1, common_bytes + size):
                continue
            self.append(table, (*common, *row, value, *extra))

    def histograms(self, common: tuple, common_bytes: int, metric) -> None:
        data = metric.histogram
        name = metric.name
        table = self.rows.table(tables.HISTOGRAM)
        temporality = int(data.aggregation_temporality)
        for point in data.data_points:
            bounds = list(point.explicit_bounds)
            counts = list(point.bucket_counts)
            if counts and len(counts) != len(bounds) + 1:
                self.reject(1, f"{name}: {len(counts)} bucket counts for {len(bounds)} bounds")
                continue
            if sum(counts) != point.count and counts:
                self.reject(1, f"{name}: bucket counts do not add up to count")
                continue
            if name == ts.CERTIFICATE_VALUE and (math.isnan(point.sum) or point.sum < 0):
                self.reject(1, f"{name}: certificates are >= 0, got sum {point.sum}")
                continue
            prefix = self.point_prefix(name, point, tables.HISTOGRAM)
            if isinstance(prefix, str):
                self.reject(1, prefix)
                continue
            row, size = prefix
            if not self.take_row_bytes(1, common_bytes + size + 16 * len(counts)):
                continue
            minimum = point.min if point.HasField("min") else 0.0
            maximum = point.max if point.HasField("max") else 0.0
            self.append(table, (*common, *row, point.count, point.sum, counts, bounds, minimum, maximum, temporality))

    def append(self, table: dict[str, list], row: tuple) -> None:
        for column, value in zip(table.values(), row, strict=True):
            column.append(value)
        self.rows.points += 1

    def samples(self, resource_attrs: dict[str, str], metric) -> None:
        """The hot path: one typed row per sampled certificate, without building attribute maps."""
        points = metric.gauge.data_points
        tp_text = resource_attrs.get(ts.RESOURCE_TP_RANK, "0")
        if not (_is_decimal(tp_text) and int(tp_text) <= _MAX_UINT16):
            self.reject(len(points), f"{ts.RESOURCE_TP_RANK} must be an integer 0..65535, got {tp_text[:40]!r}")
            return
        constants = (
            ("ServiceName", resource_attrs.get(ts.RESOURCE_SERVICE_NAME, "")),
            ("Instance", resource_attrs.get(ts.RESOURCE_INSTANCE, "")),
            ("Model", resource_attrs.get(ts.RESOURCE_MODEL, "")),
            ("Engine", resource_attrs.get(ts.RESOURCE_ENGINE, "")),
        )
        row_bytes = _SAMPLE_ROW_BYTES + sum(len(text) for _, text in constants)
        table = self.rows.table(tables.CERTIFICATE_SAMPLES)
        timestamps, values, layers, heads, steps = (
            table["Timestamp"],
            table["Value"],
            table["Layer"],
            table["Head"],
            table["Step"],
        )
        oldest, newest = self.oldest_ns[tables.CERTIFICATE_SAMPLES], self.newest_ns
        accepted = 0
        key_layer, key_head, key_step = ts.ATTR_LAYER, ts.ATTR_HEAD, ts.ATTR_STEP
        # The loop every sample goes through: attribute access on upb messages is what it costs,
        # so each field is read once and the oneof asked only when a value reads as zero.
        for point in points:
            value = point.as_double
            if value == 0.0 and point.WhichOneof("value") == "as_int":
                value = float(point.as_int)
            if not value >= 0:  # also catches NaN
                self.reject(1, f"{ts.CERTIFICATE_SAMPLE}: certificates are >= 0 (+inf allowed), got {value}")
                continue
            time_ns = point.time_unix_nano
            if not oldest <= time_ns <= newest:
                self.reject(1, self.time_problem(ts.CERTIFICATE_SAMPLE, time_ns, tables.CERTIFICATE_SAMPLES) or "")
                continue
            layer = head = step = None
            for kv in point.attributes:
                key = kv.key
                any_value = kv.value
                number = any_value.int_value
                if not number:
                    number = _unsigned(any_value, 2**64 - 1)
                if number is None or number < 0:
                    continue
                if key == key_layer:
                    layer = number if number <= _MAX_LAYER_HEAD else None
                elif key == key_head:
                    head = number if number <= _MAX_LAYER_HEAD else None
                elif key == key_step:
                    step = number
            if layer is None or head is None or step is None:
                self.reject(
                    1, f"{ts.CERTIFICATE_SAMPLE}: attributes layer, head (0..65534) and step (>= 0) are required"
                )
                continue
            timestamps.append(time_ns)
            values.append(value)
            layers.append(layer)
            heads.append(head)
            steps.append(step)
            accepted += 1
        excess = accepted - self.take_row_bytes(accepted, row_bytes)
        if excess:  # over the request's cap: the rows just added go again (a piece is small)
            for column in (timestamps, values, layers, heads, steps):
                del column[len(column) - excess :]
            accepted -= excess
        for column, constant in (*constants, ("TpRank", int(tp_text))):
            table[column].extend([constant] * accepted)
        self.rows.points += accepted


def _map_bytes(attributes: dict[str, str]) -> int:
    return sum(len(key) + len(value) for key, value in attributes.items())


def _count_points(metric) -> int:
    kind = metric.WhichOneof("data")
    return len(getattr(metric, kind).data_points) if kind else 0


def convert_request(
    request: ExportMetricsServiceRequest, limits: Limits, retention: Retention | None = None, now_ns: int | None = None
) -> Converter:
    """Validate every data point of a whole (small) request; the rows are in ``.rows``."""
    converter = Converter(limits, retention or Retention(), time.time_ns() if now_ns is None else now_ns)
    converter.convert(request)
    return converter
