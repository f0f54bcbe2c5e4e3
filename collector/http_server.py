"""OTLP/HTTP receiver (``POST /v1/metrics``, protobuf or JSON, gzip), health, metrics and the read API.

Served by aiohttp (asynchronous, maintained; chosen over uvicorn because its connections are
closed when their request headers do not arrive within the keep-alive timeout, the first request
included, and because it reads and discards the rest of a body a handler answered early, so a
client that writes its whole body before reading still sees the 413 or 503). One event loop in
its own thread accepts every connection; decoding runs on ``ingest_workers`` threads, reads of
the store on their own threads, so /healthz and /readyz answer while ingest is saturated.

Load is shed, never queued without bound: beyond ``ingest_workers + max_queued_requests``
requests in progress, or ``max_connections`` connections, or when the memory budget cannot hold
the body, a request gets 503 with ``Retry-After`` at once. Status codes follow the OTLP/HTTP spec:
200 (with ``partial_success`` when points were rejected), 400 for an undecodable body (final),
401, 404, 405, 408 (body too slow), 411, 413, 415, 503. Error bodies are ``google.rpc.Status`` in
the request's encoding.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus

from aiohttp import web
from google.protobuf import json_format
from google.rpc import status_pb2
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse

from witcert.collector import api
from witcert.collector.budget import Hold
from witcert.collector.config import CONNECTION_BUFFER_BYTES, parse_listen_address
from witcert.collector.otlp import JSON, PROTOBUF
from witcert.collector.pipeline import Pipeline
from witcert.collector.requests import ApiRequest, ApiResponse, Outcome, Route
from witcert.collector.store import StoreError

log = logging.getLogger(__name__)

_READ_STEP = 256 * 1024
_STATUS_FOR = {
    Outcome.INVALID: HTTPStatus.BAD_REQUEST,
    Outcome.TOO_LARGE: HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
    Outcome.UNAVAILABLE: HTTPStatus.SERVICE_UNAVAILABLE,
}


def _grpc_code(http_status: int) -> int:
    """The google.rpc code matching an HTTP status, as the OTLP spec pairs them."""
    return {
        400: 3,  # INVALID_ARGUMENT
        401: 16,  # UNAUTHENTICATED
        404: 5,  # NOT_FOUND
        405: 12,  # UNIMPLEMENTED
        408: 4,  # DEADLINE_EXCEEDED
        411: 3,
        413: 8,  # RESOURCE_EXHAUSTED
        415: 3,
        429: 8,
        503: 14,  # UNAVAILABLE
    }.get(http_status, 2)  # UNKNOWN


def _error(status: int, message: str, content_type: str = JSON, retry_after: int | None = None) -> web.Response:
    status_message = status_pb2.Status(code=_grpc_code(status), message=message)
    if content_type == PROTOBUF:
        body = status_message.SerializeToString()
    else:
        content_type = JSON
        body = json_format.MessageToJson(status_message, indent=None).encode()
    headers = {"Retry-After": str(retry_after)} if retry_after else {}
    return web.Response(status=status, body=body, content_type=content_type, headers=headers)


def metrics_text(pipeline: Pipeline) -> str:
    """The collector's own counters and gauges in the Prometheus text format."""
    ready, report = pipeline.readiness()
    lines = []
    for name, value in report["counters"].items():
        lines += [f"# TYPE witcert_collector_{name} counter", f"witcert_collector_{name}_total {value}"]
    dead = report["dead_letter"]
    for name, value in (
        ("ready", int(ready)),
        ("store_ok", int(report["store_ok"])),
        ("spool_bytes", report["spool_bytes"]),
        ("spool_points", report["spool_points"]),
        ("memory_in_use_bytes", report["memory_in_use_bytes"]),
        ("memory_budget_bytes", report["memory_budget_bytes"]),
        ("dead_letter_records", dead["records"]),
        ("dead_letter_points", dead["points"]),
    ):
        lines += [f"# TYPE witcert_collector_{name} gauge", f"witcert_collector_{name} {value}"]
    return "\n".join(lines) + "\n"


