"""Dashboards and alerts, executed: every panel and alert query runs against a chDB store filled
through a running witcert collector by the opentelemetry-sdk's OTLP/HTTP exporter, with the
macros expanded as grafana-clickhouse-datasource expands them.

The data set is built so every panel has a known answer: instance node-a is healthy, node-b
degrades in the last five minutes (coverage, inf and fallback spike), node-c went silent thirty
minutes ago. Layer L holds 10 certificates at <= 1e-3 and L at <= 1.0 per minute and head.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml
from grafana_foundation_sdk.models import dashboard as dashboard_models
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricExportResult,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from witcert.collector.config import CollectorConfig
from witcert.collector.service import Collector
from witcert.collector.store import Store
from witcert.dashboards import alerts, export, grafana, macros, panels
from witcert.dashboards.datasource import ClickHouseQuery, QueryFormat
from witcert.integrations.telemetry import schema as ts

REPO = Path(__file__).resolve().parent.parent
MODEL = "llama-tiny"
INSTANCES = ("node-a", "node-b", "node-c")
LAYERS, HEADS, MINUTES = 4, 2, 90
DEGRADED_MINUTES = 5  # node-b's last minutes
SILENT_MINUTES = 30  # node-c has sent nothing for this long
LOW_BOUND_INDEX = ts.CERTIFICATE_BUCKETS.index(10.0**-3)
ONE_INDEX = ts.CERTIFICATE_BUCKETS.index(1.0)
ALL = {"model": [MODEL], "instance": list(INSTANCES), "tau": "0.1"}


def _minute_start(moment: datetime) -> datetime:
    return moment.replace(second=0, microsecond=0)


# Every query is evaluated at NOW: 30 s into the current minute, so "the last 300 s" holds exactly
# the five newest minute buckets whatever the wall clock.
NOW = _minute_start(datetime.now(UTC)) + timedelta(seconds=30)


def _ns(moment: datetime) -> int:
    return int(moment.timestamp()) * 1_000_000_000


def _counter_values(instance: str, minute: int) -> dict[str, int]:
    bad = instance == "node-b" and minute < DEGRADED_MINUTES
    return {
        ts.CERTIFICATES: 100,
        ts.COVERED: 50 if bad else 100,
        ts.VACUOUS: 0,
        ts.INFINITE: 10 if bad else 0,
        ts.NAN: 0,
        ts.FALLBACKS: 30 if bad else 1,
        ts.REPAIRED_BYTES: 4096 if bad else 128,
    }


def metrics_data(instance: str) -> MetricsData:
    """Every minute of one instance as the SDK's metric data, ready for its OTLP encoder or exporter."""
    minutes = [m for m in range(MINUTES) if not (instance == "node-c" and m < SILENT_MINUTES)]
    counters: dict[str, list[NumberDataPoint]] = {name: [] for name in ts.COUNTER_METRICS}
    histogram, lag = [], []
    for minute in minutes:
        at = _minute_start(NOW) - timedelta(minutes=minute) + timedelta(seconds=10)
        start, end = _ns(at - timedelta(seconds=10)), _ns(at)
        for layer in range(LAYERS):
            for head in range(HEADS):
                attributes = {ts.ATTR_LAYER: layer, ts.ATTR_HEAD: head}
                for name, value in _counter_values(instance, minute).items():
                    counters[name].append(NumberDataPoint(attributes, start, end, value))
                buckets = [0] * (len(ts.CERTIFICATE_BUCKETS) + 1)
                buckets[LOW_BOUND_INDEX], buckets[ONE_INDEX] = 10, layer
                histogram.append(
                    HistogramDataPoint(
                        attributes,
                        start,
                        end,
                        10 + layer,
                        10 * 1e-3 + layer * 1.0,
                        buckets,
                        list(ts.CERTIFICATE_BUCKETS),
                        1e-4,
                        1.0 if layer else 1e-3,
                    )
                )
        counters[ts.STEPS].append(NumberDataPoint({}, start, end, 100))
        counters[ts.DROPPED_POINTS].append(NumberDataPoint({}, start, end, 5 if instance == "node-b" else 0))
        lag.append(NumberDataPoint({}, start, end, 0.5))
    metrics = [
        Metric(name, None, None, Sum(points, AggregationTemporality.DELTA, True))
        for name, points in counters.items()
        if points
    ]
    metrics.append(Metric(ts.CERTIFICATE_VALUE, None, None, Histogram(histogram, AggregationTemporality.DELTA)))
    metrics.append(Metric(ts.EXPORT_LAG, None, "s", Gauge(lag)))
    resource = Resource(
        {ts.RESOURCE_SERVICE_NAME: "witcert-engine", ts.RESOURCE_INSTANCE: instance, ts.RESOURCE_MODEL: MODEL}
    )
    return MetricsData([ResourceMetrics(resource, [ScopeMetrics(InstrumentationScope("witcert"), metrics, "")], "")])


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory):
    """A running witcert collector on a chDB store, fed by the SDK's OTLP/HTTP exporter."""
    root = tmp_path_factory.mktemp("dashboards")
    config = CollectorConfig(
        store_url=f"chdb://{root / 'store'}", otlp_http="127.0.0.1:0", otlp_grpc=None, spool_dir=root / "spool"
    )
    with Collector(config) as collector:
        exporter = OTLPMetricExporter(endpoint=f"http://127.0.0.1:{collector.ports.http}/v1/metrics", timeout=30)
        for instance in INSTANCES:
            assert exporter.export(metrics_data(instance)) is MetricExportResult.SUCCESS
        exporter.shutdown()
        assert collector.wait_stored(60)
        assert collector.counters.snapshot()["rejected_points"] == 0
        yield collector.store


