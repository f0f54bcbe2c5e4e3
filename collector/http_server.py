"""OTLP/HTTP receiver (``POST /v1/metrics``, protobuf or JSON, gzip), health and the read API.

Status codes follow the OTLP/HTTP spec: 200 (with ``partial_success`` when points were rejected),
400 for an undecodable body (final, the client must not retry), 401, 404, 405, 411, 413, 415, and
503 with ``Retry-After`` when the spool is full, the store has been down too long, or too many
request bytes are in memory at once. Error bodies are ``google.rpc.Status`` in the request's encoding.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
import zlib
from collections.abc import Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, urlsplit

from google.protobuf import json_format
from google.rpc import status_pb2
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse

from witcert.collector import api
from witcert.collector.config import parse_listen_address
from witcert.collector.requests import ApiRequest, Outcome, Route

if TYPE_CHECKING:
    from witcert.collector.pipeline import Pipeline

log = logging.getLogger(__name__)

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
_MAX_CONNECTIONS = 256
_SOCKET_TIMEOUT_S = 30.0


class PayloadTooLarge(ValueError):
    pass


def gunzip_capped(body: bytes, limit: int) -> bytes:
    """Decompress a gzip body, refusing to produce more than ``limit`` bytes (a gzip bomb)."""
    decompressor = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        output = decompressor.decompress(body, limit + 1)
        if len(output) > limit or decompressor.unconsumed_tail:
            raise PayloadTooLarge(f"decompressed body exceeds {limit} bytes")
        output += decompressor.flush()
    except zlib.error as error:
        raise ValueError(f"corrupt gzip body: {error}") from None
    if not decompressor.eof:
        raise ValueError("corrupt gzip body: truncated stream")
    if len(output) > limit:
        raise PayloadTooLarge(f"decompressed body exceeds {limit} bytes")
    return output


class _InflightBudget:
    """Bytes of request bodies held in memory across all connections."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def acquire(self, amount: int) -> bool:
        with self._lock:
            if self.used + amount > self.limit:
                return False
            self.used += amount
            return True

    def release(self, amount: int) -> None:
        with self._lock:
            self.used -= amount


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # The default listen backlog (5) drops connections under a burst of exporters.
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], collector: Pipeline, routes: Sequence[Route]) -> None:
        self.collector = collector
        self.routes = tuple(routes)
        self.budget = _InflightBudget(collector.config.limits.max_inflight_bytes)
        self.connection_slots = threading.BoundedSemaphore(_MAX_CONNECTIONS)
        super().__init__(address, _Handler)

    def process_request(self, request, client_address) -> None:
        # Bound the threads: beyond the cap, a connection is closed at once (clients retry).
        if not self.connection_slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.connection_slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.connection_slots.release()


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    timeout = _SOCKET_TIMEOUT_S
    server_version = "witcert-collector"

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    # --- helpers ----------------------------------------------------------------------------
    def _send(self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, message: str, content_type: str = JSON, retry_after: int | None = None) -> None:
        status_message = status_pb2.Status(code=_grpc_code(status), message=message)
        if content_type == PROTOBUF:
            body = status_message.SerializeToString()
        else:
            content_type = JSON
            body = json_format.MessageToJson(status_message, indent=None).encode()
        headers = {"Retry-After": str(retry_after)} if retry_after else {}
        if status >= 400 and self.headers.get("Content-Length") and not getattr(self, "_body_read", False):
            # The body was not read: close so that its bytes are not parsed as the next request.
            headers["Connection"] = "close"
            self.close_connection = True
        self._send(status, body, content_type, headers)

    def _authorized(self) -> bool:
        token = self.server.collector.config.token
        if token is None:
            return True
        supplied = self.headers.get("Authorization", "")
        return hmac.compare_digest(supplied.encode(), f"Bearer {token}".encode())

    # --- routes -----------------------------------------------------------------------------
    def do_POST(self) -> None:
        path = urlsplit(self.path).path
        if path != "/v1/metrics":
            self._error(HTTPStatus.NOT_FOUND, f"no such endpoint: POST {path} (OTLP metrics go to /v1/metrics)")
            return
        if not self._authorized():
            self._error(HTTPStatus.UNAUTHORIZED, "missing or wrong bearer token")
            return
        content_type = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if content_type not in (PROTOBUF, JSON):
            self._error(
                HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                f"Content-Type {content_type or '(none)'} is not supported: use {PROTOBUF} or {JSON}",
            )
            return
        encoding = self.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("identity", "gzip"):
            self._error(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, f"Content-Encoding {encoding} is not supported: use gzip")
            return
        length_text = self.headers.get("Content-Length")
        if length_text is None or not length_text.isdigit():
            self._error(HTTPStatus.LENGTH_REQUIRED, "Content-Length is required (chunked bodies are not accepted)")
            return
        length = int(length_text)
        limits = self.server.collector.config.limits
        if length > limits.max_body_bytes:
            self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body of {length} bytes exceeds {limits.max_body_bytes}")
            return
        if not self.server.budget.acquire(length):
            self._error(
                HTTPStatus.SERVICE_UNAVAILABLE,
                "too many request bytes in flight",
                content_type,
                retry_after=limits.retry_after_s,
            )
            return
        try:
            self._export(length, content_type, encoding)
        finally:
            self.server.budget.release(length)

    def _export(self, length: int, content_type: str, encoding: str) -> None:
        limits = self.server.collector.config.limits
        body = self.rfile.read(length)
        self._body_read = True
        if len(body) != length:
            self._error(HTTPStatus.BAD_REQUEST, f"body ended after {len(body)} of {length} bytes", content_type)
            self.close_connection = True
            return
        if encoding == "gzip":
            try:
                body = gunzip_capped(body, limits.max_decompressed_bytes)
            except PayloadTooLarge as error:
                self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, str(error), content_type)
                return
            except ValueError as error:
                self._error(HTTPStatus.BAD_REQUEST, str(error), content_type)
                return
        try:
            result = self.server.collector.ingest(body, content_type)
        except Exception:  # a bug must cost one request, not the connection or the service
            log.exception("ingest failed")
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error while ingesting", content_type)
            return
        if result.outcome is Outcome.INVALID:
            self._error(HTTPStatus.BAD_REQUEST, result.message, content_type)
            return
        if result.outcome is Outcome.UNAVAILABLE:
            self._error(HTTPStatus.SERVICE_UNAVAILABLE, result.message, content_type, limits.retry_after_s)
            return
        response = ExportMetricsServiceResponse()
        if result.rejected_points or result.message:
            response.partial_success.rejected_data_points = result.rejected_points
            response.partial_success.error_message = result.message
        if content_type == PROTOBUF:
            self._send(HTTPStatus.OK, response.SerializeToString(), PROTOBUF)
        else:
            self._send(HTTPStatus.OK, json_format.MessageToJson(response, indent=None).encode(), JSON)

    def do_GET(self) -> None:
        parts = urlsplit(self.path)
        path = parts.path
        collector = self.server.collector
        if path == "/healthz":
            self._send(HTTPStatus.OK, b'{"status":"ok"}', JSON)
            return
        if path == "/readyz":
            ready, report = collector.readiness()
            status = HTTPStatus.OK if ready else HTTPStatus.SERVICE_UNAVAILABLE
            self._send(status, json.dumps(report).encode(), JSON)
            return
        if not self._authorized():
            self._error(HTTPStatus.UNAUTHORIZED, "missing or wrong bearer token")
            return
        request = ApiRequest(
            path=path,
            params=dict(parse_qsl(parts.query, keep_blank_values=True)),
            headers={name.lower(): value for name, value in self.headers.items()},
            queries=collector.queries,
        )
        for route in self.server.routes:
            if path == route.prefix or path.startswith(route.prefix.rstrip("/") + "/"):
                try:
                    response = route.handler(request)
                except Exception:  # a mounted page must never take the collector down
                    log.exception("route %s failed", route.prefix)
                    self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error serving {path}")
                    return
                self._send(response.status, response.body, response.content_type, dict(response.headers))
                return
        self._error(HTTPStatus.NOT_FOUND, f"no such endpoint: GET {path}")

    do_HEAD = do_GET

    def _method_not_allowed(self) -> None:
        self._error(HTTPStatus.METHOD_NOT_ALLOWED, f"method {self.command} is not allowed here")

    do_PUT = do_DELETE = do_PATCH = _method_not_allowed


def _grpc_code(http_status: int) -> int:
    """The google.rpc code matching an HTTP status, as the OTLP spec pairs them."""
    return {
        400: 3,  # INVALID_ARGUMENT
        401: 16,  # UNAUTHENTICATED
        404: 5,  # NOT_FOUND
        405: 12,  # UNIMPLEMENTED
        411: 3,
        413: 8,  # RESOURCE_EXHAUSTED
        415: 3,
        429: 8,
        503: 14,  # UNAVAILABLE
    }.get(http_status, 2)  # UNKNOWN


def start_http_server(collector: Pipeline, address: str, extra_routes: Sequence[Route] = ()) -> tuple[_Server, int]:
    host, port = parse_listen_address(address)
    try:
        server = _Server((host, port), collector, (*api.routes(), *extra_routes))
    except OSError as error:
        raise OSError(f"cannot listen for OTLP/HTTP on {address}: {error.strerror}") from None
    thread = threading.Thread(target=server.serve_forever, name="witcert-otlp-http", daemon=True)
    thread.start()
    return server, server.server_address[1]
