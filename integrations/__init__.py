"""Connects and emits: engine integrations and the engine-side telemetry (aggregator and OTLP stream)."""

from witcert.integrations.aggregator import AggregatorSnapshot, CertificateAggregator

__all__ = ["AggregatorSnapshot", "CertificateAggregator"]
