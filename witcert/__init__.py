"""witcert: certified int8 KV-cache quantization with OpenTelemetry telemetry.

Areas (each a top-level folder of the repository):

- ``witcert.kernels``: the reference mathematics and the Triton kernels (computes).
- ``witcert.integrations``: engines (transformers, SGLang) and, in ``witcert.integrations.telemetry``,
  the engine-side telemetry: aggregator, OTLP stream and the OTLP contract (connects, emits).
- ``witcert.collector``: OTLP receiver and ClickHouse storage (receives, stores, queries).
- ``witcert.dashboards``: Grafana dashboards, alert rules and the built-in page (shows).

Data flows one way through them, in that order.
"""

__version__ = "0.1.0"
