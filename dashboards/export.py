"""The Grafana provisioning tree: datasource, dashboard provider, dashboard JSON and alert rules.

``witcert dashboards export DIR`` writes it; ``deploy/grafana/`` is a committed copy (compose and
Kubernetes mount it), and a test keeps the copy equal to what this code generates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .alerts import (
    DEFAULT_RECEIVERS,
    alert_rules,
    alert_specs,
    contact_points,
    contact_points_document,
    notification_policy,
    policies_document,
    provisioning_document,
    render_yaml,
)
from .datasource import DATASOURCE_NAME, DATASOURCE_UID, PLUGIN_ID
from .grafana import DASHBOARD_UID, FOLDER_TITLE, FOLDER_UID, dashboard_json, render_json

# Where the files land inside the Grafana container (the compose file and the manifests mount there).
GRAFANA_DASHBOARDS_PATH = "/var/lib/grafana/dashboards/witcert"


@dataclass(frozen=True)
class ClickHouseConnection:
    """How Grafana reaches ClickHouse. Values are Grafana provisioning text: ``$VAR`` reads the environment."""

    host: str = "$CLICKHOUSE_HOST"
    port: int = 8123
    protocol: str = "http"
    database: str = "$CLICKHOUSE_DATABASE"
    username: str = "$CLICKHOUSE_READER_USER"
    password: str = "$CLICKHOUSE_READER_PASSWORD"
    secure: bool = False

    def plugin_json_data(self) -> dict[str, Any]:
        """The plugin's jsonData (v4 field names), shared by the file and the API payload."""
        return {
            "host": self.host,
            "port": self.port,
            "protocol": self.protocol,
            "secure": self.secure,
            "defaultDatabase": self.database,
            "username": self.username,
        }


def datasource_payload(connection: ClickHouseConnection, uid: str = DATASOURCE_UID) -> dict[str, Any]:
    """The datasource as the HTTP API takes it (``POST /api/datasources``)."""
    return {
        "uid": uid,
        "name": DATASOURCE_NAME,
        "type": PLUGIN_ID,
        "access": "proxy",
        "jsonData": connection.plugin_json_data(),
        "secureJsonData": {"password": connection.password},
    }


def datasource_document(connection: ClickHouseConnection) -> dict[str, Any]:
    return {
        "apiVersion": 1,
        "datasources": [
            {
                "name": DATASOURCE_NAME,
                "uid": DATASOURCE_UID,
                "type": PLUGIN_ID,
                "access": "proxy",
                "editable": False,
                "jsonData": connection.plugin_json_data(),
                "secureJsonData": {"password": connection.password},
            }
        ],
    }


def dashboard_provider_document() -> dict[str, Any]:
    return {
        "apiVersion": 1,
        "providers": [
            {
                "name": "witcert",
                "orgId": 1,
                "folder": FOLDER_TITLE,
                "folderUid": FOLDER_UID,
                "type": "file",
                "disableDeletion": True,
                "allowUiUpdates": False,
                "updateIntervalSeconds": 60,
                "options": {"path": GRAFANA_DASHBOARDS_PATH},
            }
        ],
    }


def provisioning_files(
    connection: ClickHouseConnection | None = None,
    receivers: Sequence[str] = DEFAULT_RECEIVERS,
    **alert_thresholds: Any,
) -> dict[str, str]:
    """Relative path -> file text, for the whole tree. ``receivers``: the contact point's kinds."""
    connection = connection or ClickHouseConnection()
    rules = alert_rules(alert_specs(**alert_thresholds))
    return {
        "provisioning/datasources/witcert-clickhouse.yaml": render_yaml(datasource_document(connection)),
        "provisioning/dashboards/witcert.yaml": render_yaml(dashboard_provider_document()),
        "provisioning/alerting/witcert-alerts.yaml": render_yaml(provisioning_document(rules)),
        "provisioning/alerting/witcert-contact-points.yaml": render_yaml(
            contact_points_document(contact_points(receivers))
        ),
        "provisioning/alerting/witcert-policies.yaml": render_yaml(policies_document(notification_policy())),
        f"dashboards/{DASHBOARD_UID}.json": render_json(dashboard_json()),
    }


def export(
    directory: Path,
    connection: ClickHouseConnection | None = None,
    receivers: Sequence[str] = DEFAULT_RECEIVERS,
    **alert_thresholds: Any,
) -> list[Path]:
    """Write the tree under ``directory`` (created if missing); returns the files written."""
    written = []
    for relative, text in provisioning_files(connection, receivers, **alert_thresholds).items():
        path = directory / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