def run(store: Store, sql: str, variables: dict, span: timedelta, points: int = 1000) -> tuple[list[str], list[tuple]]:
    time_range = macros.TimeRange.for_width(NOW - span, NOW, points)
    return store.query(macros.render_sql(sql, time_range, variables))


# --- macro expansion ---------------------------------------------------------------------------------


def test_macros_expand_as_the_plugin_does():
    time_range = macros.TimeRange(
        datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC), datetime(2026, 1, 2, 4, 4, 5, tzinfo=UTC), 7.9
    )
    sql = "SELECT $__timeInterval(t), $__interval_s FROM x WHERE $__timeFilter(t) AND $__fromTime < $__toTime_ms"
    assert macros.expand_macros(sql, time_range) == (
        "SELECT toStartOfInterval(toDateTime(t), INTERVAL 7 second), 7 FROM x WHERE "
        "t >= toDateTime(1767323045) AND t <= toDateTime(1767326645) AND toDateTime(1767323045) < "
        "fromUnixTimestamp64Milli(1767326645000)"
    )
    with pytest.raises(macros.MacroError, match="conditionalAll"):
        macros.expand_macros("SELECT 1 WHERE $__conditionalAll(a IN ($x), $x)", time_range)
    with pytest.raises(macros.MacroError, match="expects 1"):
        macros.expand_macros("SELECT $__timeFilter(a, b)", time_range)


def test_variables_substitute_as_grafana_does():
    sql = "WHERE m IN (${model:singlequote}) AND tau <= ${tau} AND [[tau]] > 0 AND $__interval_s > 0"
    out = macros.substitute_variables(sql, {"model": ["a", "it's"], "tau": "0.1"})
    assert out == "WHERE m IN ('a','it\\'s') AND tau <= 0.1 AND 0.1 > 0 AND $__interval_s > 0"
    with pytest.raises(macros.MacroError, match="no value"):
        macros.substitute_variables("${instance:singlequote}", {})


