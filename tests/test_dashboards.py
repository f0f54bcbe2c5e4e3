"""Dashboards and alerts, executed: every panel and alert query runs against a chDB store filled
through a running witcert collector by real engines' telemetry (``fleet.py``: the aggregator and the
OTLP stream with chosen certificates), with the macros expanded as grafana-clickhouse-datasource
expands them. Every panel's answer is compared with the figure computed directly from the
certificates that were sent.
"""

from __future__ import annotations

import json
import math
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import fleet
import numpy as np
import pytest
import yaml
from fleet import INSTANCES, MODEL, NOW, TAU
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import alerting as alerting_models
from grafana_foundation_sdk.models import dashboard as dashboard_models

from witcert.collector.config import CollectorConfig
from witcert.collector.service import Collector
from witcert.collector.store import Store
from witcert.dashboards import alerts, export, grafana, macros, panels
from witcert.dashboards.datasource import ClickHouseQuery, QueryFormat

REPO = Path(__file__).resolve().parent.parent
ALL = {"model": [MODEL], "instance": list(INSTANCES), "tau": repr(TAU)}
# Taus of the what-if panels: the engine's, bucket edges, between edges, above every finite bound.
WHAT_IF_TAUS = ("0.05", "0.001", "0.03162277660168379", "0.04", "0.0562", "100")


@pytest.fixture(scope="module")
def sent(tmp_path_factory: pytest.TempPathFactory):
    """A running witcert collector on a chDB store, and the fleet's certificates it received."""
    root = tmp_path_factory.mktemp("dashboards")
    config = CollectorConfig(
        store_url=f"chdb://{root / 'store'}", otlp_http="127.0.0.1:0", otlp_grpc=None, spool_dir=root / "spool"
    )
    with Collector(config) as collector:
        records = fleet.send(f"http://127.0.0.1:{collector.ports.http}/v1/metrics")
        assert collector.wait_stored(60)
        assert collector.counters.snapshot()["rejected_points"] == 0
        yield collector.store, fleet.Fleet(records)


@pytest.fixture(scope="module")
def store(sent) -> Store:
    return sent[0]


def run(store: Store, sql: str, variables: dict, span: timedelta, points: int = 1000, at: datetime = NOW):
    time_range = macros.TimeRange.for_width(at - span, at, points)
    return store.query(macros.render_sql(sql, time_range, variables))


def comparable(rows) -> list[tuple]:
    """Rows with times as unix seconds, for comparison with ``fleet.expected_answer``."""
    return [
        tuple(int(v.replace(tzinfo=UTC).timestamp()) if isinstance(v, datetime) else v for v in row) for row in rows
    ]


def assert_rows_equal(got: list[tuple], expected: list[tuple], what: str) -> None:
    assert len(got) == len(expected), (what, len(got), len(expected))
    for got_row, expected_row in zip(got, expected, strict=True):
        assert len(got_row) == len(expected_row), (what, got_row, expected_row)
        for got_value, expected_value in zip(got_row, expected_row, strict=True):
            if isinstance(expected_value, float) and math.isfinite(expected_value):
                assert got_value == pytest.approx(expected_value, rel=1e-12, abs=1e-15), (what, got_row, expected_row)
            else:
                assert got_value == expected_value, (what, got_row, expected_row)


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
    assert [row[0] for row in instances] == sorted(INSTANCES)
    _, none = run(store, by_name["instance"].query, {"model": ["no-such-model"]}, timedelta(hours=2))
    assert none == []
    _, taus = run(store, by_name["tau"].query, ALL, timedelta(hours=2))
    assert [row[0] for row in taus][:2] == ["0.05", "0.001"]  # the engines' tau first, then the fixed choices


@pytest.mark.parametrize("key", [spec.key for spec in panels.PANELS if spec.key != "export_lag"])
def test_every_panel_answers_the_figure_computed_from_the_certificates(sent, key: str):
    store, sent_fleet = sent
    spec = panels.panel(key)
    taus = WHAT_IF_TAUS if "${tau}" in "".join(q.sql for q in spec.queries) else (repr(TAU),)
    for tau in taus:
        (query,) = spec.queries
        _, rows = run(store, query.sql, {**ALL, "tau": tau}, timedelta(hours=2))
        assert_rows_equal(comparable(rows), fleet.expected_answer(sent_fleet, key, tau), f"{key} at tau={tau}")


