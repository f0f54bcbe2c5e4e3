"""Split an encoded OTLP ``ExportMetricsServiceRequest`` into smaller valid requests, by bytes.

Decoding protobuf costs memory in proportion to the number of messages, up to 68 bytes per byte of
input (empty exponential-histogram points, two bytes each on the wire). Splitting a large request
into pieces of at most ``chunk_bytes`` before decoding bounds that cost by the piece, whatever the
request. The split walks only the nesting (resource -> scope -> metric -> data points) and copies
each data point's bytes whole; every piece repeats the resource, scope and metric fields of its
points, so each piece decodes to the same rows those points would give in the whole request.

Pieces are deterministic for given bytes and sizes: a client's retry is split the same way, which
the spool's deduplication labels rely on.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
# ExportMetricsServiceRequest.resource_metrics, ResourceMetrics.scope_metrics, ScopeMetrics.metrics,
# <Gauge|Sum|Histogram|ExponentialHistogram|Summary>.data_points: all field 1 or 2, LEN.
_RESOURCE_METRICS = 1
_SCOPE_METRICS = 2
_METRICS = 2
_DATA_POINTS = 1
# Metric's data oneof: gauge, sum, histogram, exponential_histogram, summary.
_METRIC_DATA = frozenset((5, 7, 9, 10, 11))


class WireError(ValueError):
    """The bytes are not a well-formed protobuf message."""


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while pos < end:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            break
    raise WireError("malformed varint")


def _fields(data: bytes, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(field number, field start, value start, field end) of each field in ``data[start:end]``."""
    pos = start
    while pos < end:
        field_start = pos
        key, pos = _varint(data, pos, end)
        wire_type = key & 7
        if wire_type == _LEN:
            length, pos = _varint(data, pos, end)
            value_start, pos = pos, pos + length
        elif wire_type == _VARINT:
            value_start = pos
            _, pos = _varint(data, pos, end)
        elif wire_type == _I64:
            value_start, pos = pos, pos + 8
        elif wire_type == _I32:
            value_start, pos = pos, pos + 4
        else:
            raise WireError(f"wire type {wire_type} does not occur in OTLP")
        if pos > end:
            raise WireError("a field runs past the end of its message")
        yield key >> 3, field_start, value_start, pos


def _tag(number: int, length: int) -> bytes:
    out = bytearray()
    for value in ((number << 3) | _LEN, length):
        while value >= 0x80:
            out.append((value & 0x7F) | 0x80)
            value >>= 7
        out.append(value)
    return bytes(out)


@dataclass
class _Metric:
    header: list[memoryview]  # every field but the data
    data_field: int
    data_header: list[memoryview]  # the data message's fields but its points
    points: list[memoryview] = field(default_factory=list)

    def encode(self) -> bytes:
        if not self.data_field:  # a metric without data: its own fields only
            return b"".join(self.header)
        data = b"".join([*self.data_header, *self.points])
        return b"".join([*self.header, _tag(self.data_field, len(data)), data])


@dataclass
class _Piece:
    """The part of one request that goes into one output piece, nested as in the request."""

    # [(resource header, [(scope header, [metric, ...]), ...]), ...]
    resources: list[tuple[list[memoryview], list[tuple[list[memoryview], list[_Metric]]]]] = field(default_factory=list)
    size: int = 0

    def encode(self) -> bytes:
        out = []
        for resource_header, scopes in self.resources:
            scope_bytes = []
            for scope_header, metrics in scopes:
                metric_bytes = [m.encode() for m in metrics]
                body = b"".join([*scope_header, *(_tag(_METRICS, len(m)) + m for m in metric_bytes)])
                scope_bytes.append(_tag(_SCOPE_METRICS, len(body)) + body)
            resource = b"".join([*resource_header, *scope_bytes])
            out.append(_tag(_RESOURCE_METRICS, len(resource)) + resource)
        return b"".join(out)


@dataclass
class Split:
    """Pieces of a request, and the points left out because they are too large to decode safely."""

    pieces: list[bytes]
    oversized_points: int = 0
    messages: list[str] = field(default_factory=list)


def _size(parts: list[memoryview]) -> int:
    return sum(len(part) for part in parts)


# Bytes a piece may spend on the length prefixes of its four levels of nesting.
_NESTING = 4 * 11


