"""OTLP/gRPC receiver: ``opentelemetry.proto.collector.metrics.v1.MetricsService/Export``.

The handler takes the request's raw bytes (grpc has already undone gzip, within the message size
cap), so client retries are recognised by the same body hash as over HTTP. What grpc holds before
the handler runs is bounded by ``grpc_workers`` concurrent calls of ``max_grpc_message_bytes``. Refusals carry a
``google.rpc.RetryInfo`` in ``grpc-status-details-bin``, as the OTLP spec asks.
"""

from __future__ import annotations

import hmac
from concurrent import futures
from typing import TYPE_CHECKING

import grpc
from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse

from witcert.collector.config import parse_listen_address
from witcert.collector.otlp import PROTOBUF
from witcert.collector.requests import Outcome

if TYPE_CHECKING:
    from witcert.collector.pipeline import Pipeline

_SERVICE = "opentelemetry.proto.collector.metrics.v1.MetricsService"


def _abort_with_retry(context: grpc.ServicerContext, message: str, retry_after_s: int) -> None:
    retry = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=retry_after_s))
    status = status_pb2.Status(code=code_pb2.UNAVAILABLE, message=message)
    status.details.add().Pack(retry)
    context.set_trailing_metadata((("grpc-status-details-bin", status.SerializeToString()),))
    context.abort(grpc.StatusCode.UNAVAILABLE, message)


def _export_handler(collector: Pipeline):
    limits = collector.config.limits

    def export(body: bytes, context: grpc.ServicerContext) -> bytes:
        token = collector.config.token
        if token is not None:
            supplied = dict(context.invocation_metadata()).get("authorization", "")
            if not hmac.compare_digest(supplied.encode(), f"Bearer {token}".encode()):
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        with collector.budget.hold() as hold:
            # grpc already holds the message; it still counts against the budget while it is decoded.
            if not hold.try_take(len(body)):
                _abort_with_retry(context, "the memory budget is in use by other requests", limits.retry_after_s)
            result = collector.ingest(body, PROTOBUF, "identity", hold)
        if result.outcome is Outcome.INVALID:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, result.message)
        if result.outcome is Outcome.TOO_LARGE:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, result.message)
        if result.outcome is Outcome.UNAVAILABLE:
            _abort_with_retry(context, result.message, limits.retry_after_s)
        response = ExportMetricsServiceResponse()
        if result.rejected_points or result.message:
            response.partial_success.rejected_data_points = result.rejected_points
            response.partial_success.error_message = result.message
        return response.SerializeToString()

    return export


def start_grpc_server(collector: Pipeline, address: str) -> tuple[grpc.Server, int]:
    host, port = parse_listen_address(address)
    limit = collector.config.limits.max_grpc_message_bytes
    workers = collector.config.grpc_workers
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="witcert-grpc"),
        options=[("grpc.max_receive_message_length", limit), ("grpc.so_reuseport", 0)],
        # Bounds memory: at most this many messages (each <= max_grpc_message_bytes once inflated)
        # are held at once; beyond, grpc answers RESOURCE_EXHAUSTED.
        maximum_concurrent_rpcs=workers,
    )
    handler = grpc.unary_unary_rpc_method_handler(_export_handler(collector))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, {"Export": handler}),))
    try:
        bound = server.add_insecure_port(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    except RuntimeError as error:  # grpc reports a busy port this way
        raise OSError(f"cannot listen for OTLP/gRPC on {address}: {error}") from None
    if bound == 0:
        raise OSError(f"cannot listen for OTLP/gRPC on {address}")
    server.start()
    return server, bound