# --- panels ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("span", [timedelta(hours=2), timedelta(days=30)], ids=["1m-rollup", "1h-rollup"])
def test_every_panel_query_runs_and_returns_its_columns(store: Store, span: timedelta):
    for spec in panels.PANELS:
        for query in spec.queries:
            columns, rows = run(store, query.sql, ALL, span)
            assert tuple(columns) == query.columns, (spec.key, query.ref_id)
            assert rows, f"{spec.key}/{query.ref_id} returned no rows over {span}"
            if spec.kind == "timeseries":
                times = [row[0] for row in rows]
                assert times == sorted(times), f"{spec.key}: Grafana needs time-ordered rows"
                assert all(isinstance(row[0], datetime) for row in rows)


def _granules_read(store: Store, sql: str) -> dict[str, int]:
    """Granules ClickHouse plans to read per table, from EXPLAIN indexes = 1."""
    _, plan = store.query("EXPLAIN indexes = 1 " + sql)
    read: dict[str, int] = {}
    table = None
    for (line,) in plan:
        started = re.search(r"ReadFromMergeTree \(\w+\.(\w+)\)", line)
        if started:
            table = started.group(1)
            read.setdefault(table, 0)
        counted = re.search(r"Granules: (\d+)", line)
        if counted and table:
            read[table] = max(read[table], int(counted.group(1)))
    return read


@pytest.mark.parametrize(("span", "skipped"), [(timedelta(hours=2), "_1h"), (timedelta(days=30), "_1m")])
def test_each_range_reads_one_rollup_only(store: Store, span: timedelta, skipped: str):
    """The constant range condition makes ClickHouse skip the other rollup entirely."""
    for spec in panels.PANELS:
        for query in spec.queries:
            time_range = macros.TimeRange.for_width(NOW - span, NOW, 1000)
            read = _granules_read(store, macros.render_sql(query.sql, time_range, ALL))
            assert read, spec.key
            assert all(count == 0 for table, count in read.items() if table.endswith(skipped)), (spec.key, read)
            assert any(count > 0 for count in read.values()), (spec.key, read)


def test_variables_list_what_the_store_holds(store: Store):
    by_name = {spec.name: spec for spec in panels.VARIABLES}
    _, models = run(store, by_name["model"].query, {}, timedelta(hours=2))
    assert [row[0] for row in models] == [MODEL]
    _, instances = run(store, by_name["instance"].query, {"model": [MODEL]}, timedelta(hours=2))
    assert [row[0] for row in instances] == list(INSTANCES)
    _, none = run(store, by_name["instance"].query, {"model": ["no-such-model"]}, timedelta(hours=2))
    assert none == []


def test_heat_maps_hold_the_known_answer(store: Store):
    for span in (timedelta(hours=2), timedelta(days=30)):  # both rollups agree
        _, coverage = run(store, panels.panel("coverage_heatmap").queries[0].sql, ALL, span)
        # Each head: 10 / (10 + layer) of its finite samples <= 0.1, and 50 of its 24,000 certificates
        # are +inf (node-b's last 5 minutes), which count as not covered.
        assert {(layer, head): round(value, 12) for layer, head, value in coverage} == {
            (layer, head): round(10 / (10 + layer) * (1 - 50 / 24000), 12)
            for layer in range(LAYERS)
            for head in range(HEADS)
        }
        _, largest = run(store, panels.panel("max_certificate_heatmap").queries[0].sql, ALL, span)
        assert {(layer, head): value for layer, head, value in largest} == {
            (layer, head): 1.0 if layer else ts.CERTIFICATE_BUCKETS[LOW_BOUND_INDEX]
            for layer in range(LAYERS)
            for head in range(HEADS)
        }


