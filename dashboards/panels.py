"""Every panel's SQL, written once: the Grafana dashboard and the built-in page both render from here.

Panels read the collector's rollups (``witcert_counts_*``, ``witcert_buckets_*``), never the raw
sample rows, so a 30-day view stays cheap: ranges up to one day read the 1-minute rollup, longer
ones the 1-hour rollup. The switch is a constant condition on the time range inside the SQL itself
(ClickHouse folds it and reads no part of the branch that is off), so Grafana and the page send
the same text. Export lag is the one panel that reads a raw table (the gauge); its rows are
few (one per exporter flush) and the exporter schema's sort key (ServiceName, MetricName, ...)
finds them.

SQL uses only the macros grafana-clickhouse-datasource expands on its backend and the dashboard
variables ``model``, ``instance`` (multi-value, ``${name:singlequote}``) and ``tau``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from witcert.integrations.telemetry import schema as names

# Ranges up to this many seconds read the 1-minute rollup; longer ones the 1-hour rollup.
MINUTE_ROLLUP_MAX_RANGE_S = 86400

# The rollups' Layer/Head for counters reported without those attributes.
NO_LAYER_OR_HEAD = 65535

PanelKind = Literal["stat", "timeseries", "matrix"]
TIME = "time"  # the time column every time-series query returns first


@dataclass(frozen=True)
class PanelQuery:
    """One query of a panel and the columns it must return, in order."""

    ref_id: str
    sql: str
    columns: tuple[str, ...]
    labels: tuple[str, ...] = ()  # time series: the columns after ``time`` that name a series


@dataclass(frozen=True)
class PanelSpec:
    """A panel, independent of who renders it.

    ``kind`` decides the shape: ``timeseries`` queries return ``time``, then label columns (strings,
    one series per distinct combination), then numeric values; ``matrix`` queries return row key,
    column key and value (the layer x head heat maps); ``stat`` queries return one row of values.
    """

    key: str
    title: str
    description: str
    kind: PanelKind
    queries: tuple[PanelQuery, ...]
    unit: str  # Grafana unit id: percentunit, short, bytes, s, ...
    section: str
    width: int = 12  # of Grafana's 24 grid columns
    height: int = 8
    min_value: float | None = None
    max_value: float | None = None
    higher_is_better: bool = False  # colours: coverage is good when high, everything else when low


@dataclass(frozen=True)
class VariableSpec:
    """A dashboard variable: a query over the store, or fixed choices."""

    name: str
    label: str
    description: str
    query: str | None = None  # one column of values; None means fixed ``choices``
    choices: tuple[str, ...] = ()
    default: str = ""
    multi: bool = False


_SELECTION = "Model IN (${model:singlequote}) AND Instance IN (${instance:singlequote})"
_IS_SHORT_RANGE = f"dateDiff('second', $__fromTime, $__toTime) <= {MINUTE_ROLLUP_MAX_RANGE_S}"


def rollup(family: Literal["counts", "buckets"], columns: str) -> str:
    """A subquery over the right rollup for the range: ``t`` (time bucket) plus ``columns``, filtered.

    The time bucket is Grafana's interval, but never finer than the rollup's own resolution.
    """
    return (
        "(\n"
        f"  SELECT toStartOfInterval(Bucket, INTERVAL greatest($__interval_s, 60) second) AS t, {columns}\n"
        f"  FROM witcert_{family}_1m\n"
        f"  WHERE $__timeFilter(Bucket) AND {_IS_SHORT_RANGE} AND {_SELECTION}\n"
        "  UNION ALL\n"
        f"  SELECT toStartOfInterval(Bucket, INTERVAL greatest($__interval_s, 3600) second) AS t, {columns}\n"
        f"  FROM witcert_{family}_1h\n"
        "  WHERE Bucket >= toStartOfHour($__fromTime) AND Bucket <= $__toTime\n"
        f"    AND NOT ({_IS_SHORT_RANGE}) AND {_SELECTION}\n"
        ")"
    )


def _ratio(numerator: str, denominator: str) -> str:
    # Empty buckets give NULL (a gap in the chart), never a division by zero.
    return f"sum({numerator}) / nullIf(sum({denominator}), 0)"


_TAU = "toFloat64('${tau}')"
_COVERED_AT_TAU = f"sumIf(Count, UpperBound <= {_TAU})"
_BUCKET_SECONDS = "greatest($__interval_s, if(" + _IS_SHORT_RANGE + ", 60, 3600))"


# Series labels a time-series panel may split by: the rollup column read, and its display form.
_LABELS = {
    "model": ("Model", "Model"),
    "instance": ("Instance", "Instance"),
    "layer": ("Layer", "concat('layer ', leftPad(toString(Layer), 3, '0'))"),
}


def _timeseries(
    ref_id: str,
    family: Literal["counts", "buckets"],
    source_columns: str,
    select: str,
    labels: tuple[str, ...],
    values: tuple[str, ...],
) -> PanelQuery:
    label_select = "".join(f", {_LABELS[label][1]} AS {label}" for label in labels)
    label_sources = "".join(f", {_LABELS[label][0]}" for label in labels)
    group_by = "".join(f", {label}" for label in labels)
    sql = (
        f"SELECT t AS {TIME}{label_select}, {select}\n"
        f"FROM {rollup(family, source_columns + label_sources)}\n"
        f"GROUP BY {TIME}{group_by}\n"
        f"ORDER BY {TIME}{group_by}"
    )
    return PanelQuery(ref_id, sql, (TIME, *labels, *values), labels)


# Grouping keys of coverage queries: (output column, expression over rollup columns, column read).
Key = tuple[str, str, str]
KEY_TIME: Key = (TIME, "t", "")
KEY_MODEL: Key = ("model", "Model", "Model")
KEY_LAYER_LABEL: Key = ("layer", _LABELS["layer"][1], "Layer")
KEY_LAYER: Key = ("layer", "Layer", "Layer")
KEY_HEAD: Key = ("head", "Head", "Head")


def coverage_sql(keys: tuple[Key, ...], value: str = "coverage_at_tau") -> str:
    """Coverage at tau per ``keys``: P(finite) x P(<= tau | finite).

    The histogram holds finite sampled certificates only, so its share at or below tau alone would
    count +inf and NaN certificates as if they were absent; the counters know their share among all
    certificates, and multiplying keeps such certificates uncovered, as they are.
    """
    names = ", ".join(name for name, _, _ in keys)
    selects = "".join(f"{expression} AS {name}, " for name, expression, _ in keys)
    sources = "".join(f", {column}" for _, _, column in keys if column)
    real_heads = [f"{column} != {NO_LAYER_OR_HEAD}" for _, _, column in keys if column in ("Layer", "Head")]
    where = f"  WHERE {' AND '.join(real_heads)}\n" if real_heads else ""
    group = f"  GROUP BY {names}\n" if keys else ""
    finite_share = (
        f"(\n  SELECT {selects}{_COVERED_AT_TAU} / nullIf(sum(Count), 0) AS covered_share\n"
        f"  FROM {rollup('buckets', 'UpperBound, Count' + sources)}\n{where}{group})"
    )
    non_finite = (
        f"(\n  SELECT {selects}sum(Infinite + NaNs) / nullIf(sum(Certificates), 0) AS non_finite_share\n"
        f"  FROM {rollup('counts', 'Infinite, NaNs, Certificates' + sources)}\n{group})"
    )
    join = f"LEFT JOIN {non_finite} AS non_finite USING ({names})" if keys else f"CROSS JOIN {non_finite} AS non_finite"
    return (
        f"SELECT {names + ', ' if keys else ''}covered_share * (1 - ifNull(non_finite_share, 0)) AS {value}\n"
        f"FROM {finite_share} AS finite\n{join}" + (f"\nORDER BY {names}" if keys else "")
    )


def _coverage_query(label: Key | None = None) -> PanelQuery:
    keys = (KEY_TIME, label) if label else (KEY_TIME,)
    labels = (label[0],) if label else ()
    return PanelQuery("A", coverage_sql(keys), (TIME, *labels, "coverage_at_tau"), labels)


def _matrix_query(select: str, value: str, family: Literal["counts", "buckets"], columns: str) -> PanelQuery:
    sql = (
        f"SELECT Layer AS layer, Head AS head, {select} AS {value}\n"
        f"FROM {rollup(family, 'Layer, Head, ' + columns)}\n"
        # Rows of counters that carry no layer/head (steps, drops) sit at 65535: not a head.
        f"WHERE Layer != {NO_LAYER_OR_HEAD} AND Head != {NO_LAYER_OR_HEAD}\n"
        "GROUP BY layer, head\n"
        "ORDER BY layer, head"
    )
    return PanelQuery("A", sql, ("layer", "head", value))


def _counts_stat_query(select: str, value: str, columns: str) -> PanelQuery:
    return PanelQuery("A", f"SELECT {select} AS {value}\nFROM {rollup('counts', columns)}", (value,))


def _summary_stat(
    key: str,
    title: str,
    description: str,
    query: PanelQuery,
    unit: str,
    max_value: float | None = None,
    higher_is_better: bool = False,
) -> PanelSpec:
    """A headline number of the Summary row: one value, never negative, in a small tile."""
    return PanelSpec(
        key=key,
        title=title,
        description=description,
        kind="stat",
        queries=(query,),
        unit=unit,
        section="Summary",
        width=6,
        height=4,
        min_value=0,
        max_value=max_value,
        higher_is_better=higher_is_better,
    )


def _coverage_by(dimension: str, key: Key) -> PanelSpec:
    return PanelSpec(
        key=f"coverage_by_{dimension}",
        title=f"Coverage at tau by {dimension}",
        description=f"Coverage at tau (as in the summary), one series per {dimension}.",
        kind="timeseries",
        queries=(_coverage_query(key),),
        unit="percentunit",
        section="Coverage",
        min_value=0,
        max_value=1,
        higher_is_better=True,
    )


VARIABLES: tuple[VariableSpec, ...] = (
    VariableSpec(
        name="model",
        label="Model",
        description="Models that reported certificates in the time range",
        query="SELECT DISTINCT Model FROM witcert_counts_1h "
        "WHERE Bucket >= toStartOfHour($__fromTime) AND Bucket <= $__toTime ORDER BY Model",
        multi=True,
    ),
    VariableSpec(
        name="instance",
        label="Instance",
        description="Engine instances (service.instance.id) of the selected models",
        query="SELECT DISTINCT Instance FROM witcert_counts_1h "
        "WHERE Bucket >= toStartOfHour($__fromTime) AND Bucket <= $__toTime AND Model IN (${model:singlequote}) "
        "ORDER BY Instance",
        multi=True,
    ),
    VariableSpec(
        name="tau",
        label="tau",
        description="Threshold on the certificate (a bound on TV distance): coverage is the share of "
        "certificates at or below it, read from the sampled histogram in whole buckets (a lower bound)",
        choices=("0.001", "0.01", "0.0316", "0.05", "0.1", "0.316", "1"),
        default="0.1",
    ),
)

PANELS: tuple[PanelSpec, ...] = (
    # --- headline numbers -----------------------------------------------------------------------
    _summary_stat(
        "coverage_now",
        "Coverage at tau",
        "Share of certificates <= tau over the range: finite sampled certificates in whole buckets "
        "<= tau (a lower bound), times the share of finite certificates (+inf and NaN count as not covered).",
        PanelQuery("A", coverage_sql(()), ("coverage_at_tau",)),
        "percentunit",
        max_value=1,
        higher_is_better=True,
    ),
    _summary_stat(
        "gate_coverage_now",
        "Covered at the engine's tau",
        "Certificates at or below the tau in force in the engine, over every decode step (not only sampled ones).",
        _counts_stat_query(_ratio("Covered", "Certificates"), "covered_fraction", "Covered, Certificates"),
        "percentunit",
        max_value=1,
        higher_is_better=True,
    ),
    _summary_stat(
        "fallback_now",
        "Fallback rate",
        "Head-steps repaired from the exact K/V backup, per certificate computed.",
        _counts_stat_query(_ratio("Fallbacks", "Certificates"), "fallback_rate", "Fallbacks, Certificates"),
        "percentunit",
    ),
    _summary_stat(
        "inf_now",
        "Infinite certificates",
        "Certificates that overflowed to +inf (still valid bounds, never averaged).",
        _counts_stat_query("sum(Infinite)", "inf_certificates", "Infinite"),
        "short",
    ),
    # --- coverage ---------------------------------------------------------------------------------
    PanelSpec(
        key="coverage_overall",
        title="Coverage over time at tau",
        description="Coverage at tau (as in the summary), and certificates covered at the engine's own tau "
        "over every decode step.",
        kind="timeseries",
        queries=(
            _coverage_query(),
            _timeseries(
                "B",
                "counts",
                "Covered, Certificates",
                f"{_ratio('Covered', 'Certificates')} AS covered_at_engine_tau",
                (),
                ("covered_at_engine_tau",),
            ),
        ),
        unit="percentunit",
        section="Coverage",
        width=24,
        min_value=0,
        max_value=1,
        higher_is_better=True,
    ),
    _coverage_by("model", KEY_MODEL),
    _coverage_by("layer", KEY_LAYER_LABEL),
    PanelSpec(
        key="coverage_heatmap",
        title="Coverage at tau, layer x head",
        description="Coverage at tau (as in the summary) for each (layer, head) over the range.",
        kind="matrix",
        queries=(
            PanelQuery(
                "A",
                coverage_sql((KEY_LAYER, KEY_HEAD)),
                ("layer", "head", "coverage_at_tau"),
            ),
        ),
        unit="percentunit",
        section="Layer x head",
        min_value=0,
        max_value=1,
        higher_is_better=True,
    ),
    PanelSpec(
        key="max_certificate_heatmap",
        title="Largest certificate, layer x head",
        description="Upper bound of the highest non-empty histogram bucket per (layer, head): the largest "
        "sampled certificate is at most this.",
        kind="matrix",
        queries=(_matrix_query("maxIf(UpperBound, Count > 0)", "max_certificate", "buckets", "UpperBound, Count"),),
        unit="short",
        section="Layer x head",
        min_value=0,
    ),
    # --- distribution -------------------------------------------------------------------------------
    PanelSpec(
        key="certificate_quantiles",
        title="Certificate quantiles",
        description="p50, p90, p99 of sampled certificates, each the upper bound of the bucket holding it.",
        kind="timeseries",
        queries=(
            _timeseries(
                "A",
                "buckets",
                "UpperBound, Count",
                "quantileExactWeighted(0.5)(UpperBound, Count) AS p50, "
                "quantileExactWeighted(0.9)(UpperBound, Count) AS p90, "
                "quantileExactWeighted(0.99)(UpperBound, Count) AS p99",
                (),
                ("p50", "p90", "p99"),
            ),
        ),
        unit="short",
        section="Certificates",
        min_value=0,
    ),
    PanelSpec(
        key="vacuous_inf_fractions",
        title="Vacuous and infinite fractions",
        description="Certificates >= 1 (no guarantee) and +inf, per certificate computed; NaN (a bug) is shown too.",
        kind="timeseries",
        queries=(
            _timeseries(
                "A",
                "counts",
                "Vacuous, Infinite, NaNs, Certificates",
                f"{_ratio('Vacuous', 'Certificates')} AS vacuous_fraction, "
                f"{_ratio('Infinite', 'Certificates')} AS inf_fraction, "
                f"{_ratio('NaNs', 'Certificates')} AS nan_fraction",
                (),
                ("vacuous_fraction", "inf_fraction", "nan_fraction"),
            ),
        ),
        unit="percentunit",
        section="Certificates",
        min_value=0,
    ),
    # --- gating -------------------------------------------------------------------------------------
    PanelSpec(
        key="fallback_rate",
        title="Fallback rate by model",
        description="Head-steps repaired from exact K/V per certificate computed.",
        kind="timeseries",
        queries=(
            _timeseries(
                "A",
                "counts",
                "Fallbacks, Certificates",
                f"{_ratio('Fallbacks', 'Certificates')} AS fallback_rate",
                ("model",),
                ("fallback_rate",),
            ),
        ),
        unit="percentunit",
        section="Gating",
        min_value=0,
    ),
    PanelSpec(
        key="repaired_bytes",
        title="Repaired bytes per second",
        description="Bytes paged in from the exact K/V backup.",
        kind="timeseries",
        queries=(
            _timeseries(
                "A",
                "counts",
                "RepairedBytes",
                f"sum(RepairedBytes) / {_BUCKET_SECONDS} AS repaired_bytes_per_s",
                ("model",),
                ("repaired_bytes_per_s",),
            ),
        ),
        unit="Bps",
        section="Gating",
        min_value=0,
    ),
    # --- telemetry health -----------------------------------------------------------------------------
    PanelSpec(
        key="samples_per_second",
        title="Stored samples per second",
        description="Sampled certificates stored, per instance.",
        kind="timeseries",
        queries=(
            _timeseries(
                "A",
                "buckets",
                "Count",
                f"sum(Count) / {_BUCKET_SECONDS} AS samples_per_s",
                ("instance",),
                ("samples_per_s",),
            ),
        ),
        unit="short",
        section="Telemetry health",
        width=8,
        min_value=0,
    ),
    PanelSpec(
        key="dropped_points",
        title="Dropped points",
        description="Points the engine dropped because its export buffer was full.",
        kind="timeseries",
        queries=(_timeseries("A", "counts", "Dropped", "sum(Dropped) AS dropped", ("instance",), ("dropped",)),),
        unit="short",
        section="Telemetry health",
        width=8,
        min_value=0,
    ),
    PanelSpec(
        key="export_lag",
        title="Export lag",
        description="Seconds from the device snapshot to the OTLP export, worst per interval.",
        kind="timeseries",
        queries=(
            PanelQuery(
                "A",
                f"SELECT $__timeInterval(TimeUnix) AS {TIME}, "
                f"ResourceAttributes['{names.RESOURCE_INSTANCE}'] AS instance, max(Value) AS export_lag_s\n"
                "FROM otel_metrics_gauge\n"
                f"WHERE MetricName = '{names.EXPORT_LAG}' AND $__timeFilter(TimeUnix)\n"
                f"  AND ResourceAttributes['{names.RESOURCE_MODEL}'] IN (${{model:singlequote}})\n"
                f"  AND ResourceAttributes['{names.RESOURCE_INSTANCE}'] IN (${{instance:singlequote}})\n"
                f"GROUP BY {TIME}, instance\n"
                f"ORDER BY {TIME}, instance",
                (TIME, "instance", "export_lag_s"),
                ("instance",),
            ),
        ),
        unit="s",
        section="Telemetry health",
        width=8,
        min_value=0,
    ),
)

SECTIONS: tuple[str, ...] = tuple(dict.fromkeys(panel.section for panel in PANELS))


def panel(key: str) -> PanelSpec:
    for spec in PANELS:
        if spec.key == key:
            return spec
    raise KeyError(f"no panel {key!r}; panels: {', '.join(p.key for p in PANELS)}")