def test_export_lag_is_one_point_per_batch_of_each_reporting_instance(store: Store):
    _, lag = run(store, panels.panel("export_lag").queries[0].sql, ALL, timedelta(hours=2))
    reporting = {(time.replace(second=0), instance) for time, instance, _ in lag}
    assert {instance for _, instance in reporting} == set(INSTANCES)
    assert all(0 <= value < 5 for _, _, value in lag)


def test_the_selection_narrows_every_figure(sent):
    store, sent_fleet = sent
    one = {**ALL, "instance": ["node-b"]}
    for key in ("coverage_now", "inf_now", "coverage_heatmap", "max_certificate_heatmap", "certificate_quantiles"):
        _, rows = run(store, panels.panel(key).queries[0].sql, one, timedelta(hours=2))
        assert_rows_equal(comparable(rows), fleet.expected_answer(sent_fleet, key, "0.05", ["node-b"]), key)


def test_heads_are_shown_by_global_index_under_tensor_parallelism(sent):
    store, _ = sent
    _, cells = run(store, panels.panel("coverage_heatmap").queries[0].sql, ALL, timedelta(hours=2))
    assert {head for _, head, _ in cells} == set(range(2 * fleet.HEADS))
    ranks = {**ALL, "instance": ["node-a/tp1"]}
    _, cells = run(store, panels.panel("max_certificate_heatmap").queries[0].sql, ranks, timedelta(hours=2))
    assert {head for _, head, _ in cells} == {fleet.HEADS + local for local in range(fleet.HEADS)}


def test_what_if_coverage_is_an_interval_holding_the_sampled_truth(sent):
    """Off the engine's tau the panel says "between a and b"; the sampled certificates' true share is inside."""
    store, sent_fleet = sent
    records = sent_fleet.select()
    values = np.concatenate([r.values.ravel() for r in records])
    finite_share = np.isfinite(values).mean()
    sampled = np.concatenate([r.values.ravel() for r in records if r.sampled])
    sampled = sampled[np.isfinite(sampled)]
    widths = []
    for tau in WHAT_IF_TAUS[1:]:
        _, rows = run(store, panels.panel("coverage_at_tau").queries[0].sql, {**ALL, "tau": tau}, timedelta(hours=2))
        ((at_least, at_most, exact),) = rows
        assert exact == 0
        truth = finite_share * (sampled <= np.float32(tau)).mean()
        assert at_least <= truth * (1 + 1e-12) and truth <= at_most * (1 + 1e-12), (tau, at_least, truth, at_most)
        widths.append(at_most - at_least)
    assert max(widths) > 0  # a tau inside a bucket that holds certificates: a real interval, never a point


@pytest.mark.parametrize("span", [timedelta(days=30)], ids=["1h-rollup"])
def test_the_hour_rollups_give_the_same_totals(sent, span: timedelta):
    store, sent_fleet = sent
    for key in ("coverage_now", "coverage_heatmap", "fallback_now", "inf_now", "coverage_at_tau"):
        for tau in ("0.05", "0.01"):
            _, rows = run(store, panels.panel(key).queries[0].sql, {**ALL, "tau": tau}, span)
            assert_rows_equal(comparable(rows), fleet.expected_answer(sent_fleet, key, tau), f"{key} over {span}")


# --- alerts ---------------------------------------------------------------------------------------------


def _breaching(store: Store, spec: alerts.AlertSpec, at: datetime) -> set[str]:
    """One evaluation as Grafana makes it: the query over [at - window, at], then the threshold per row."""
    time_range = macros.TimeRange(at - timedelta(seconds=spec.window_s), at, 1.0)
    columns, rows = store.query(macros.render_sql(spec.sql, time_range, {}))
    assert columns[-1] == spec.value_column
    compare = {"gt": lambda v: v > spec.threshold, "lt": lambda v: v < spec.threshold}[spec.evaluator]
    return {row[1] for row in rows if row[-1] is not None and compare(row[-1])}


def _seconds(duration: str) -> int:
    return int(duration[:-1]) * {"s": 1, "m": 60, "h": 3600}[duration[-1]]


