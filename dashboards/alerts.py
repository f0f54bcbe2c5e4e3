"""Alert rules as code: the same rules as Grafana file provisioning and as provisioning-API payloads.

Alert queries run in Grafana's backend, where dashboard variables do not exist and
``$__conditionalAll`` is never expanded (the browser does that), so their SQL uses only the
plugin's backend macros. Each query returns a numeric table: label columns (model, instance) and
one value per row, which Grafana alerting turns into one alert instance per row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import yaml
from grafana_foundation_sdk.builders import alerting, expr
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import alerting as alerting_models
from grafana_foundation_sdk.models import dashboard as dashboard_models

from witcert.integrations.telemetry import schema as names

from .datasource import DATASOURCE_UID, ClickHouseQuery, ClickHouseQueryBuilder, QueryFormat
from .grafana import DASHBOARD_UID, FOLDER_TITLE, FOLDER_UID

RULE_GROUP = "witcert"
EVALUATION_INTERVAL_S = 60
EXPRESSION_DATASOURCE = "__expr__"

# Defaults of the thresholds; `witcert dashboards export/push` can override them.
COVERAGE_TARGET = 0.99
INF_FRACTION_FLOOR = 1e-3
FALLBACK_RATE_FLOOR = 0.05
SPIKE_FACTOR = 3.0
SILENCE_S = 300

Evaluator = Literal["gt", "lt"]


@dataclass(frozen=True)
class AlertSpec:
    """One alert rule: a SQL query over a window ending now, and a threshold on its value column."""

    uid: str
    title: str
    summary: str
    sql: str
    value_column: str
    window_s: int  # the query's relative time range: [now - window_s, now]
    evaluator: Evaluator
    threshold: float
    pending: str  # how long the condition must hold before the rule fires
    severity: Literal["critical", "warning"]


def _spike_sql(event: str, floor: float, factor: float) -> str:
    # The last 5 minutes against the hour before them: fire when the recent rate exceeds both an
    # absolute floor and `factor` times its own baseline (zero for an instance with no history).
    # Value > 1 means "spike".
    return (
        "SELECT Model AS model, Instance AS instance,\n"
        f"  (sumIf({event}, Bucket >= $__toTime - 300) / nullIf(sumIf(Certificates, Bucket >= $__toTime - 300), 0))\n"
        f"  / greatest({floor}, {factor} * ifNull(sumIf({event}, Bucket < $__toTime - 300)"
        " / nullIf(sumIf(Certificates, Bucket < $__toTime - 300), 0), 0)) AS spike_ratio\n"
        "FROM witcert_counts_1m\n"
        "WHERE $__timeFilter(Bucket)\n"
        "GROUP BY model, instance\n"
        "HAVING sumIf(Certificates, Bucket >= $__toTime - 300) > 0\n"
        "ORDER BY model, instance"
    )


def _spike_spec(uid: str, title: str, summary: str, event: str, floor: float, factor: float) -> AlertSpec:
    # The query reads the hour before the last 5 minutes too, hence its 65-minute window.
    return AlertSpec(
        uid=uid,
        title=title,
        summary=summary,
        sql=_spike_sql(event, floor, factor),
        value_column="spike_ratio",
        window_s=3900,
        evaluator="gt",
        threshold=1.0,
        pending="0s",
        severity="warning",
    )


def alert_specs(
    coverage_target: float = COVERAGE_TARGET,
    inf_fraction_floor: float = INF_FRACTION_FLOOR,
    fallback_rate_floor: float = FALLBACK_RATE_FLOOR,
    spike_factor: float = SPIKE_FACTOR,
    silence_s: int = SILENCE_S,
) -> tuple[AlertSpec, ...]:
    """The four rules of the issue, with their thresholds."""
    if not 0 < coverage_target <= 1:
        raise ValueError(f"coverage target must be in (0, 1], got {coverage_target}")
    if inf_fraction_floor < 0 or fallback_rate_floor < 0 or spike_factor <= 0 or silence_s <= 0:
        raise ValueError("alert floors must be >= 0, the spike factor and the silence must be > 0")
    return (
        AlertSpec(
            uid="witcert-coverage-low",
            title="witcert coverage below target",
            summary=f"Share of certificates covered at the engine's tau fell below {coverage_target:g} "
            "for {{ $labels.model }} on {{ $labels.instance }}: {{ $values.A.Value }}",
            sql=(
                "SELECT Model AS model, Instance AS instance, sum(Covered) / sum(Certificates) AS coverage\n"
                "FROM witcert_counts_1m\n"
                "WHERE $__timeFilter(Bucket)\n"
                "GROUP BY model, instance\n"
                "HAVING sum(Certificates) > 0\n"
                "ORDER BY model, instance"
            ),
            value_column="coverage",
            window_s=300,
            evaluator="lt",
            threshold=coverage_target,
            pending="5m",
            severity="critical",
        ),
        _spike_spec(
            "witcert-inf-spike",
            "witcert infinite-certificate spike",
            "Share of +inf certificates in the last 5 minutes is above "
            f"{inf_fraction_floor:g} and {spike_factor:g}x its previous hour on {{{{ $labels.instance }}}}",
            "Infinite",
            inf_fraction_floor,
            spike_factor,
        ),
        _spike_spec(
            "witcert-fallback-spike",
            "witcert fallback-rate spike",
            "Gating fallbacks per certificate in the last 5 minutes are above "
            f"{fallback_rate_floor:g} and {spike_factor:g}x the previous hour on {{{{ $labels.instance }}}}",
            "Fallbacks",
            fallback_rate_floor,
            spike_factor,
        ),
        AlertSpec(
            uid="witcert-instance-silent",
            title="witcert instance stopped reporting",
            summary=f"No telemetry for over {silence_s} s from {{{{ $labels.instance }}}} "
            "({{ $labels.model }}), which reported during the last day",
            sql=(
                # The exporter sets the export-lag gauge on every batch it builds: its newest point is
                # the instance's last sign of life. Few rows (one per batch), found by the raw table's
                # sort key (ServiceName, MetricName, ...), exact timestamps.
                f"SELECT ResourceAttributes['{names.RESOURCE_MODEL}'] AS model,\n"
                f"  ResourceAttributes['{names.RESOURCE_INSTANCE}'] AS instance,\n"
                "  dateDiff('second', max(TimeUnix), $__toTime) AS silent_s\n"
                "FROM otel_metrics_gauge\n"
                f"WHERE MetricName = '{names.EXPORT_LAG}' AND $__timeFilter(TimeUnix)\n"
                "GROUP BY model, instance\n"
                "ORDER BY model, instance"
            ),
            value_column="silent_s",
            window_s=86400,
            evaluator="gt",
            threshold=float(silence_s),
            pending="0s",
            severity="critical",
        ),
    )


def _rule(spec: AlertSpec, folder_uid: str, datasource_uid: str) -> alerting.Rule:
    source = (
        alerting.Query("A")
        .datasource_uid(datasource_uid)
        .relative_time_range(alerting_models.RelativeTimeRange(from_val=spec.window_s, to=0))
        .model(ClickHouseQueryBuilder(ClickHouseQuery("A", spec.sql, QueryFormat.TABLE, datasource_uid)))
    )
    threshold = (
        alerting.Query("B")
        .datasource_uid(EXPRESSION_DATASOURCE)
        .model(
            expr.TypeThreshold()
            .ref_id("B")
            .datasource(dashboard_models.DataSourceRef(type_val=EXPRESSION_DATASOURCE, uid=EXPRESSION_DATASOURCE))
            .expression("A")
            .conditions(
                [
                    expr.ExprTypeThresholdConditions().evaluator(
                        expr.ExprTypeThresholdConditionsEvaluator().type(spec.evaluator).params([spec.threshold])
                    )
                ]
            )
        )
    )
    return (
        alerting.Rule(spec.title)
        .uid(spec.uid)
        .folder_uid(folder_uid)
        .rule_group(RULE_GROUP)
        .org_id(1)
        .queries([source, threshold])
        .condition("B")
        .for_val(spec.pending)
        # An empty result is no fault of its own: a silent instance has a rule of its own.
        .no_data_state("OK")
        .exec_err_state("Error")
        .is_paused(False)
        .labels({"service": "witcert", "severity": spec.severity})
        .annotations({"summary": spec.summary, "__dashboardUid__": DASHBOARD_UID, "value_column": spec.value_column})
    )


def alert_rules(
    specs: tuple[AlertSpec, ...] | None = None,
    folder_uid: str = FOLDER_UID,
    datasource_uid: str = DATASOURCE_UID,
) -> list[dict[str, Any]]:
    """Provisioning-API payloads (``POST /api/v1/provisioning/alert-rules``), one per rule."""
    rules = [_rule(spec, folder_uid, datasource_uid).build() for spec in (specs or alert_specs())]
    return json.loads(json.dumps(rules, cls=JSONEncoder))


def _escape_dollars(value: Any) -> Any:
    # Grafana interpolates $VAR / ${VAR} from the environment in every provisioning file, which would
    # eat the SQL macros and {{ $labels }}; "$$" is its escape for a literal "$".
    if isinstance(value, str):
        return value.replace("$", "$$")
    if isinstance(value, dict):
        return {key: _escape_dollars(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_escape_dollars(item) for item in value]
    return value


def provisioning_document(rules: list[dict[str, Any]], folder_title: str = FOLDER_TITLE) -> dict[str, Any]:
    """The same rules as a Grafana alerting provisioning file (``provisioning/alerting/*.yaml``)."""
    file_rules = []
    for rule in rules:
        file_rule = {
            "uid": rule["uid"],
            "title": rule["title"],
            "condition": rule["condition"],
            "data": rule["data"],
            "for": rule["for"],
            "noDataState": rule["noDataState"],
            "execErrState": rule["execErrState"],
            "isPaused": rule["isPaused"],
            "labels": rule["labels"],
            "annotations": rule["annotations"],
        }
        file_rules.append(_escape_dollars(file_rule))
    return {
        "apiVersion": 1,
        "groups": [
            {
                "orgId": 1,
                "name": RULE_GROUP,
                "folder": folder_title,
                "interval": f"{EVALUATION_INTERVAL_S}s",
                "rules": file_rules,
            }
        ],
    }


class _BlockStyleDumper(yaml.SafeDumper):
    """Writes multi-line strings (the SQL) as literal blocks, so the files read like the code."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockStyleDumper.add_representer(str, _represent_str)


def render_yaml(document: dict[str, Any]) -> str:
    """Stable YAML text for committed files."""
    return yaml.dump(document, Dumper=_BlockStyleDumper, sort_keys=True, default_flow_style=False, width=120)
