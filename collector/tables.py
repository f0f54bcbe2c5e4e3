"""Every table and view of the store, named once.

The migrations (``schema/*.sql``, as ``${T_<NAME>}`` placeholders), the collector's inserts, the
read queries, the dashboards' panels and the alert rules all take their table names from here.
The raw ``otel_metrics_*`` names are those of the OpenTelemetry Collector's ClickHouse exporter:
changing them breaks compatibility with it.
"""

from __future__ import annotations

# Raw OTLP data points, exporter compatible.
SUM = "otel_metrics_sum"
GAUGE = "otel_metrics_gauge"
HISTOGRAM = "otel_metrics_histogram"

# Typed certificate samples (the collector writes them directly; the view types another writer's rows).
CERTIFICATE_SAMPLES = "witcert_certificate_samples"
CERTIFICATE_SAMPLES_MV = "witcert_certificate_samples_mv"

# Rollups of the delta counters (counts) and of the certificate-value histogram (buckets).
COUNTS_1M = "witcert_counts_1m"
COUNTS_1H = "witcert_counts_1h"
BUCKETS_1M = "witcert_buckets_1m"
BUCKETS_1H = "witcert_buckets_1h"
COUNTS_1M_MV = "witcert_counts_1m_mv"
COUNTS_1H_MV = "witcert_counts_1h_mv"
BUCKETS_1M_MV = "witcert_buckets_1m_mv"
BUCKETS_1H_MV = "witcert_buckets_1h_mv"

# Applied schema versions.
SCHEMA_MIGRATIONS = "witcert_schema_migrations"

RAW = (SUM, GAUGE, HISTOGRAM)
ROLLUPS = (COUNTS_1M, COUNTS_1H, BUCKETS_1M, BUCKETS_1H)
# The tables the migrations create, in order (views excluded): the cluster variant gives each a
# ``<name>_local`` Replicated table and a Distributed table under the name itself.
DATA_TABLES = (*RAW, CERTIFICATE_SAMPLES, *ROLLUPS)
VIEWS = (CERTIFICATE_SAMPLES_MV, COUNTS_1M_MV, COUNTS_1H_MV, BUCKETS_1M_MV, BUCKETS_1H_MV)

# Placeholder -> name, for the SQL templates under schema/.
TEMPLATE_NAMES: dict[str, str] = {
    f"T_{constant}": name
    for constant, name in {
        "SUM": SUM,
        "GAUGE": GAUGE,
        "HISTOGRAM": HISTOGRAM,
        "CERTIFICATE_SAMPLES": CERTIFICATE_SAMPLES,
        "CERTIFICATE_SAMPLES_MV": CERTIFICATE_SAMPLES_MV,
        "COUNTS_1M": COUNTS_1M,
        "COUNTS_1H": COUNTS_1H,
        "BUCKETS_1M": BUCKETS_1M,
        "BUCKETS_1H": BUCKETS_1H,
        "COUNTS_1M_MV": COUNTS_1M_MV,
        "COUNTS_1H_MV": COUNTS_1H_MV,
        "BUCKETS_1M_MV": BUCKETS_1M_MV,
        "BUCKETS_1H_MV": BUCKETS_1H_MV,
    }.items()
}