def alert_states(store: Store, spec: alerts.AlertSpec, minutes_ago: range) -> dict[int, dict[str, str]]:
    """Grafana's state machine over evaluations every minute, oldest first: a breaching instance is
    Pending until it has breached for the rule's ``for``, then Alerting; Normal again once it stops."""
    since: dict[str, datetime] = {}
    states: dict[int, dict[str, str]] = {}
    for minutes in sorted(minutes_ago, reverse=True):
        at = NOW - timedelta(minutes=minutes)
        breaching = _breaching(store, spec, at)
        since = {instance: since.get(instance, at) for instance in breaching}
        states[minutes] = {
            instance: "Alerting" if (at - start).total_seconds() >= _seconds(spec.pending) else "Pending"
            for instance, start in since.items()
        }
    return states


def _alerting(states: dict[int, dict[str, str]]) -> dict[str, list[int]]:
    alerting: dict[str, list[int]] = {}
    for minutes, by_instance in states.items():
        for instance, state in by_instance.items():
            if state == "Alerting":
                alerting.setdefault(instance, []).append(minutes)
    return {instance: sorted(minutes) for instance, minutes in alerting.items()}


RULES = {spec.uid: spec for spec in alerts.alert_specs()}


def test_coverage_drop_fires_after_its_pending_period_and_resolves(store: Store):
    # node-b's certificates were half above tau 10 to 14 minutes ago: every 5-minute window touching those
    # minutes (evaluations 14 .. 6 minutes ago) breaches; after 5 minutes pending it fires, then resolves.
    states = alert_states(store, RULES["witcert-coverage-low"], range(25))
    assert states[14] == {"node-b": "Pending"} and states[10] == {"node-b": "Pending"}
    assert _alerting(states) == {"node-b": list(range(6, 10))}
    assert states[5] == {} and states[20] == {}
    # A laxer target stops it: the threshold really is the target.
    lax = alerts.alert_specs(coverage_target=0.4)[0]
    assert _alerting(alert_states(store, lax, range(25))) == {}


@pytest.mark.parametrize(
    ("uid", "event", "floor"),
    [
        ("witcert-inf-spike", np.isinf, alerts.INF_FRACTION_FLOOR),
        ("witcert-fallback-spike", lambda v: v > fleet.F32_TAU, alerts.FALLBACK_RATE_FLOOR),
    ],
)
def test_spikes_fire_while_the_last_five_minutes_hold_them_and_resolve(sent, uid: str, event, floor: float):
    store, sent_fleet = sent
    states = alert_states(store, RULES[uid], range(25))

    def share(instance: str, minutes: range) -> float | None:
        records = sent_fleet.select([instance], minutes)
        total = sum(r.values.size for r in records)
        return fleet.Fleet.count(records, event) / total if total else None

    expected: dict[str, list[int]] = {}
    for minutes in range(25):
        for instance in INSTANCES:
            recent = share(instance, range(minutes, minutes + 5))
            baseline = share(instance, range(minutes + 5, minutes + 65)) or 0.0
            if recent is not None and recent / max(floor, alerts.SPIKE_FACTOR * baseline) > 1:
                expected.setdefault(instance, []).append(minutes)
    assert _alerting(states) == expected
    assert set(expected) == {"node-b"} and expected["node-b"][0] > 5 and expected["node-b"][-1] == 14


def test_instance_silent_means_down_not_idle(store: Store):
    # node-c's last batch was 31 minutes ago; node-d has decoded nothing for as long but sends heartbeats.
    states = alert_states(store, RULES["witcert-instance-silent"], range(35))
    assert _alerting(states) == {"node-c": list(range(27))}
    assert all(state == {} for minutes, state in states.items() if minutes >= 27)


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


def _round_trip(model_class, document: dict) -> dict:
    return json.loads(json.dumps(model_class.from_json(document), cls=JSONEncoder))


