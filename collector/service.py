"""The collector process: OTLP receivers -> pipeline (durable spool -> drain -> store), plus read API.

``Collector(config).start()`` runs everything in-process (``witcert collector``, ``witcert demo``,
tests) and returns the bound ports; ``stop()`` stops the receivers, gives the drain a moment,
and closes the store. Later stages mount read-only pages with ``extra_routes`` (the collector
never imports them); their request and response types are in ``requests``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from witcert.collector.config import CollectorConfig
from witcert.collector.grpc_server import start_grpc_server
from witcert.collector.http_server import start_http_server
from witcert.collector.pipeline import Counters, Pipeline
from witcert.collector.queries import Queries
from witcert.collector.requests import Route
from witcert.collector.spool import Spool
from witcert.collector.store import Store


@dataclass(frozen=True)
class BoundPorts:
    http: int | None
    grpc: int | None


class Collector:
    """The pipeline with its OTLP/HTTP (and read API, mounted routes) and OTLP/gRPC receivers."""

    def __init__(self, config: CollectorConfig, extra_routes: Sequence[Route] = ()) -> None:
        self.config = config
        self.extra_routes = tuple(extra_routes)
        self.pipeline = Pipeline(config)
        self.ports = BoundPorts(http=None, grpc=None)
        self._http = None
        self._grpc = None

    @property
    def counters(self) -> Counters:
        return self.pipeline.counters

    @property
    def store(self) -> Store | None:
        return self.pipeline.store

    @property
    def spool(self) -> Spool | None:
        return self.pipeline.spool

    @property
    def queries(self) -> Queries | None:
        return self.pipeline.queries

    def start(self) -> BoundPorts:
        self.pipeline.start()
        try:
            http_port = grpc_port = None
            if self.config.otlp_http is not None:
                self._http, http_port = start_http_server(self.pipeline, self.config.otlp_http, self.extra_routes)
            if self.config.otlp_grpc is not None:
                self._grpc, grpc_port = start_grpc_server(self.pipeline, self.config.otlp_grpc)
        except BaseException:
            self.stop()
            raise
        self.ports = BoundPorts(http=http_port, grpc=grpc_port)
        return self.ports

    def stop(self, drain_timeout_s: float = 10.0) -> None:
        """Stop receiving, give the drain up to ``drain_timeout_s`` to store what is spooled, close."""
        if self._http is not None:
            self._http.stop()
            self._http = None
        if self._grpc is not None:
            self._grpc.stop(grace=1.0).wait()
            self._grpc = None
        self.pipeline.stop(drain_timeout_s)

    def __enter__(self) -> Collector:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def wait_stored(self, timeout_s: float = 30.0) -> bool:
        """Block until everything acknowledged so far is in the store (tests, demo, benchmark)."""
        return self.pipeline.wait_stored(timeout_s)
