"""Prebuilt OTLP requests and a minimal keep-alive OTLP/HTTP client: the replay load of the
benchmark and the reliability tests, shaped like the engine's raw certificate samples."""

from __future__ import annotations

import gzip
import http.client
import math
import random
from dataclasses import dataclass

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from witcert.integrations.telemetry import schema as ts


def samples_request(
    model: str,
    instance: str,
    layers: int,
    heads: int,
    steps: range,
    time_ns: int,
    inf_every: int = 0,
    rng: random.Random | None = None,
    step_ns: int = 20_000_000,
) -> ExportMetricsServiceRequest:
    """One request with a sample per (layer, head, step): value ``(layer + head + step) % 100 / 1000``
    (exactly predictable, for tests), or log-normal with median 0.018 when ``rng`` is given (as
    incompressible as real certificates, for disk figures); +inf for every ``inf_every``-th point
    (0: never). Step ``s`` is stamped ``time_ns + s * step_ns`` (default: 50 decode steps a second)."""
    request = ExportMetricsServiceRequest()
    resource_metrics = request.resource_metrics.add()
    for key, value in (
        (ts.RESOURCE_SERVICE_NAME, "witcert-engine"),
        (ts.RESOURCE_INSTANCE, instance),
        (ts.RESOURCE_MODEL, model),
        (ts.RESOURCE_ENGINE, "loadgen"),
        (ts.RESOURCE_TP_RANK, "0"),
    ):
        resource_metrics.resource.attributes.add(key=key, value=AnyValue(string_value=value))
    scope_metrics = resource_metrics.scope_metrics.add()
    scope_metrics.scope.name = ts.INSTRUMENTATION_SCOPE
    points = scope_metrics.metrics.add(name=ts.CERTIFICATE_SAMPLE).gauge.data_points
    index = 0
    for step in steps:
        for layer in range(layers):
            for head in range(heads):
                index += 1
                if inf_every and index % inf_every == 0:
                    value = math.inf
                elif rng is not None:
                    value = rng.lognormvariate(-4.0, 1.5)
                else:
                    value = ((layer + head + step) % 100) / 1000
                point = points.add(time_unix_nano=time_ns + step * step_ns, as_double=value)
                point.attributes.add(key=ts.ATTR_LAYER, value=AnyValue(int_value=layer))
                point.attributes.add(key=ts.ATTR_HEAD, value=AnyValue(int_value=head))
                point.attributes.add(key=ts.ATTR_STEP, value=AnyValue(int_value=step))
    return request


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def partial_success(self) -> tuple[int, str]:
        response = ExportMetricsServiceResponse.FromString(self.body)
        return response.partial_success.rejected_data_points, response.partial_success.error_message


class OtlpHttpClient:
    """Keep-alive POSTs to ``/v1/metrics``; reconnects once when the server closed the connection."""

    def __init__(self, host: str, port: int, token: str | None = None, timeout_s: float = 30.0) -> None:
        self.host, self.port, self.token, self.timeout_s = host, port, token, timeout_s
        self._connection: http.client.HTTPConnection | None = None

    def post(
        self,
        body: bytes,
        content_type: str = "application/x-protobuf",
        compress: bool = False,
        headers: dict[str, str] | None = None,
        path: str = "/v1/metrics",
    ) -> Reply:
        all_headers = {"Content-Type": content_type}
        if compress:
            body = gzip.compress(body, compresslevel=1)
            all_headers["Content-Encoding"] = "gzip"
        if self.token:
            all_headers["Authorization"] = f"Bearer {self.token}"
        all_headers.update(headers or {})
        for attempt in range(2):
            if self._connection is None:
                self._connection = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
            try:
                self._connection.request("POST", path, body=body, headers=all_headers)
                response = self._connection.getresponse()
                data = response.read()
            except (ConnectionError, http.client.HTTPException):
                self.close()
                if attempt:
                    raise
                continue
            if response.getheader("Connection", "").lower() == "close":
                self.close()
            return Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, data)
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None