def test_alerting_files_validate_against_grafanas_models(tmp_path: Path):
    """Rules, contact point and notification policy files: Grafana 11.6's provisioning shapes, every field
    known to grafana-foundation-sdk's models (a field they drop or do not know fails the round trip)."""
    export.export(tmp_path, receivers=("webhook", "email", "slack"))
    folder = tmp_path / "provisioning" / "alerting"
    rules_file = yaml.safe_load((folder / "witcert-alerts.yaml").read_text())
    points_file = yaml.safe_load((folder / "witcert-contact-points.yaml").read_text())
    policies_file = yaml.safe_load((folder / "witcert-policies.yaml").read_text())
    assert rules_file["apiVersion"] == points_file["apiVersion"] == policies_file["apiVersion"] == 1

    (group,) = rules_file["groups"]
    assert group["orgId"] == 1 and group["name"] == alerts.RULE_GROUP and group["folder"] == grafana.FOLDER_TITLE
    for rule in group["rules"]:
        unescaped = json.loads(json.dumps(rule).replace("$$", "$"))
        decoded = _round_trip(alerting_models.Rule, unescaped)
        # A file rule takes its organisation, folder and group from its group; the API model has them per rule.
        assert {decoded.pop(key) for key in ("orgID", "folderUID", "ruleGroup")} == {0, ""}
        assert decoded == unescaped
        for annotation in ("summary", "description", "runbook"):
            assert len(unescaped["annotations"][annotation]) > 40, (rule["uid"], annotation)

    (point,) = points_file["contactPoints"]
    assert point["name"] == alerts.CONTACT_POINT and point["orgId"] == 1
    kinds = set()
    for receiver in point["receivers"]:
        document = {**receiver, "name": point["name"]}
        assert _round_trip(alerting_models.ContactPoint, document) == document
        variable, key, _ = alerts.RECEIVERS[receiver["type"]]
        assert receiver["settings"][key] == f"${variable}"  # Grafana expands it from its environment
        kinds.add(receiver["type"])
    assert kinds == {"webhook", "email", "slack"}

    (policy,) = policies_file["policies"]
    assert policy.pop("orgId") == 1
    assert _round_trip(alerting_models.NotificationPolicy, policy) == policy
    (route,) = policy["routes"]
    assert route["receiver"] == policy["receiver"] == alerts.CONTACT_POINT
    for rule in group["rules"]:  # every witcert rule matches the witcert route
        assert all(rule["labels"].get(name) == value for name, _, value in route["object_matchers"]), rule["uid"]


def test_contact_points_take_destinations_from_the_environment_only():
    points = alerts.contact_points(
        ("webhook", "slack"),
        {"WITCERT_ALERT_WEBHOOK_URL": "https://hooks.example/a", "WITCERT_ALERT_SLACK_URL": "https://slack.example/b"},
    )
    assert [(p["type"], p["settings"]["url"]) for p in points] == [
        ("webhook", "https://hooks.example/a"), ("slack", "https://slack.example/b"),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="WITCERT_ALERT_EMAIL_ADDRESSES"):
        alerts.contact_points(("email",), {})
    with pytest.raises(ValueError, match="receivers must be among"):
        alerts.contact_points(("pager",))
    for text in export.provisioning_files().values():
        assert "https://" not in text.replace("https://grafana", "")  # no destination is written into a file


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
    intervals = [spec for spec in panels.PANELS if spec.kind == "interval"]
    for spec in intervals:  # both ends named on the stat: never a single point value
        names = {o.matcher.options: o.properties[0].value for o in panels_by_title[spec.title].field_config.overrides}
        assert names == {panels.AT_LEAST: "at least", panels.AT_MOST: "at most"}


def test_cli_export_writes_the_tree_with_the_thresholds_given(tmp_path: Path, capsys: pytest.CaptureFixture):
    import argparse

    from witcert.dashboards import cli

    parser = argparse.ArgumentParser(prog="witcert")
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["dashboards", "export", str(tmp_path), "--coverage-target", "0.95", "--silence", "600"])
    assert args.handler(args) == 0
    assert len(capsys.readouterr().out.split()) == len(export.provisioning_files())
    document = yaml.safe_load((tmp_path / "provisioning/alerting/witcert-alerts.yaml").read_text())
    thresholds = {
        rule["uid"]: rule["data"][1]["model"]["conditions"][0]["evaluator"]["params"][0]
        for rule in document["groups"][0]["rules"]
    }
    assert thresholds["witcert-coverage-low"] == 0.95 and thresholds["witcert-instance-silent"] == 600
    args = parser.parse_args(["dashboards", "export", str(tmp_path), "--coverage-target", "1.5"])
    assert args.handler(args) == 1
    assert "coverage target" in capsys.readouterr().err
