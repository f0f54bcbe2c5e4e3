"""The Grafana dashboard, built with grafana-foundation-sdk (Grafana 11.6 schema) from ``panels``."""

from __future__ import annotations

import json
from typing import Any

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.builders import stat, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as models

from .datasource import DATASOURCE_UID, ClickHouseQuery, ClickHouseQueryBuilder, QueryFormat, datasource_ref
from .panels import AT_LEAST, AT_MOST, PANELS, SECTIONS, VARIABLES, PanelSpec, VariableSpec

DASHBOARD_UID = "witcert-coverage"
DASHBOARD_TITLE = "witcert: certificate coverage"
FOLDER_UID = "witcert"
FOLDER_TITLE = "witcert"


def _variable(spec: VariableSpec, datasource_uid: str) -> Any:
    if spec.query is None:
        return (
            dashboard_builders.CustomVariable(spec.name)
            .label(spec.label)
            .description(spec.description)
            .values(",".join(spec.choices))
            .current(models.VariableOption(selected=True, text=spec.default, value=spec.default))
        )
    variable = (
        dashboard_builders.QueryVariable(spec.name)
        .label(spec.label)
        .description(spec.description)
        .datasource(datasource_ref(datasource_uid))
        .query(spec.query)
        .refresh(models.VariableRefresh.ON_TIME_RANGE_CHANGED)
    )
    if not spec.multi:
        # Options in the query's order (the engines' tau first); Grafana starts at the first one.
        return variable.sort(models.VariableSort.DISABLED)
    return (
        variable.multi(True)
        .include_all(True)
        .sort(models.VariableSort.ALPHABETICAL_ASC)
        .current(models.VariableOption(selected=True, text=["All"], value=["$__all"]))
    )


def _targets(spec: PanelSpec, datasource_uid: str) -> list[ClickHouseQueryBuilder]:
    query_format = QueryFormat.TIME_SERIES if spec.kind == "timeseries" else QueryFormat.TABLE
    return [
        ClickHouseQueryBuilder(ClickHouseQuery(query.ref_id, query.sql, query_format, datasource_uid))
        for query in spec.queries
    ]


def _continuous_colors(spec: PanelSpec) -> dashboard_builders.FieldColor:
    if spec.higher_is_better:
        return dashboard_builders.FieldColor().mode(models.FieldColorModeId.CONTINUOUS_RD_YL_GR)
    return dashboard_builders.FieldColor().mode(models.FieldColorModeId.CONTINUOUS_GR_YL_RD)


# How the two columns of an interval panel read in Grafana.
_INTERVAL_NAMES = {AT_LEAST: "at least", AT_MOST: "at most"}


def _panel(spec: PanelSpec, panel_id: int, datasource_uid: str) -> Any:
    if spec.kind in ("stat", "interval"):
        builder: Any = (
            stat.Panel()
            .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
            .color_mode(common.BigValueColorMode.BACKGROUND)
            .graph_mode(common.BigValueGraphMode.NONE)
            .color_scheme(_continuous_colors(spec))
        )
    if spec.kind == "interval":
        # Both ends, each named: an interval is never shown as a point value (the exact flag is not shown).
        builder = builder.reduce_options(
            common_builders.ReduceDataOptions()
            .calcs(["lastNotNull"])
            .values(False)
            .fields(f"/^({AT_LEAST}|{AT_MOST})$/")
        )
        for column, name in _INTERVAL_NAMES.items():
            builder = builder.override_by_name(column, [models.DynamicConfigValue(id_val="displayName", value=name)])
    if spec.kind == "timeseries":
        builder = (
            timeseries.Panel()
            .line_width(1)
            .fill_opacity(10)
            .span_nulls(False)
            .legend(
                common_builders.VizLegendOptions()
                .display_mode(common.LegendDisplayMode.LIST)
                .placement(common.LegendPlacement.BOTTOM)
                .show_legend(True)
            )
            .tooltip(common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI))
        )
    if spec.kind == "matrix":
        # A layer x head heat map: rows are layers, columns heads, each cell coloured by its value.
        row_key, column_key, value = spec.queries[0].columns
        builder = (
            table.Panel()
            .with_transformation(
                models.DataTransformerConfig(
                    id_val="groupingToMatrix",
                    options={"rowField": row_key, "columnField": column_key, "valueField": value},
                )
            )
            .cell_options(common.TableColoredBackgroundCellOptions(mode=common.TableCellBackgroundDisplayMode.GRADIENT))
            .color_scheme(_continuous_colors(spec))
        )
    builder = (
        builder.id(panel_id)
        .title(spec.title)
        .description(spec.description)
        .datasource(datasource_ref(datasource_uid))
        .targets(_targets(spec, datasource_uid))
        .unit(spec.unit)
        .span(spec.width)
        .height(spec.height)
    )
    if spec.min_value is not None:
        builder = builder.min(spec.min_value)
    if spec.max_value is not None:
        builder = builder.max(spec.max_value)
    return builder


def build_dashboard(datasource_uid: str = DATASOURCE_UID) -> models.Dashboard:
    """The dashboard model: one row per section, panels in ``panels.PANELS`` order."""
    dashboard = (
        dashboard_builders.Dashboard(DASHBOARD_TITLE)
        .uid(DASHBOARD_UID)
        .description(
            "Certified int8 KV cache: coverage of the attention-error certificate, vacuous and infinite "
            "bounds, gating fallbacks and telemetry health, read from the witcert ClickHouse rollups."
        )
        .tags(["witcert", "kv-cache", "certificates"])
        .timezone("utc")
        .time("now-6h", "now")
        .refresh("1m")
        .tooltip(models.DashboardCursorSync.CROSSHAIR)
        .readonly()
        .variables([_variable(spec, datasource_uid) for spec in VARIABLES])
    )
    panel_id = 1
    for section in SECTIONS:
        dashboard = dashboard.with_row(dashboard_builders.Row(section).id(panel_id))
        panel_id += 1
        for spec in PANELS:
            if spec.section == section:
                dashboard = dashboard.with_panel(_panel(spec, panel_id, datasource_uid))
                panel_id += 1
    return dashboard.build()


def dashboard_json(datasource_uid: str = DATASOURCE_UID) -> dict[str, Any]:
    """The dashboard as Grafana's JSON model (plain dicts, ready for the API or a file)."""
    return json.loads(json.dumps(build_dashboard(datasource_uid), cls=JSONEncoder))


def render_json(document: Any) -> str:
    """Stable text for committed files: sorted keys, two-space indent, trailing newline."""
    return json.dumps(document, cls=JSONEncoder, indent=2, sort_keys=True) + "\n"