def split_request(body: bytes, chunk_bytes: int, max_point_bytes: int) -> Split:
    """Cut ``body`` into requests of at most ``chunk_bytes`` (each data point whole).

    A data point over ``max_point_bytes``, or the points of a metric whose resource, scope and metric
    fields together exceed it, are left out and counted. ``chunk_bytes`` must be at least twice
    ``max_point_bytes``, so that any header with any point fits one piece."""
    view = memoryview(body)
    split = Split(pieces=[])
    piece = _Piece()

    def flush() -> None:
        nonlocal piece
        if piece.resources:
            split.pieces.append(piece.encode())
        piece = _Piece()

    def reject(count: int, reason: str) -> None:
        split.oversized_points += count
        if reason not in split.messages:
            split.messages.append(reason)

    for number, _, value_start, end in _fields(body, 0, len(body)):
        if number != _RESOURCE_METRICS:
            continue
        resource_header, scopes = _children(body, view, value_start, end, _SCOPE_METRICS)
        for scope_start, scope_end in scopes:
            scope_header, metrics = _children(body, view, scope_start, scope_end, _METRICS)
            for metric_start, metric_end in metrics:
                metric_header, data = [], None
                for inner, start, inner_value, inner_end in _fields(body, metric_start, metric_end):
                    if inner in _METRIC_DATA and data is None:
                        data = (inner, inner_value, inner_end)
                    else:
                        metric_header.append(view[start:inner_end])
                data_header: list[memoryview] = []
                count = 0  # first pass: the data message's own fields, and how many points
                if data is not None:
                    for _ in _point_spans(body, data[1], data[2], data_header):
                        count += 1
                header_size = _size(resource_header) + _size(scope_header) + _size(metric_header) + _size(data_header)
                if header_size > max_point_bytes:
                    largest = max(
                        (_size(resource_header), "resource (attributes, schema URL)"),
                        (_size(scope_header), "scope (name, version, attributes, schema URL)"),
                        (_size(metric_header) + _size(data_header), "metric (name, description, unit, metadata)"),
                    )[1]
                    reject(count, f"the fields of a {largest} exceed {max_point_bytes} encoded bytes")
                    continue
                metric = None
                run_start = run_end = -1  # the points taken last, contiguous in the request
                for start, end in _point_spans(body, data[1], data[2]) if data is not None else ():
                    if end - start > max_point_bytes:
                        reject(1, f"a data point (attributes, exemplars) of more than {max_point_bytes} encoded bytes")
                        continue
                    if metric is not None and piece.size + end - start > chunk_bytes:
                        metric.points.append(view[run_start:run_end])
                        flush()
                        metric = None
                    if metric is None:
                        metric = _Metric(metric_header, data[0], data_header)
                        _place(piece, resource_header, scope_header, metric)
                        piece.size += header_size + _NESTING
                        run_start = run_end = start
                    elif start != run_end:
                        metric.points.append(view[run_start:run_end])
                        run_start = start
                    run_end = end
                    piece.size += end - start
                if metric is not None:
                    metric.points.append(view[run_start:run_end])
                else:  # no points (or none kept): the metric still goes through its own checks
                    if piece.size + header_size + _NESTING > chunk_bytes:
                        flush()
                    data_field = data[0] if data is not None else 0
                    _place(piece, resource_header, scope_header, _Metric(metric_header, data_field, data_header))
                    piece.size += header_size + _NESTING
    flush()
    return split


def _children(
    body: bytes, view: memoryview, start: int, end: int, number: int
) -> tuple[list[memoryview], list[tuple[int, int]]]:
    """A message's fields but ``number`` (its header), and the value spans of its ``number`` fields."""
    header, children = [], []
    for inner, field_start, value_start, field_end in _fields(body, start, end):
        if inner == number:
            children.append((value_start, field_end))
        else:
            header.append(view[field_start:field_end])
    return header, children


def _point_spans(
    body: bytes, start: int, end: int, header: list[memoryview] | None = None
) -> Iterator[tuple[int, int]]:
    """(start, end) of each data point of a data message; its other fields go to ``header``.

    The loop every point of a large request goes through, twice (nothing is kept per point):
    one-byte keys and lengths are read inline."""
    pos = start
    point_key = (_DATA_POINTS << 3) | _LEN
    while pos < end:
        if body[pos] == point_key:
            length = body[pos + 1] if pos + 1 < end else 0x80
            value_start = pos + 2
            if length >= 0x80:
                length, value_start = _varint(body, pos + 1, end)
            field_end = value_start + length
            if field_end > end:
                raise WireError("a data point runs past the end of its message")
            yield pos, field_end
            pos = field_end
            continue
        for _, field_start, _, field_end in _fields(body, pos, end):
            if header is not None:
                header.append(memoryview(body)[field_start:field_end])
            pos = field_end
            break


def _place(piece: _Piece, resource_header: list, scope_header: list, metric: _Metric) -> None:
    """Append a metric under its resource and scope, opening them unless they are the last ones."""
    if not piece.resources or piece.resources[-1][0] is not resource_header:
        piece.resources.append((resource_header, []))
    scopes = piece.resources[-1][1]
    if not scopes or scopes[-1][0] is not scope_header:
        scopes.append((scope_header, []))
    scopes[-1][1].append(metric)