def test_coverage_follows_tau_and_the_selection(store: Store):
    sql = panels.panel("coverage_now").queries[0].sql
    at = {tau: run(store, sql, {**ALL, "tau": tau}, timedelta(hours=2))[1][0][0] for tau in ("0.0001", "0.01", "1")}
    finite = 1 - 400 / 192_000  # +inf certificates among all: node-b's 400 of 3 x 8 heads x 100 per minute
    assert at["0.0001"] == 0  # every certificate sits in the 1e-3 bucket or above
    assert at["0.01"] == pytest.approx(40 / 46 * finite)  # per minute and head: 10 per layer at 1e-3, 6 at 1.0
    assert at["1"] == pytest.approx(finite)
    _, by_layer = run(store, panels.panel("coverage_by_layer").queries[0].sql, ALL, timedelta(hours=2))
    newest = _minute_start(NOW) - timedelta(minutes=DEGRADED_MINUTES - 1)
    # In node-b's bad minutes, 20 of the 400 certificates per layer and minute are +inf (node-c is silent).
    observed = {(time.replace(tzinfo=UTC), label): round(value, 12) for time, label, value in by_layer}
    assert len({time for time, _ in observed}) == MINUTES
    assert observed == {
        (time, f"layer {layer:03d}"): round(10 / (10 + layer) * (0.95 if time >= newest else 1), 12)
        for time, _ in observed
        for layer in range(LAYERS)
    }
    gate = panels.panel("gate_coverage_now").queries[0].sql
    healthy = run(store, gate, {**ALL, "instance": ["node-a"]}, timedelta(hours=2))[1][0][0]
    degraded = run(store, gate, {**ALL, "instance": ["node-b"]}, timedelta(hours=2))[1][0][0]
    assert healthy == 1.0
    assert degraded == pytest.approx((85 * 100 + 5 * 50) / (90 * 100))


def test_counts_panels_add_up(store: Store):
    span = timedelta(hours=2)
    assert run(store, panels.panel("inf_now").queries[0].sql, ALL, span)[1] == [(5 * LAYERS * HEADS * 10,)]
    _, fractions = run(
        store, panels.panel("vacuous_inf_fractions").queries[0].sql, {**ALL, "instance": ["node-b"]}, span
    )
    by_time = {row[0]: row[1:] for row in fractions}
    newest = max(by_time)
    assert by_time[newest] == (0.0, 0.1, 0.0)
    assert by_time[min(by_time)] == (0.0, 0.0, 0.0)
    _, quantiles = run(store, panels.panel("certificate_quantiles").queries[0].sql, ALL, span)
    assert {row[1:] for row in quantiles} == {(ts.CERTIFICATE_BUCKETS[LOW_BOUND_INDEX], 1.0, 1.0)}
    # Stored samples per second in one-minute buckets (2-hour range: 7.2 s interval < 60 s).
    _, rate = run(store, panels.panel("samples_per_second").queries[0].sql, {**ALL, "instance": ["node-a"]}, span)
    assert {round(value, 9) for _, _, value in rate} == {round(HEADS * (10 * LAYERS + 6) / 60, 9)}
    _, dropped = run(store, panels.panel("dropped_points").queries[0].sql, ALL, span)
    assert {(instance, value) for _, instance, value in dropped} == {("node-a", 0), ("node-b", 5), ("node-c", 0)}
    _, lag = run(store, panels.panel("export_lag").queries[0].sql, ALL, span)
    assert {value for _, _, value in lag} == {0.5}


# --- alerts ---------------------------------------------------------------------------------------------


def _firing(store: Store, spec: alerts.AlertSpec) -> set[str]:
    """Evaluate a rule as Grafana does: its query over [now - window, now], then the threshold per row."""
    time_range = macros.TimeRange(NOW - timedelta(seconds=spec.window_s), NOW, 1.0)
    columns, rows = store.query(macros.render_sql(spec.sql, time_range, {}))
    assert columns[-1] == spec.value_column
    compare = {"gt": lambda v: v > spec.threshold, "lt": lambda v: v < spec.threshold}[spec.evaluator]
    return {row[1] for row in rows if row[-1] is not None and compare(row[-1])}


