"""Engine-side telemetry: what an engine integration reports to, and how it reaches the collector.

- ``schema``: the OTLP contract (metric, attribute and resource names, histogram bounds); the only
  module the collector and the dashboards import from here. It imports nothing heavy.
- ``CertificateAggregator`` (``aggregator``): per-(layer, head) certificate counters, a sampled
  histogram and a raw-sample ring on the device; CUDA-graph safe, no host sync.
- ``StepReport`` and ``CertificateObserver`` (``step_report``): one decode step's certificates
  buffered per layer and reported to the aggregator in one call.
- ``TelemetryStream``, ``EngineIdentity`` and ``otlp_http_exporter`` (``exporter``): the background
  thread that turns device snapshots into delta OTLP metrics through opentelemetry-sdk.

The classes load on first use (torch and Triton come with them), so importing ``schema`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from witcert.integrations.telemetry.aggregator import AggregatorSnapshot, CertificateAggregator
    from witcert.integrations.telemetry.exporter import EngineIdentity, TelemetryStream, otlp_http_exporter
    from witcert.integrations.telemetry.step_report import CertificateObserver, StepReport

_PUBLIC = {
    "AggregatorSnapshot": "aggregator",
    "CertificateAggregator": "aggregator",
    "CertificateObserver": "step_report",
    "StepReport": "step_report",
    "EngineIdentity": "exporter",
    "TelemetryStream": "exporter",
    "otlp_http_exporter": "exporter",
}

__all__ = [
    "AggregatorSnapshot",
    "CertificateAggregator",
    "CertificateObserver",
    "EngineIdentity",
    "StepReport",
    "TelemetryStream",
    "otlp_http_exporter",
]


def __getattr__(name: str) -> object:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
