"""Every panel's SQL, written once: the Grafana dashboard and the built-in page both render from here.

What each panel shows is exact wherever the store holds an exact figure:

- Coverage is the engine's own count: certificates at or below the tau in force in the engine,
  over every decode step (``Covered / Certificates`` of the counter rollups), per (layer, head) too.
- "Largest certificate" and the quantiles are raw sample values (``witcert_certificate_samples``:
  one value per sampled (layer, head, step), the maximum over the batch rows), never a bucket bound.
- Coverage at another tau (the dashboard's ``tau`` variable) can only come from the sampled
  histogram, whose buckets say where a value lies only up to the bucket's width: it is shown as
  the interval it is, ``at_least`` and ``at_most``, and as the exact engine count when the
  dashboard's tau equals the tau every selected engine reported over the range.

Counter and histogram panels read the collector's rollups (``witcert_counts_*``, ``witcert_buckets_*``):
ranges up to one day read the 1-minute rollup, longer ones the 1-hour rollup. The switch is a
constant condition on the time range inside the SQL itself (ClickHouse folds it and reads no part
of the branch that is off), so Grafana and the page send the same text. Sample panels read the
typed sample table, the tau panels and export lag the raw gauge table (few rows: one per batch,
found by the exporter schema's sort key ServiceName, MetricName, ...).

Heads are global indices: under tensor parallelism each rank's exporter numbers its heads from
its first global head (``TelemetryStream(first_head=...)``), so ranks never share a cell.

SQL uses only the macros grafana-clickhouse-datasource expands on its backend and the dashboard
variables ``model``, ``instance`` (multi-value, ``${name:singlequote}``) and ``tau``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from witcert.collector import tables
from witcert.integrations.telemetry import schema as names

# Ranges up to this many seconds read the 1-minute rollup; longer ones the 1-hour rollup.
MINUTE_ROLLUP_MAX_RANGE_S = 86400

# The rollups' Layer/Head for counters reported without those attributes.
NO_LAYER_OR_HEAD = 65535

# Quantile levels of the sampled-certificate panel.
QUANTILES: tuple[float, ...] = (0.5, 0.9, 0.99)

# stat: one row of values; interval: one row (at_least, at_most, exact), shown as one figure when the
# ends are equal and as "between a and b" otherwise; timeseries: time, labels, values; matrix: layer, head, value.
PanelKind = Literal["stat", "interval", "timeseries", "matrix"]
TIME = "time"  # the time column every time-series query returns first
AT_LEAST, AT_MOST = "at_least", "at_most"  # the columns of an interval
EXACT = "exact"  # an interval's third column: 1 when both ends are an exact count, 0 when read from buckets


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
    column key and value (the layer x head heat maps); ``stat`` queries return one row of values;
    ``interval`` queries one row ``(at_least, at_most, exact)``.
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
    """A dashboard variable: a query over the store, or fixed choices.

    A single-value query variable (``tau``) starts at its first option and accepts any positive number.
    """

    name: str
    label: str
    description: str
    query: str | None = None  # one column of values; None means fixed ``choices``
    choices: tuple[str, ...] = ()
    default: str = ""
    multi: bool = False


_SELECTION = "Model IN (${model:singlequote}) AND Instance IN (${instance:singlequote})"
_RAW_SELECTION = (
    f"ResourceAttributes['{names.RESOURCE_MODEL}'] IN (${{model:singlequote}})\n"
    f"  AND ResourceAttributes['{names.RESOURCE_INSTANCE}'] IN (${{instance:singlequote}})"
)
_IS_SHORT_RANGE = f"dateDiff('second', $__fromTime, $__toTime) <= {MINUTE_ROLLUP_MAX_RANGE_S}"
_TAU = "toFloat64('${tau}')"
_BUCKET_SECONDS = "greatest($__interval_s, if(" + _IS_SHORT_RANGE + ", 60, 3600))"
_REAL_HEAD = f"Layer != {NO_LAYER_OR_HEAD} AND Head != {NO_LAYER_OR_HEAD}"


_ROLLUPS = {"counts": (tables.COUNTS_1M, tables.COUNTS_1H), "buckets": (tables.BUCKETS_1M, tables.BUCKETS_1H)}


def rollup(family: Literal["counts", "buckets"], columns: str) -> str:
    """A subquery over the right rollup for the range: ``t`` (time bucket) plus ``columns``, filtered.

    The time bucket is Grafana's interval, but never finer than the rollup's own resolution.
    """
    minute, hour = _ROLLUPS[family]
    return (
        "(\n"
        f"  SELECT toStartOfInterval(Bucket, INTERVAL greatest($__interval_s, 60) second) AS t, {columns}\n"
        f"  FROM {minute}\n"
        f"  WHERE $__timeFilter(Bucket) AND {_IS_SHORT_RANGE} AND {_SELECTION}\n"
        "  UNION ALL\n"
        f"  SELECT toStartOfInterval(Bucket, INTERVAL greatest($__interval_s, 3600) second) AS t, {columns}\n"
        f"  FROM {hour}\n"
        "  WHERE Bucket >= toStartOfHour($__fromTime) AND Bucket <= $__toTime\n"
        f"    AND NOT ({_IS_SHORT_RANGE}) AND {_SELECTION}\n"
        ")"
    )


def samples(columns: str) -> str:
    """A subquery over the raw sampled certificates of the range: ``t`` (time bucket) plus ``columns``."""
    return (
        "(\n"
        f"  SELECT toStartOfInterval(Timestamp, INTERVAL greatest($__interval_s, 60) second) AS t, {columns}\n"
        f"  FROM {tables.CERTIFICATE_SAMPLES}\n"
        f"  WHERE $__timeFilter(Timestamp) AND {_SELECTION}\n"
        ")"
    )


def _ratio(numerator: str, denominator: str) -> str:
    # Empty buckets give NULL (a gap in the chart), never a division by zero.
    return f"sum({numerator}) / nullIf(sum({denominator}), 0)"


# Series labels a time-series panel may split by: the column read, and its display form.
_LABELS = {
    "model": ("Model", "Model"),
    "instance": ("Instance", "Instance"),
    "layer": ("Layer", "concat('layer ', leftPad(toString(Layer), 3, '0'))"),
}


def _timeseries(
    ref_id: str,
    source: str,
    select: str,
    labels: tuple[str, ...],
    values: tuple[str, ...],
    where: str = "",
) -> PanelQuery:
    label_select = "".join(f", {_LABELS[label][1]} AS {label}" for label in labels)
    group_by = "".join(f", {label}" for label in labels)
    sql = (
        f"SELECT t AS {TIME}{label_select}, {select}\n"
        f"FROM {source}\n" + (f"WHERE {where}\n" if where else "") + f"GROUP BY {TIME}{group_by}\n"
        f"ORDER BY {TIME}{group_by}"
    )
    return PanelQuery(ref_id, sql, (TIME, *labels, *values), labels)


def _counts(columns: str, labels: tuple[str, ...] = ()) -> str:
    return rollup("counts", columns + "".join(f", {_LABELS[label][0]}" for label in labels))


_EXACT_COVERAGE = f"{_ratio('Covered', 'Certificates')} AS coverage"


def _exact_coverage_query(labels: tuple[str, ...] = ()) -> PanelQuery:
    source = _counts("Covered, Certificates" + ("" if "layer" in labels else ", Layer") + ", Head", labels)
    return _timeseries("A", source, _EXACT_COVERAGE, labels, ("coverage",), where=_REAL_HEAD)


def _bucket_bounds_sql() -> str:
    return "[" + ", ".join(repr(bound) for bound in names.CERTIFICATE_BUCKETS) + ", inf]"


# The smallest bucket bound >= tau: every bucket up to it may hold values <= tau.
_CEILING_BOUND = f"arrayFirst(bound -> bound >= {_TAU}, {_bucket_bounds_sql()})"

# Whether every tau the selected engines reported in the range is the dashboard's tau: then the
# engine's exact count answers, and the interval collapses onto it.
_ENGINE_TAU_IS_TAU = (
    f"(\n  SELECT count() > 0 AND countIf(Value != {_TAU}) = 0 AS exact\n"
    f"  FROM {tables.GAUGE}\n"
    f"  WHERE MetricName = '{names.TAU}' AND $__timeFilter(TimeUnix)\n  AND {_RAW_SELECTION}\n)"
)


def coverage_interval_sql(with_time: bool) -> str:
    """Coverage at the dashboard's tau as an interval, overall or per time bucket.

    Sampled finite certificates (the histogram) fall in buckets ``(previous bound, bound]``: those in
    buckets wholly at or below tau are covered for sure (``at_least``), those in the bucket holding tau
    may be (``at_most``). Both are scaled by the share of finite certificates among all of them (the
    counters, every step): +inf and NaN certificates are never covered. When the engines' tau is the
    dashboard's, both columns are the engines' exact count.
    """
    key = f"t AS {TIME}, " if with_time else ""
    group = f"  GROUP BY {TIME}\n" if with_time else ""
    histogram = (
        f"(\n  SELECT {key}sumIf(Count, UpperBound <= {_TAU}) / nullIf(sum(Count), 0) AS low,\n"
        f"    sumIf(Count, UpperBound <= {_CEILING_BOUND}) / nullIf(sum(Count), 0) AS high\n"
        f"  FROM {rollup('buckets', 'UpperBound, Count, Layer, Head')}\n  WHERE {_REAL_HEAD}\n{group})"
    )
    counters = (
        f"(\n  SELECT {key}1 - sum(Infinite + NaNs) / nullIf(sum(Certificates), 0) AS finite,\n"
        f"    {_ratio('Covered', 'Certificates')} AS covered\n"
        f"  FROM {rollup('counts', 'Infinite, NaNs, Covered, Certificates')}\n{group})"
    )
    join = f"LEFT JOIN {counters} AS counters USING ({TIME})" if with_time else f"CROSS JOIN {counters} AS counters"
    select = f"{TIME}, " if with_time else ""
    exact = "" if with_time else f",\n  toUInt8(engine.exact) AS {EXACT}"
    return (
        f"SELECT {select}if(engine.exact, covered, finite * low) AS {AT_LEAST},\n"
        f"  if(engine.exact, covered, finite * high) AS {AT_MOST}{exact}\n"
        f"FROM {histogram} AS histogram\n{join}\nCROSS JOIN {_ENGINE_TAU_IS_TAU} AS engine"
        + (f"\nORDER BY {TIME}" if with_time else "")
    )


def _matrix_query(select: str, value: str, source: str) -> PanelQuery:
    sql = (
        f"SELECT Layer AS layer, Head AS head, {select} AS {value}\n"
        f"FROM {source}\n"
        # Rows of counters that carry no layer/head (steps, drops) sit at 65535: not a head.
        f"WHERE {_REAL_HEAD}\n"
        "GROUP BY layer, head\n"
        "ORDER BY layer, head"
    )
    return PanelQuery("A", sql, ("layer", "head", value))


def _stat_query(select: str, value: str, source: str) -> PanelQuery:
    return PanelQuery("A", f"SELECT {select} AS {value}\nFROM {source}", (value,))


def _summary_stat(
    key: str,
    title: str,
    description: str,
    query: PanelQuery,
    unit: str,
    kind: PanelKind = "stat",
    max_value: float | None = None,
    higher_is_better: bool = False,
) -> PanelSpec:
    """A headline number of the Summary row: one value (or interval), never negative, in a small tile."""
    return PanelSpec(
        key=key,
        title=title,
        description=description,
        kind=kind,
        queries=(query,),
        unit=unit,
        section="Summary",
        width=4,
        height=4,
        min_value=0,
        max_value=max_value,
        higher_is_better=higher_is_better,
    )


def _coverage_by(dimension: str) -> PanelSpec:
    return PanelSpec(
        key=f"coverage_by_{dimension}",
        title=f"Coverage at the engine's tau by {dimension}",
        description=f"Certificates at or below the engine's tau over every decode step, one series per {dimension}.",
        kind="timeseries",
        queries=(_exact_coverage_query((dimension,)),),
        unit="percentunit",
        section="Coverage",
        min_value=0,
        max_value=1,
        higher_is_better=True,
    )


_FIXED_TAUS = ("0.001", "0.01", "0.0316", "0.05", "0.1", "0.316", "1")

VARIABLES: tuple[VariableSpec, ...] = (
    VariableSpec(
        name="model",
        label="Model",
        description="Models that reported certificates in the time range",
        query=f"SELECT DISTINCT Model FROM {tables.COUNTS_1H} "
        "WHERE Bucket >= toStartOfHour($__fromTime) AND Bucket <= $__toTime ORDER BY Model",
        multi=True,
    ),
    VariableSpec(
        name="instance",
        label="Instance",
        description="Engine instances (service.instance.id) of the selected models",
        query=f"SELECT DISTINCT Instance FROM {tables.COUNTS_1H} "
        "WHERE Bucket >= toStartOfHour($__fromTime) AND Bucket <= $__toTime AND Model IN (${model:singlequote}) "
        "ORDER BY Instance",
        multi=True,
    ),
    VariableSpec(
        name="tau",
        label="tau",
        description="Threshold for the what-if coverage panels: the engines' own tau first (exact), then other "
        "values, for which coverage is an interval read from the sampled histogram",
        query=(
            "SELECT tau FROM (\n"
            f"  SELECT toString(Value) AS tau, 0 AS fixed FROM {tables.GAUGE}\n"
            f"  WHERE MetricName = '{names.TAU}' AND $__timeFilter(TimeUnix)\n  AND {_RAW_SELECTION}\n"
            "  UNION ALL\n"
            f"  SELECT arrayJoin([{', '.join(repr(tau) for tau in _FIXED_TAUS)}]) AS tau, 1 AS fixed\n"
            ")\nGROUP BY tau\nORDER BY min(fixed), toFloat64(tau)"
        ),
    ),
)

PANELS: tuple[PanelSpec, ...] = (
    # --- headline numbers -----------------------------------------------------------------------
    _summary_stat(
        "coverage_now",
        "Coverage at the engine's tau",
        "Certificates at or below the tau in force in the engine, counted exactly over every decode step "
        "(+inf and NaN are never covered).",
        _stat_query(_ratio("Covered", "Certificates"), "coverage", _counts("Covered, Certificates")),
        "percentunit",
        max_value=1,
        higher_is_better=True,
    ),
    _summary_stat(
        "engine_tau",
        "Engine tau",
        "The gating threshold the selected engines reported over the range (lowest and highest).",
        PanelQuery(
            "A",
            f"SELECT min(Value) AS {AT_LEAST}, max(Value) AS {AT_MOST}, toUInt8(1) AS {EXACT}\n"
            f"FROM {tables.GAUGE}\n"
            f"WHERE MetricName = '{names.TAU}' AND $__timeFilter(TimeUnix)\n  AND {_RAW_SELECTION}\n"
            "HAVING count() > 0",
            (AT_LEAST, AT_MOST, EXACT),
        ),
        "none",
        kind="interval",
    ),
    _summary_stat(
        "coverage_at_tau",
        "Coverage at tau ${tau}",
        "Certificates at or below the dashboard's tau. Equal to the engine's exact count when tau is the "
        "engine's; otherwise an interval from the sampled histogram (4 buckets per decade), never a point value.",
        PanelQuery("A", coverage_interval_sql(with_time=False), (AT_LEAST, AT_MOST, EXACT)),
        "percentunit",
        kind="interval",
        max_value=1,
        higher_is_better=True,
    ),
    _summary_stat(
        "largest_certificate",
        "Largest sampled certificate",
        "The largest raw sampled certificate in the range (every stride-th step, maximum over the batch rows).",
        _stat_query("max(Value)", "max_certificate", samples("Value")),
        "short",
    ),
    _summary_stat(
        "fallback_now",
        "Fallback rate",
        "Head-steps repaired from the exact K/V backup, per certificate computed.",
        _stat_query(_ratio("Fallbacks", "Certificates"), "fallback_rate", _counts("Fallbacks, Certificates")),
        "percentunit",
    ),
    _summary_stat(
        "inf_now",
        "Infinite certificates",
        "Certificates that overflowed to +inf (still valid bounds, never averaged).",
        _stat_query("sum(Infinite)", "inf_certificates", _counts("Infinite")),
        "short",
    ),
    # --- coverage ---------------------------------------------------------------------------------
    PanelSpec(
        key="coverage_overall",
        title="Coverage at the engine's tau over time",
        description="Certificates at or below the engine's tau over every decode step, counted exactly.",
        kind="timeseries",
        queries=(_exact_coverage_query(),),
        unit="percentunit",
        section="Coverage",
        min_value=0,
        max_value=1,
        higher_is_better=True,
    ),
    PanelSpec(
        key="coverage_at_tau_over_time",
        title="Coverage at tau ${tau} over time: at least, at most",
        description="The interval of the summary's coverage at tau, per time bucket: the two lines meet where "
        "the engine's tau is the dashboard's.",
        kind="timeseries",
        queries=(PanelQuery("A", coverage_interval_sql(with_time=True), (TIME, AT_LEAST, AT_MOST)),),
        unit="percentunit",
        section="Coverage",
        min_value=0,
        max_value=1,
        higher_is_better=True,
    ),
    _coverage_by("model"),
    _coverage_by("layer"),
    PanelSpec(
        key="coverage_heatmap",
        title="Coverage at the engine's tau, layer x head",
        description="Certificates at or below the engine's tau per (layer, global head), counted exactly.",
        kind="matrix",
        queries=(
            _matrix_query(_ratio("Covered", "Certificates"), "coverage", _counts("Covered, Certificates, Layer, Head")),
        ),
        unit="percentunit",
        section="Layer x head",
        min_value=0,
        max_value=1,
        higher_is_better=True,
    ),
    PanelSpec(
        key="max_certificate_heatmap",
        title="Largest sampled certificate, layer x head",
        description="The largest raw sampled certificate per (layer, global head) in the range.",
        kind="matrix",
        queries=(_matrix_query("max(Value)", "max_certificate", samples("Value, Layer, Head")),),
        unit="short",
        section="Layer x head",
        min_value=0,
    ),
    # --- distribution -------------------------------------------------------------------------------
    PanelSpec(
        key="certificate_quantiles",
        title="Sampled certificate quantiles",
        description="p50, p90, p99 of the raw sampled certificates per time bucket: each is a sampled value "
        "(the one at rank floor(q x n) of the n sorted samples), +inf included.",
        kind="timeseries",
        queries=(
            _timeseries(
                "A",
                samples("Value"),
                ", ".join(f"quantileExactHigh({level})(Value) AS p{round(level * 100)}" for level in QUANTILES),
                (),
                tuple(f"p{round(level * 100)}" for level in QUANTILES),
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
                _counts("Vacuous, Infinite, NaNs, Certificates"),
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
                _counts("Fallbacks, Certificates", ("model",)),
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
                _counts("RepairedBytes", ("model",)),
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
        title="Histogram certificates per second",
        description="Finite certificates entered in the histogram (every batch row of the sampled steps), "
        "per instance.",
        kind="timeseries",
        queries=(
            _timeseries(
                "A",
                rollup("buckets", "Count, Instance"),
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
        queries=(
            _timeseries("A", _counts("Dropped", ("instance",)), "sum(Dropped) AS dropped", ("instance",), ("dropped",)),
        ),
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
                f"FROM {tables.GAUGE}\n"
                f"WHERE MetricName = '{names.EXPORT_LAG}' AND $__timeFilter(TimeUnix)\n"
                f"  AND {_RAW_SELECTION}\n"
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
