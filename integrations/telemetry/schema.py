"""The OTLP contract between the engine-side aggregator (emits) and the collector (receives).

Both sides import these names; nothing else couples them. docs/TELEMETRY.md documents each metric.
Counters and histograms use delta temporality. ``layer`` and ``head`` are the only per-series
attributes of aggregated metrics (never ``step`` or a request id: they would explode cardinality).
Raw samples are gauge data points built by hand, one per sampled (layer, head, step), carrying
``step`` as an attribute and ``+inf`` as a value, which the SDK's instruments would drop.
"""

from __future__ import annotations

INSTRUMENTATION_SCOPE = "witcert"

# Per (layer, head) counters, summed over every decode step (not only sampled ones).
CERTIFICATES = "witcert.certificate.count"  # certificates computed
COVERED = "witcert.certificate.covered"  # certificate <= tau
VACUOUS = "witcert.certificate.vacuous"  # 1 <= certificate < +inf: no guarantee
INFINITE = "witcert.certificate.inf"  # certificate == +inf (fp32 overflow of expm1; still a valid bound)
NAN = "witcert.certificate.nan"  # NaN: a kernel bug, reported loudly
FALLBACKS = "witcert.fallback.count"  # head-steps repaired from exact K/V (gate mode)
REPAIRED_BYTES = "witcert.fallback.bytes"  # bytes paged in from the exact backup

# Histogram of finite sampled certificate values on log-scale buckets.
CERTIFICATE_VALUE = "witcert.certificate.value"
# Raw sampled values: gauge points with attributes layer, head, step (value may be +inf).
CERTIFICATE_SAMPLE = "witcert.certificate.sample"
# The gating threshold in force (gauge), so coverage can be read against it.
TAU = "witcert.config.tau"

# Telemetry health.
DROPPED_POINTS = "witcert.telemetry.dropped"  # points dropped because the export buffer was full
EXPORT_LAG = "witcert.telemetry.export_lag"  # seconds from device snapshot to export (gauge)
STEPS = "witcert.engine.steps"  # decode steps observed

# Log-scale histogram bucket upper bounds for certificate values: 1e-6 .. 1e1, 4 per decade.
CERTIFICATE_BUCKETS: tuple[float, ...] = tuple(10.0 ** (e / 4.0) for e in range(-24, 5))

ATTR_LAYER = "layer"
ATTR_HEAD = "head"
ATTR_STEP = "step"

# Resource attributes set by the engine side.
RESOURCE_SERVICE_NAME = "service.name"
RESOURCE_SERVICE_VERSION = "service.version"
RESOURCE_INSTANCE = "service.instance.id"
RESOURCE_HOST_NAME = "host.name"
RESOURCE_HOST_ID = "host.id"
RESOURCE_MODEL = "witcert.model"
RESOURCE_ENGINE = "witcert.engine"
RESOURCE_TP_RANK = "witcert.tp_rank"
# The pool's 64-bit dither seed as 16 hex digits (an OTLP int is signed 64-bit): drawn at random per pool
# unless fixed, it names the draw the certificates' probability is over (docs/THEORY.md, section 2).
RESOURCE_DITHER_SEED = "witcert.dither.seed"


def dither_seed_text(seed: int) -> str:
    return f"{seed:016x}"


COUNTER_METRICS: tuple[str, ...] = (
    CERTIFICATES,
    COVERED,
    VACUOUS,
    INFINITE,
    NAN,
    FALLBACKS,
    REPAIRED_BYTES,
    DROPPED_POINTS,
    STEPS,
)
