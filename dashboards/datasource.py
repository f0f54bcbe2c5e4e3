"""The grafana-clickhouse-datasource as seen by the dashboards: its identity and its query model.

grafana-foundation-sdk ships no model for this plugin's queries, so the plugin's SQL-editor query
(``editorType: sql``, ``rawSql``, ``queryType``, ``format``) is declared here as an SDK dataquery
variant and registered with the SDK runtime: ``Dashboard.from_json`` then decodes our panels'
targets into this class instead of an opaque bag, which is how the committed JSON is validated.
"""

from __future__ import annotations

import enum
from typing import Any, Self

from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import runtime as cogruntime
from grafana_foundation_sdk.cog import variants as cogvariants
from grafana_foundation_sdk.models import dashboard

PLUGIN_ID = "grafana-clickhouse-datasource"
# Written into each query as the plugin itself does; any 4.x keeps the plugin from migrating the
# query as a v3 one. The macros are expanded as v4.0.3 and later do ($__timeFilter on DateTime).
PLUGIN_VERSION = "4.3.2"
DATASOURCE_UID = "witcert-clickhouse"
DATASOURCE_NAME = "witcert ClickHouse"


def datasource_ref(uid: str = DATASOURCE_UID) -> dashboard.DataSourceRef:
    return dashboard.DataSourceRef(type_val=PLUGIN_ID, uid=uid)


class QueryFormat(enum.IntEnum):
    """sqlds' format option: how the backend shapes the result frame."""

    TIME_SERIES = 0  # long frames (time, labels..., value) become one series per label set
    TABLE = 1  # rows as they are; alerting reads a numeric table as one series per row


class ClickHouseQuery(cogvariants.Dataquery):
    """One SQL-editor query of grafana-clickhouse-datasource."""

    def __init__(
        self,
        ref_id: str = "A",
        raw_sql: str = "",
        query_format: QueryFormat = QueryFormat.TABLE,
        datasource_uid: str = DATASOURCE_UID,
        hide: bool | None = None,
    ) -> None:
        self.ref_id = ref_id
        self.raw_sql = raw_sql
        self.query_format = QueryFormat(query_format)
        self.datasource_uid = datasource_uid
        self.hide = hide

    def to_json(self) -> dict[str, object]:
        payload: dict[str, object] = {
            "datasource": {"type": PLUGIN_ID, "uid": self.datasource_uid},
            "editorType": "sql",
            "format": int(self.query_format),
            "pluginVersion": PLUGIN_VERSION,
            "queryType": "timeseries" if self.query_format is QueryFormat.TIME_SERIES else "table",
            "rawSql": self.raw_sql,
            "refId": self.ref_id,
        }
        if self.hide is not None:
            payload["hide"] = self.hide
        return payload

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Self:
        if data.get("editorType", "sql") != "sql":
            raise ValueError(f"only SQL-editor queries are supported, got editorType={data.get('editorType')!r}")
        return cls(
            ref_id=data.get("refId", "A"),
            raw_sql=data.get("rawSql", ""),
            query_format=QueryFormat(data.get("format", QueryFormat.TABLE)),
            datasource_uid=data.get("datasource", {}).get("uid", DATASOURCE_UID),
            hide=data.get("hide"),
        )


class ClickHouseQueryBuilder(cogbuilder.Builder[ClickHouseQuery]):
    """SDK builder wrapper, so panels and alert queries take it like any other target."""

    def __init__(self, query: ClickHouseQuery) -> None:
        self._query = query

    def build(self) -> ClickHouseQuery:
        return self._query


cogruntime.register_dataquery_variant(
    cogruntime.DataqueryConfig(identifier=PLUGIN_ID, from_json_hook=ClickHouseQuery.from_json)
)
