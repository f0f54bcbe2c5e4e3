"""Alerts as code: rules, the contact point that reaches a person, and the notification policy.

The same objects are written as Grafana file provisioning and sent as provisioning-API payloads.
Alert queries run in Grafana's backend, where dashboard variables do not exist and
``$__conditionalAll`` is never expanded (the browser does that), so their SQL uses only the
plugin's backend macros. Each query returns a numeric table: label columns (model, instance) and
one value per row, which Grafana alerting turns into one alert instance per row. Every rule carries
a summary, a description and a runbook (what to check, what gating does about it).

Receivers (webhook, email, Slack) read their destinations from environment variables: in the
provisioning files as ``$VARIABLE`` references Grafana expands from its own environment, for a push
from the pushing process's environment. No address is written into any file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import yaml
from grafana_foundation_sdk.builders import alerting, expr
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import alerting as alerting_models
from grafana_foundation_sdk.models import dashboard as dashboard_models

from witcert.collector import tables
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

# The contact point every witcert rule notifies, and its receivers: kind -> (environment variable,
# settings key, what the variable holds). Grafana 11.6 integration settings.
CONTACT_POINT = "witcert"
RECEIVERS: dict[str, tuple[str, str, str]] = {
    "webhook": ("WITCERT_ALERT_WEBHOOK_URL", "url", "the URL Grafana POSTs its alert JSON to"),
    "email": ("WITCERT_ALERT_EMAIL_ADDRESSES", "addresses", "addresses separated by ';' (Grafana needs GF_SMTP_*)"),
    "slack": ("WITCERT_ALERT_SLACK_URL", "url", "a Slack incoming-webhook URL"),
}
DEFAULT_RECEIVERS: tuple[str, ...] = ("webhook",)
_RECEIVER_SETTINGS: dict[str, dict[str, Any]] = {
    "webhook": {"httpMethod": "POST"},
    "email": {"singleEmail": False},
    "slack": {},
}


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
    description: str = ""  # what the numbers mean
    runbook: str = ""  # what to check, and what gating does about it


def _spike_sql(event: str, floor: float, factor: float) -> str:
    # The last 5 minutes against the hour before them: fire when the recent rate exceeds both an
    # absolute floor and `factor` times its own baseline (zero for an instance with no history).
    # Value > 1 means "spike".
    return (
        "SELECT Model AS model, Instance AS instance,\n"
        f"  (sumIf({event}, Bucket >= $__toTime - 300) / nullIf(sumIf(Certificates, Bucket >= $__toTime - 300), 0))\n"
        f"  / greatest({floor}, {factor} * ifNull(sumIf({event}, Bucket < $__toTime - 300)"
        " / nullIf(sumIf(Certificates, Bucket < $__toTime - 300), 0), 0)) AS spike_ratio\n"
        f"FROM {tables.COUNTS_1M}\n"
        "WHERE $__timeFilter(Bucket)\n"
        "GROUP BY model, instance\n"
        "HAVING sumIf(Certificates, Bucket >= $__toTime - 300) > 0\n"
        "ORDER BY model, instance"
    )


def _spike_spec(
    uid: str, title: str, summary: str, event: str, floor: float, factor: float, description: str, runbook: str
) -> AlertSpec:
    # The query reads the hour before the last 5 minutes too, hence its 65-minute window.
    return AlertSpec(
        uid=uid,
        title=title,
        summary=summary,
        description=description,
        runbook=runbook,
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
                f"FROM {tables.COUNTS_1M}\n"
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
            description="Coverage is the engine's own exact count: certificates at or below the tau in force, over "
            "every decode step of the last 5 minutes, for this instance. It has stayed below the target for 5 minutes.",
            runbook="Check the dashboard's layer x head heat maps for the heads that fell (one layer, or all?) and "
            "the vacuous and infinite fractions; compare with the fallback rate. In gate mode every head-step above "
            "tau was already recomputed from exact K/V, so outputs stay within tau and the cost is bandwidth "
            "(fallback rate, repaired bytes); in observe mode nothing was repaired: those steps carry no guarantee. "
            "Look for a new model, prompt mix or context length; raise outlier_pairs or tau only knowingly.",
        ),
        _spike_spec(
            "witcert-inf-spike",
            "witcert infinite-certificate spike",
            "Share of +inf certificates in the last 5 minutes is above "
            f"{inf_fraction_floor:g} and {spike_factor:g}x its previous hour on {{{{ $labels.instance }}}}",
            "Infinite",
            inf_fraction_floor,
            spike_factor,
            description="+inf certificates overflowed in float32: still valid bounds, but vacuous. Their share of "
            "the last 5 minutes is above the floor and above the spike factor times the hour before.",
            runbook="Check the largest-certificate heat map for the heads at +inf and the engine's logs around the "
            "start; +inf usually means extreme logits (a new model, very long contexts). In gate mode those "
            "head-steps were recomputed exactly (every +inf is above tau); in observe mode they carry no guarantee.",
        ),
        _spike_spec(
            "witcert-fallback-spike",
            "witcert fallback-rate spike",
            "Gating fallbacks per certificate in the last 5 minutes are above "
            f"{fallback_rate_floor:g} and {spike_factor:g}x the previous hour on {{{{ $labels.instance }}}}",
            "Fallbacks",
            fallback_rate_floor,
            spike_factor,
            description="Head-steps repaired from the exact K/V backup per certificate, in the last 5 minutes, are "
            "above the floor and above the spike factor times the hour before.",
            runbook="Gating is doing its job: each fallback is a head-step recomputed exactly, so the outputs keep "
            "their guarantee, but every one costs bandwidth (see repaired bytes/s and decode latency). Check which "
            "layers and heads fall back (heat maps) and whether coverage fell with it; a sustained rate means the "
            "quantized cache no longer fits this traffic.",
        ),
        AlertSpec(
            uid="witcert-instance-silent",
            title="witcert instance stopped reporting",
            summary=f"No telemetry for over {silence_s} s from {{{{ $labels.instance }}}} "
            "({{ $labels.model }}), which reported during the last day",
            sql=(
                # Every batch the engine's stream exports carries the tau gauge, and an idle engine still sends
                # it as a heartbeat: its newest point is the instance's last sign of life. Few rows (one per
                # batch), found by the raw table's sort key (ServiceName, MetricName, ...), exact timestamps.
                f"SELECT ResourceAttributes['{names.RESOURCE_MODEL}'] AS model,\n"
                f"  ResourceAttributes['{names.RESOURCE_INSTANCE}'] AS instance,\n"
                "  dateDiff('second', max(TimeUnix), $__toTime) AS silent_s\n"
                f"FROM {tables.GAUGE}\n"
                f"WHERE MetricName = '{names.TAU}' AND $__timeFilter(TimeUnix)\n"
                "GROUP BY model, instance\n"
                "ORDER BY model, instance"
            ),
            value_column="silent_s",
            window_s=86400,
            evaluator="gt",
            threshold=float(silence_s),
            pending="0s",
            severity="critical",
            description="An engine's stream sends a batch on every flush and a heartbeat while it decodes nothing, "
            "so silence means the engine process, its network path or the collector is down, not idle traffic. "
            "Instances keep their id across restarts (service.instance.id), so a restarted engine resolves this.",
            runbook="Check that the engine process is running and its logs; that it reaches the collector "
            "(OTEL_EXPORTER_OTLP_ENDPOINT or WITCERT_COLLECTOR_ENDPOINT, /readyz of the collector) and the "
            "collector's dropped and rejected counters. Gating inside a running engine does not depend on "
            "telemetry: a down collector loses observation, not protection.",
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
        .annotations(
            {
                "summary": spec.summary,
                "description": spec.description,
                "runbook": spec.runbook,
                "__dashboardUid__": DASHBOARD_UID,
                "value_column": spec.value_column,
            }
        )
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


def contact_points(kinds: Sequence[str] = DEFAULT_RECEIVERS, values: Mapping[str, str] | None = None) -> list[dict]:
    """The witcert contact point, one provisioning-API payload per receiver kind.

    ``values`` None: each destination is a ``$VARIABLE`` reference (provisioning files, expanded by
    Grafana from its environment). Otherwise the destinations are read from ``values`` (a push); a
    kind whose variable is unset or empty raises ``ValueError`` naming it.
    """
    unknown = [kind for kind in kinds if kind not in RECEIVERS]
    if unknown or not kinds:
        raise ValueError(f"receivers must be among {', '.join(RECEIVERS)}, got {', '.join(kinds) or 'none'}")
    payloads = []
    for kind in dict.fromkeys(kinds):
        variable, key, meaning = RECEIVERS[kind]
        if values is None:
            destination = f"${variable}"
        else:
            destination = values.get(variable, "").strip()
            if not destination:
                raise ValueError(f"the {kind} receiver needs {variable}: {meaning}")
        builder = (
            alerting.ContactPoint()
            .uid(f"witcert-{kind}")
            .name(CONTACT_POINT)
            .type(kind)
            .settings({key: destination, **_RECEIVER_SETTINGS[kind]})
            .disable_resolve_message(False)
        )
        payloads.append(json.loads(json.dumps(builder.build(), cls=JSONEncoder)))
    return payloads


def notification_policy() -> dict[str, Any]:
    """The notification policy tree: witcert's rules (label service=witcert) go to the witcert contact point,
    one notification per rule, model and instance; critical ones are repeated every hour until resolved."""
    witcert = (
        alerting.NotificationPolicy()
        .receiver(CONTACT_POINT)
        .object_matchers([["service", "=", "witcert"]])
        .group_by(["alertname", "model", "instance"])
        .group_wait("30s")
        .group_interval("5m")
        .repeat_interval("4h")
        .routes(
            [
                alerting.NotificationPolicy()
                .receiver(CONTACT_POINT)
                .object_matchers([["severity", "=", "critical"]])
                .repeat_interval("1h")
            ]
        )
    )
    root = (
        alerting.NotificationPolicy()
        .receiver(CONTACT_POINT)
        .group_by(["grafana_folder", "alertname"])
        .routes([witcert])
    )
    return json.loads(json.dumps(root.build(), cls=JSONEncoder))


def contact_points_document(points: list[dict[str, Any]]) -> dict[str, Any]:
    """The contact point as a Grafana provisioning file (``provisioning/alerting/*.yaml``)."""
    receivers = [{key: point[key] for key in ("uid", "type", "settings", "disableResolveMessage")} for point in points]
    return {"apiVersion": 1, "contactPoints": [{"orgId": 1, "name": CONTACT_POINT, "receivers": receivers}]}


def policies_document(policy: dict[str, Any]) -> dict[str, Any]:
    """The notification policy tree as a Grafana provisioning file; it replaces the organisation's tree."""
    return {"apiVersion": 1, "policies": [{"orgId": 1, **policy}]}


class _BlockStyleDumper(yaml.SafeDumper):
    """Writes multi-line strings (the SQL) as literal blocks, so the files read like the code."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockStyleDumper.add_representer(str, _represent_str)


def render_yaml(document: dict[str, Any]) -> str:
    """Stable YAML text for committed files."""
    return yaml.dump(document, Dumper=_BlockStyleDumper, sort_keys=True, default_flow_style=False, width=120)