class HttpReceiver:
    """The aiohttp application and its event-loop thread."""

    def __init__(self, pipeline: Pipeline, address: str, routes: Sequence[Route]) -> None:
        self.pipeline = pipeline
        self.address = address
        self.routes = tuple(routes)
        limits = pipeline.config.limits
        self.limits = limits
        self._ingest_pool = ThreadPoolExecutor(limits.ingest_workers, thread_name_prefix="witcert-ingest")
        self._read_pool = ThreadPoolExecutor(2, thread_name_prefix="witcert-read")
        self._in_progress = 0  # ingest requests admitted (decoding or waiting for a worker); loop thread only
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    # --- lifecycle --------------------------------------------------------------------------
    def start(self) -> int:
        host, port = parse_listen_address(self.address)
        started = threading.Event()
        failure: list[BaseException] = []

        async def serve() -> None:
            app = web.Application(client_max_size=self.limits.max_body_bytes)
            app.router.add_route("*", "/{tail:.*}", self._dispatch)
            self._runner = web.AppRunner(
                app,
                access_log=None,
                shutdown_timeout=2.0,
                keepalive_timeout=self.limits.header_timeout_s,
                lingering_time=self.limits.body_timeout_s,
                read_bufsize=CONNECTION_BUFFER_BYTES // 2,
                # Bodies are inflated by the pipeline, against the memory budget and its cap.
                auto_decompress=False,
            )
            await self._runner.setup()
            site = web.TCPSite(self._runner, host, port, backlog=512, reuse_address=True)
            await site.start()
            self.port = self._runner.addresses[0][1]

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(serve())
            except BaseException as error:  # reported to start() below
                failure.append(error)
                started.set()
                return
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="witcert-otlp-http", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            self._thread.join()
            self._shutdown_pools()
            error = failure[0]
            reason = error.strerror if isinstance(error, OSError) and error.strerror else error
            raise OSError(f"cannot listen for OTLP/HTTP on {self.address}: {reason}") from None
        assert self.port is not None
        return self.port

    def stop(self) -> None:
        if self._thread is None:
            return
        runner = self._runner

        async def close() -> None:
            if runner is not None:
                await runner.cleanup()
            others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in others:  # connections still open (keep-alive clients): end their handlers
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._thread = None
        self._loop.close()
        self._shutdown_pools()

    def _shutdown_pools(self) -> None:
        self._ingest_pool.shutdown(wait=True, cancel_futures=True)
        self._read_pool.shutdown(wait=True, cancel_futures=True)

    # --- routing ----------------------------------------------------------------------------
    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        server = self._runner.server if self._runner is not None else None
        if server is not None and len(server.connections) > self.limits.max_connections:
            response = _error(
                HTTPStatus.SERVICE_UNAVAILABLE, "too many open connections", retry_after=self.limits.retry_after_s
            )
            response.force_close()
            return response
        if request.method == "POST":
            return await self._post(request)
        if request.method in ("GET", "HEAD"):
            return await self._get(request)
        return _error(HTTPStatus.METHOD_NOT_ALLOWED, f"method {request.method} is not allowed here")

    def _authorized(self, request: web.Request) -> bool:
        token = self.pipeline.config.token
        if token is None:
            return True
        supplied = request.headers.get("Authorization", "")
        return hmac.compare_digest(supplied.encode(), f"Bearer {token}".encode())

    # --- OTLP -------------------------------------------------------------------------------
    async def _post(self, request: web.Request) -> web.StreamResponse:
        limits = self.limits
        if request.path != "/v1/metrics":
            return _error(
                HTTPStatus.NOT_FOUND, f"no such endpoint: POST {request.path} (OTLP metrics go to /v1/metrics)"
            )
        if not self._authorized(request):
            return _error(HTTPStatus.UNAUTHORIZED, "missing or wrong bearer token")
        content_type = request.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if content_type not in (PROTOBUF, JSON):
            return _error(
                HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                f"Content-Type {content_type or '(none)'} is not supported: use {PROTOBUF} or {JSON}",
            )
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("identity", "gzip"):
            return _error(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, f"Content-Encoding {encoding} is not supported: use gzip")
        length = request.content_length
        if length is None:
            return _error(HTTPStatus.LENGTH_REQUIRED, "Content-Length is required (chunked bodies are not accepted)")
        if length > limits.max_body_bytes:
            return _error(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"body of {length} bytes exceeds {limits.max_body_bytes}",
                content_type,
            )
        hold = self.pipeline.budget.hold()
        try:
            # A slow upload holds only the bytes it sent (and is cut at body_timeout_s), never a
            # decoding slot: the slots go to requests whose bodies are in.
            body = await self._read_body(request, length, hold)
        except BaseException:
            hold.release_all()
            raise
        if isinstance(body, web.Response):
            hold.release_all()
            return body
        if self._in_progress >= limits.ingest_workers + limits.max_queued_requests:
            hold.release_all()
            return _error(
                HTTPStatus.SERVICE_UNAVAILABLE,
                "the collector is busy decoding other requests",
                content_type,
                retry_after=limits.retry_after_s,
            )
        self._in_progress += 1
        try:
            loop = asyncio.get_running_loop()
            result = await loop.run_in_executor(
                self._ingest_pool, self.pipeline.ingest, body, content_type, encoding, hold
            )
        except Exception:  # a bug must cost one request, not the connection or the service
            log.exception("ingest failed")
            return _error(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error while ingesting", content_type)
        finally:
            hold.release_all()
            self._in_progress -= 1
        if result.outcome in _STATUS_FOR:
            status = _STATUS_FOR[result.outcome]
            retry = limits.retry_after_s if result.outcome is Outcome.UNAVAILABLE else None
            return _error(status, result.message, content_type, retry)
        response = ExportMetricsServiceResponse()
        if result.rejected_points or result.message:
            response.partial_success.rejected_data_points = result.rejected_points
            response.partial_success.error_message = result.message
        if content_type == PROTOBUF:
            return web.Response(body=response.SerializeToString(), content_type=PROTOBUF)
        return web.Response(body=json_format.MessageToJson(response, indent=None).encode(), content_type=JSON)

    async def _read_body(self, request: web.Request, length: int, hold: Hold) -> bytes | web.Response:
        """The body, reserved from the budget as it arrives, within ``body_timeout_s``."""
        content_type = request.headers.get("Content-Type", "").split(";")[0].strip().lower()
        parts: list[bytes] = []
        received = 0
        try:
            async with asyncio.timeout(self.limits.body_timeout_s):
                while received < length:
                    chunk = await request.content.read(min(_READ_STEP, length - received))
                    if not chunk:
                        break
                    if not hold.try_take(len(chunk)):
                        return _error(
                            HTTPStatus.SERVICE_UNAVAILABLE,
                            "the memory budget is in use by other requests",
                            content_type,
                            retry_after=self.limits.retry_after_s,
                        )
                    parts.append(chunk)
                    received += len(chunk)
        except TimeoutError:
            response = _error(
                HTTPStatus.REQUEST_TIMEOUT,
                f"body not received within {self.limits.body_timeout_s:g} s ({received} of {length} bytes)",
                content_type,
            )
            response.force_close()
            return response
        if received != length:
            response = _error(HTTPStatus.BAD_REQUEST, f"body ended after {received} of {length} bytes", content_type)
            response.force_close()
            return response
        if len(parts) == 1:
            return parts[0]
        if not hold.try_take(length):  # joined: both copies for a moment
            return _error(
                HTTPStatus.SERVICE_UNAVAILABLE,
                "the memory budget is in use by other requests",
                content_type,
                retry_after=self.limits.retry_after_s,
            )
        body = b"".join(parts)
        parts.clear()
        hold.give_back(length)
        return body

    # --- health, metrics, read API, mounted pages --------------------------------------------
    async def _get(self, request: web.Request) -> web.StreamResponse:
        if request.body_exists:
            return _error(HTTPStatus.BAD_REQUEST, f"{request.method} requests take no body")
        path = request.path
        if path == "/healthz":
            return web.Response(body=b'{"status":"ok"}', content_type=JSON)
        if path == "/readyz":
            ready, report = self.pipeline.readiness()
            status = HTTPStatus.OK if ready else HTTPStatus.SERVICE_UNAVAILABLE
            return web.Response(status=status, body=json.dumps(report).encode(), content_type=JSON)
        if path == "/metrics":
            return web.Response(text=metrics_text(self.pipeline), content_type="text/plain", charset="utf-8")
        if not self._authorized(request):
            return _error(HTTPStatus.UNAUTHORIZED, "missing or wrong bearer token")
        for route in self.routes:
            if path == route.prefix or path.startswith(route.prefix.rstrip("/") + "/"):
                api_request = ApiRequest(
                    path=path,
                    params=dict(request.query),
                    headers={name.lower(): value for name, value in request.headers.items()},
                    queries=self.pipeline.queries,
                )
                loop = asyncio.get_running_loop()
                try:
                    answer: ApiResponse = await loop.run_in_executor(self._read_pool, route.handler, api_request)
                except StoreError as error:
                    return _error(HTTPStatus.SERVICE_UNAVAILABLE, str(error), retry_after=self.limits.retry_after_s)
                except Exception:  # a mounted page must never take the collector down
                    log.exception("route %s failed", route.prefix)
                    return _error(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error serving {path}")
                return web.Response(
                    status=answer.status,
                    body=answer.body,
                    headers={"Content-Type": answer.content_type, **dict(answer.headers)},
                )
        return _error(HTTPStatus.NOT_FOUND, f"no such endpoint: GET {path}")


def start_http_server(pipeline: Pipeline, address: str, extra_routes: Sequence[Route] = ()) -> tuple[HttpReceiver, int]:
    receiver = HttpReceiver(pipeline, address, (*api.routes(), *extra_routes))
    return receiver, receiver.start()