def test_each_alert_fires_for_exactly_the_faulty_instance(store: Store):
    rules = {spec.uid: spec for spec in alerts.alert_specs()}
    assert _firing(store, rules["witcert-coverage-low"]) == {"node-b"}
    assert _firing(store, rules["witcert-inf-spike"]) == {"node-b"}
    assert _firing(store, rules["witcert-fallback-spike"]) == {"node-b"}
    assert _firing(store, rules["witcert-instance-silent"]) == {"node-c"}
    # A laxer target stops the coverage alert: the threshold really is the target.
    assert _firing(store, alerts.alert_specs(coverage_target=0.4)[0]) == set()


def test_alert_sql_uses_only_backend_macros():
    for rule in alerts.alert_rules():
        sql = rule["data"][0]["model"]["rawSql"]
        assert "$__conditionalAll" not in sql
        # No dashboard variables either: alerting has none.
        assert macros.substitute_variables(sql, {}) == sql
        assert rule["data"][1]["model"]["type"] == "threshold"


def test_alert_provisioning_file_matches_the_api_payloads():
    rules = alerts.alert_rules()
    document = yaml.safe_load(alerts.render_yaml(alerts.provisioning_document(rules)))
    (group,) = document["groups"]
    assert group["folder"] == grafana.FOLDER_TITLE and group["interval"] == "60s"
    for file_rule, api_rule in zip(group["rules"], rules, strict=True):
        # Grafana turns "$$" back into "$" when it reads the file.
        unescaped = json.loads(json.dumps(file_rule).replace("$$", "$"))
        for key, value in unescaped.items():
            assert api_rule[key] == value, key


# --- generated files ---------------------------------------------------------------------------------


def test_committed_provisioning_equals_the_generated_files(tmp_path: Path):
    written = export.export(tmp_path)
    assert written
    for path in written:
        relative = path.relative_to(tmp_path)
        committed = REPO / "deploy" / "grafana" / relative
        assert committed.read_text() == path.read_text(), (
            f"{committed} is stale: run `witcert dashboards export deploy/grafana`"
        )


def test_dashboard_validates_against_the_pinned_sdk_models():
    document = json.loads((REPO / "deploy/grafana/dashboards/witcert-coverage.json").read_text())
    model = dashboard_models.Dashboard.from_json(document)
    assert json.loads(grafana.render_json(model)) == document  # nothing lost or unknown
    panels_by_title = {p.title: p for p in model.panels if isinstance(p, dashboard_models.Panel)}
    assert set(panels_by_title) == {spec.title for spec in panels.PANELS}
    for spec in panels.PANELS:
        targets = panels_by_title[spec.title].targets
        assert all(isinstance(target, ClickHouseQuery) for target in targets)
        assert [t.raw_sql for t in targets] == [q.sql for q in spec.queries]  # one source of truth
        expected_format = QueryFormat.TIME_SERIES if spec.kind == "timeseries" else QueryFormat.TABLE
        assert {t.query_format for t in targets} == {expected_format}
    assert [v.name for v in model.templating.list_val] == ["model", "instance", "tau"]


def test_cli_export_writes_the_tree_with_the_thresholds_given(tmp_path: Path, capsys: pytest.CaptureFixture):
    import argparse

    from witcert.dashboards import cli

    parser = argparse.ArgumentParser(prog="witcert")
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["dashboards", "export", str(tmp_path), "--coverage-target", "0.95", "--silence", "600"])
    assert args.handler(args) == 0
    assert len(capsys.readouterr().out.split()) == 4
    document = yaml.safe_load((tmp_path / "provisioning/alerting/witcert-alerts.yaml").read_text())
    thresholds = {
        rule["uid"]: rule["data"][1]["model"]["conditions"][0]["evaluator"]["params"][0]
        for rule in document["groups"][0]["rules"]
    }
    assert thresholds["witcert-coverage-low"] == 0.95 and thresholds["witcert-instance-silent"] == 600
    args = parser.parse_args(["dashboards", "export", str(tmp_path), "--coverage-target", "1.5"])
    assert args.handler(args) == 1
    assert "coverage target" in capsys.readouterr().err
